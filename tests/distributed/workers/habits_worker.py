"""Worker for tests/distributed/test_habits.py: the data-loading habits of real DDP scripts, through ``allocate``.

Each scenario builds its loader the way some user's script does (a sampler kept in a
variable, Lightning's ``batch_sampler.sampler`` path, a plain shuffled loader, a
``BatchSampler`` of its own, a ``Subset``, a loader made anew every epoch, ...),
trains ``EPOCHS`` epochs through ``hetdp.DDP`` and saves, per rank, the dataset
indices of every step and the warnings rank 0 saw.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Subset

import hetdp

EPOCHS = 3
BATCH = 4
"""Each rank's batch under plain DDP: steps are BATCH x ranks samples."""


class Indexed(Dataset):
    """Item i is (i as a feature, i): the loop reads which samples a step trained."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(index)]), index


Epochs = Iterator[DataLoader]
"""A scenario: yields the loader to iterate for each epoch, having done what the script does before it."""


def variable(model: hetdp.DDP, size: int) -> Epochs:
    sampler = DistributedSampler(Indexed(size), seed=0)
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, sampler=sampler))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        yield loader


def loader_sampler(model: hetdp.DDP, size: int) -> Epochs:
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, sampler=DistributedSampler(Indexed(size))))
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        yield loader


def batch_sampler_sampler(model: hetdp.DDP, size: int) -> Epochs:
    """Lightning's path: ``set_epoch`` on ``loader.batch_sampler.sampler``."""
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, sampler=DistributedSampler(Indexed(size))))
    for epoch in range(EPOCHS):
        loader.batch_sampler.sampler.set_epoch(epoch)
        yield loader


def never_set(model: hetdp.DDP, size: int) -> Epochs:
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, sampler=DistributedSampler(Indexed(size))))
    for _ in range(EPOCHS):
        yield loader


def seeded(model: hetdp.DDP, size: int) -> Epochs:
    sampler = DistributedSampler(Indexed(size), seed=7)
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, sampler=sampler))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        yield loader


def sampler_drops_last(model: hetdp.DDP, size: int) -> Epochs:
    """On ``size + 1`` samples, which do not divide among 2 ranks: the sampler drops one."""
    sampler = DistributedSampler(Indexed(size + 1), drop_last=True)
    loader = model.allocate(DataLoader(Indexed(size + 1), batch_size=BATCH, sampler=sampler))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        yield loader


def loader_drops_last(model: hetdp.DDP, size: int) -> Epochs:
    sampler = DistributedSampler(Indexed(size))
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, sampler=sampler, drop_last=True))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        yield loader


def own_batch_sampler(model: hetdp.DDP, size: int) -> Epochs:
    sampler = DistributedSampler(Indexed(size))
    loader = model.allocate(DataLoader(Indexed(size), batch_sampler=BatchSampler(sampler, BATCH, drop_last=False)))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        yield loader


def subset(model: hetdp.DDP, size: int) -> Epochs:
    """A ``Subset`` of every other sample of a dataset twice the size: indices are the subset's."""
    data = Subset(Indexed(2 * size), list(range(0, 2 * size, 2)))
    sampler = DistributedSampler(data)
    loader = model.allocate(DataLoader(data, batch_size=BATCH, sampler=sampler))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        yield loader


def recreated(model: hetdp.DDP, size: int) -> Epochs:
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(Indexed(size))
        sampler.set_epoch(epoch)
        yield model.allocate(DataLoader(Indexed(size), batch_size=BATCH, sampler=sampler))


def plain_shuffle(model: hetdp.DDP, size: int) -> Epochs:
    torch.manual_seed(int(torch.distributed.get_rank()))  # ranks that disagree: the loader must agree for them
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, shuffle=True))
    for _ in range(EPOCHS):
        yield loader


def plain_shuffle_generator(model: hetdp.DDP, size: int) -> Epochs:
    loader = model.allocate(DataLoader(Indexed(size), batch_size=BATCH, shuffle=True,
                                       generator=torch.Generator().manual_seed(11)))
    for _ in range(EPOCHS):
        yield loader


def plain_shuffle_recreated(model: hetdp.DDP, size: int) -> Epochs:
    for _ in range(EPOCHS):
        yield model.allocate(DataLoader(Indexed(size), batch_size=BATCH, shuffle=True))


SCENARIOS: dict[str, Callable[[hetdp.DDP, int], Epochs]] = {
    scenario.__name__: scenario
    for scenario in (variable, loader_sampler, batch_sampler_sampler, never_set, seeded, sampler_drops_last,
                     loader_drops_last, own_batch_sampler, subset, recreated, plain_shuffle, plain_shuffle_generator,
                     plain_shuffle_recreated)
}


def run(name: str, size: int, out: Path) -> None:
    model = hetdp.DDP(nn.Linear(1, 1), "equal")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps: list[list[list[int]]] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for loader in SCENARIOS[name](model, size):
            steps.append([])
            for x, index in loader:
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
                steps[-1].append(index.tolist())
    model.close()
    record = {"steps": steps, "warnings": [str(warning.message) for warning in seen]}
    (out / f"{name}_{model.rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--scenarios", required=True)
    args = parser.parse_args()
    hetdp.init_distributed()
    for name in args.scenarios.split(","):
        run(name, args.size, args.out)


if __name__ == "__main__":
    main()
