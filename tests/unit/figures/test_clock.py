"""The step clock: compute, wait and period per step, two backwards a step, and no device synchronization unless
pacing."""

from __future__ import annotations

import pytest
import torch

from hetdp import runtime
from hetdp.cluster.emulate import Emulation
from hetdp.figures import clock as clock_module
from hetdp.figures.clock import StepClock, StepTimes, TimesTotal


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(clock_module.time, "perf_counter", fake.perf_counter)
    return fake


@pytest.fixture
def device_syncs(monkeypatch):
    """The clock's device-synchronize seam, counted."""
    calls: list[torch.device] = []
    monkeypatch.setattr(runtime, "synchronize", calls.append)
    return calls


def _step(clock: StepClock, fake: FakeTime, backwards: list[tuple[float, float]]) -> StepTimes:
    """Run a step whose backwards compute ``c`` seconds, then wait ``w`` for their exchange, each (c, w)."""
    clock.start(step=0, samples=8)
    for compute_s, wait_s in backwards:
        clock.mark_ready(last_bucket=False)
        fake.now += compute_s
        clock.mark_synced()  # an early bucket's exchange ends before the backward's last bucket: not a wait
        clock.mark_ready(last_bucket=True)
        fake.now += wait_s / 2
        clock.mark_synced()
        fake.now += wait_s / 2
        clock.mark_synced()  # the last bucket to complete ends the wait
    return clock.finish()


def test_a_step_times_its_compute_and_its_wait_without_synchronizing_the_device(fake_time, device_syncs):
    clock = StepClock(torch.device("cpu"), Emulation().pacer(0, 2))
    times = _step(clock, fake_time, [(0.3, 0.2)])
    assert times.compute_s == pytest.approx(0.3) and times.wait_s == pytest.approx(0.2)
    assert device_syncs == []


def test_a_step_s_period_runs_from_the_previous_step_s_start_and_is_unknown_after_the_ranks_met(fake_time):
    clock = StepClock(torch.device("cpu"), Emulation().pacer(0, 2))
    first = _step(clock, fake_time, [(0.3, 0.2)])
    fake_time.now += 0.1  # the optimizer's step and the loop's own work: neither compute nor wait
    second = _step(clock, fake_time, [(0.3, 0.2)])
    assert first.period_s == 0.0 and second.period_s == pytest.approx(0.6)
    clock.restart()  # an epoch's end: the meeting is no part of a step
    fake_time.now += 5.0
    assert _step(clock, fake_time, [(0.3, 0.2)]).period_s == 0.0


def test_the_wait_that_ends_a_first_backward_is_not_compute_of_the_second(fake_time, device_syncs):
    clock = StepClock(torch.device("cpu"), Emulation().pacer(0, 2))
    times = _step(clock, fake_time, [(0.3, 0.2), (0.1, 0.05)])
    assert times.compute_s == pytest.approx(0.4) and times.wait_s == pytest.approx(0.25)
    assert device_syncs == []


def test_pacing_waits_for_the_device_once_a_step_to_measure_the_real_compute(fake_time, device_syncs, monkeypatch):
    monkeypatch.setattr("hetdp.cluster.emulate.sleep", lambda seconds: None)
    clock = StepClock(torch.device("cpu"), Emulation(speeds=(1.0, 2.0)).pacer(0, 2))
    _step(clock, fake_time, [(0.3, 0.2), (0.1, 0.05)])
    assert device_syncs == [torch.device("cpu")]


def test_a_step_without_a_backward_reads_as_nothing_and_totals_sum_the_steps(fake_time):
    clock = StepClock(torch.device("cpu"), Emulation().pacer(0, 1))
    total = TimesTotal()
    for _ in range(70):  # past the point where completed steps are folded into the sums
        total.add(_step(clock, fake_time, [(0.01, 0.02)]))
    total.add(StepTimes(None, []))
    compute_s, wait_s = total.totals()
    assert compute_s == pytest.approx(0.7) and wait_s == pytest.approx(1.4)


def test_an_epoch_that_gathers_nothing_holds_a_bounded_number_of_unread_steps(fake_time):
    # Static shares or a rank alone gather figures at the epoch's end only: the steps in between must not pile up
    # (each step would cost more than the one before it, and hold its events).
    clock = StepClock(torch.device("cpu"), Emulation().pacer(0, 1))
    total = TimesTotal()
    for _ in range(1000):
        total.add(_step(clock, fake_time, [(0.001, 0.002)]))
        assert len(total._unread) <= TimesTotal.UNREAD
    compute_s, wait_s = total.totals()
    assert compute_s == pytest.approx(1.0) and wait_s == pytest.approx(2.0)


class FakeEvent:
    """A CUDA event as the clock uses it, at ``at_s`` on the device's timeline; complete once ``device.now`` passes
    it. Waiting for it (``synchronize``) before then is the host sync on the step path that must never happen."""

    def __init__(self, device: FakeTime, at_s: float) -> None:
        self.device, self.at_s = device, at_s

    def query(self) -> bool:
        return self.device.now >= self.at_s

    def synchronize(self) -> None:
        assert self.query(), "waited for the device on the step path"

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at_s - self.at_s) * 1000.0


def test_steps_still_on_the_device_are_left_unread_and_folded_in_order_once_complete():
    device = FakeTime()  # the device's progress: the host queues steps ahead of it
    total = TimesTotal()
    for step in range(200):
        device.now = 10.0 * (step - 100) + 5.0  # the device runs 100 steps behind the host: the last 100 are running
        start = 10.0 * step
        ready, synced = FakeEvent(device, start + 3.0), FakeEvent(device, start + 4.0)
        total.add(StepTimes(FakeEvent(device, start), [[ready, synced]]))
        assert len(total._unread) <= 100
    device.now = float("inf")  # the epoch's end: reading the rest may wait
    compute_s, wait_s = total.totals()
    assert compute_s == pytest.approx(200 * 3.0) and wait_s == pytest.approx(200 * 1.0)


def test_a_step_whose_forward_had_no_backward_reads_as_nothing(fake_time):
    clock = StepClock(torch.device("cpu"), Emulation().pacer(0, 1))
    clock.start(step=0, samples=4)
    times = clock.finish()
    assert (times.compute_s, times.wait_s) == (0.0, 0.0)
