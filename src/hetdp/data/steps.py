"""A step as the allocated loader cuts it: the ticket that names every rank's block, and the batch sampler that cuts
each step of the epoch's order by the shares of the step."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hetdp.allocate.pack import CostBalance, pack_by_cost
from hetdp.allocate.sampler import split_step
from hetdp.errors import ConfigError


@dataclass(frozen=True)
class StepTicket:
    """One step as this rank's loader cut it."""

    step: int
    """Global step index, counted over all epochs."""
    epoch: int
    index: int
    """The step's index within its epoch."""
    block: tuple[int, ...]
    """Samples of every rank in the step."""
    rank: int
    cost: tuple[float, ...] | None = None
    """Cost of every rank's block, where the loader knows the samples' costs (``CostBalance``)."""
    weights: tuple[float, ...] | None = None
    """What every rank's gradient is weighted by, where it is not its samples (``CostBalance(mean_over="cost")``)."""
    shares: tuple[int, ...] | None = None
    """The shares a full cost-packed step was cut by (its ``block`` then counts samples, not shares)."""
    last: bool = False
    """The epoch's last step: the ranks meet after it, where their synchronization meets per epoch."""

    @property
    def samples(self) -> int:
        """This rank's samples: 0 means it joins the step with a stand-in batch weighted 0."""
        return self.block[self.rank]

    @property
    def work(self) -> float:
        """This rank's work in the step, what emulation paces: its block's cost where known, else its samples."""
        return self.samples if self.cost is None else self.cost[self.rank]

    @property
    def cut_by(self) -> tuple[int, ...]:
        """The shares the step was cut by: for a full step, the allocation's shares at that step."""
        return self.block if self.shares is None else self.shares

    @property
    def total(self) -> int:
        return sum(self.block)


