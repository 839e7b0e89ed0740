"""The drop-in's planning: every rank's step figures gathered to all ranks, the allocator re-planned on them, and
the shares scheduled by step.

A re-plan must reach every rank before any rank cuts a step it changes: each rank
gathers the next step its loader will cut (its horizon) with its figures, and the
new shares apply from the latest horizon on. A gather runs in the background, every
``metrics.every`` steps or when the allocator's window is full. Under allreduce with
every rank in the exchange, which holds the ranks in step anyway, it is awaited as
the next step is cut, and its plan applies from that step: the step right after its
window. Where the ranks are not in step (partial and local synchronization, ranks
that sit out) it is awaited ``PLAN_LAG`` steps later, and its plan applies from
there; under partial and local synchronization the ranks also meet, and a meeting
carries the figures. A step never waits on the device for its figures: a step whose
times are still on the device (CUDA events not yet complete) is sent as unknown and
goes out again with the next gather. Only an epoch's end and a meeting, which wait
for every rank's replica anyway, read every step.
"""

from __future__ import annotations

import collections
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hetdp.allocate.policy import PLAN_LAG, Allocator
from hetdp.errors import ConfigError
from hetdp.figures.clock import EndedStep
from hetdp.figures.metrics import MetricsConfig, MetricsWriter, StepFigures
from hetdp.runtime import wait_for
from hetdp.sync.base import Synchronizer

if TYPE_CHECKING:
    from hetdp.data.loader import AllocatedLoader
    from hetdp.data.steps import StepTicket


log = logging.getLogger(__name__)

HISTORY_STEPS = 10_000
"""Per-step figures kept in ``step_figures`` (the oldest are dropped; a metrics file keeps them all)."""


@dataclass(frozen=True)
class FiguresRow:
    """What one rank gathers to the others: its horizon, the figures of its steps since the last gather, and what the
    caller adds (an epoch's totals). Every rank's row has the same length: the ranks gather the same steps."""

    horizon: int
    """The next step this rank's loader cuts: a plan applies from the latest rank's on."""
    compute_s: list[float]
    wait_s: list[float]
    period_s: list[float]
    samples: list[int]
    extra: list[float]

    def values(self) -> list[float]:
        """The row as it travels: one float64 tensor."""
        return [float(self.horizon), *self.compute_s, *self.wait_s, *self.period_s, *map(float, self.samples),
                *self.extra]

    @classmethod
    def of(cls, values: Sequence[float], steps: int) -> FiguresRow:
        """Read back ``values()`` of a row with figures of ``steps`` steps."""
        values = [float(value) for value in values]
        figures = [values[1 + k * steps : 1 + (k + 1) * steps] for k in range(4)]
        return cls(horizon=int(values[0]), compute_s=figures[0], wait_s=figures[1], period_s=figures[2],
                   samples=[round(n) for n in figures[3]], extra=values[1 + 4 * steps :])


@dataclass
class _PlanningGather:
    """An all-gather of step figures in flight: started at one step, awaited as the step at ``guard`` is cut or
    ``PLAN_LAG`` steps later, whichever comes first."""

    work: dist.Work
    rows: list[torch.Tensor]
    pending: list[EndedStep]
    """This rank's steps whose figures it carries."""
    await_after: int
    """``steps_done`` from which ``step_ended`` waits for it."""
    lag: int
    """Steps between a rank's horizon and its guard: 0 under allreduce, ``PLAN_LAG`` out of step."""
    guard: int
    """The first step this rank's loader may not cut before the plan is known: the plan applies from the latest
    rank's ``guard`` on, so no rank has cut a step whose shares the plan changes."""


