"""Worker for tests/distributed/test_pacing.py: which steps of the drop-in let the emulated deadline run on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.cluster.emulate import Emulation, Pacer

SYNCS = ("local", "local:2", "allreduce", "majority")
STEPS = 5
PER_RANK_BATCH = 2


class RecordingPacer(Pacer):
    """A pacer that notes, step by step, whether the drop-in let its deadline run on into the next step, and when
    it restarted it between steps."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[bool | str] = []

    def finish(self, step, samples, compute_s, forwards=None, *, alone=False) -> None:
        self.events.append(alone)
        super().finish(step, samples, compute_s, forwards, alone=alone)

    def restart(self) -> None:
        self.events.append("restart")
        super().restart()


MADE: list[RecordingPacer] = []
"""The pacers the drop-in made, in order."""


class RecordingEmulation(Emulation):
    """Emulated devices a microsecond per sample, whose pacers record."""

    def pacer(self, rank: int, world_size: int) -> RecordingPacer:
        MADE.append(RecordingPacer(self, rank, world_size))
        return MADE[-1]


def _model(sync: str) -> tuple[hetdp.DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = hetdp.DDP(nn.Linear(3, 2), "equal", sync, emulation=RecordingEmulation(sample_cost_ms=0.001))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_step(model: hetdp.DDP, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(inputs), torch.zeros(len(inputs), dtype=torch.long)).backward()
    optimizer.step()


def allocated_loop(sync: str) -> list[bool | str]:
    """One epoch of the allocated loader, which tells the drop-in which step ends it."""
    data = TensorDataset(torch.randn(STEPS * PER_RANK_BATCH * dist.get_world_size(), 3))
    model, optimizer = _model(sync)
    loader = model.allocate(DataLoader(data, batch_size=PER_RANK_BATCH, sampler=DistributedSampler(data)))
    with model:
        for (inputs,) in loader:
            _train_step(model, optimizer, inputs)
    return MADE[-1].events


def own_loop() -> list[bool | str]:
    """Two epochs of three steps each, opened and closed by the loop itself: no step says it ends its epoch."""
    model, optimizer = _model("local")
    with model:
        for epoch in range(2):
            model.begin_epoch(epoch)
            for _ in range(3):
                model.begin_step(PER_RANK_BATCH, PER_RANK_BATCH * dist.get_world_size())
                _train_step(model, optimizer, torch.randn(PER_RANK_BATCH, 3))
                model.end_step()
            model.end_epoch()
    return MADE[-1].events


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, _ = hetdp.init_distributed()
    flags = {sync: allocated_loop(sync) for sync in SYNCS}
    flags["own loop"] = own_loop()
    (args.out / f"rank{rank}.json").write_text(json.dumps(flags))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
