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
from typing import Any, Protocol

from torch.utils.data import DataLoader

from hetdp.data.randomness import set_random_state
from hetdp.data.steps import StepSampler, StepTicket
from hetdp.runtime.teardown import collect_released

_DATALOADER_OPTIONS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                       "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                       "pin_memory_device")
"""The DataLoader settings a re-cut loader keeps (those of the running torch that the loader has)."""


class _Ended(Protocol):
    epoch: int
    """The epoch an ended epoch's report is of."""


class StepDriver(Protocol):
    """What an allocated loader needs of the model whose steps it drives (``hetdp.DDP``), and what a framework that owns
    the loop calls on it (``hetdp.integrations``)."""

    steps_done: int
    resume_random_state: dict[str, Any] | None
    """A resumed run's random state, restored as the loop starts (once)."""

    @property
    def epochs_done(self) -> int: ...
    @property
    def last_epoch(self) -> _Ended | None: ...
    def begin_epoch(self, epoch: int, start_step: int = 0) -> None: ...
    def begin_ticket(self, ticket: StepTicket, total: int | None = None) -> None: ...
    def end_step(self) -> None: ...
    def end_epoch(self) -> Any: ...
    def batch_yielded(self, ticket: StepTicket) -> None: ...
    def loader_resumed(self) -> None: ...
    def loader_exhausted(self) -> None: ...
    def pass_starts(self) -> None: ...
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

    def __init__(self, model: StepDriver, loader: DataLoader, sampler: StepSampler) -> None:
        """``sampler`` cuts the steps of ``loader``'s dataset (``model.allocate`` builds it from what ``loader`` asks
        for, ``hetdp.data.order``)."""
        self.original = loader
        self.model = model
        self.sampler = sampler
        accepted = inspect.signature(DataLoader.__init__).parameters
        options = {name: getattr(loader, name) for name in _DATALOADER_OPTIONS
                   if name in accepted and hasattr(loader, name)}
        if options.get("num_workers", 0) == 0:
            options.pop("prefetch_factor", None)
        if "in_order" in accepted:
            options["in_order"] = True  # batches must come back in the order their tickets were cut
        self._loader = DataLoader(loader.dataset, batch_sampler=sampler, **options)

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
        return self._start_workers()

    def _start_workers(self) -> Iterator[Any]:
        """``iter`` of the re-cut loader, after a collection where it has worker processes to start.

        A worker forked from this process inherits the garbage the collector has not reached yet and may collect it
        itself: a process group that ``destroy_process_group`` left to a reference cycle (a closed drop-in, a model
        built again) then runs its destructor there and joins gloo threads that exist only in this process, and the
        worker hangs or crashes. Collected here, such a group ends in this process, where its threads are.
        """
        if self._loader.num_workers > 0:
            collect_released()
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
        batches = self._start_workers()  # draws the workers' base seed from the global generator
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
