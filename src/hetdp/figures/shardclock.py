"""The sharded drop-in's step clock: FSDP2's collectives mark where a rank computed and where it waited, and pace it.

Under FSDP2 every unit all-gathers its parameters in forward (and again in
backward where it resharded them) and reduce-scatters its gradients in backward:
the ranks meet at every collective, not once per step. Each one's span counts as
wait, what lies between them as compute, and emulated slowness is slept segment by
segment before each collective (``Pacer.pace``): a single pad at the step's end
would leave every collective waiting on the slowest rank's real compute, then add
its whole pad on top.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from hetdp import runtime
from hetdp.cluster.emulate import Pacer
from hetdp.figures.clock import Mark, StepClock, StepTimes

Result = TypeVar("Result")


class ShardedClock(StepClock):
    """Time one rank's steps under FSDP2 and pace them to its emulated device, one compute segment at a time.

    A step's compute runs from its first forward to its last reduce-scatter's start (or, in a backward that reduces
    nothing, to the backward's end), less the spans of its collectives; its wait is those spans, and the last
    reduce-scatter up to the backward's end. The pacing spreads the emulated block over the step's collectives in
    order, in compute time (waits inside collectives are not compute): the k-th of a step that runs n reaches k / n
    of the block (n is the last step's count, the same on every rank, so balanced shares reach each collective
    together). The first step, whose count is unknown, reaches its whole block at its first reduce-scatter.
    """

    def __init__(self, device: torch.device, pacer: Pacer) -> None:
        super().__init__(device, pacer)
        self.reducing = False
        """Whether the started step's backward has reduce-scattered (a heartbeat's progress tells)."""
        self._collectives = 0
        """Collectives of the started step so far."""
        self._expected = 0
        """Collectives the last step ran (0: none known yet)."""
        self._segment_began = 0.0
        """The host's clock where the running compute segment began."""
        self._waited_s = 0.0
        """Host seconds the started step spent inside collectives: not compute, which pacing counts."""
        self._last_reduce: list[Mark] | None = None
        """The span of the running backward's last reduce-scatter, until the backward ends."""

    def start(self, step: int, samples: float) -> None:
        super().start(step, samples)
        self.reducing = False
        self._collectives = 0
        self._last_reduce = None
        self._waited_s = 0.0
        self._segment_began = time.perf_counter()

    def collective(self, call: Callable[[], Result], *, reduces: bool) -> Result:
        """Run one of FSDP2's collectives (``call``), paced and timed as part of the started step, if any."""
        if self._start is None:
            return call()
        if self._paced is not None:
            self._pace_segment(reduces)
        entered = time.perf_counter()
        begin = self._mark()
        result = call()
        span = [begin, self._mark()]
        self._segment_began = time.perf_counter()
        self._waited_s += self._segment_began - entered
        self._backwards.append(span)
        self._collectives += 1
        if reduces:
            self.reducing = True
            self._last_reduce = span
        return result

    def _pace_segment(self, reduces: bool) -> None:
        step, samples = self._paced  # type: ignore[misc]
        if self.pacer.active:
            runtime.synchronize(self.device)  # only while pacing: the segment's real compute must have ended
            # A step of an unknown count (the first) reaches its whole block before its first reduce-scatter: by
            # then its backward has all but ended, and later its pad would fall into the exchange's wait.
            unknown = 1.0 if reduces else 0.0
            fraction = (self._collectives + 1) / self._expected if self._expected else unknown
            now = time.perf_counter()
            self.pacer.pace(step, samples, fraction, now - self._started_at - self._waited_s,
                            now - self._segment_began)

    def backward_ended(self) -> bool | None:
        """A backward of the started step ended (after FSDP2's own end-of-backward work): close its compute; return
        whether it reduce-scattered (None outside a started step)."""
        if self._start is None:
            return None
        if self._last_reduce is None:  # reduced nothing (gradient sync off, or one rank): ready here, no wait
            self._backwards.append([self._mark()])
            return False
        self._finish_pacing()
        self._last_reduce[1:] = [self._mark()]  # its wait runs to the end of FSDP2's final callback
        self._last_reduce = None
        return True

    def _finish_pacing(self) -> None:
        if self._paced is None:
            return
        step, samples = self._paced
        self._paced = None
        if self.pacer.active:
            runtime.synchronize(self.device)
            now = time.perf_counter()
            self.pacer.finish_segments(step, samples, now - self._started_at - self._waited_s,
                                       now - self._segment_began, max(self.forwards, 1))

    def finish(self) -> StepTimes:
        """Close the started step: a step whose backward never reduced (its gradients wait under
        ``set_requires_gradient_sync(False)``) is padded now, at its end, as one with its own compute only."""
        if self._start is not None and self._paced is not None:
            self._finish_pacing()
            self._backwards.append([self._mark()])
        if self._start is not None:
            self._expected = self._collectives
        return super().finish()
