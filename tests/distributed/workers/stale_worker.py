"""Worker for tests/distributed/test_partial_stale.py: the drop-in under solo and majority, where one rank's first
gradient misses its round and travels stale in the next, after torch DDP rebuilt its gradient buckets.

Each run trains one epoch of a linear layer under a loss linear in its outputs (so
a gradient is the same whatever the parameters, and a stale one equals a fresh one)
with plain SGD. The rank that does not fire round 0 (solo: rank 1; majority: the
other rank than round 0's initiator) sleeps before its first step, so that round 0
runs without it. Applied once each, the contributions leave exactly the parameters
of one process on the same global batches. Rank 0 writes, for every run, the
largest gap to that one process and between the replicas, and whether the late
rank's first gradient did miss round 0.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.collectives.protocol import initiator

FEATURES, CLASSES = 8, 3
SIZE, GLOBAL_BATCH = 64, 16
"""Four full steps: every step's gradient is the mean over 16 samples, whatever order the epoch takes."""
LR, SEED = 0.5, 7
LATE_S = 0.4
"""How long the late rank sleeps before its first step: far longer than a step of this model takes."""


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(SIZE, FEATURES, generator=generator),
                         torch.randint(0, CLASSES, (SIZE,), generator=generator))


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Linear(FEATURES, CLASSES)


def linear_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Minus the mean of the labels' outputs: a linear layer's gradient depends on the batch alone."""
    return -output.gather(1, labels[:, None]).mean()


def reference() -> torch.Tensor:
    """One process: every step a mean over 16 samples, so the epoch sums the samples' gradients over 16, in any
    order."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = dataset().tensors
    for first in range(0, SIZE, GLOBAL_BATCH):
        optimizer.zero_grad()
        linear_loss(model(x[first : first + GLOBAL_BATCH]), y[first : first + GLOBAL_BATCH]).backward()
        optimizer.step()
    return flat(model)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def one_run(sync: str, rank: int, world_size: int) -> dict:
    late = 1 if sync == "solo" else 1 - initiator(0, 0, world_size)
    data = dataset()
    model = hetdp.DDP(make_model(), "equal", sync, emulation=hetdp.Emulation())
    first_rounds: list[bool] = []
    contribute = model.synchronizer.contribute

    def recording(*args: object, **kwargs: object) -> list:
        rounds = contribute(*args, **kwargs)
        if not first_rounds:
            first_rounds.extend(r.result.fresh for r in rounds)
        return rounds

    model.synchronizer.contribute = recording
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = model.allocate(DataLoader(data, batch_size=GLOBAL_BATCH // world_size,
                                       sampler=DistributedSampler(data, seed=SEED)))
    for step, (x, y) in enumerate(loader):  # the epoch's last step meets: every round applied, then the average
        if step == 0 and rank == late:
            time.sleep(LATE_S)
        optimizer.zero_grad()
        linear_loss(model(x), y).backward()
        optimizer.step()
    final = flat(model.module)
    model.close()
    finals: list[torch.Tensor | None] = [None] * world_size
    dist.all_gather_object(finals, final)
    missed = [None] * world_size
    dist.all_gather_object(missed, not any(first_rounds))
    return {"reference_gap": float((finals[0] - reference()).abs().max()),
            "replica_gap": max(float((f - finals[0]).abs().max()) for f in finals),
            "late_missed_round_0": bool(missed[late])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rank, world_size = hetdp.init_distributed()
    runs = {sync: [one_run(sync, rank, world_size) for _ in range(args.repeats)] for sync in ("solo", "majority")}
    if rank == 0:
        args.out.write_text(json.dumps(runs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
