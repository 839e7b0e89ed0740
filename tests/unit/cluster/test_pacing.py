"""The pacer's arithmetic on an injected clock: what each step sleeps, not how long it took."""

from __future__ import annotations

import pytest

from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import LEAD_FRACTION, Emulation, Pacer

BLOCK_S = 0.020
"""A block of 20 samples at 1 ms per sample, speed 1."""


class Timeline:
    """A clock that moves only when the pacer sleeps or the test says the rank worked."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(max(seconds, 0.0))
        self.now += max(seconds, 0.0)

    def work(self, seconds: float) -> None:
        self.now += seconds


def _pacer(timeline: Timeline, emulation: Emulation | None = None, rank: int = 0, world_size: int = 1) -> Pacer:
    emulation = emulation or Emulation(speeds=(1.0,), sample_cost_ms=1.0)
    return Pacer(emulation, rank, world_size, clock=timeline.clock, sleep=timeline.sleep)


def _step(pacer: Pacer, timeline: Timeline, step: int, compute_s: float, host_s: float, *, alone: bool,
          samples: float = 20, forwards: int | None = None) -> None:
    """One step of ``compute_s`` real compute, then ``host_s`` of host work before the next (optimizer, data)."""
    started = timeline.now
    pacer.start(step, samples)
    timeline.work(compute_s)
    pacer.finish(step, samples, timeline.now - started, forwards, alone=alone)
    timeline.work(host_s)


def test_steps_alone_absorb_the_host_work_between_them():
    timeline = Timeline()
    pacer = _pacer(timeline)
    for step in range(5):
        _step(pacer, timeline, step, compute_s=0.005, host_s=0.003, alone=True)
    assert timeline.now - 0.003 == pytest.approx(5 * BLOCK_S)


def test_after_an_exchange_each_step_restarts_and_host_work_adds_to_it():
    timeline = Timeline()
    pacer = _pacer(timeline)
    for step in range(5):
        _step(pacer, timeline, step, compute_s=0.005, host_s=0.003, alone=False)
    assert timeline.now - 0.003 == pytest.approx(5 * BLOCK_S + 4 * 0.003)


def test_the_lead_is_slept_before_the_compute_less_the_host_work_already_done():
    timeline = Timeline()
    pacer = _pacer(timeline)
    _step(pacer, timeline, 0, compute_s=0.005, host_s=0.001, alone=True)
    lead_s = LEAD_FRACTION * BLOCK_S
    assert timeline.sleeps[:2] == pytest.approx([lead_s, BLOCK_S - lead_s - 0.005])
    pacer.start(1, 20)
    assert timeline.sleeps[2] == pytest.approx(lead_s - 0.001)


def test_a_block_that_ran_long_is_made_up_by_the_next_sleeps_of_the_phase():
    timeline = Timeline()
    pacer = _pacer(timeline)
    for step, compute_s in enumerate([0.005, 0.030, 0.005, 0.005]):
        _step(pacer, timeline, step, compute_s=compute_s, host_s=0.0, alone=True)
    assert timeline.now == pytest.approx(4 * BLOCK_S)


def test_a_step_that_runs_on_is_timed_from_the_last_steps_end_and_lasts_its_block():
    """Timed from the host's start, a step alone would read as its block less the host work before it."""
    timeline = Timeline()
    pacer = _pacer(timeline)
    _step(pacer, timeline, 0, compute_s=0.005, host_s=0.003, alone=True)
    ended = timeline.now - 0.003
    assert pacer.start(1, 20) == pytest.approx(ended)
    timeline.work(0.005)
    pacer.finish(1, 20, 0.005)
    assert timeline.now - ended == pytest.approx(BLOCK_S)
    assert pacer.start(2, 20) is None  # step 1 ended with an exchange: step 2 starts afresh, timed from now


def test_a_wait_longer_than_the_next_block_restarts_the_deadline():
    """A collective nobody announced (a bucket rebuild, a planning gather) must not come out of the next blocks."""
    timeline = Timeline()
    pacer = _pacer(timeline)
    _step(pacer, timeline, 0, compute_s=0.005, host_s=0.050, alone=True)
    waited_until = timeline.now
    _step(pacer, timeline, 1, compute_s=0.005, host_s=0.0, alone=True)
    assert timeline.now - waited_until == pytest.approx(BLOCK_S)


def test_the_deadline_runs_on_only_into_the_very_next_step():
    """A rank out of batches skips steps (no compute), and the ranks meet after a step it did not compute."""
    timeline = Timeline()
    pacer = _pacer(timeline)
    _step(pacer, timeline, 3, compute_s=0.005, host_s=0.010, alone=True)
    resumed = timeline.now
    _step(pacer, timeline, 5, compute_s=0.005, host_s=0.0, alone=True)
    assert timeline.now - resumed == pytest.approx(BLOCK_S)


def test_straggler_delays_come_on_top_of_each_block():
    timeline = Timeline()
    pacer = _pacer(timeline, Emulation(speeds=(1.0,), sample_cost_ms=1.0, straggler_count=1,
                                       straggler_delay_ms=50.0))
    for step in range(3):
        _step(pacer, timeline, step, compute_s=0.005, host_s=0.002, alone=True)
    assert timeline.now - 0.002 == pytest.approx(3 * (0.050 + BLOCK_S))


