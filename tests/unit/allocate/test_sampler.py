from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.allocate.sampler import WeightedDistributedSampler
from hetdp.allocate.sampler import split_step

shares_strategy = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=6).filter(lambda s: sum(s) > 0)


def shards(size, shares, seed=0, epoch=0, start=0, drop_last=False, padded=False):
    """Each rank's samples; without ``padded``, the padding sample of an empty block is left out."""
    result = []
    for rank in range(len(shares)):
        sampler = WeightedDistributedSampler(range(size), shares, rank, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch, start=start)
        items, blocks = iter(list(sampler)), sampler.blocks()
        batches = [[next(items) for _ in range(max(block[rank], 1))] for block in blocks]
        result.append([i for batch, block in zip(batches, blocks) for i in batch if padded or block[rank]])
    return result


@given(size=st.integers(0, 500), shares=shares_strategy, seed=st.integers(0, 5), epoch=st.integers(0, 5))
def test_shards_are_disjoint_and_cover_the_epoch(size, shares, seed, epoch):
    per_rank = shards(size, shares, seed, epoch)
    counts = Counter(index for shard in per_rank for index in shard)
    assert sorted(counts) == list(range(size))
    assert set(counts.values()) <= {1}


@given(size=st.integers(1, 500), shares=shares_strategy)
def test_each_full_step_gives_every_rank_exactly_its_share(size, shares):
    per_rank = shards(size, shares, drop_last=True)
    steps = size // sum(shares)
    assert [len(shard) for shard in per_rank] == [steps * share for share in shares]


@given(size=st.integers(1, 500), shares=shares_strategy)
def test_used_alone_every_rank_gets_the_same_number_of_batches(size, shares):
    # A plain DataLoader with batch_size=shares[rank] must give every rank one batch per step, or DDP hangs.
    for rank, share in enumerate(shares):
        sampler = WeightedDistributedSampler(range(size), shares, rank)
        batch_size = max(share, 1)
        assert -(-len(sampler) // batch_size) == sampler.num_steps
        assert all(max(block[rank], 1) <= batch_size for block in sampler.blocks())


@given(shares=shares_strategy, data=st.data())
def test_a_short_step_leaves_no_rank_with_a_share_empty_when_it_has_enough_samples(shares, data):
    count = data.draw(st.integers(1, sum(shares)))
    block = split_step(shares, count)
    active = [rank for rank, share in enumerate(shares) if share]
    assert sum(block) == count and all(block[r] <= shares[r] for r in range(len(shares)))
    assert all(block[r] == 0 for r in range(len(shares)) if not shares[r])
    if count >= len(active):
        assert all(block[r] >= 1 for r in active)


@given(size=st.integers(1, 400), old=shares_strategy, new=shares_strategy, data=st.data())
def test_changing_shares_mid_epoch_keeps_disjoint_cover(size, old, new, data):
    if len(new) != len(old):
        new = (new * len(old))[: len(old)] if sum((new * len(old))[: len(old)]) else [1] * len(old)
    start = data.draw(st.integers(0, size))
    before = shards(size, old)  # what was taken before the change: the first `start` permuted samples
    order = WeightedDistributedSampler(range(size), old, 0).permutation()
    after = shards(size, new, start=start)
    taken = Counter(order[:start]) + Counter(index for shard in after for index in shard)
    assert sorted(taken) == list(range(size)) and set(taken.values()) <= {1}
    assert sum(len(shard) for shard in before) == size


def test_same_seed_and_epoch_give_same_shards_and_epochs_differ():
    assert shards(100, [1, 2, 3], seed=7, epoch=1) == shards(100, [1, 2, 3], seed=7, epoch=1)
    assert shards(100, [1, 2, 3], seed=7, epoch=1) != shards(100, [1, 2, 3], seed=7, epoch=2)


def test_num_steps_is_the_same_on_every_rank_and_matches_blocks():
    for rank in range(3):
        sampler = WeightedDistributedSampler(range(100), [1, 2, 3], rank)
        assert sampler.num_steps == 17 == len(sampler.blocks())


@pytest.mark.parametrize("shares", [[0, 0], [-1, 3]])
def test_bad_shares_are_rejected(shares):
    with pytest.raises(ConfigError, match="shares"):
        WeightedDistributedSampler(range(10), shares, 0)


def test_rank_outside_the_shares_is_rejected():
    with pytest.raises(ConfigError, match="rank"):
        WeightedDistributedSampler(range(10), [1, 1], 2)
