import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.allocate.pack import block_costs, pack_by_cost

costs_strategy = st.lists(st.integers(1, 2000).map(float), min_size=1, max_size=60)
shares_strategy = st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(lambda s: sum(s) > 0)


@given(costs=costs_strategy, shares=shares_strategy)
def test_blocks_partition_the_step_and_follow_the_shares(costs, shares):
    blocks = pack_by_cost(costs, shares)
    assert sorted(i for block in blocks for i in block) == list(range(len(costs)))
    assert all(not blocks[rank] for rank, share in enumerate(shares) if share == 0)
    active = [rank for rank, share in enumerate(shares) if share > 0]
    if len(costs) >= len(active):
        assert all(blocks[rank] for rank in active)
    # Longest-processing-time bound for unequal speeds: load / target <= 1 + (N - 1) max cost / total cost
    # (a block of one sample may be one given to a rank the rule left empty).
    loads, total = block_costs(costs, blocks), sum(costs)
    bound = 1 + (len(active) - 1) * max(costs) / total
    for rank in active:
        if len(blocks[rank]) > 1:
            assert loads[rank] <= bound * total * shares[rank] / sum(shares) + 1e-9


@given(count=st.integers(1, 200), shares=shares_strategy)
def test_equal_costs_give_counts_near_the_shares(count, shares):
    blocks = pack_by_cost([1.0] * count, shares)
    quotas = [count * share / sum(shares) for share in shares]
    active = sum(1 for share in shares if share > 0)
    for block, quota in zip(blocks, quotas):
        assert abs(len(block) - quota) < active


def test_long_sequences_are_spread_and_short_ones_fill_in():
    blocks = pack_by_cost([100, 10, 10, 10, 90, 10, 10, 10, 10, 10], [1, 1])
    assert block_costs([100, 10, 10, 10, 90, 10, 10, 10, 10, 10], blocks) == [140.0, 130.0]
    assert blocks == [[0, 2, 5, 7, 9], [1, 3, 4, 6, 8]]


def test_a_faster_rank_gets_a_larger_cost():
    costs = [float(c) for c in range(1, 41)]
    loads = block_costs(costs, pack_by_cost(costs, [1, 3]))
    assert loads[1] == pytest.approx(3 * loads[0], rel=0.05)


def test_it_is_deterministic():
    costs = [5.0, 5.0, 5.0, 5.0, 3.0]
    assert pack_by_cost(costs, [2, 2, 1]) == pack_by_cost(costs, [2, 2, 1])


@pytest.mark.parametrize(("costs", "shares"), [([1.0, 0.0], [1, 1]), ([1.0], [0, 0]), ([1.0], [-1, 2])])
def test_bad_input_is_a_config_error(costs, shares):
    with pytest.raises(ConfigError):
        pack_by_cost(costs, shares)

