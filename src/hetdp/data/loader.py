"""The drop-in's data side: the user's DataLoader, re-cut so that every step gives each rank its share.

``hetdp.DDP.allocate(loader)`` keeps every option of the user's ``DataLoader``
(workers, ``collate_fn``, ``pin_memory``, any batch type) and replaces only its
batching: each step takes the next ``global_batch`` samples of the epoch's
permutation, and rank r takes ``shares[r]`` of them, where ``shares`` may change
from one step to the next.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from hetdp.allocate.pack import CostBalance
from hetdp.data.owndata import OwnData
from hetdp.data.randomness import set_random_state
from hetdp.data.steps import StepSampler, StepTicket
from hetdp.errors import ConfigError


@dataclass(frozen=True)
class _Order:
    """How the user's loader orders an epoch, read off its sampler (or given to ``allocate``)."""

    shuffle: bool
    seed: int | None
    """None: a plain shuffled loader's, which the ranks draw and agree on (torch draws one per pass)."""
    source: DistributedSampler | None
    """The user's ``DistributedSampler``, whose epoch the allocated loader follows."""
    drops_tail: bool
    """Whether the sampler drops the samples that do not divide among the ranks (``drop_last`` on it)."""


def _order_of(loader: DataLoader, shuffle: bool | None, seed: int | None) -> _Order:
    """The order the user's loader asked for, read off its sampler (``shuffle`` and ``seed`` override it). A loader
    that batches with a ``batch_sampler`` of its own ignores ``loader.sampler``: its order is the batch sampler's."""
    sampler = loader.sampler
    own = _own_batch_sampler(loader)
    if own is not None:
        sampler = own.sampler if type(own) is BatchSampler else own
    if isinstance(sampler, DistributedSampler):
        found = _Order(sampler.shuffle, sampler.seed, sampler, sampler.drop_last)
    elif isinstance(sampler, RandomSampler):
        found = _Order(True, None, None, False)
    elif isinstance(sampler, SequentialSampler):
        found = _Order(False, 0, None, False)
    elif shuffle is None:
        raise ConfigError(
            f"allocate() replaces the loader's sampler and cannot imitate a {type(sampler).__name__}: use a "
            f"DistributedSampler, or pass shuffle= (and seed=; cost= balances steps by length)"
        )
    else:
        found = _Order(shuffle, None, None, False)
    shuffle = found.shuffle if shuffle is None else shuffle
    if seed is None and found.seed is None and not shuffle:
        seed = 0  # an order that is not shuffled needs no seed
    return replace(found, shuffle=shuffle, seed=found.seed if seed is None else seed)


def _drawn_seed(loader: DataLoader) -> int:
    """A seed for a plain shuffled loader's orders, drawn as torch's ``RandomSampler`` draws one: from the
    loader's ``generator`` if it has one, else from torch's global generator (``torch.manual_seed`` fixes it)."""
    generator = getattr(loader.sampler, "generator", None) or loader.generator
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) % 2**62


def _drops_last(loader: DataLoader) -> bool:
    """Whether the user's loader drops a partial last batch (a ``BatchSampler`` of its own says so itself)."""
    own = _own_batch_sampler(loader)
    return own.drop_last if type(own) is BatchSampler else loader.drop_last


def _own_batch_sampler(loader: DataLoader) -> Any | None:
    """The ``batch_sampler`` the user's loader batches with, if given (its ``sampler`` and ``drop_last`` are then
    unused)."""
    return loader.batch_sampler if loader.batch_size is None else None


def per_rank_batch(loader: DataLoader) -> int | None:
    """The batch each rank of plain DDP would take from ``loader``: its ``batch_size``, or that of a torch
    ``BatchSampler`` it batches with; None where the loader does not say."""
    own = _own_batch_sampler(loader)
    if own is None:
        return loader.batch_size
    return own.batch_size if type(own) is BatchSampler else None


_DATALOADER_OPTIONS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                       "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                       "pin_memory_device")
"""The DataLoader settings a re-cut loader keeps (those of the running torch that the loader has)."""


class _Ended(Protocol):
    epoch: int
    """The epoch an ended epoch's report is of."""


class StepDriver(Protocol):
    """What an allocated loader needs of the model whose steps it cuts and drives (``hetdp.DDP``)."""

    rank: int
    world_size: int
    steps_done: int
    resume_random_state: dict[str, Any] | None
    """A resumed run's random state, restored as the loop starts (once)."""

    @property
    def epochs_done(self) -> int: ...
    @property
    def last_epoch(self) -> _Ended | None: ...
    def shares_at(self, step: int) -> list[int]: ...
    def begin_epoch(self, epoch: int, start_step: int = 0) -> None: ...
    def begin_ticket(self, ticket: StepTicket, total: int | None = None) -> None: ...
    def end_step(self) -> None: ...
    def end_epoch(self) -> Any: ...
    def batch_yielded(self, ticket: StepTicket) -> None: ...
    def loader_resumed(self) -> None: ...
    def loader_exhausted(self) -> None: ...
    def pass_starts(self) -> None: ...
    def _rank0s(self, value: Any, what: str) -> Any: ...
    def _first_warning(self, key: str) -> bool: ...


