"""What both drop-ins are made of beside their exchange: the steps opened and closed around the user's loop, the
epochs' figures, the planner's gathers and re-plans, the allocation and the checkpoint state.

``hetdp.DDP`` (torch's DDP and a comm hook) and the sharded drop-in (``hetdp.fully_shard``: FSDP2 and its
reduce-scatters) each inherit ``StepCoordinator`` and open and close their exchange's side of every step
(``_open_step``, ``_close_step``); the lifecycle, the figures and the allocation are this one.
"""

from __future__ import annotations

import collections
import functools
import warnings
import weakref
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
from hetdp.ddp.windows import StepProgress, accumulated_window, batch_samples, fed_by_a_model, split_batch
from hetdp.errors import ConfigError
from hetdp.figures.clock import EndedStep, StepClock
from hetdp.figures.gather import Planner
from hetdp.figures.metrics import EpochReport, MetricsConfig, MetricsWriter
from hetdp.figures.tally import Epochs
from hetdp.runtime.liveness import Heartbeat, step_progress
from hetdp.runtime import host_group
from hetdp.runtime.teardown import collect_at_exit, release_group
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
                    metrics: MetricsConfig | None) -> None:
        """Start the planning, the epochs' figures and this rank's heartbeat (collective over ``group``), once the
        exchange is built."""
        collect_at_exit()  # registered before the heartbeat's stop, so it runs after it: see its module
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
        self._epoch_ends = 0
        """Epoch ends this rank entered (``end_epoch``, a collective), for its heartbeat's progress."""
        self._heartbeat = Heartbeat(group, functools.partial(_progress, weakref.ref(self))).start()
        weakref.finalize(self, self._heartbeat.stop)
        self._ahead: collections.deque[StepTicket] = collections.deque()
        """Tickets of batches the allocated loader yielded whose steps wait for the open one to close (a loop that
        fetches ahead)."""
        self._exhausted = False
        """Whether the allocated loader yielded its epoch's last batch while steps of it had not closed yet."""
        self._left_open = False
        """Whether the open step is one a loop that broke off left: the next batch yielded opens its own."""
        self._progress = StepProgress()
        """What the loop did in the open step since its backward: whether its batch is done (``windows``)."""
        self._parameter_ids: frozenset[int] | None = None
        """The ids of the module's parameters, which an optimizer that takes its update holds (once one stepped)."""
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
        """This rank's samples in the batch the loop trains (None outside a step), read before its forward or after.
        0: its batch is a stand-in that trains nothing (it sits out, or a short last step has none for it); leave it
        out of samples seen and accuracy."""
        if self._steps.open is None:
            return None
        if self._ahead and self._progress.done(self._accumulates):  # the loop moved on to the next batch it fetched
            return self._ahead[0].samples
        return self._steps.open.ticket.samples

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
        self._progress = StepProgress()
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
        when its last step closes."""
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

    # --- a loop that trains a window of batches it fetched, with no fetch between them (``windows``) ------------

    @property
    def _leader(self) -> StepCoordinator:
        """The model whose allocated loader cuts this model's steps: itself, unless it follows another."""
        return self

    def _training_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], synchronizing: bool = True) -> None:
        """A forward with gradients begins (``synchronizing``: outside ``no_sync``). Where the loop fetched batches
        ahead and this model's batch in the open step is done (``StepProgress.done``), the loop trains the next batch
        it fetched: that batch's step begins here, unless another model's output feeds this forward (a GAN's
        discriminator on the generator's output, part of the step under way)."""
        leader, progress, open_step = self._leader, self._progress, self._steps.open
        if leader._ahead and progress.backward and open_step is not None:
            accumulates = leader._accumulates
            if progress.done(accumulates) and not fed_by_a_model((args, kwargs)):
                leader._warn_once("split", split_batch(progress, open_step.ticket.samples))
                leader._close_bound()
                progress = self._progress
            elif accumulates:
                leader._warn_once("accumulated", accumulated_window(progress, open_step.ticket.samples))
        progress.forward(batch_samples(args, kwargs), synchronizing)

    def _backward_ran(self, waiting: bool | None = None) -> None:
        """A backward through this model's forwards of the open step ran; ``waiting``: it left its gradients waiting
        (None: as the forward before it said)."""
        progress = self._progress
        progress.backward_ended(self.module.parameters(),
                                waiting=not progress.synchronizing if waiting is None else waiting)

    def _optimizer_step_seen(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped (torch's global hook): whether it took this model's update."""
        if self._progress.backward:
            if self._parameter_ids is None:
                self._parameter_ids = frozenset(id(p) for p in self.module.parameters())
            held = self._parameter_ids
            self._progress.optimizer_stepped(any(id(p) in held for group in optimizer.param_groups
                                                 for p in group["params"]))

    def _warn_once(self, key: str, message: str | None) -> None:
        """Warn ``message`` (if any) once a run, from rank 0 (``_first_warning``)."""
        if message is not None and self._first_warning(key):
            warnings.warn(f"hetdp: {message}", stacklevel=6)

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

    def _reducing(self) -> bool:
        """Whether the open step's gradient has reached the exchange's reduction (a heartbeat's progress tells)."""
        raise NotImplementedError

    def _step_closed(self) -> None:
        """After a step's figures are recorded, before a checkpoint may save it: what the exchange does then."""

    def end_epoch(self) -> EpochReport:
        """Close the epoch: merge where the synchronization meets per epoch, gather its figures, re-plan if due.

        Collective; the allocated loader calls it after the epoch's last step.
        """
        assert self._epochs.tally is not None, "end_epoch() without begin_epoch()"
        self._epoch_ends += 1
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
            release_group(self._figures_group)


def _optimizer_stepped(ref: weakref.ref[StepCoordinator], optimizer: torch.optim.Optimizer, args: Any,
                       kwargs: Any) -> None:
    """torch's hook after any ``optimizer.step()``: once the allocated loader yielded its epoch's last batch before
    the loop trained the batches it fetched ahead, no next batch is asked for, and the open step closes here once
    a forward ran in it (weakly held: the hook is global). Earlier steps close as the loop asks for the next batch,
    after the whole loop body (a scheduler's step, a checkpoint's state)."""
    model = ref()
    if model is None:
        return
    model._optimizer_step_seen(optimizer)
    if not model._exhausted:
        return
    open_step = model._steps.open
    if open_step is not None and open_step.started:
        model._close_bound()


def _progress(ref: weakref.ref[StepCoordinator]) -> int:
    """How far a rank got, for its heartbeat (``hetdp.runtime.liveness.step_progress``; weakly held: the heartbeat
    must not keep the model, and its process group, alive)."""
    model = ref()
    if model is None:
        return 0
    step = model._steps.open
    return step_progress(model.steps_done, step is not None and step.started, model._reducing(), model._epoch_ends)
