"""The step clock: compute and wait per step, two backwards a step, and no device synchronization unless pacing."""

from __future__ import annotations

import pytest
import torch

from hetdp import runtime
from hetdp.cluster.emulate import Emulation
from hetdp.train import clock as clock_module
from hetdp.train.clock import StepClock, StepTimes, TimesTotal


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
    for _ in range(70):  # past the point where read steps are folded into the sums
        times = _step(clock, fake_time, [(0.01, 0.02)])
        assert not times.read
        total.add(times)
        times.compute_s  # noqa: B018  (a gather reads it)
    total.add(StepTimes(None, []))
    compute_s, wait_s = total.totals()
    assert compute_s == pytest.approx(0.7) and wait_s == pytest.approx(1.4)


def test_a_step_whose_forward_had_no_backward_reads_as_nothing(fake_time):
    clock = StepClock(torch.device("cpu"), Emulation().pacer(0, 1))
    clock.start(step=0, samples=4)
    times = clock.finish()
    assert (times.compute_s, times.wait_s) == (0.0, 0.0)
