"""The drop-in's cost per step against a plain loop (and torch's DDP, at one rank), in long epochs.

With ``--model tiny`` (108 parameters) a step is all host work (loading, Python, dispatch), so the
difference in microseconds per step is what ``hetdp.DDP`` adds to it, and epochs of many steps show
whether that grows along an epoch (it must not). ``--model mlp`` (``hetdp bench gpu``'s 1.9M-parameter
MLP) adds the gradients' trip through torch DDP's buckets. Rank 0 trains; with ``--nproc_per_node``
above 1 the other ranks sit out from the second step, so rank 0 runs as a lone member. Run::

    python -m torch.distributed.run --nproc_per_node 1 tools/step_overhead.py --steps 3000
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.cluster.emulate import Emulation
from hetdp.runtime import init_distributed

MODELS = {"tiny": (64, (8, 8, 4)), "mlp": (16, (3 * 32 * 32, 512, 512, 10))}
"""Batch and layer widths of each model."""


def make(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for inputs, outputs in zip(widths, widths[1:]):
        layers += [nn.Linear(inputs, outputs), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


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
    parser.add_argument("--model", choices=MODELS, default="tiny")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, _ = init_distributed("gloo")
    world_size = dist.get_world_size()
    batch, widths = MODELS[args.model]
    samples = batch * args.steps
    data = TensorDataset(torch.randn(samples, widths[0]), torch.randint(0, widths[-1], (samples,)))
    weights = hetdp.Static((1.0,) * world_size) if world_size > 1 else "adaptive"
    model = hetdp.DDP(make(widths), weights, "allreduce", emulation=Emulation())
    loader = model.allocate(DataLoader(data, batch_size=batch // world_size, sampler=DistributedSampler(data)))
    if world_size > 1:
        model.set_shares([batch] + [0] * (world_size - 1), at_step=1)
    runs = {"hetdp.DDP": (model, loader)}
    if world_size == 1:
        theirs = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data))
        runs["torch DDP"] = (TorchDDP(make(widths)), theirs)
    if rank == 0:
        runs["plain loop"] = (make(widths), DataLoader(data, batch_size=batch, shuffle=True))
    optimizers = {name: torch.optim.SGD(net.parameters(), lr=0.01) for name, (net, _) in runs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for epoch in range(args.epochs):  # the runs take turns, so that the machine's drift falls on each alike
        for name, (net, data_loader) in runs.items():
            if name != "plain loop":
                dist.barrier()
                data_loader.sampler.set_epoch(epoch)
            seconds[name].append(epoch_us_per_step(net, data_loader, optimizers[name]))
    if rank == 0:
        listed = "; ".join(f"{name} {', '.join(f'{value:.0f}' for value in values)}"
                           for name, values in seconds.items())
        print(f"us per step, {args.model}, epochs of {args.steps} steps, {world_size} rank(s): {listed}")
    dist.barrier()
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
