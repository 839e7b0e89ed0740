import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.allocate.steptime import StepTime, fit_step_time


def separable(truth: StepTime, shares: list[int]) -> bool:
    """Whether a fixed cost, the micro-batch cost and the per-sample cost can be told apart at these shares: the
    points (1, forwards, share) span all three. One micro-batch count, or forwards on a line with the shares (all
    full micro-batches, say), leave some mix of the three costs unseen."""
    design = np.array([[1.0, truth.forwards(share), share] for share in shares])
    return bool(np.linalg.matrix_rank(design) == 3)


@given(per_forward=st.floats(0.0, 0.02), per_sample=st.floats(1e-4, 1e-2), chunk=st.integers(4, 64),
       shares=st.lists(st.integers(1, 300), min_size=3, max_size=6, unique=True))
def test_recovers_the_step_time_from_exact_measurements(per_forward, per_sample, chunk, shares):
    truth = StepTime(per_forward, per_sample, chunk)
    if not separable(truth, shares):
        return
    fitted = fit_step_time([(share, truth.seconds(share)) for share in shares], chunk)
    for share in range(1, 400, 7):
        assert fitted.seconds(share) == pytest.approx(truth.seconds(share), rel=1e-6, abs=1e-9)


@given(fixed=st.floats(0.001, 0.05), per_forward=st.floats(0.0, 0.02), per_sample=st.floats(1e-4, 1e-2),
       chunk=st.integers(4, 64), shares=st.lists(st.integers(1, 300), min_size=3, max_size=6, unique=True))
def test_runs_through_the_latest_point_and_learns_the_micro_batch_jump(fixed, per_forward, per_sample, chunk, shares):
    truth = StepTime(per_forward, per_sample, chunk)
    measured = [(share, fixed + truth.seconds(share)) for share in shares]
    if not separable(truth, shares):
        return
    fitted = fit_step_time(measured, chunk)
    latest_share, latest_s = measured[-1]
    assert fitted.seconds(latest_share) == pytest.approx(latest_s)
    if per_forward <= latest_s / fitted.forwards(latest_share):  # the jump fits inside the latest time
        assert fitted.per_forward_s == pytest.approx(per_forward, rel=1e-6, abs=1e-9)


def test_a_rank_without_micro_batches_keeps_the_papers_proportional_model():
    fitted = fit_step_time([(10, 1.0), (20, 1.5), (40, 2.5)])  # a fixed cost would fit exactly; the paper's doesn't
    assert fitted == StepTime(0.0, 2.5 / 40, None)


def test_one_micro_batch_count_charges_the_fixed_cost_per_micro_batch():
    # 70 and 90 samples both run as 2 micro-batches of at most 48: 40 ms fixed, 1 ms per sample.
    fitted = fit_step_time([(70, 0.110), (90, 0.130)], chunk=48)
    assert fitted.per_forward_s == pytest.approx(0.020)
    assert fitted.seconds(48) == pytest.approx(0.020 + 0.048)  # one fewer micro-batch: predicted cheaper
    assert fitted.seconds(97) == pytest.approx(0.060 + 0.097)


def test_a_staircase_has_no_cost_per_sample():
    # Micro-batches below the knee: every one costs 50 ms whatever its size.
    fitted = fit_step_time([(30, 0.050), (60, 0.100), (45, 0.100), (90, 0.150)], chunk=32)
    assert fitted.per_sample_s == pytest.approx(0.0, abs=1e-9)
    assert fitted.seconds(96) == pytest.approx(0.150)


def test_time_that_does_not_grow_falls_back_to_proportional():
    assert fit_step_time([(10, 2.0), (20, 1.0)], chunk=64) == StepTime(0.0, 1.0 / 20, 64)


@pytest.mark.parametrize("points", [[], [(0, 1.0)], [(5, 0.0)], [(5, float("nan"))]])
def test_bad_points_are_config_errors(points):
    with pytest.raises(ConfigError):
        fit_step_time(points)


def test_table_puts_inf_above_the_cap():
    assert StepTime(0.0, 1.0, None).table(4, cap=2) == [0.0, 1.0, 2.0, float("inf"), float("inf")]


@given(points=st.lists(st.tuples(st.integers(1, 200), st.floats(1e-4, 1.0)), min_size=1, max_size=6),
       chunk=st.one_of(st.none(), st.integers(1, 64)))
def test_any_fit_never_decreases_with_the_share(points, chunk):
    table = fit_step_time(points, chunk).table(300)
    assert all(later >= earlier for earlier, later in itertools.pairwise(table))
