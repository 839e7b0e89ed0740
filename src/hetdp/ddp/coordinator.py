"""What both drop-ins are made of beside their exchange: the steps opened and closed around the user's loop, the
epochs' figures, the planner's gathers and re-plans, the allocation and the checkpoint state.

``hetdp.DDP`` (torch's DDP and a comm hook) and the sharded drop-in (``hetdp.fully_shard``: FSDP2 and its
reduce-scatters) each inherit ``StepCoordinator`` and open and close their exchange's side of every step
(``_open_step``, ``_close_step``); the lifecycle, the figures and the allocation are this one.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from hetdp.allocate.policy import AllocationPolicy
from hetdp.checkpoint.checkpointer import CheckpointState
from hetdp.cluster.emulate import Emulation
from hetdp.data.steps import StepTicket
from hetdp.ddp.allocating import Allocating
from hetdp.errors import ConfigError
from hetdp.figures.clock import EndedStep, StepClock
from hetdp.figures.gather import Planner
from hetdp.figures.metrics import EpochReport, MetricsConfig, MetricsWriter
from hetdp.figures.tally import Epochs
from hetdp.runtime.liveness import Heartbeat
from hetdp.runtime import host_group
from hetdp.sync.base import Synchronizer


class _Ticketed(Protocol):
    ticket: StepTicket
    started: bool
    """Whether a forward with gradients ran in the step (its batch trained)."""


class _Steps(Protocol):
    open: _Ticketed | None
    """The open step, if any."""


class StepCoordinator(Allocating, CheckpointState):
    """A drop-in's steps, epochs, figures and allocation: what ``hetdp.DDP`` and the sharded drop-in share.

    A subclass sets ``rank``, ``world_size``, ``step_timeout_s``, ``allocation``, ``emulation``, ``clock`` and
    ``_steps`` (its open step), builds its exchange, then calls ``_coordinate``; it opens and closes its exchange's
    side of each step in ``_open_step`` and ``_close_step``.

    Warning:
        Every rank must open and close the same steps and epochs in the same order: the gathers of figures, the
        re-plans and the epochs' ends are collective.
    """

    steps_in_process: ClassVar[int] = 0
    """Steps any drop-in opened in this process: ``hetdp run`` warns when its settings met none."""

    clock: StepClock
    _steps: _Steps
    allocation: AllocationPolicy
    emulation: Emulation

    def _coordinate(self, module: nn.Module, synchronizer: Synchronizer, group: dist.ProcessGroup,
                    metrics: MetricsConfig | None, progress: Callable[[], int]) -> None:
        """Start the planning, the epochs' figures and this rank's heartbeat (collective over ``group``), once the
        exchange is built; ``progress`` tells the heartbeat how far the rank got."""
        self.metrics = metrics or MetricsConfig()
        self._writer = MetricsWriter(self.metrics) if self.metrics.enabled and self.rank == 0 else None
        self._figures_group = host_group(group, self.step_timeout_s)
        self._planner = Planner(synchronizer, module, self._figures_group, timeout_s=self.step_timeout_s,
                                metrics=self.metrics, writer=self._writer, on_replan=self._replanned)
        self.step_figures = self._planner.step_figures
        """Every rank's figures per step, as far as the last gather (every ``metrics.every`` steps, at re-plans,
        meetings and epoch ends)."""
        self._epochs = Epochs(self._writer)
        self.epoch_reports = self._epochs.reports
        self.resume_position: tuple[int, int] = (0, 0)
        """(epoch, step within it) a loaded checkpoint resumes at; the allocated loader starts there."""
        self.resume_random_state: dict[str, Any] | None = None
        """This rank's random state a loaded checkpoint saved; the allocated loader restores it as the loop starts."""
        self._listeners = []
        self._warned: set[str] = set()
        self._heartbeat = Heartbeat(group, progress).start()
        weakref.finalize(self, self._heartbeat.stop)
        self._ahead: collections.deque[StepTicket] = collections.deque()
        """Tickets of batches the allocated loader yielded whose steps wait for the open one to close (a loop that
        fetches ahead)."""
        self._exhausted = False
        """Whether the allocated loader yielded its epoch's last batch while steps of it had not closed yet."""
        self._left_open = False
        """Whether the open step is one a loop that broke off left: the next batch yielded opens its own."""
        self._optimizer_hook = register_optimizer_step_post_hook(
            functools.partial(_optimizer_stepped, weakref.ref(self)))
        weakref.finalize(self, self._optimizer_hook.remove)

    @property
    def steps_done(self) -> int:
        """Steps finished, over all epochs: the global index of the next step."""
        return self._planner.steps_done

    @property
    def epochs_done(self) -> int:
        """Epochs ended: the index of the next one, which a plain shuffled loader's order follows."""
        return self._epochs.next

    @property
    def step_samples(self) -> int | None:
        """This rank's samples in the open step (None outside one). 0: its batch is a stand-in that trains nothing
        (it sits out, or a short last step has none for it); leave it out of samples seen and accuracy."""
        return None if self._steps.open is None else self._steps.open.ticket.samples

    def _first_warning(self, key: str) -> bool:
        """Whether the warning ``key`` is due: on rank 0, the first time (one line a run, not one a rank)."""
        if self.rank != 0 or key in self._warned:
            return False
        self._warned.add(key)
        return True

    # --- the step lifecycle (the allocated loader drives it; loops with their own batching may too) -------------

    def begin_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Start the epoch's figures; the allocated loader calls it."""
        self._epochs.begin(epoch, first=self.steps_done - start_step)

    def begin_step(self, samples: int, total: int) -> None:
        """Open a step in which this rank computes ``samples`` of the step's ``total`` (0: a stand-in batch, a training
        step in the module's own mode that weighs nothing). The allocated loader calls it; a loop with its own batching
        calls it before each step's first forward, and ``end_step`` after ``optimizer.step()``."""
        if not 0 <= samples <= total or total < 1:
            raise ConfigError(f"a step needs 0 <= samples <= total and total >= 1, got {samples} of {total}")
        if self._epochs.tally is None:
            self.begin_epoch(0)
        tally = self._epochs.tally
        block = tuple(samples if rank == self.rank else 0 for rank in range(self.world_size))
        self.begin_ticket(StepTicket(step=self.steps_done, epoch=tally.epoch, index=self.steps_done - tally.first,
                                     block=block, rank=self.rank), total)

    def begin_ticket(self, ticket: StepTicket, total: int | None = None) -> None:
        """Open a step cut by the allocated loader (``total`` defaults to the ticket's)."""
        if self._epochs.tally is None:
            self.begin_epoch(ticket.epoch)
        total = ticket.total if total is None else total
        wanted = any(listener.meets_after(self.steps_done + 1) for listener in self._listeners)
        self._open_step(ticket, total, meets=self._planner.meets_after(ticket, wanted))
        StepCoordinator.steps_in_process += 1

    # --- steps bound to their batches: the allocated loader's side of the lifecycle -------------------------------

    def batch_yielded(self, ticket: StepTicket) -> None:
        """The allocated loader yields the batch of ``ticket``. Its step opens now where no step waits (a loop that
        trains each batch as it comes), else once the steps before it closed (a loop that fetches ahead)."""
        if self._left_open or (self._steps.open is None and not self._ahead):
            self._left_open = False
            self.begin_ticket(ticket)
        else:
            self._ahead.append(ticket)

    def loader_resumed(self) -> None:
        """The loop asks the allocated loader for its next batch: the open step closes if its batch trained (a
        forward with gradients ran in it); one whose batch has not trained stays open (the loop fetched ahead)."""
        open_step = self._steps.open
        if open_step is not None and open_step.started:
            self._close_bound()

    def loader_exhausted(self) -> None:
        """The allocated loader yielded its epoch's last batch: the epoch ends now if every step of it closed, else
        when its last closes (``_close_bound``)."""
        if self._steps.open is None and not self._ahead:
            self.end_epoch()
        else:
            self._exhausted = True

    def pass_starts(self) -> None:
        """A new pass over the allocated loader starts: an epoch whose last steps are still open ends first (their
        batches' work is done, or never came: a loop that fetched ahead of its last batches and left them); the
        steps of a pass the loop broke off are dropped, as they were."""
        while self._exhausted:
            self._close_bound()
        self._ahead.clear()
        self._left_open = self._steps.open is not None  # the pass's first step replaces it, its figures dropped

    def _close_bound(self) -> None:
        """Close the open step, then open the next one whose batch was yielded, or end the epoch after its last."""
        self.end_step()
        if self._ahead:
            self.begin_ticket(self._ahead.popleft())
        elif self._exhausted:
            self._exhausted = False
            self.end_epoch()

    def _open_step(self, ticket: StepTicket, total: int, meets: bool) -> None:
        """Open the exchange's side of the step of ``ticket`` (``total`` samples over all ranks; ``meets``: the ranks
        meet after it)."""
        raise NotImplementedError

    def record_loss(self, loss: torch.Tensor | float, samples: int | None = None) -> None:
        """Count a loss (the mean over ``samples``, default this step's) into the epoch report's ``loss``."""
        open_step = self._steps.open
        samples = open_step.ticket.samples if samples is None and open_step is not None else samples
        if samples and self._epochs.tally is not None:
            self._epochs.tally.add_loss(loss, samples)

    def end_step(self) -> None:
        """Close the step (after ``optimizer.step()``): record its figures; meet or re-plan when due."""
        ended = self._close_step()
        if ended is None:
            raise ConfigError("end_step() without an open step (call begin_step first)")
        if self._epochs.tally is not None:
            self._epochs.tally.add_step(ended.times, ended.ticket.samples)
        self._planner.step_ended(ended)
        self._step_closed()
        for listener in self._listeners:
            listener.step_ended(self.steps_done)

    def _close_step(self) -> EndedStep | None:
        """Close the exchange's side of the open step (None if none) and return it, with its times."""
        raise NotImplementedError

    def _step_closed(self) -> None:
        """After a step's figures are recorded, before a checkpoint may save it: what the exchange does then."""

    def end_epoch(self) -> EpochReport:
        """Close the epoch: merge where the synchronization meets per epoch, gather its figures, re-plan if due.

        Collective; the allocated loader calls it after the epoch's last step.
        """
        assert self._epochs.tally is not None, "end_epoch() without begin_epoch()"
        totals = self._epochs.tally.totals().values()
        every_rank = self._planner.gather(meet=self._planner.apart, extra=totals, epoch_end=True)
        self.clock.restart()  # the ranks just met, announced or not: no emulated step runs on past it
        self._epoch_met()
        allocator = self.allocator
        return self._epochs.end(every_rank, shares=self.shares, stable=allocator.stable if allocator else True,
                                sat_out=dict(allocator.sat_out) if allocator else {},
                                caps=allocator.caps if allocator else None)

    def _epoch_met(self) -> None:
        """The ranks met at the epoch's end: what the exchange brings current there."""

    def _replanned(self, first_step: int, shares: list[int]) -> None:
        """The planner's news: ``shares`` from global step ``first_step`` on."""
        if self._epochs.tally is not None:
            self._epochs.tally.add_replan(first_step, shares)

    @property
    def last_epoch(self) -> EpochReport | None:
        """The latest epoch's report (identical on every rank), or None before the first epoch ended."""
        return self.epoch_reports[-1] if self.epoch_reports else None

    def _release_figures(self, group: dist.ProcessGroup) -> None:
        """Close the metrics files and the figures' own group (if not ``group``); part of a collective ``close``."""
        if self._writer is not None:
            self._writer.close()
        if self._figures_group is not group:
            dist.destroy_process_group(self._figures_group)


def _optimizer_stepped(ref: weakref.ref[StepCoordinator], optimizer: torch.optim.Optimizer, args: Any,
                       kwargs: Any) -> None:
    """torch's hook after any ``optimizer.step()``: once the allocated loader yielded its epoch's last batch before
    the loop trained the batches it fetched ahead, no next batch is asked for, and the open step closes here once
    a forward ran in it (weakly held: the hook is global). Earlier steps close as the loop asks for the next batch,
    after the whole loop body (a scheduler's step, a checkpoint's state)."""
    model = ref()
    if model is None or not model._exhausted:
        return
    open_step = model._steps.open
    if open_step is not None and open_step.started:
        model._close_bound()