class AllocatedLoader:
    """The user's DataLoader, batching each step by the ranks' shares; iterate it as the original.

    Iterating yields one batch per step, the same number on every rank
    (``len(loader)``), so per-step schedulers and step counts work unchanged.
    Each step's shares are bound to its batch: a step opens as its batch is
    yielded, or, where the loop fetches ahead (timm's ``PrefetchLoader``, a CUDA
    prefetcher, a generator one batch ahead), once the steps of the batches
    before it closed; a step closes as the loop asks for a batch after its own
    trained (a forward with gradients ran), or, once the loader yielded its last
    batch, at the ``optimizer.step()`` after it; the epoch ends (a re-plan, a
    merge, the epoch's figures) after its last step closed, at the latest when the
    next pass starts. Attributes it does not define come from the original loader.

    Its epochs follow the loader's own ``DistributedSampler``: ``set_epoch`` on
    that sampler, on ``loader.sampler`` or on ``loader.batch_sampler.sampler``
    (Lightning's path) gives every epoch its order. A loop that never sets the
    epoch trains one order every epoch, as plain DDP does (with a warning). A
    plain shuffled loader (``shuffle=True``, no ``DistributedSampler``) takes a new
    order each epoch from a seed the ranks agree on, as torch's ``RandomSampler``.

    Warning:
        Every rank must iterate it the same way (same epochs, ``set_epoch`` as
        with ``DistributedSampler``): each step is collective.
    """

    def __init__(self, model: StepDriver, loader: DataLoader, *, global_batch: int,
                 shuffle: bool | None = None, seed: int | None = None, cost: CostBalance | None = None,
                 own: OwnData | None = None) -> None:
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError("allocate() needs a map-style dataset (with __len__ and __getitem__), "
                              f"got {type(dataset).__name__}")
        order = _order_of(loader, shuffle, seed)
        seed = order.seed if order.seed is not None else model._rank0s(_drawn_seed(loader), "agreeing on the order's seed")
        size = len(dataset)
        self.original = loader
        self.model = model
        if own is not None:  # the loader holds this rank's own samples (``hetdp.data.owndata``)
            self.sampler = own.sampler(model.rank, shuffle=order.shuffle, seed=seed, drop_last=_drops_last(loader),
                                       epoch_source=order.source)
        else:
            self.sampler = StepSampler(size, global_batch, model.rank, shares_at=model.shares_at,
                                       shuffle=order.shuffle, seed=seed, drop_last=_drops_last(loader), cost=cost,
                                       epoch_source=order.source,
                                       epoch_size=size - size % model.world_size if order.drops_tail else size)
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
        self._start_pass()
        return iter(self._loader)

    def _start_pass(self) -> None:
        """Settle a pass over the loader before its first step is cut: its epoch, and the step it starts at."""
        self.sampler.tickets.clear()  # a loop that broke off early left tickets of steps never run
        self.sampler.next_step = self.model.steps_done
        self.sampler.begin_pass(self.model.epochs_done)
        self._warn_if_order_repeats()

    def __iter__(self) -> Iterator[Any]:
        self.model.pass_starts()  # the last pass's steps fetched ahead and not closed yet close first
        self._start_pass()
        self.model.begin_epoch(self.sampler.epoch, self.sampler.start)
        batches = iter(self._loader)  # draws the workers' base seed from the global generator
        if self.model.resume_random_state is not None:  # after that draw, which the saved run made before saving
            set_random_state(self.model.resume_random_state)
            self.model.resume_random_state = None
        for batch in batches:
            self.model.batch_yielded(self.sampler.tickets.popleft())
            yield batch
            self.model.loader_resumed()
        self.sampler.start = 0
        self.model.loader_exhausted()

    def _warn_if_order_repeats(self) -> None:
        """Warn (once, from rank 0) when a shuffled epoch repeats the last one's order: the user's
        ``DistributedSampler`` was never told the epoch, which plain DDP trains the same way, as a rule by mistake."""
        last = self.model.last_epoch
        if (self.sampler.shuffle and self.sampler.start == 0 and last is not None
                and last.epoch == self.sampler.epoch and self.model._first_warning("order repeats")):
            warnings.warn(f"hetdp: epoch {last.epoch}'s order again, as under plain DDP: the loader's "
                          "DistributedSampler was not told the epoch; call sampler.set_epoch(epoch) before each epoch "
                          "(on your sampler or on loader.sampler) for a new order", stacklevel=3)
