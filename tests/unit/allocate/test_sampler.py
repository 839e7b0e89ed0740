"""A step's samples divided among the ranks by their shares (what the drop-in's step sampler cuts each step by)."""

from hypothesis import given
from hypothesis import strategies as st

from hetdp.allocate.sampler import split_step

shares_strategy = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0)


@given(shares=shares_strategy, data=st.data())
def test_a_short_step_leaves_no_rank_with_a_share_empty_when_it_has_enough_samples(shares, data):
    count = data.draw(st.integers(1, sum(shares)))
    block = split_step(shares, count)
    active = [rank for rank, share in enumerate(shares) if share]
    assert sum(block) == count and all(block[r] <= shares[r] for r in range(len(shares)))
    assert all(block[r] == 0 for r in range(len(shares)) if not shares[r])
    if count >= len(active):
        assert all(block[r] >= 1 for r in active)


@given(shares=shares_strategy, data=st.data())
def test_a_short_step_gives_no_rank_fewer_than_the_least_a_batchnorm_trains_on(shares, data):
    # A full step's parts are the shares themselves (the allocator's minimum keeps them at 2 or more); a short one
    # is cut here.
    count = data.draw(st.integers(2, max(2, sum(shares) - 1)))
    if count >= sum(shares):
        return
    block = split_step(shares, count, least=2)
    assert sum(block) == count
    assert all(block[r] == 0 for r in range(len(shares)) if not shares[r])
    assert all(part == 0 or part >= 2 for part in block)
    active = [rank for rank, share in enumerate(shares) if share]
    if count >= 2 * len(active):
        assert all(block[r] >= 2 for r in active)
