import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.allocate.minmax import min_max_shares, step_time_of


def compositions(total, parts, minimum):
    """Every way to write ``total`` as ``parts`` integers >= minimum (the brute-force oracle's search space)."""
    for cut in itertools.product(range(minimum, total + 1), repeat=parts - 1):
        last = total - sum(cut)
        if last >= minimum:
            yield [*cut, last]


@st.composite
def tables(draw):
    """Non-decreasing step-time tables with steps, plateaus and caps (inf above a random share)."""
    ranks = draw(st.integers(1, 3))
    total = draw(st.integers(0, 9))
    rows = []
    for _ in range(ranks):
        increments = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]), min_size=total, max_size=total))
        start = draw(st.sampled_from([0.0, 1.0, 5.0]))
        row = list(np.cumsum([start, *increments]))
        cap = draw(st.integers(0, total + 1))
        rows.append([value if share <= cap else math.inf for share, value in enumerate(row)])
    return rows, total, draw(st.integers(0, 2))


@given(tables())
def test_matches_brute_force_on_small_tables(case):
    rows, total, minimum = case
    feasible = [shares for shares in compositions(total, len(rows), minimum) if step_time_of(rows, shares) < math.inf]
    if not feasible:
        with pytest.raises(ConfigError):
            min_max_shares(rows, total, minimum)
        return
    shares = min_max_shares(rows, total, minimum)
    assert sum(shares) == total and min(shares) >= minimum
    assert step_time_of(rows, shares) == min(step_time_of(rows, s) for s in feasible)


def test_linear_times_give_speed_proportional_shares():
    speeds = [1.0, 1.0, 2.0, 4.0]
    rows = [[share / speed for share in range(129)] for speed in speeds]
    assert min_max_shares(rows, 128, minimum=1) == [16, 16, 32, 64]


def test_fixed_overheads_shift_work_to_the_ranks_without_them():
    # The case: speeds 1, 1, 2, 4 with fixed per-step costs of 0, 0, 20 and 80 ms, 6 ms per sample.
    rows = [[overhead + 6.0 * share / speed for share in range(129)]
            for speed, overhead in zip([1, 1, 2, 4], [0, 0, 20, 80])]
    shares = min_max_shares(rows, 128, minimum=1)
    assert shares == [23, 23, 40, 42] and step_time_of(rows, shares) == 143.0  # 141.5 ms with fractional shares


def test_a_step_shaped_curve_keeps_a_rank_just_below_its_jump():
    # Rank 0 runs a second micro-batch above 10 samples (+5 s); rank 1 is slower per sample but has no jump.
    rows = [[s + (5.0 if s > 10 else 0.0) for s in range(21)], [1.2 * s for s in range(21)]]
    assert min_max_shares(rows, 20) == [10, 10]


def test_caps_are_respected_and_an_impossible_total_is_a_config_error():
    rows = [[s if s <= 3 else math.inf for s in range(11)], [2.0 * s for s in range(11)]]
    assert min_max_shares(rows, 10) == [3, 7]
    capped = [[s if s <= 3 else math.inf for s in range(11)]] * 2
    with pytest.raises(ConfigError, match="at most 6"):
        min_max_shares(capped, 10)


@pytest.mark.parametrize(("rows", "message"), [
    ([[0.0, 2.0, 1.0]], "must not decrease"),
    ([[0.0, float("nan"), 1.0]], "NaN"),
    ([[0.0, 1.0]], "needs 3 values"),
])
def test_bad_tables_are_config_errors(rows, message):
    with pytest.raises(ConfigError, match=message):
        min_max_shares(rows, 2)
