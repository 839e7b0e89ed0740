"""C-ADP in a training script: rank 0 plans each device's share, sends it once, devices train locally and merge.

One rank per device of the cluster file, rank 0 (the data owner) first; or one rank
more, and rank 0 only owns the data and merges (the paper's parameter server):
    hetdp run -n 4 examples/cadp_train.py --cluster examples/cadp_cluster.toml --epochs 5
    torchrun --nproc-per-node 4 examples/cadp_train.py --cluster examples/cadp_cluster.toml
By default one machine emulates the described cluster (each batch lasts the device's
batch_time_s, each transfer its link's time); on real machines pass --no-emulate.
The paper-sized examples/cluster.toml (8 devices, a 100 MB model) takes 8 or 9 ranks and
is meant for `hetdp plan`: emulating its links would take minutes per epoch.
"""

from __future__ import annotations

import argparse

import torch

import hetdp
from hetdp.datasets import load_digits
from hetdp.models import ConvNet, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", required=True, help="cluster file (see `hetdp plan --help`)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--method", choices=("exact", "alm"), default="exact", help="C-ADP solver")
    parser.add_argument("--transport", choices=("samples", "indices"), default="samples",
                        help="send the samples, or only their indices (shared storage)")
    parser.add_argument("--emulate", action=argparse.BooleanOptionalAction, default=True,
                        help="pace batches and transfers to the cluster file (default on)")
    args = parser.parse_args()

    rank, _ = hetdp.init_distributed()
    cluster = hetdp.ClusterSpec.from_toml(args.cluster)
    needs_data = rank == 0 or args.transport == "indices"  # only the owner holds the data, unless storage is shared
    split = load_digits() if needs_data else None
    owned = split.train if needs_data else None
    model = ConvNet()  # rank 0's initial parameters reach every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = hetdp.CadpConfig(epochs=args.epochs, method=args.method, transport=args.transport, emulate=args.emulate)

    def progress(stats) -> None:
        if rank == 0:
            print(f"epoch {stats.epoch}: {stats.seconds:.2f} s, loss {stats.loss:.4f}", flush=True)

    result = hetdp.train_cadp(model, optimizer, owned, cluster, config, on_epoch=progress)
    if rank == 0:
        shares = ", ".join(f"{d.name} {d.samples}" for d in result.plan.devices)
        print(f"samples per device: {shares}")
        print(f"T_send {result.send_s:.2f} s (planned {result.plan.send_s:.2f}), T_train {result.train_s:.2f} s, "
              f"T_total {result.total_s:.2f} s (planned {result.plan.total_s:.2f}), "
              f"test accuracy {accuracy(model, split.test):.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
