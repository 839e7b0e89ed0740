"""Eager-SGD on the digits: each step waits for a majority of the ranks (or one, or k), not for the slowest.

    hetdp run -n 4 --stragglers 1:200 examples/eager_sgd.py --mode majority
    torchrun --nproc-per-node=4 examples/eager_sgd.py --mode solo

The model stays on the CPU: run it on gloo ranks (under NCCL, which hetdp.init_distributed picks when every local
rank has a GPU of its own, hetdp.DDP refuses a CPU model; examples/allocation_train.py shows the move to GPU).

Eager-SGD is the drop-in's partial synchronization: ``hetdp.DDP(net, "equal",
"majority")`` in place of ``DDP(net)``, and the loop stays a plain DDP loop.
``--stragglers 1:200`` makes one random rank sleep 200 ms at every step (the
same draw on every rank); compare the epoch times of ``--mode full`` (every
round waits for every rank, as synchronous SGD) with ``solo`` and ``majority``.

Expect more optimizer steps than loop steps: a round runs as soon as its mode
allows (in majority, when its initiator arrives), so ranks out of step with each
other each start rounds of their own, and a step that receives several rounds
runs the loop's ``optimizer.step()`` once per round, as a rank that received
them one by one. At each epoch's end the ranks meet (the rounds in flight are
flushed, the parameters averaged): every replica then holds the same model.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import hetdp
from hetdp.bench.datasets import load_digits
from hetdp.bench.models import ConvNet, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description="Eager-SGD on the digits dataset.")
    parser.add_argument("--mode", default="majority", choices=["solo", "majority", "quorum", "full"])
    parser.add_argument("--quorum", type=int, help="k, for --mode quorum")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    args = parser.parse_args()

    rank, _ = hetdp.init_distributed()
    split = load_digits()
    optimizer_steps = 0

    def count(*_: object) -> None:
        nonlocal optimizer_steps
        optimizer_steps += 1

    sync = hetdp.Partial(mode=args.mode, quorum=args.quorum)
    with hetdp.DDP(ConvNet(), "equal", sync, step_timeout_s=30.0) as model:  # was: DDP(ConvNet()); `hetdp run --stragglers` applies
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optimizer.register_step_post_hook(count)
        loader = model.allocate(DataLoader(split.train, batch_size=args.batch, sampler=DistributedSampler(split.train)))
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            for images, labels in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(images), labels).backward()
                optimizer.step()
            report = model.last_epoch  # the ranks met: every replica holds the same model
            if rank == 0:
                print(f"epoch {epoch}: {report.epoch_s:.2f} s, {model.steps_done} steps and {optimizer_steps} "
                      f"optimizer steps so far, test accuracy {accuracy(model.module, split.test):.3f}; "
                      f"{report.diagnosis()}", flush=True)
        steps = model.steps_done
    if rank == 0:
        print(f"{args.mode}: {steps} steps per rank; {optimizer_steps} optimizer steps on rank 0, one per round it "
              f"received (a round runs without waiting for the ranks out of step, so there are more rounds than steps)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
