"""The drop-in's host cost per step against a plain loop, in long epochs: what it adds where compute is nothing.

A model of a few hundred parameters makes a step all host work (loading, Python, dispatch), so the
difference in microseconds per step is what ``hetdp.DDP`` adds to it. Epochs of many steps show
whether that cost grows along an epoch (it must not). Rank 0 trains; with ``--nproc_per_node`` above 1
the other ranks sit out from the second step, so rank 0 runs as a lone member. Run::

    python -m torch.distributed.run --nproc_per_node 1 tools/step_overhead.py --steps 3000
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.cluster.emulate import Emulation
from hetdp.runtime import init_distributed

BATCH = 64


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def epoch_us_per_step(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer) -> float:
    started, steps = time.perf_counter(), 0
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        steps += 1
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, _ = init_distributed("gloo")
    world_size = dist.get_world_size()
    data = TensorDataset(torch.randn(BATCH * args.steps, 8), torch.randint(0, 4, (BATCH * args.steps,)))
    weights = hetdp.Static((1.0,) * world_size) if world_size > 1 else "adaptive"
    model = hetdp.DDP(make(), weights, "allreduce", emulation=Emulation())
    loader = model.allocate(DataLoader(data, batch_size=BATCH // world_size, sampler=DistributedSampler(data)))
    if world_size > 1:  # what a re-plan that lets the others sit out does
        model._planner.schedule.append((1, [BATCH] + [0] * (world_size - 1)))
        model._sitting.schedule(1, [0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ours = []
    for epoch in range(args.epochs):
        dist.barrier()
        loader.sampler.set_epoch(epoch)
        ours.append(epoch_us_per_step(model, loader, optimizer))
    dist.barrier()
    if rank == 0:
        module = make()
        plain_optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        plain_loader = DataLoader(data, batch_size=BATCH, shuffle=True)
        plain = [epoch_us_per_step(module, plain_loader, plain_optimizer) for _ in range(args.epochs)]
        def listed(values: list[float]) -> str:
            return ", ".join(f"{value:.0f}" for value in values)

        print(f"us per step, epochs of {args.steps} steps, {world_size} rank(s): hetdp.DDP {listed(ours)}; "
              f"plain loop {listed(plain)}")
    dist.barrier()
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
