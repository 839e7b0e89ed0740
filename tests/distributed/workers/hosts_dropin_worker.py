"""Worker for tests/distributed/test_hosts.py: a drop-in script launched across emulated hosts by `hetdp run
--nnodes 2`, with step checkpoints; on the first attempt rank ``--die-rank`` kills itself after ``--die-at`` steps.

Every rank records where it ran (its node's label, the attempt, the emulated speeds it saw) in ``OUT/rank-R.json``;
rank 0 saves the final parameters to ``OUT/final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp

SIZE = 96
"""Samples in the dataset; a step takes 4 per rank."""


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SIZE, 6, generator=generator)
    return TensorDataset(x, (x.sum(1) > 0).long())


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=1)
    args = parser.parse_args()

    hetdp.init_distributed("gloo")
    data = make_data()
    model = hetdp.DDP(make_model())  # allocation and emulation from `hetdp run`
    loader = model.allocate(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False)))
    optimizer = make_optimizer(model)
    ckpt = model.checkpointer(args.ckpt, optimizer, every=2)
    ckpt.resume()
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]  # torch's count, as under torchrun's own restarts
    with model:
        for epoch in range(ckpt.epoch, args.epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if attempt == "0" and model.rank == args.die_rank and model.steps_done == args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        where = {"node": os.environ.get("HETDP_NODE"), "attempt": attempt,
                 "speeds": hetdp.Emulation.from_env().speeds, "world_size": dist.get_world_size()}
        (args.out / f"rank-{model.rank}.json").write_text(json.dumps(where))
        if model.rank == 0:
            torch.save(model.module.state_dict(), args.out / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
