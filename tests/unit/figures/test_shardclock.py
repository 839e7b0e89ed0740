"""The sharded clock: compute and wait of a step whose collectives FSDP2 runs unit by unit, and its pacing."""

from __future__ import annotations

import pytest
import torch

from hetdp.cluster.emulate import Emulation
from hetdp.figures import clock as clock_module
from hetdp.figures import shardclock
from hetdp.figures.shardclock import ShardedClock


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self.slept.append(seconds)
            self.now += seconds


@pytest.fixture
def fake_time(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(clock_module.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(shardclock.time, "perf_counter", fake.perf_counter)
    return fake


def _clock(fake: FakeTime, emulation: Emulation | None = None) -> ShardedClock:
    pacer = (emulation or Emulation()).pacer(0, 1)
    pacer._clock, pacer._sleep = fake.perf_counter, fake.sleep  # the pacer's injected seams
    return ShardedClock(torch.device("cpu"), pacer)


def _collective(clock: ShardedClock, fake: FakeTime, compute_s: float, wait_s: float, *, reduces: bool) -> None:
    fake.now += compute_s

    def waits() -> None:
        fake.now += wait_s

    clock.collective(waits, reduces=reduces)


def _step(clock: ShardedClock, fake: FakeTime, samples: float = 8):
    """Forward: 3 all-gathers after 5 ms each; backward: 2 all-gathers, then 3 reduce-scatters after 10 ms each;
    every collective waits 20 ms; FSDP2's end of backward 1 ms after the last reduce-scatter."""
    clock.start(step=0, samples=samples)
    for _ in range(3):
        _collective(clock, fake, 0.005, 0.020, reduces=False)
    for _ in range(2):
        _collective(clock, fake, 0.010, 0.020, reduces=False)
    for _ in range(3):
        _collective(clock, fake, 0.010, 0.020, reduces=True)
    fake.now += 0.001
    clock.backward_ended()
    return clock.finish()


def test_compute_runs_to_the_last_reduce_scatter_less_the_collectives_and_the_rest_is_wait(fake_time):
    times = _step(_clock(fake_time), fake_time)
    assert times.compute_s == pytest.approx(3 * 0.005 + 5 * 0.010)
    assert times.wait_s == pytest.approx(8 * 0.020 + 0.001)


def test_a_backward_that_reduces_nothing_is_ready_at_its_end_with_no_wait(fake_time):
    clock = _clock(fake_time)
    clock.start(step=0, samples=8)
    _collective(clock, fake_time, 0.005, 0.020, reduces=False)
    fake_time.now += 0.010
    clock.backward_ended()
    times = clock.finish()
    assert times.compute_s == pytest.approx(0.015) and times.wait_s == pytest.approx(0.020)
    assert not clock.reducing


def test_an_emulated_step_reaches_its_block_before_its_last_reduce_scatter_in_compute_time(fake_time):
    # 8 samples at 20 ms a sample: a block of 160 ms. The first step, whose count of collectives is not known yet,
    # reaches it at its first reduce-scatter (the two 10 ms segments after it come on top); the next spreads it
    # over all eight collectives, and its waits stay waits.
    clock = _clock(fake_time, Emulation(speeds=(1.0,), sample_cost_ms=20.0))
    first, second = _step(clock, fake_time), _step(clock, fake_time)
    assert first.compute_s == pytest.approx(0.180)
    assert second.compute_s == pytest.approx(0.160)
    assert first.wait_s == pytest.approx(8 * 0.020 + 0.001) and second.wait_s == pytest.approx(8 * 0.020 + 0.001)
