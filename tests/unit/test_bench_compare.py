"""How every benchmark times a comparison (``bench.compare``): the sides in turn on one clock, warm-up dropped alike,
and the ideal worked out from the run's own compute."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed import HashStore

from hetdp.bench import compare


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Side:
    def __init__(self, name: str, trained: list[tuple[str, int]]) -> None:
        self.name = name
        self.trained = trained

    def train_epoch(self, epoch: int) -> None:
        self.trained.append((self.name, epoch))

    def describe(self) -> dict:
        return {"shares": [len(self.name)], "sat_out": {}}

    def close(self) -> None:
        pass


def test_the_sides_take_turns_in_an_order_that_alternates_and_share_one_warm_up(one_rank):
    trained: list[tuple[str, int]] = []
    rows = compare.alternate([_Side("a", trained), _Side("bb", trained)], 4, warmup=1)
    assert trained == [("a", 0), ("bb", 0), ("bb", 1), ("a", 1), ("a", 2), ("bb", 2), ("bb", 3), ("a", 3)]
    assert [row["warmup"] for row in rows["a"]] == [True, False, False, False]
    assert [row["warmup"] for row in rows["bb"]] == [True, False, False, False]
    assert rows["bb"][2]["shares"] == [2] and rows["bb"][2]["epoch"] == 2 and rows["bb"][2]["epoch_s"] >= 0


def test_epoch_marks_give_the_seconds_between_marks(one_rank):
    marks = compare.EpochMarks()
    for _ in range(3):
        marks.mark()
    seconds = marks.epochs_s()
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)


def _rows(seconds, warmup=1, **fields):
    return [{"epoch_s": s, "warmup": i < warmup, **fields} for i, s in enumerate(seconds)]


def test_the_steady_epoch_is_the_median_past_the_warm_up():
    assert compare.steady_s(_rows([100.0, 3.0, 1.0, 2.0])) == 2.0  # the 100 s warm-up does not count
    with pytest.raises(ValueError, match="warm-up"):
        compare.steady_s(_rows([1.0], warmup=1))


def test_per_sample_compute_and_exchange_come_from_the_steady_epochs():
    rows = [{"warmup": True, "compute_s": [99.0, 99.0], "samples": [1, 1], "wait_s": [9.0, 9.0], "steps": 1,
             "sat_out": {}},
            {"warmup": False, "compute_s": [2.0, 1.0], "samples": [100, 100], "wait_s": [0.5, 1.5], "steps": 10,
             "sat_out": {}},
            {"warmup": False, "compute_s": [2.0, 0.0], "samples": [100, 0], "wait_s": [0.3, 0.1], "steps": 10,
             "sat_out": {"1": "why"}}]
    assert compare.per_sample_s(rows) == [0.02, 0.01]  # (2 + 2) / 200, (1 + 0) / 100
    assert compare.per_sample_s(rows[:1] + [{**rows[1], "samples": [100, 0]}]) == [0.02, None]
    # the least wait of the members, per step: 0.5 / 10 and 0.3 / 10 (rank 1 sat out); the median of the two
    assert compare.exchange_s(rows) == pytest.approx(0.04)


def test_the_ideal_saves_the_compute_that_balanced_shares_would_and_keeps_the_rest():
    # 100 samples a rank; 40, 40, 20 and 10 ms a sample: the slowest computes 4 s; balanced, 400 samples at
    # 25 + 25 + 50 + 100 samples/s take 2 s; a 10 s epoch keeps its other 6 s
    best = compare.ideal(10.0, baseline_samples=[100] * 4, per_sample=[0.04, 0.04, 0.02, 0.01])
    assert best.saved_s == pytest.approx(2.0) and best.epoch_s == pytest.approx(8.0)
    assert best.speedup == pytest.approx(1.25) and best.efficiency(10.0) == pytest.approx(0.8)
    # a rank whose speed is unknown is left out: the others share its samples
    partial = compare.ideal(10.0, baseline_samples=[100, 100], per_sample=[0.04, None])
    assert partial.saved_s == 0.0
    with pytest.raises(ValueError, match="do not belong"):
        compare.ideal(1.0, baseline_samples=[100] * 4, per_sample=[0.04, 0.04, 0.02, 0.01])
