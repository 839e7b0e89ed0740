"""The data-loading habits of real DDP scripts train what plain DDP trains, a new order every epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.utils.data import BatchSampler, DistributedSampler

RANKS = 2
SIZE = 50
BATCH = 4
EPOCHS = 3
DISTRIBUTED = {  # scenario: (dataset size, sampler seed, sampler drop_last, loader drop_last, sets the epoch)
    "variable": (SIZE, 0, False, False, True),
    "loader_sampler": (SIZE, 0, False, False, True),
    "batch_sampler_sampler": (SIZE, 0, False, False, True),
    "seeded": (SIZE, 7, False, False, True),
    "sampler_drops_last": (SIZE + 1, 0, True, False, True),
    "loader_drops_last": (SIZE, 0, False, True, True),
    "own_batch_sampler": (SIZE, 0, False, False, True),
    "subset": (SIZE, 0, False, False, True),
    "recreated": (SIZE, 0, False, False, True),
    "never_set": (SIZE, 0, False, False, False),
}
PLAIN = ("plain_shuffle", "plain_shuffle_generator", "plain_shuffle_recreated")


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("habits")
    torchrun("habits_worker.py", RANKS, "--out", folder, "--size", SIZE, "--scenarios", ",".join([*DISTRIBUTED, *PLAIN]),
             timeout_s=300)
    return folder


def trained(out: Path, scenario: str) -> tuple[list[list[set[int]]], list[str]]:
    """Per epoch, per step: the samples the ranks trained together; and rank 0's warnings."""
    records = [json.loads((out / f"{scenario}_{rank}.json").read_text()) for rank in range(RANKS)]
    epochs = [[set().union(*(set(record["steps"][epoch][step]) for record in records))
               for step in range(len(records[0]["steps"][epoch]))] for epoch in range(EPOCHS)]
    for epoch in range(EPOCHS):  # the ranks' blocks of a step never overlap
        for step in range(len(epochs[epoch])):
            assert sum(len(record["steps"][epoch][step]) for record in records) == len(epochs[epoch][step])
    return epochs, records[0]["warnings"]


def plain_ddp(size: int, seed: int, sampler_drops: bool, loader_drops: bool, epoch: int) -> list[set[int]]:
    """What plain DDP trains per step: the union over ranks of each rank's batch from its DistributedSampler."""
    batches = []
    for rank in range(RANKS):
        sampler = DistributedSampler(range(size), num_replicas=RANKS, rank=rank, seed=seed, drop_last=sampler_drops)
        sampler.set_epoch(epoch)
        batches.append(list(BatchSampler(sampler, BATCH, drop_last=loader_drops)))
    return [set().union(*(set(batches[rank][step]) for rank in range(RANKS))) for step in range(len(batches[0]))]


@pytest.mark.parametrize("scenario", DISTRIBUTED)
def test_each_epoch_trains_what_plain_ddp_trains(out, scenario):
    size, seed, sampler_drops, loader_drops, sets_epoch = DISTRIBUTED[scenario]
    epochs, warnings = trained(out, scenario)
    for epoch, steps in enumerate(epochs):
        expected = plain_ddp(size, seed, sampler_drops, loader_drops, epoch if sets_epoch else 0)
        if scenario == "subset":  # the subset's index i is the dataset's 2i
            expected = [{2 * i for i in step} for step in expected]
        assert steps == expected, f"epoch {epoch}"
    if sets_epoch:
        assert epochs[1] != epochs[0] and epochs[2] != epochs[1]
        assert warnings == []
    else:  # plain DDP's order every epoch, and one warning that says why
        assert epochs[0] == epochs[1] == epochs[2]
        assert len(warnings) == 1 and "set_epoch" in warnings[0]


@pytest.mark.parametrize("scenario", PLAIN)
def test_a_plain_shuffled_loader_trains_every_sample_in_a_new_order_each_epoch(out, scenario):
    epochs, warnings = trained(out, scenario)
    orders = [[sorted(step) for step in steps] for steps in epochs]
    for steps in epochs:
        assert sorted(i for step in steps for i in step) == list(range(SIZE))  # each sample once, ranks agreeing
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert orders[0] != [list(range(first, min(first + BATCH * RANKS, SIZE))) for first in range(0, SIZE, 8)]
    assert warnings == []
