"""When a rank's step computed and when its gradients came back: the figures allocation and diagnosis run on."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from hetdp import runtime
from hetdp.cluster.emulate import Pacer
from hetdp.data.steps import StepTicket

Mark = float | torch.cuda.Event
"""A moment of a step: ``time.perf_counter()`` on the host, or an event on a CUDA device's stream."""


class StepTimes:
    """One step's compute and wait seconds, worked out when first read (``compute_s``, ``wait_s``), and its period.

    On CUDA the marks are events on the device's own timeline; reading them waits
    for the last one, so the drop-in reads them at its next gather of figures (a
    collective anyway), never on the step path.
    """

    def __init__(self, start: Mark | None, backwards: list[list[Mark]], period_s: float = 0.0) -> None:
        self._start = start
        self._backwards = backwards
        """Per backward of the step: [ready] or [ready, synced] (its last bucket ready; its gradients combined)."""
        self.period_s = period_s
        """Host seconds from the rank's previous step's start to this one's: the whole turn of a step, the optimizer,
        the loop's own work and contention for shared cores included, which compute and wait leave out (0: unknown,
        the first step, or the first after the ranks met outside a step)."""
        self._figures: tuple[float, float] | None = None if start is not None else (0.0, 0.0)

    @property
    def compute_s(self) -> float:
        """Seconds from the step's start to its last backward's last bucket, less the waits of earlier backwards."""
        return self._read()[0]

    @property
    def wait_s(self) -> float:
        """Seconds from each backward's last bucket ready to its gradients combined, summed over the step's
        backwards: waiting for others plus the exchange."""
        return self._read()[1]

    @property
    def completed(self) -> bool:
        """Whether reading the figures would not wait for the device: read already, marked on the host, or every
        event completed (``query`` does not block)."""
        if self._figures is not None or isinstance(self._start, float):
            return True
        marks = [self._start, *(mark for marks in self._backwards for mark in marks)]
        return all(mark.query() for mark in marks)  # type: ignore[union-attr]

    def _read(self) -> tuple[float, float]:
        if self._figures is None and not self._backwards:  # a forward with no backward after it: nothing to time
            self._figures = (0.0, 0.0)
        if self._figures is None:
            start = self._start
            if not isinstance(start, float):  # CUDA events
                # elapsed_time needs both events completed. A step's marks lie on more than one stream (a comm
                # hook's callback records on a stream that waited for its exchange; a second backward may run
                # elsewhere), so the last recorded need not be the last to complete: wait for each (a completed
                # one returns at once). This runs at a gather, never on the step path.
                for marks in self._backwards:
                    for mark in marks:
                        mark.synchronize()  # type: ignore[union-attr]

                def seconds(mark: Mark) -> float:
                    return start.elapsed_time(mark) / 1000.0  # type: ignore[union-attr, arg-type]
            else:

                def seconds(mark: Mark) -> float:
                    return mark - start  # type: ignore[operator]
            spans = [[seconds(mark) for mark in marks] for marks in self._backwards]
            waits = [max(span[1] - span[0], 0.0) if len(span) == 2 else 0.0 for span in spans]
            ready_s = spans[-1][0] if spans else 0.0
            self._figures = (max(ready_s - sum(waits[:-1]), 0.0), sum(waits))
        return self._figures


@dataclass(frozen=True)
class EndedStep:
    """One of this rank's steps, as measured (its times read once complete, or at the next gather)."""

    ticket: StepTicket
    times: StepTimes


