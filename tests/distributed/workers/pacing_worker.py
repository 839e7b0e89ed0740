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
    """A pacer that notes, step by step, whether the drop-in let its deadline run on into the next step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.alone: list[bool] = []

    def finish(self, step, samples, compute_s, forwards=None, *, alone=False) -> None:
        self.alone.append(alone)
        super().finish(step, samples, compute_s, forwards, alone=alone)


MADE: list[RecordingPacer] = []
"""The pacers the drop-in made, in order."""


class RecordingEmulation(Emulation):
    """Emulated devices a microsecond per sample, whose pacers record."""

    def pacer(self, rank: int, world_size: int) -> RecordingPacer:
        MADE.append(RecordingPacer(self, rank, world_size))
        return MADE[-1]


def alone_flags(sync: str) -> list[bool]:
    samples = STEPS * PER_RANK_BATCH * dist.get_world_size()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(samples, 3), torch.randint(0, 2, (samples,)))
    model = hetdp.DDP(nn.Linear(3, 2), "equal", sync, emulation=RecordingEmulation(sample_cost_ms=0.001))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = model.allocate(DataLoader(data, batch_size=PER_RANK_BATCH, sampler=DistributedSampler(data)))
    with model:
        for inputs, labels in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
    return MADE[-1].alone


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, _ = hetdp.init_distributed()
    flags = {sync: alone_flags(sync) for sync in SYNCS}
    (args.out / f"rank{rank}.json").write_text(json.dumps(flags))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
