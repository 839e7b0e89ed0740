"""The pure parts of local training: merge weights, the data order, the emulation's deadline clock."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hetdp.errors import ConfigError
from hetdp.sync.averaging import merge_weights
from hetdp.train import local
from hetdp.train.local import Pace, epoch_order


def test_merge_weights_are_each_devices_share_of_the_data():
    assert merge_weights([300, 100, 0, 600]) == [0.3, 0.1, 0.0, 0.6]


@given(st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=12).filter(any))
def test_merge_weights_sum_to_one_and_follow_the_counts(counts):
    weights = merge_weights(counts)
    assert sum(weights) == pytest.approx(1.0)
    for (a, wa), (b, wb) in zip(zip(counts, weights), zip(counts[1:], weights[1:])):
        assert (a < b) == (wa < wb)


@pytest.mark.parametrize("counts", [[0, 0, 0], [3, -1, 2]])
def test_merge_weights_reject_empty_or_negative_counts(counts):
    with pytest.raises(ConfigError, match="sample counts"):
        merge_weights(counts)


def test_epoch_order_is_a_permutation_that_differs_by_epoch_and_rank():
    first = epoch_order(50, seed=1, epoch=0, rank=0)
    assert sorted(first.tolist()) == list(range(50))
    assert torch.equal(first, epoch_order(50, seed=1, epoch=0, rank=0))
    assert not torch.equal(first, epoch_order(50, seed=1, epoch=1, rank=0))
    assert not torch.equal(first, epoch_order(50, seed=1, epoch=0, rank=1))


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.sleeps = []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(round(seconds, 9))
        self.now += seconds


def test_pace_deadlines_accumulate_so_overshoot_does_not_add_up(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(local.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(local.time, "sleep", clock.sleep)
    pace = Pace()
    clock.now += 0.03  # real work of 30 ms in a 100 ms batch
    pace.wait(0.1)
    clock.now += 0.15  # real work of 150 ms overruns the next 100 ms batch ...
    pace.wait(0.1)
    clock.now += 0.01  # ... and the third batch catches up
    pace.wait(0.1)
    assert clock.sleeps == [0.07, 0.04]
    assert clock.now == pytest.approx(100.3)


def test_a_disabled_pace_never_sleeps(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(local.time, "sleep", clock.sleep)
    pace = Pace(enabled=False)
    pace.wait(5.0)
    assert clock.sleeps == []
