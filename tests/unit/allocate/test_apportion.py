import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError, apportion
from hetdp.allocate.apportion import apportion_min_max

weights_strategy = st.lists(st.floats(min_value=0.01, max_value=1000.0), min_size=1, max_size=12)


@given(weights=weights_strategy, extra=st.integers(min_value=0, max_value=5000), minimum=st.integers(0, 5))
def test_shares_sum_to_total_and_respect_minimum(weights, extra, minimum):
    total = minimum * len(weights) + extra
    shares = apportion(weights, total, minimum)
    assert sum(shares) == total
    assert all(share >= minimum for share in shares)


@given(weights=weights_strategy, extra=st.integers(min_value=0, max_value=5000), minimum=st.integers(0, 5))
def test_shares_within_one_of_proportional_value(quotas, weights, extra, minimum):
    total = minimum * len(weights) + extra
    shares = apportion(weights, total, minimum)
    for share, quota in zip(shares, quotas(weights, total, minimum)):
        assert abs(share - quota) < 1 + 1e-6


@given(count=st.integers(1, 10), per_rank=st.integers(1, 100))
def test_equal_weights_give_equal_shares(count, per_rank):
    assert apportion([2.5] * count, count * per_rank) == [per_rank] * count


@given(weights=weights_strategy, total=st.integers(min_value=12, max_value=5000))
def test_a_heavier_weight_never_gets_less(weights, total):
    shares = apportion(weights, total, minimum=1)
    for i in range(len(weights)):
        for j in range(len(weights)):
            if weights[i] > weights[j]:
                assert shares[i] >= shares[j]


def slowest(shares, speeds):
    return max(share / speed for share, speed in zip(shares, speeds))


@given(speeds=st.lists(st.floats(min_value=0.05, max_value=50.0), min_size=1, max_size=6),
       extra=st.integers(min_value=0, max_value=300), minimum=st.integers(0, 5))
def test_min_max_rounding_gives_the_shortest_step_of_any_integer_shares(quotas, shortest_step, speeds, extra, minimum):
    total = minimum * len(speeds) + extra
    shares = apportion_min_max(speeds, total, minimum)
    assert sum(shares) == total and min(shares) >= minimum
    assert slowest(shares, speeds) <= shortest_step(speeds, total, minimum) * (1 + 1e-9)
    # from the floors up: the leftover units, fewer than the ranks, are all a share can exceed its quota by
    for share, quota in zip(shares, quotas(speeds, total, minimum)):
        assert quota - 1 - 1e-6 < share < quota + len(speeds)
    assert slowest(shares, speeds) <= slowest(apportion(speeds, total, minimum), speeds) + 1e-12


def test_min_max_rounding_may_give_one_rank_more_than_its_ceiling():
    # quotas [10.5, 10.5, 178.9]: every floor-or-ceiling split takes 11 / 0.25 = 44, while [10, 10, 180] takes 42.4
    shares = apportion_min_max([0.25, 0.25, 4.25], 200)
    assert shares == [10, 10, 180]


def test_min_max_rounding_gives_the_leftover_unit_to_the_rank_it_costs_least():
    # quotas 103 * [0.2, 0.8] = [20.6, 82.4]: Hamilton rounds up rank 0 (21/1 = 21 > 82/4 = 20.5),
    # min-max rounds up rank 1 (83/4 = 20.75 < 21)
    assert apportion([1.0, 4.0], 103) == [21, 82]
    assert apportion_min_max([1.0, 4.0], 103) == [20, 83]


def test_a_minimum_binding_for_one_rank_leaves_the_others_proportional():
    # the speed-1 rank's 16 is above the minimum, so nothing is pinned: exactly proportional
    assert apportion([1.0, 1.0, 2.0, 4.0], 128) == [16, 16, 32, 64]
    # rank 0's proportional 0.5 is below the minimum 2: pinned at 2, the other 18 split 1:2
    assert apportion([1.0, 10.0, 20.0], 20, minimum=2) == [2, 6, 12]


@pytest.mark.parametrize(
    ("weights", "total", "minimum", "message"),
    [
        ([], 4, 1, "at least one weight"),
        ([1.0, -1.0], 4, 1, "index 1"),
        ([1.0, float("nan")], 4, 1, "index 1"),
        ([0.0, 0.0], 4, 1, "all be zero"),
        ([1.0, 1.0], 1, 1, "cannot give 2 shares"),
    ],
)
def test_bad_input_names_the_problem(weights, total, minimum, message):
    with pytest.raises(ConfigError, match=message):
        apportion(weights, total, minimum)


def clipped_quotas(weights, total, minimum, caps):
    """Oracle: ``clip(level * weight, minimum, cap)`` summing to ``total``, the level found by bisection."""
    limits = [float("inf") if cap is None else cap for cap in caps]

    def at(level):
        return [min(max(level * w, minimum), cap) if w > 0 else minimum for w, cap in zip(weights, limits)]

    low, high = 0.0, 1.0
    while sum(at(high)) < total:
        high *= 2
    for _ in range(200):
        level = (low + high) / 2
        low, high = (level, high) if sum(at(level)) < total else (low, level)
    return at(high)


@st.composite
def capped_case(draw):
    weights = draw(weights_strategy)
    minimum = draw(st.integers(0, 3))
    caps = [draw(st.one_of(st.none(), st.integers(minimum, minimum + 60))) for _ in weights]
    room = sum(1000 if cap is None else cap for cap in caps)
    total = draw(st.integers(minimum * len(weights), min(room, minimum * len(weights) + 3000)))
    return weights, total, minimum, caps


@given(capped_case())
def test_caps_bound_every_share_and_the_rest_stays_proportional(case):
    weights, total, minimum, caps = case
    shares = apportion(weights, total, minimum, caps=caps)
    assert sum(shares) == total and min(shares) >= minimum
    assert all(cap is None or share <= cap for share, cap in zip(shares, caps))
    for share, quota in zip(shares, clipped_quotas(weights, total, minimum, caps)):
        assert abs(share - quota) < 1 + 1e-6


@given(capped_case())
def test_capped_min_max_rounding_gives_the_shortest_step_within_the_caps(shortest_step, case):
    weights, total, minimum, caps = case
    shares = apportion_min_max(weights, total, minimum, caps=caps)
    assert sum(shares) == total and min(shares) >= minimum
    assert all(cap is None or share <= cap for share, cap in zip(shares, caps))
    assert slowest(shares, weights) <= shortest_step(weights, total, minimum, caps) * (1 + 1e-9)


def test_a_capped_rank_leaves_its_excess_to_the_others_in_proportion():
    assert apportion([1.0, 1.0, 2.0, 4.0], 128, caps=[20, 20, 20, None]) == [18, 18, 20, 72]


def test_a_total_above_the_caps_is_a_config_error():
    with pytest.raises(ConfigError, match="exceeds the sum of the caps, 10"):
        apportion([1.0, 1.0], 11, caps=[5, 5])
