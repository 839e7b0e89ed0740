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
def test_shares_within_one_of_proportional_value(weights, extra, minimum):
    total = minimum * len(weights) + extra
    shares = apportion(weights, total, minimum)
    weight_sum = sum(weights)
    for share, weight in zip(shares, weights):
        assert abs(share - (minimum + extra * weight / weight_sum)) < 1 + 1e-9


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


@given(speeds=weights_strategy, extra=st.integers(min_value=0, max_value=5000), minimum=st.integers(0, 5))
def test_min_max_rounding_keeps_quota_and_never_makes_the_slowest_rank_slower(speeds, extra, minimum):
    total = minimum * len(speeds) + extra
    shares = apportion_min_max(speeds, total, minimum)
    assert sum(shares) == total
    speed_sum = sum(speeds)
    for share, speed in zip(shares, speeds):
        assert abs(share - (minimum + extra * speed / speed_sum)) < 1 + 1e-9

    def slowest(allocation):
        return max(share / speed for share, speed in zip(allocation, speeds))

    assert slowest(shares) <= slowest(apportion(speeds, total, minimum)) + 1e-12


def test_min_max_rounding_gives_the_leftover_unit_to_the_rank_it_costs_least():
    # quotas 1 + 98 * [0.2, 0.8] = [20.6, 79.4]: Hamilton rounds up rank 0 (21/1 = 21 > 80/4 = 20),
    # min-max rounds up rank 1 (80/4 = 20 < 21)
    assert apportion([1.0, 4.0], 100) == [21, 79]
    assert apportion_min_max([1.0, 4.0], 100) == [20, 80]


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
