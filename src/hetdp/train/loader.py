"""The drop-in's data side: the user's DataLoader, re-cut so that every step gives each rank its share.

``hetdp.DDP.allocate(loader)`` keeps every option of the user's ``DataLoader``
(workers, ``collate_fn``, ``pin_memory``, any batch type) and replaces only its
batching: each step takes the next ``global_batch`` samples of the epoch's
permutation, and rank r takes ``shares[r]`` of them, where ``shares`` may change
from one step to the next.
"""

from __future__ import annotations

import collections
import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from hetdp.allocate.pack import CostBalance, pack_by_cost
from hetdp.allocate.sampler import split_step
from hetdp.errors import ConfigError
from hetdp.train.stepcheckpoint import set_random_state

if TYPE_CHECKING:
    from hetdp.train.ddp import DistributedDataParallel


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
    rank (``DistributedSampler``'s: seed + epoch). Step k covers its samples
    ``k * global_batch`` to ``(k + 1) * global_batch``, so the shares may change
    between any two steps without any bookkeeping of positions. A rank whose block
    is empty gets one stand-in index, the step's first sample, so that its loop
    still has a batch to run: ``hetdp.DDP`` weighs that step 0 on it and runs its
    forward in eval mode (no BatchNorm statistics from it).

    Every index list it makes is recorded as a ``StepTicket``, which the loader
    pairs with the batch when the DataLoader delivers it (workers prefetch ahead).

    With ``cost`` (variable-length data), the shares are parts of each step's cost,
    not of its samples: the step's samples are packed so that each rank's block
    costs its part (``pack_by_cost``), unless ``cost.pack`` is False.
    """

    def __init__(self, dataset_size: int, global_batch: int, rank: int, *, shares_at: Callable[[int], list[int]],
                 shuffle: bool, seed: int, drop_last: bool, cost: CostBalance | None = None) -> None:
        if dataset_size < 1:
            raise ConfigError("the dataset is empty")
        self.dataset_size = dataset_size
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
        self.next_step = 0
        """The global index of the next step to produce."""
        self.tickets: collections.deque[StepTicket] = collections.deque()

    def resume_at(self, epoch: int, start: int) -> None:
        """Make the next ``set_epoch(epoch)`` start at step ``start`` of it (a run resumed from a checkpoint)."""
        self.set_epoch(epoch, start)
        self._resume = (epoch, start)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation (call before each epoch, as with ``DistributedSampler``); ``start`` skips
        the epoch's first steps (a resumed run)."""
        if self._resume is not None:
            if self._resume[0] == epoch and start == 0:
                start = self._resume[1]
            self._resume = None
        if not 0 <= start <= self.steps_per_epoch:
            raise ConfigError(f"start must be a step in [0, {self.steps_per_epoch}], got {start}")
        self.epoch = epoch
        self.start = start

    @property
    def steps_per_epoch(self) -> int:
        full, remainder = divmod(self.dataset_size, self.global_batch)
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
            count = min(self.global_batch, self.dataset_size - first)
            shares = self.shares_at(self.next_step)
            if self.cost is not None:
                yield self._cost_step(order[first : first + count], shares, index)
                continue
            block = tuple(split_step(shares, count))
            ticket = StepTicket(step=self.next_step, epoch=self.epoch, index=index, block=block, rank=self.rank,
                                last=index == self.steps_per_epoch - 1)
            self.tickets.append(ticket)
            self.next_step += 1
            offset = first + sum(block[: self.rank])
            yield order[offset : offset + block[self.rank]] if block[self.rank] else [order[first]]

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


def _order_of(loader: DataLoader, shuffle: bool | None, seed: int | None) -> tuple[bool, int]:
    """The shuffle and seed the user's loader asked for, read off its sampler (or given). A loader that batches
    with a ``batch_sampler`` of its own ignores ``loader.sampler``: its order is the batch sampler's."""
    sampler = loader.sampler
    own = _own_batch_sampler(loader)
    if own is not None:
        sampler = own.sampler if type(own) is BatchSampler else own
    if isinstance(sampler, DistributedSampler):
        found = (sampler.shuffle, sampler.seed)
    elif isinstance(sampler, RandomSampler):
        found = (True, 0)
    elif isinstance(sampler, SequentialSampler):
        found = (False, 0)
    elif shuffle is None:
        raise ConfigError(
            f"allocate() replaces the loader's sampler and cannot imitate a {type(sampler).__name__}: use a "
            f"DistributedSampler, or pass shuffle= (and seed=; cost= balances steps by length)"
        )
    else:
        found = (shuffle, 0)
    return (found[0] if shuffle is None else shuffle), (found[1] if seed is None else seed)


def _drops_last(loader: DataLoader) -> bool:
    """Whether the user's loader drops a partial last batch (a ``BatchSampler`` of its own says so itself)."""
    own = _own_batch_sampler(loader)
    return own.drop_last if type(own) is BatchSampler else loader.drop_last


def _own_batch_sampler(loader: DataLoader) -> Any | None:
    """The ``batch_sampler`` the user's loader batches with, if given (its ``sampler`` and ``drop_last`` are then
    unused)."""
    return loader.batch_sampler if loader.batch_size is None else None


_DATALOADER_OPTIONS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                       "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                       "pin_memory_device")
"""The DataLoader settings a re-cut loader keeps (those of the running torch that the loader has)."""


class AllocatedLoader:
    """The user's DataLoader, batching each step by the ranks' shares; iterate it as the original.

    Iterating yields one batch per step, the same number on every rank
    (``len(loader)``), so per-step schedulers and step counts work unchanged.
    Between two batches it tells the model that one step ended and the next
    began; after the last, that the epoch ended (a re-plan, a merge, the epoch's
    figures). Attributes it does not define come from the original loader.

    .. warning::
        Every rank must iterate it the same way (same epochs, ``set_epoch`` on
        ``loader.sampler`` as with ``DistributedSampler``): each step is collective.
    """

    def __init__(self, model: DistributedDataParallel, loader: DataLoader, *, global_batch: int,
                 shuffle: bool | None = None, seed: int | None = None, cost: CostBalance | None = None) -> None:
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError("allocate() needs a map-style dataset (with __len__ and __getitem__), "
                              f"got {type(dataset).__name__}")
        shuffle, seed = _order_of(loader, shuffle, seed)
        self.original = loader
        self.model = model
        self.sampler = StepSampler(len(dataset), global_batch, model.rank, shares_at=model.shares_at,
                                   shuffle=shuffle, seed=seed, drop_last=_drops_last(loader), cost=cost)
        accepted = inspect.signature(DataLoader.__init__).parameters
        options = {name: getattr(loader, name) for name in _DATALOADER_OPTIONS
                   if name in accepted and hasattr(loader, name)}
        if options.get("num_workers", 0) == 0:
            options.pop("prefetch_factor", None)
        if "in_order" in accepted:
            options["in_order"] = True  # batches must come back in the order their tickets were cut
        self._loader = DataLoader(dataset, batch_sampler=self.sampler, **options)

    @property
    def dataset(self) -> Any:
        return self.original.dataset

    @property
    def global_batch(self) -> int:
        return self.sampler.global_batch

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["original"], name)

    def batches(self) -> Iterator[Any]:
        """Iterate the epoch's batches without opening or closing the model's steps: for a framework that owns the
        loop (``hetdp.integrations``), which fetches a batch before it trains it, or stops fetching at the epoch's
        last batch, and says itself when a batch's step begins and ends (``begin_ticket`` with
        ``sampler.tickets.popleft()``, ``end_step``, ``begin_epoch``, ``end_epoch``)."""
        self.sampler.tickets.clear()
        self.sampler.next_step = self.model.steps_done
        return iter(self._loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.tickets.clear()  # a loop that broke off early left tickets of steps never run
        self.sampler.next_step = self.model.steps_done
        self.model.begin_epoch(self.sampler.epoch, self.sampler.start)
        batches = iter(self._loader)  # draws the workers' base seed from the global generator
        if self.model.resume_random_state is not None:  # after that draw, which the saved run made before saving
            set_random_state(self.model.resume_random_state)
            self.model.resume_random_state = None
        for batch in batches:
            self.model.begin_ticket(self.sampler.tickets.popleft())
            yield batch
            self.model.end_step()
        self.sampler.start = 0
        self.model.end_epoch()