class StepClock:
    """Time one rank's steps: compute (first forward to last gradient bucket ready) and wait (until synchronized).

    Compute excludes waiting for others, which is what the adaptive rule needs,
    also in a step that synchronizes more than one backward (a GAN's
    discriminator, two losses backpropagated apart): the wait that ends each
    backward but the last counts as wait, not as compute of the next one.
    On CUDA every mark is an event recorded on the device's stream, and a wait
    ends when the exchange completes there (the comm hook's callback runs on a
    stream that waits for it), not when it was queued; nothing on the step path
    blocks the host. Emulated slowness (``Pacer``) is slept inside the compute: a
    straggler delay and a lead at ``start``, the rest at the last bucket, after
    the step's real compute, so the real work of ranks sharing a few cores
    overlaps with the sleeps of others instead of delaying the exchange. Only
    then does the clock wait for the device: pacing needs the real compute's end.
    """

    def __init__(self, device: torch.device, pacer: Pacer) -> None:
        self.device = device
        self.pacer = pacer
        self._start: Mark | None = None
        self._started_at = 0.0
        """The host's clock at ``start``: what pacing measures the real compute against."""
        self._previous_start: float | None = None
        """The host's clock at the previous step's ``start`` (None: none since the ranks last met outside a step)."""
        self._period_s = 0.0
        """The started step's period (``StepTimes.period_s``)."""
        self._backwards: list[list[Mark]] = []
        self._closed = False
        """A bucket came after the last backward's last one: that backward's wait is over (another began)."""
        self._paced: tuple[int, float] | None = None
        """(step, work) of the started step until its padding has run."""
        self.forwards = 0
        """Forwards (micro-batches) of the started step so far; the model counts them, emulation prices them."""

    def _mark(self) -> Mark:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, step: int, samples: float) -> None:
        """The step's first forward begins (``samples``: its work, in samples or cost units)."""
        self._started_at = time.perf_counter()
        previous, self._previous_start = self._previous_start, self._started_at
        self._period_s = 0.0 if previous is None else self._started_at - previous
        self._start = self._mark() if self.device.type == "cuda" else self._started_at
        self._backwards = []
        self._closed = False
        self._paced = (step, samples)
        self.forwards = 0
        began = self.pacer.start(step, samples)
        if began is not None and self.device.type != "cuda":
            self._start = began  # the emulated device ran on from the last step (Pacer.start)

    def mark_ready(self, last_bucket: bool, alone: bool = False) -> None:
        """A gradient bucket is ready; after the last one, pad the compute to the emulated device's. ``alone``: the
        rank exchanges nothing with the others before its next step, whose emulated time then runs on from this
        one's (``Pacer``)."""
        self._closed = bool(self._backwards)
        if not last_bucket:
            return
        if self._paced is not None:
            step, samples = self._paced
            self._paced = None
            if self.pacer.active:
                runtime.synchronize(self.device)  # the one host sync, and only while pacing
                self.pacer.finish(step, samples, time.perf_counter() - self._started_at, max(self.forwards, 1),
                                  alone=alone)
        self._backwards.append([self._mark()])
        self._closed = False

    def restart(self) -> None:
        """The rank just met the others outside a step (an epoch's end the loop did not announce): the next step's
        emulated time starts afresh, and its period is unknown (the meeting is no part of a step)."""
        self._previous_start = None
        self.pacer.restart()

    def mark_synced(self) -> None:
        """Gradients of the step are combined (each bucket's, as it completes: the last one ends the wait)."""
        if self._backwards and not self._closed:
            self._backwards[-1][1:] = [self._mark()]

    def finish(self) -> StepTimes:
        """Close the started step: its figures, read later (``StepTimes``)."""
        times = StepTimes(self._start, self._backwards, self._period_s)
        self._start, self._backwards = None, []
        return times


class TimesTotal:
    """The compute and wait seconds of many steps (an epoch's), summed as the steps complete.

    A step's CUDA events are read only once they completed (reading earlier would wait for the device), so steps
    are added unread, and folded into the sums, oldest first, once more than ``UNREAD`` wait and the oldest have
    completed. An epoch that gathers no figures until its end (static shares, a rank alone) thus holds a bounded
    number of steps, and each step costs the same at the epoch's end as at its start.
    """

    UNREAD = 64

    def __init__(self) -> None:
        self._unread: deque[StepTimes] = deque()
        self._compute_s = self._wait_s = 0.0

    def add(self, times: StepTimes) -> None:
        self._unread.append(times)
        if len(self._unread) > self.UNREAD:
            while self._unread and self._unread[0].completed:  # stops at the first step still on the device
                self._fold(self._unread.popleft())

    def _fold(self, times: StepTimes) -> None:
        self._compute_s += times.compute_s
        self._wait_s += times.wait_s

    def totals(self) -> tuple[float, float]:
        """(compute seconds, wait seconds) of every step added: reads the unread ones (a gather: waits if it must)."""
        while self._unread:
            self._fold(self._unread.popleft())
        return self._compute_s, self._wait_s
