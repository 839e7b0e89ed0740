"""One step on this rank: what its gradient weighs (in the comm hook, and once accumulated over steps), and how long
it computed and waited."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hetdp.data.steps import StepTicket
from hetdp.ddp.accumulation import StepAccumulation
from hetdp.ddp.hook import HookState
from hetdp.figures.clock import EndedStep, StepTimes
from hetdp.runtime import peer_failures
from hetdp.sync.base import LossConvention, step_part

log = logging.getLogger(__name__)


@dataclass
class OpenStep:
    ticket: StepTicket
    total: int
    """Samples of the step over all ranks."""
    weight: tuple[float, float]
    """(this rank's part, the step's whole) the comm hook weighs the step's gradient by."""
    started: bool = False
    ends_accumulation: bool = False
    """Whether the step's backward synchronizes gradients accumulated under ``no_sync``."""


class StepRunner:
    """Opens and closes this rank's steps: sets the comm hook's weight, times the step on the hook's clock, and
    weighs gradients accumulated under ``no_sync`` step by step (``StepAccumulation``)."""

    def __init__(self, hook: HookState, module: nn.Module, loss: LossConvention = "mean") -> None:
        self.hook = hook
        self.module = module
        self.loss = loss
        """What each rank's loss is (``hetdp.sync.base.LossConvention``): it says what the gradient weighs."""
        self.open: OpenStep | None = None
        self.accumulation: StepAccumulation | None = None
        """Set up by the first forward under ``no_sync``: gradients the loop accumulates, perhaps over steps."""

    def begin(self, ticket: StepTicket, total: int, meets: bool) -> None:
        """Open the step of ``ticket`` (``total`` samples over all ranks); ``meets``: the ranks meet after it."""
        if self.open is not None:
            log.debug("rank %d: step %d was left open (the loop broke off); its figures are dropped", ticket.rank,
                      self.open.ticket.step)
        mine, whole = ((ticket.samples, total) if ticket.weights is None  # cost-balanced: its part of the step's cost
                       else (ticket.weights[ticket.rank], sum(ticket.weights)))
        weight = step_part(self.loss, mine, whole, self.hook.world_size)
        self.open = OpenStep(ticket, total, weight)
        self.hook.samples, self.hook.total = weight
        self.hook.meets = meets

    def forward(self, synchronizing: bool, before_timing: Callable[[], None]) -> None:
        """A forward with gradients in the open step; the step's first starts its clock (after ``before_timing``).

        Gradients accumulated under ``no_sync`` over several steps weigh each step by its own share; the backward
        that synchronizes their sum then reduces it with weight 1."""
        step = self.open
        assert step is not None
        if not step.started:
            step.started = True
            before_timing()
            self.hook.clock.start(step.ticket.step, step.ticket.work)
        self.hook.clock.forwards += 1
        if self.accumulation is None:
            if synchronizing:
                return
            self.accumulation = StepAccumulation(self.module)
        if self.accumulation.forward_starts(self.hook.synchronizer.weight(*step.weight), synchronizing):
            step.ends_accumulation = True
        if step.ends_accumulation:
            self.hook.samples, self.hook.total = 1, 1

    def end(self) -> EndedStep | None:
        """Close the open step (None if none) and return its times."""
        step, self.open = self.open, None
        if step is None:
            return None
        hook, clock = self.hook, self.hook.clock
        reached, hook.reached = hook.reached, False
        hook.outside_step()
        if self.accumulation is not None:
            self.accumulation.step_ended(hook.synchronizer.weight(*step.weight), synchronized=reached)
        if step.started and not reached:  # a micro-batch under no_sync: no bucket marked its end
            clock.mark_ready(last_bucket=True)
            clock.mark_synced()
        hook.synchronizer.count(step.ticket.samples, step.total)
        return EndedStep(step.ticket, clock.finish() if step.started else StepTimes(None, []))

    def stand_in(self) -> bool:
        """Whether the open step runs a stand-in batch (no sample of this rank) in training: its forward changes
        nothing that persists (``weighing_nothing``), and the comm hook weighs its gradient 0."""
        return self.open is not None and self.open.ticket.samples == 0 and self.module.training

    def close(self) -> None:
        if self.accumulation is not None:
            self.accumulation.close()


class StepListener(Protocol):
    """What a model tells at each step's end, after the models that follow it (a checkpointer)."""

    def meets_after(self, steps_done: int) -> bool:
        """Whether the step that makes the count ``steps_done`` needs the ranks' replicas to be one."""

    def step_ended(self, steps_done: int) -> None: ...


def rebuild_buckets(model: TorchDDP, timeout_s: float, group: dist.ProcessGroup | None) -> None:
    """Let torch's DDP rebuild its gradient buckets (once, at the second step's forward) before the step's
    compute is timed: the rebuild is a collective, and where the ranks are out of step (partial and local
    synchronization) a fast rank would time its wait for the slowest as compute: its window would read as noise,
    and the first plan would wait for more steps. torch's own call in ``forward`` then finds nothing to rebuild."""
    with peer_failures("DDP's bucket rebuild", timeout_s, group):
        if model.reducer._rebuild_buckets():
            model._has_rebuilt_buckets = True


def warn_unstepped() -> None:
    """Warn that a training forward ran outside any step (the caller warns once, from ``hetdp.DDP.forward``)."""
    warnings.warn("hetdp.DDP: a training forward outside any step, so this backward averages the ranks' "
                  "gradients as plain DDP does, and nothing is allocated, timed or emulated: iterate the "
                  "loader that model.allocate(loader) returns (was its result dropped?), or open steps "
                  "with model.begin_step / end_step", stacklevel=5)