class StepSampler:
    """A batch sampler: per step, this rank's indices of the epoch's next ``global_batch`` samples.

    The epoch's order is one seeded permutation of the dataset, the same on every
    rank (``DistributedSampler``'s: seed + epoch), of which an epoch trains the
    first ``epoch_size`` samples (``DistributedSampler(drop_last=True)`` drops the
    tail that does not divide among the ranks). Step k covers its samples
    ``k * global_batch`` to ``(k + 1) * global_batch``, so the shares may change
    between any two steps without any bookkeeping of positions.

    The epoch is the user's: with ``epoch_source`` (their own ``DistributedSampler``),
    ``set_epoch`` on either sampler selects it for both, so a loop that keeps its
    sampler in a variable reshuffles as under torch. Without one (a plain shuffled
    loader), each epoch takes the next order, as torch's ``RandomSampler`` draws a
    new one every pass, unless ``set_epoch`` chose it. A rank whose block
    is empty gets stand-in indices (``stand_in`` of them, from the step's first
    sample), so that its loop still has a batch to run: the drop-in weighs that
    step 0 on it and puts back the buffers its forward changed.

    Every index list it makes is recorded as a ``StepTicket``, which the loader
    pairs with the batch when the DataLoader delivers it (workers prefetch ahead).

    With ``cost`` (variable-length data), the shares are parts of each step's cost,
    not of its samples: the step's samples are packed so that each rank's block
    costs its part (``pack_by_cost``), unless ``cost.pack`` is False.
    """

    def __init__(self, dataset_size: int, global_batch: int, rank: int, *, shares_at: Callable[[int], list[int]],
                 shuffle: bool, seed: int, drop_last: bool, cost: CostBalance | None = None,
                 epoch_size: int | None = None, epoch_source: Any = None) -> None:
        if dataset_size < 1:
            raise ConfigError("the dataset is empty")
        self.dataset_size = dataset_size
        self.epoch_size = dataset_size if epoch_size is None else epoch_size
        """How many of the permutation's first samples an epoch trains."""
        if not 1 <= self.epoch_size <= dataset_size:
            raise ConfigError(f"an epoch of {self.epoch_size} samples from a dataset of {dataset_size}: the "
                              "sampler drops them all (drop_last with fewer samples than ranks?)")
        self.epoch_source = epoch_source
        """The user's own sampler whose ``epoch`` this one follows (a ``DistributedSampler``), if any."""
        self.global_batch = global_batch
        self.rank = rank
        self.shares_at = shares_at
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if cost is not None and len(cost.cost) != dataset_size:
            raise ConfigError(f"cost gives {len(cost.cost)} sample costs for a dataset of {dataset_size} samples")
        self.cost = cost
        self.epoch = 0
        self.start = 0
        """The first step of the epoch to produce (a resumed epoch skips those done)."""
        self._resume: tuple[int, int] | None = None
        self._epoch_chosen = False
        """Whether ``set_epoch`` was called: a plain shuffled loader's epochs then stop counting by themselves."""
        self.next_step = 0
        """The global index of the next step to produce."""
        self.tickets: collections.deque[StepTicket] = collections.deque()
        self.stand_in = 1
        """Samples of a stand-in batch, and the fewest a short step gives a rank that takes part: 2 where the
        model's BatchNorm trains (``hetdp.membership.standin.stand_in_samples``), else 1."""

    def resume_at(self, epoch: int, start: int) -> None:
        """Make the next pass over ``epoch`` start at its step ``start`` (a run resumed from a checkpoint)."""
        self._select(epoch)
        self._check_start(start)
        self.start = start
        self._resume = (epoch, start)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation (call before each epoch, as with ``DistributedSampler``; the user's own
        sampler, if the loader had one, is set too)."""
        self._select(epoch)
        self._epoch_chosen = True

    def _select(self, epoch: int) -> None:
        self.epoch = epoch
        if self.epoch_source is not None:
            self.epoch_source.set_epoch(epoch)

    def begin_pass(self, epochs_done: int) -> None:
        """Settle the epoch a pass over the loader trains, before its first step is cut: the user's sampler's
        epoch if it has one, else ``set_epoch``'s, else ``epochs_done`` (a plain shuffled loader: a new order each
        epoch); a pending resume starts at its step if the epoch is its own."""
        if self.epoch_source is not None:
            self.epoch = self.epoch_source.epoch
        elif not self._epoch_chosen:
            self.epoch = epochs_done
        resume, self._resume = self._resume, None
        self.start = resume[1] if resume is not None and resume[0] == self.epoch else 0

    def _check_start(self, start: int) -> None:
        if not 0 <= start <= self.steps_per_epoch:
            raise ConfigError(f"start must be a step in [0, {self.steps_per_epoch}], got {start}")

    @property
    def steps_per_epoch(self) -> int:
        full, remainder = divmod(self.epoch_size, self.global_batch)
        return full + (1 if remainder and not self.drop_last else 0)

    def permutation(self) -> list[int]:
        """The epoch's order of all dataset indices, identical on every rank."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.permutation()
        for index in range(self.start, self.steps_per_epoch):
            first = index * self.global_batch
            count = min(self.global_batch, self.epoch_size - first)
            shares = self.shares_at(self.next_step)
            if self.cost is not None:
                yield self._cost_step(order[first : first + count], shares, index)
                continue
            block = tuple(split_step(shares, count, self.stand_in))
            ticket = StepTicket(step=self.next_step, epoch=self.epoch, index=index, block=block, rank=self.rank,
                                last=index == self.steps_per_epoch - 1)
            self.tickets.append(ticket)
            self.next_step += 1
            offset = first + sum(block[: self.rank])
            yield (order[offset : offset + block[self.rank]] if block[self.rank]
                   else [order[(first + i) % len(order)] for i in range(self.stand_in)])

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start

    def _cost_step(self, indices: list[int], shares: list[int], index: int) -> list[int]:
        """This rank's indices of a step of ``indices``, cut by cost (or by count, costs kept), and its ticket."""
        assert self.cost is not None
        costs = [self.cost.cost[i] for i in indices]
        if self.cost.pack:
            positions = pack_by_cost(costs, shares)
        else:
            counts = split_step(shares, len(indices))
            positions = [list(range(end - count, end)) for end, count in zip(itertools.accumulate(counts), counts)]
        spent = tuple(float(sum(costs[p] for p in block)) for block in positions)
        full = len(indices) == self.global_batch
        ticket = StepTicket(step=self.next_step, epoch=self.epoch, index=index, rank=self.rank,
                            block=tuple(len(block) for block in positions), cost=spent,
                            weights=spent if self.cost.mean_over == "cost" else None,
                            shares=tuple(shares) if full and self.cost.pack else None,
                            last=index == self.steps_per_epoch - 1)
        self.tickets.append(ticket)
        self.next_step += 1
        mine = [indices[p] for p in positions[self.rank]]
        return mine or [indices[0]]
