"""LoopLoader: batches a framework fetches ahead of training them pair, in order, with the steps the loader cut, and
the steps open and close when the framework's hooks say so, not when batches are fetched."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hetdp.data.loader import AllocatedLoader
from hetdp.data.steps import StepSampler
from hetdp.integrations.steps import LoopLoader


class Recorder:
    """What a LoopLoader needs of hetdp.DDP, recording the calls: rank 0 of 2, shares 3 and 1 of 4 a step."""

    rank, world_size = 0, 2
    last_epoch = None

    def __init__(self) -> None:
        self.steps_done = self.epochs_done = 0
        self.calls: list[tuple] = []

    def shares_at(self, step: int) -> list[int]:
        return [3, 1]

    def begin_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.calls.append(("begin_epoch", epoch))

    def begin_ticket(self, ticket) -> None:
        self.calls.append(("begin", ticket.step, ticket.samples, ticket.weights))

    def end_step(self) -> None:
        self.calls.append(("end", self.steps_done))
        self.steps_done += 1

    def end_epoch(self) -> None:
        self.calls.append(("end_epoch",))


def _loop(size: int = 10) -> tuple[LoopLoader, Recorder]:
    data = TensorDataset(torch.arange(size))
    model = Recorder()
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    steps = StepSampler(size, 4, 0, shares_at=model.shares_at, shuffle=False, seed=0, drop_last=False,
                        epoch_source=loader.sampler)
    return LoopLoader(AllocatedLoader(model, loader, steps)), model  # type: ignore[arg-type]


def test_batches_fetched_ahead_open_their_steps_only_when_trained_and_in_order():
    loop, model = _loop()
    batches = iter(loop)
    fetched = [next(batches), next(batches)]  # a fetcher one batch ahead: nothing opened yet
    assert model.calls == [("begin_epoch", 0)]
    for batch in fetched:
        ticket = loop.begin_batch()
        assert len(batch[0]) == ticket.samples == 3  # the batch trained is the step opened
        loop.end_batch()
    assert model.calls[1:] == [("begin", 0, 3, None), ("end", 0), ("begin", 1, 3, None), ("end", 1)]


def test_the_epoch_closes_when_the_loop_says_so_not_when_the_fetching_stops():
    loop, model = _loop()
    batches = list(loop)  # 3 steps (10 samples, 4 a step): all fetched, none trained
    assert [len(batch[0]) for batch in batches] == [3, 3, 1]  # the last step's 2 samples: rank 0 takes 1
    assert ("end_epoch",) not in model.calls
    for _ in batches:
        loop.begin_batch()  # the previous step closes as the next opens, if the loop did not close it
    loop.end_epoch()
    assert model.calls[-2:] == [("end", 2), ("end_epoch",)]
    loop.end_epoch()
    assert model.calls.count(("end_epoch",)) == 1  # closing twice closes once


def test_a_step_weighed_as_plain_ddp_carries_its_weights():
    loop, model = _loop()
    next(iter(loop))
    ticket = loop.begin_batch(weights=(1.0, 1.0))
    assert ticket.weights is None and model.calls[-1] == ("begin", 0, 3, (1.0, 1.0))
