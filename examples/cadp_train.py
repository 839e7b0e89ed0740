"""C-ADP in a training script: rank 0 plans each device's share and sends it once; every device trains on its own
samples through the drop-in, and the models merge by weighted averaging after each epoch.

One rank per device of the cluster file, rank 0 (the data owner) first:
    hetdp run -n 4 examples/cadp_train.py --cluster examples/cadp_cluster.toml --epochs 5
    torchrun --nproc-per-node 4 examples/cadp_train.py --cluster examples/cadp_cluster.toml
By default one machine emulates the described cluster (each sample costs its device's
batch_time_s / batch_size, the delivery its link's time); on real machines pass --no-emulate.
The model stays on the CPU: launch it with gloo ranks (a machine whose every rank has a GPU of its own gets NCCL from
hetdp.init_distributed, and hetdp.DDP refuses a CPU model there; examples/allocation_train.py shows the move to GPU).

C-ADP is the data owner plus the drop-in: ``hetdp.plan`` (the owner's D_i), ``hetdp.distribute``
(each device receives its D_i samples once), ``hetdp.DDP(net, hetdp.Planned(cluster), "local")``
and ``model.allocate(loader, own_data=True)`` over the samples this device holds: every epoch,
device i trains all of its samples in batches of its own size (the cluster file's), and the
models merge as w = sum_i (D_i / D) w_i. ``hetdp bench cadp`` measures it against DDP and local SGD.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import hetdp
from hetdp.bench.datasets import load_digits
from hetdp.bench.models import ConvNet, accuracy


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

    model = hetdp.DDP(ConvNet(), hetdp.Planned(cluster), "local",
                      emulation=emulation if args.emulate else hetdp.Emulation())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = model.allocate(DataLoader(local.data, shuffle=True), own_data=True)  # this device's batches
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            model.record_loss(loss)
            optimizer.step()
        report = model.last_epoch  # after the merge: w = sum_i (D_i / D) w_i on every rank
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
