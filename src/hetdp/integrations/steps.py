"""An allocated loader whose steps a framework's own loop opens and closes, one hook per trained batch.

Trainers that own the loop fetch a batch before they train it, or stop fetching at an epoch's last batch when
they know the loader's length: the allocated loader's own pacing (a step opens as its batch is yielded, closes as
the next is fetched, the epoch after the last) would then close a step before its backward, or never the epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from hetdp.data.loader import AllocatedLoader
from hetdp.data.steps import StepTicket
from hetdp.errors import ConfigError
from hetdp.figures.metrics import EpochReport


class LoopLoader:
    """The allocated loader as a framework iterates it, its steps opened and closed by the framework's hooks.

    Iterating only yields the epoch's batches. The loop calls ``begin_batch``
    before a batch's forward (it opens the step the loader cut for the next batch
    trained: batches and steps pair in order), ``end_batch`` after the optimizer
    step, and ``end_epoch`` once the epoch's batches are trained. Attributes it does
    not define come from the allocated loader: ``sampler`` is the step sampler,
    so a framework's ``set_epoch`` on ``loader.sampler`` reshuffles the steps.

    Warning:
        Every rank must call the hooks in the same order, once per batch trained:
        closing a step and an epoch are collective.
    """

    def __init__(self, allocated: AllocatedLoader) -> None:
        self.allocated = allocated
        self.model = allocated.model
        self._step_open = False
        self._epoch_open = False

    def __len__(self) -> int:
        return len(self.allocated)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["allocated"], name)

    def __iter__(self) -> Iterator[Any]:
        self.end_epoch()  # a loop that broke off without closing its epoch
        sampler = self.allocated.sampler
        batches = self.allocated.batches()
        self.model.begin_epoch(sampler.epoch, sampler.start)
        self._epoch_open = True
        yield from batches

    def begin_batch(self, weights: tuple[float, ...] | None = None) -> StepTicket:
        """Open the step of the next batch trained (closing the previous one, if the loop did not); return it.

        Args:
            weights: what every rank's gradient is weighed by in this step, where the loss is not the mean over
                this rank's samples (None: its samples). A loss the framework already normalized over the whole
                step (transformers' token count across devices) takes equal weights: plain DDP's mean.
        """
        self.end_batch()
        tickets = self.allocated.sampler.tickets
        if not tickets:
            raise ConfigError("a training batch began that the allocated loader did not deliver: the loop trains "
                              "batches of another loader, or calls begin_batch twice per batch")
        ticket = tickets.popleft()
        self.model.begin_ticket(ticket if weights is None else dataclasses.replace(ticket, weights=weights))
        self._step_open = True
        return ticket

    def end_batch(self) -> None:
        """Close the open step (after the optimizer step): its figures are recorded, a re-plan applies if due."""
        if self._step_open:
            self._step_open = False
            self.model.end_step()

    def end_epoch(self) -> EpochReport | None:
        """Close the open step and the epoch (collective); return its report, None if no epoch was open."""
        self.end_batch()
        if not self._epoch_open:
            return None
        self._epoch_open = False
        self.allocated.sampler.start = 0
        return self.model.end_epoch()
