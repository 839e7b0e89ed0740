"""Eager-SGD on the digits: each step waits for a majority of the ranks (or one, or k), not for the slowest.

    hetdp run -n 4 --stragglers 1:200 examples/eager_sgd.py --mode majority
    torchrun --nproc-per-node=4 examples/eager_sgd.py --mode solo

``--stragglers 1:200`` makes one random rank sleep 200 ms at every step (the
same draw on every rank); compare the epoch times of ``--mode full`` (plain
synchronous SGD) with ``solo`` and ``majority``.

Expect more rounds than steps: a round runs as soon as its mode allows (in
majority, when its initiator arrives), so ranks that are out of step with each
other each start rounds of their own, and every ``flush()`` adds one. No
gradient is lost or counted twice: each lands in exactly one round, so the
rounds hold steps x ranks gradients in all.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import hetdp
from hetdp.datasets import load_digits
from hetdp.models import ConvNet


def main() -> None:
    parser = argparse.ArgumentParser(description="Eager-SGD on the digits dataset.")
    parser.add_argument("--mode", default="majority", choices=["solo", "majority", "quorum", "full"])
    parser.add_argument("--quorum", type=int, help="k, for --mode quorum")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    args = parser.parse_args()

    rank, world_size = hetdp.init_distributed()
    split = load_digits()
    sampler = DistributedSampler(split.train, seed=0, drop_last=True)  # the same number of steps on every rank
    loader = DataLoader(split.train, batch_size=args.batch, sampler=sampler, drop_last=True)
    torch.manual_seed(0)  # the same initial model on every rank
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    partial = hetdp.PartialConfig(mode=args.mode, quorum=args.quorum, timeouts=hetdp.Timeouts(round_s=30.0))

    with hetdp.EagerSGD(optimizer, model, mode=partial) as eager:  # the --stragglers of `hetdp run` apply by itself
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            started = time.perf_counter()
            for images, labels in loader:
                eager.zero_grad()
                nn.functional.cross_entropy(model(images), labels).backward()
                eager.step()
            eager.flush()  # every rank has now applied the same rounds: a safe point to evaluate
            if rank == 0:
                with torch.no_grad():
                    images, labels = split.test.tensors
                    accuracy = (model(images).argmax(1) == labels).float().mean().item()
                print(f"epoch {epoch}: {time.perf_counter() - started:.2f} s, {eager.steps} steps and "
                      f"{eager.rounds} rounds so far, test accuracy {accuracy:.3f}", flush=True)
    gap = eager.divergence()
    if rank == 0:
        print(f"{args.mode}: {eager.steps} steps per rank; {eager.rounds} rounds held {eager.gradients} gradients "
              f"({eager.steps} steps x {world_size} ranks, each in one round; a round runs without waiting for the "
              f"ranks that are out of step, so there are more rounds than steps); "
              f"largest parameter gap between replicas {gap:g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
