"""C-ADP in a training script: rank 0 plans each device's share and sends it once; every device trains on its own
samples through the drop-in, and the models merge by weighted averaging after each epoch.

One rank per device of the cluster file, rank 0 (the data owner) first:
    hetdp run -n 4 examples/cadp_train.py --cluster examples/cadp_cluster.toml --epochs 5
    torchrun --nproc-per-node 4 examples/cadp_train.py --cluster examples/cadp_cluster.toml
By default one machine emulates the described cluster (each sample costs its device's
batch_time_s / batch_size, the delivery its link's time); on real machines pass --no-emulate.

C-ADP is three calls: ``hetdp.plan`` (the owner's D_i), ``hetdp.distribute`` (each device
receives its D_i samples once) and ``hetdp.DDP(net, "equal", "local")`` (local training,
merged as w = sum_i (D_i / D) w_i at each epoch's end). Each rank's data is its own, so the
loop cuts its own batches and tells the drop-in each step's samples (``begin_step`` /
``end_step``). ``hetdp bench cadp`` measures it against DDP and local SGD.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import hetdp
from hetdp.datasets import load_digits
from hetdp.models import ConvNet, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", required=True, help="cluster file (see `hetdp plan --help`)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--method", choices=("exact", "alm"), default="exact", help="C-ADP solver")
    parser.add_argument("--emulate", action=argparse.BooleanOptionalAction, default=True,
                        help="pace compute and the delivery to the cluster file (default on)")
    args = parser.parse_args()

    rank, _ = hetdp.init_distributed()
    cluster = hetdp.ClusterSpec.from_toml(args.cluster)
    split = load_digits() if rank == 0 else None  # only the owner holds the data
    planned = [None]
    if rank == 0:
        planned[0] = hetdp.plan(cluster, len(split.train), args.epochs, method=args.method, min_samples=1)
    dist.broadcast_object_list(planned, src=0)  # the owner's plan, to every device
    plan = planned[0]
    link_s = [hetdp.Link(bandwidth_mbps=d.bandwidth_mbps, latency_ms=d.latency_ms).transfer_s(n * cluster.sample_bytes)
              for d, n in zip(cluster.devices, plan.samples)]
    local = hetdp.distribute(split.train if rank == 0 else None, plan.samples,
                             transfer_s=link_s if args.emulate else None)  # this device's D_i samples
    sample_ms = [1000 * d.batch_time_s / d.batch_size for d in cluster.devices]
    emulation = hetdp.Emulation(speeds=tuple(max(sample_ms) / ms for ms in sample_ms), sample_cost_ms=max(sample_ms))

    model = hetdp.DDP(ConvNet(), "equal", "local", emulation=emulation if args.emulate else hetdp.Emulation())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images, labels = local.data.tensors
    sizes = plan.batch_sizes
    steps = max(-(-n // b) for n, b in zip(plan.samples, sizes))  # every rank takes part in every step
    for epoch in range(args.epochs):
        model.begin_epoch(epoch)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps):
            batch = order[step * sizes[rank] : (step + 1) * sizes[rank]]
            model.begin_step(len(batch), sum(min(b, max(0, n - step * b)) for n, b in zip(plan.samples, sizes)))
            optimizer.zero_grad()
            # A device out of batches joins with a stand-in sample, weighted 0 (its replica does not move).
            chosen = batch if len(batch) else order[:1]
            loss = nn.functional.cross_entropy(model(images[chosen]), labels[chosen])
            loss.backward()
            model.record_loss(loss)
            if len(batch):
                optimizer.step()
            model.end_step()
        report = model.end_epoch()  # the merge: w = sum_i (D_i / D) w_i on every rank
        if rank == 0:
            print(f"epoch {epoch}: {report.epoch_s:.2f} s, loss {report.loss:.4f}; {report.diagnosis()}", flush=True)
    model.close()
    if rank == 0:
        shares = ", ".join(f"{d.name} {d.samples}" for d in plan.devices)
        print(f"samples per device: {shares}; planned T_total {plan.total_s:.2f} s; "
              f"test accuracy {accuracy(model.module, split.test):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