class Planner:
    """One rank's side of the gathers and re-plans: the steps done and met, their figures, the shares by step.

    Warning:
        Every rank must call ``step_ended`` and ``gather`` at the same steps: the gathers are collective.
    """

    def __init__(self, synchronizer: Synchronizer, module: nn.Module, group: dist.ProcessGroup, *,
                 timeout_s: float, metrics: MetricsConfig, writer: MetricsWriter | None,
                 on_replan: Callable[[int, list[int]], None]) -> None:
        self.synchronizer = synchronizer
        self.module = module
        self.group = group
        """The ranks' host group (gloo) the figures travel over: their gathers never wait on a device."""
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.metrics = metrics
        self.writer = writer
        self._on_replan = weakref.WeakMethod(on_replan)  # type: ignore[arg-type]
        """Told of every new plan (first step, shares), a restored one too; weakly: the model that listens holds
        the planner."""
        self.allocator: Allocator | None = None
        self.loader: weakref.ref[AllocatedLoader] | None = None
        """The allocated loader, whose next step is this rank's horizon (weakly: it holds the model)."""
        self.schedule: list[tuple[int, list[int]]] = []
        """(first step, shares from it on), by step: decisions apply only to steps not yet cut by any rank."""
        self.steps_done = 0
        """Steps finished, over all epochs: the global index of the next step."""
        self.since_meeting = 0
        """Steps since the ranks last met (their replicas may differ meanwhile under partial or local sync)."""
        self.step_figures: collections.deque[StepFigures] = collections.deque(maxlen=HISTORY_STEPS)
        self._pending: list[EndedStep] = []
        """This rank's steps since the last gather."""
        self._planning: _PlanningGather | None = None
        """The gather in flight in the background, if any (``_start_planning``)."""

    def start(self, allocator: Allocator) -> None:
        """Plan with ``allocator`` from the next step on."""
        self.allocator = allocator
        self.schedule = [(self.steps_done, list(allocator.shares))]

    @property
    def shares(self) -> list[int]:
        return list(self.schedule[-1][1]) if self.schedule else []

    def shares_at(self, step: int) -> list[int]:
        """The shares of global step ``step`` (a step past a planning gather's guard waits for its plan)."""
        if self._planning is not None and step >= self._planning.guard:
            self.settle()
        for first, shares in reversed(self.schedule):
            if first <= step:
                return list(shares)
        return list(self.schedule[0][1])

    @property
    def apart(self) -> bool:
        """Whether the ranks' replicas may differ: partial or local synchronization, with steps since the last
        meeting."""
        return not self.synchronizer.meets_every_step and self.since_meeting > 0

    def meets_after(self, ticket: StepTicket, wanted: bool) -> bool:
        """Whether the ranks will meet after the step of ``ticket`` (every rank gives the same answer): every
        ``every`` steps, at the epoch's end, and where ``wanted`` (before a checkpoint). Knowing it before the
        step's gradient lets the synchronization complete the step everywhere first."""
        if self.synchronizer.meets_every_step:
            return False
        return ticket.last or wanted or self.synchronizer.due(self.since_meeting + 1)

    def step_ended(self, ended: EndedStep) -> None:
        """Count a finished step; meet, gather or re-plan when due (collective)."""
        self._pending.append(ended)
        self.steps_done += 1
        self.since_meeting += 1
        if self._planning is not None and self.steps_done >= self._planning.await_after:
            self.settle()
        if self.synchronizer.meets_every_step:
            if self._planning is None and self._gather_due():
                self._start_planning()
        elif self.synchronizer.due(self.since_meeting):
            self.gather(meet=True)
        elif self._planning_gather_due():
            self._start_planning()

    def _gather_due(self) -> bool:
        window = self.allocator.window() if self.allocator is not None else None
        if window and self._window_steps() >= window:
            return True
        return self.metrics.enabled and len(self._pending) >= self.metrics.every

    def _planning_gather_due(self) -> bool:
        """Partial and local synchronization: an adaptive allocation gathers its step times in the background
        (``PLAN_LAG``) once its window was measured at the current shares, ``MEETING_WINDOW`` steps or more after its
        first decision (a window that short still has robust statistics under random stragglers), while the shares
        settle and, once stable, while it watches for drift; only the synchronization's own meetings make the ranks
        wait for each other."""
        if self.allocator is None or self._planning is not None:
            return False
        window = self.allocator.window()
        return bool(window) and self._window_steps() >= max(window, self.allocator.out_of_step_window())

    def _window_steps(self) -> int:
        """Steps measured at the current shares, gathered or not: what the allocator's next re-plan would use."""
        current = self.allocator.shares  # type: ignore[union-attr]
        return self.allocator.measured + sum(  # type: ignore[union-attr]
            1 for ended in self._pending if list(ended.ticket.cut_by) == current)

    def _start_planning(self) -> None:
        """Gather the figures of the steps since the last gather in the background; ``settle`` takes them in."""
        pending, self._pending = self._pending, []
        row = self._row(pending, [], read_all=False)
        lag = 0 if self._in_step() else PLAN_LAG
        if self.world_size == 1:  # alone: nothing to wait for, and no collective
            self._record([row], pending)
            self._plan(row.horizon + lag, epoch_end=False)
            return
        mine = torch.tensor(row.values(), dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(rows, mine, group=self.group, async_op=True)
        self._planning = _PlanningGather(work, rows, pending, await_after=self.steps_done + PLAN_LAG, lag=lag,
                                         guard=row.horizon + lag)

    def _in_step(self) -> bool:
        """Whether every rank is held in step by the step's exchange: allreduce with no rank sitting out. Then a
        planning gather awaited as the next step is cut costs what a blocking one would, and its plan applies a step
        after its window, not ``PLAN_LAG`` steps later at the old shares. Ranks that sit out run stand-ins outside
        the exchange, not in step with the members, and one that rejoins catches up as the step before it ends: a
        plan made only as the next step is cut would come too late for that."""
        allocator = self.allocator
        return (self.synchronizer.meets_every_step
                and (allocator is None or len(allocator.members) == self.world_size))

    def settle(self) -> None:
        """Wait for the planning gather in flight, if any, record its figures and re-plan from them."""
        planning, self._planning = self._planning, None
        if planning is None:
            return
        left = self.synchronizer.standby(planning.work.is_completed, self.timeout_s)
        wait_for(planning.work, "gathering step figures", max(left, 1.0), self.group)
        rows = [FiguresRow.of(row.cpu().tolist(), len(planning.pending)) for row in planning.rows]
        self._record(rows, planning.pending)
        self._plan(max(row.horizon for row in rows) + planning.lag, epoch_end=False)

    def gather(self, *, meet: bool = False, extra: Sequence[float] = (), epoch_end: bool = False
               ) -> list[list[float]]:
        """Bring every rank's figures since the last gather to all ranks (riding a meeting if ``meet``), record
        them, re-plan if the window is full; return every rank's ``extra`` (collective; reads every step's times,
        waiting for the device where they are still on it)."""
        self.settle()
        pending, self._pending = self._pending, []
        rows = self._exchange(self._row(pending, extra, read_all=True), len(pending), meet)
        self._record(rows, pending)
        self._plan(max(row.horizon for row in rows), epoch_end)
        return [row.extra for row in rows]

    def _row(self, pending: list[EndedStep], extra: Sequence[float], *, read_all: bool) -> FiguresRow:
        """This rank's row; unless ``read_all``, a step whose times are still on the device goes as NaN (unknown)."""
        known = [read_all or ended.times.completed for ended in pending]
        return FiguresRow(horizon=self.horizon,
                          compute_s=[ended.times.compute_s if ok else math.nan for ended, ok in zip(pending, known)],
                          wait_s=[ended.times.wait_s if ok else math.nan for ended, ok in zip(pending, known)],
                          period_s=[ended.times.period_s for ended in pending],
                          samples=[ended.ticket.samples for ended in pending], extra=list(extra))

    def _exchange(self, row: FiguresRow, steps: int, meet: bool) -> list[FiguresRow]:
        """Every rank's row, in rank order: summed into the meeting's carry if ``meet``, else all-gathered."""
        values = row.values()
        if meet:
            carry = torch.zeros(self.world_size, len(values), dtype=torch.float64)
            carry[self.rank] = torch.tensor(values, dtype=torch.float64)
            summed = self.synchronizer.meet(self.module, carry.reshape(-1))
            self.since_meeting = 0
            gathered = summed.reshape(self.world_size, len(values)).cpu()  # type: ignore[union-attr]
        elif self.world_size == 1:  # alone: the row is every rank's, with no collective (and no tensor)
            return [FiguresRow.of(values, steps)]
        else:
            mine = torch.tensor(values, dtype=torch.float64)
            rows = [torch.empty_like(mine) for _ in range(self.world_size)]
            wait_for(dist.all_gather(rows, mine, group=self.group, async_op=True), "gathering step figures",
                     self.timeout_s, self.group)
            gathered = torch.stack(rows).cpu()
        return [FiguresRow.of(values, steps) for values in gathered.tolist()]

    def _record(self, rows: list[FiguresRow], pending: list[EndedStep]) -> None:
        """Keep the gathered figures of ``pending`` (every rank's row) and measure the allocator on them. A step that
        some rank sent as unknown (its times still on the device) waits for the next gather, on every rank alike."""
        known = [all(math.isfinite(row.compute_s[i]) and math.isfinite(row.wait_s[i]) for row in rows)
                 for i in range(len(pending))]
        self._pending[:0] = [ended for ended, ok in zip(pending, known) if not ok]
        figures = [StepFigures(step=times.ticket.step, epoch=times.ticket.epoch,
                               shares=[row.samples[i] for row in rows], compute_s=[row.compute_s[i] for row in rows],
                               wait_s=[row.wait_s[i] for row in rows])
                   for i, times in enumerate(pending) if known[i]]
        self.step_figures.extend(figures)
        if self.writer is not None and figures:
            self.writer.write_steps(figures)
        if self.allocator is not None:
            current = self.allocator.shares
            periods = [[row.period_s[i] for row in rows] for i in range(len(pending)) if known[i]]
            for step, ended, period_s in zip(figures, [ended for ended, ok in zip(pending, known) if ok], periods):
                if list(ended.ticket.cut_by) == current:
                    self.allocator.measure(step.compute_s, step.wait_s, period_s)

    def _plan(self, horizon: int, epoch_end: bool) -> None:
        allocator = self.allocator
        if allocator is None:
            return
        # Under partial and local synchronization a meeting soon after the last (at an epoch's end) holds too few
        # steps for robust statistics under random stragglers: they count towards the next meeting's re-plan.
        min_steps = 0 if self.synchronizer.meets_every_step else allocator.out_of_step_window()
        if not allocator.due(epoch_end, min_steps):
            return
        shares = allocator.replan()
        if shares is None:
            return
        first = max(horizon, self.steps_done)
        self._announce(first, shares)
        log.debug("rank %d: shares %s from step %d", self.rank, shares, first)

    def force(self, first: int, shares: list[int]) -> None:
        """Take ``shares`` from global step ``first`` on, set by hand (``hetdp.DDP.set_shares``); every rank calls it
        with the same figures, at a step no rank's loader has cut."""
        self.settle()
        if self.allocator is None:
            raise ConfigError("set_shares() before allocate(): the shares are of the allocated loader's steps")
        self.allocator.take(shares)
        self._announce(first, list(shares))

    def _announce(self, first: int, shares: list[int]) -> None:
        """Schedule ``shares`` from global step ``first`` on, and tell the re-plan listener (the loader's sampler)."""
        self.schedule.append((first, shares))
        listener = self._on_replan()
        if listener is not None:
            listener(first, shares)

    @property
    def horizon(self) -> int:
        """The first step this rank's loader has not cut yet (its workers fetch ahead): the earliest a plan can
        change."""
        loader = self.loader() if self.loader is not None else None
        return loader.sampler.next_step if loader is not None else self.steps_done

    def restore(self, steps_done: int, allocator_state: dict[str, Any] | None, saved_world: int) -> None:
        """Continue a saved run at ``steps_done``: its allocator's state where it ran on as many ranks (else the
        allocation starts afresh: adaptive allocation re-learns the shares)."""
        self.settle()
        self.steps_done = steps_done
        if self.allocator is not None and allocator_state is not None:
            if saved_world == self.world_size:
                self.allocator.load_state_dict(allocator_state)
            else:
                log.warning("rank %d: checkpoint of %d ranks resumed on %d; the allocation starts afresh",
                            self.rank, saved_world, self.world_size)
            self.schedule = []
            self._announce(steps_done, list(self.allocator.shares))
        self._pending = []
        self.since_meeting = 0