def test_a_speed_change_reprices_the_blocks_from_its_step_on():
    timeline = Timeline()
    pacer = _pacer(timeline, Emulation(speeds=(1.0,), sample_cost_ms=1.0, speed_changes=((2, (2.0,)),)))
    for step in range(4):
        _step(pacer, timeline, step, compute_s=0.001, host_s=0.001, alone=True)
    assert timeline.now - 0.001 == pytest.approx(2 * BLOCK_S + 2 * BLOCK_S / 2)


def test_device_models_price_the_micro_batches_the_step_ran():
    timeline = Timeline()
    device = DeviceModel(step_overhead_ms=3.0, max_batch=10, micro_overhead_ms=5.0)
    pacer = _pacer(timeline, Emulation(speeds=(1.0,), sample_cost_ms=1.0, devices=(device,)))
    for step in range(2):
        _step(pacer, timeline, step, compute_s=0.001, host_s=0.002, alone=True, forwards=2)
    assert timeline.now - 0.002 == pytest.approx(2 * (0.003 + 2 * 0.005 + BLOCK_S))


def test_stretching_measured_time_paces_each_step_on_its_own():
    timeline = Timeline()
    pacer = _pacer(timeline, Emulation(speeds=(1.0, 4.0)))
    for step in range(3):
        _step(pacer, timeline, step, compute_s=0.010, host_s=0.002, alone=True)
    assert timeline.now - 0.002 == pytest.approx(3 * 4 * 0.010 + 2 * 0.002)


def test_without_emulation_nothing_sleeps():
    timeline = Timeline()
    pacer = _pacer(timeline, Emulation())
    _step(pacer, timeline, 0, compute_s=0.005, host_s=0.002, alone=True)
    assert timeline.sleeps == []


def test_a_step_whose_samples_are_known_only_at_its_end_still_lasts_its_whole_block():
    """A caller may start the clock before it knows the batch (``start`` with 0 samples)."""
    timeline = Timeline()
    pacer = _pacer(timeline)
    pacer.start(0, 0)
    timeline.work(0.005)
    pacer.finish(0, 20, 0.005)
    assert timeline.now == pytest.approx(BLOCK_S)


def test_a_restart_between_two_steps_alone_stops_the_deadline_running_on():
    """A meeting the step before did not foresee (an epoch's end in a loop of its own) still restarts it."""
    timeline = Timeline()
    pacer = _pacer(timeline)
    _step(pacer, timeline, 0, compute_s=0.005, host_s=0.010, alone=True)
    pacer.restart()
    resumed = timeline.now
    _step(pacer, timeline, 1, compute_s=0.005, host_s=0.0, alone=True)
    assert timeline.now - resumed == pytest.approx(BLOCK_S)


def _lockstep_step(pacer: Pacer, timeline: Timeline, segments_s: list[float], waits_s: list[float],
                   samples: float = 20) -> float:
    """A step of FSDP2's lockstep: real compute segments, each followed by a collective that waits; paced as the
    sharded clock paces (the k-th collective at k / n of the block). Returns its compute seconds (no waits)."""
    started, waited = timeline.now, 0.0
    pacer.start(0, samples)
    count = len(waits_s)
    for index, (compute_s, wait_s) in enumerate(zip(segments_s, waits_s)):
        timeline.work(compute_s)
        segment_began = timeline.now - compute_s
        pacer.pace(0, samples, (index + 1) / count, timeline.now - started - waited, timeline.now - segment_began)
        timeline.work(wait_s)
        waited += wait_s
    pacer.finish_segments(0, samples, timeline.now - started - waited, 0.0)
    return timeline.now - started - waited


def test_lockstep_pacing_counts_compute_not_the_waits_inside_collectives():
    # Four collectives, each waiting 30 ms for the others: a wall-clock deadline would be long past at each, and the
    # rank would run at its real speed; in compute time each reaches its quarter of the block.
    timeline = Timeline()
    computed_s = _lockstep_step(_pacer(timeline), timeline, [0.001] * 4, [0.030] * 4)
    assert computed_s == pytest.approx(BLOCK_S)
    assert timeline.now == pytest.approx(BLOCK_S + 4 * 0.030)


def test_lockstep_pacing_spreads_the_block_over_the_collectives():
    timeline = Timeline()
    pacer = _pacer(timeline)
    pacer.start(0, 20)
    lead_s = LEAD_FRACTION * BLOCK_S
    pacer.pace(0, 20, 0.5, computed_s=lead_s, segment_s=0.0)
    assert timeline.sleeps[-1] == pytest.approx(0.5 * (BLOCK_S - lead_s))


def test_lockstep_pacing_stretches_each_segment_where_speeds_stretch_measured_time():
    timeline = Timeline()
    emulation = Emulation(speeds=(1.0, 4.0))  # no sample cost: rank 0 runs 4 times slower than measured
    computed_s = _lockstep_step(_pacer(timeline, emulation), timeline, [0.002, 0.003], [0.010, 0.010])
    assert computed_s == pytest.approx(4 * 0.005)
