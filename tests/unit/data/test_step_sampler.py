"""The drop-in's step sampler: every step's samples cut among the ranks by that step's shares, the same on every rank.

What ``model.allocate(loader)`` batches by: the ranks' blocks must be disjoint and cover the epoch whatever the
shares and whenever they change, and every rank must get one batch per step, or the ranks' collectives part ways.
"""

from collections import Counter
from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from hetdp import apportion
from hetdp.data.steps import StepSampler

Shares = Callable[[int], list[int]]

weights = st.lists(st.integers(0, 5), min_size=1, max_size=5).filter(any)


def epoch(size: int, total: int, shares_at: Shares, ranks: int, *, seed: int = 0, number: int = 0,
          drop_last: bool = False) -> list[list[tuple[list[int], tuple[int, ...]]]]:
    """Per rank, its (batch, block) of every step of epoch ``number``."""
    steps = []
    for rank in range(ranks):
        sampler = StepSampler(size, total, rank, shares_at=shares_at, shuffle=True, seed=seed, drop_last=drop_last)
        sampler.set_epoch(number)
        batches = list(sampler)
        assert len(batches) == len(sampler) == sampler.steps_per_epoch
        steps.append([(batch, ticket.block) for batch, ticket in zip(batches, sampler.tickets)])
    return steps


def trained(steps: list[list[tuple[list[int], tuple[int, ...]]]]) -> Counter:
    """How often each sample is trained over the ranks (a stand-in batch, for an empty block, trains nothing)."""
    return Counter(index for rank, per_rank in enumerate(steps) for batch, block in per_rank if block[rank]
                   for index in batch)


@given(size=st.integers(1, 300), weights=weights, total=st.integers(1, 40), seed=st.integers(0, 5),
       number=st.integers(0, 5))
def test_the_ranks_blocks_are_disjoint_and_cover_the_epoch(size, weights, total, seed, number):
    shares = apportion(weights, total, minimum=0)
    counts = trained(epoch(size, total, lambda _: shares, len(shares), seed=seed, number=number))
    assert sorted(counts) == list(range(size)) and set(counts.values()) == {1}


@given(size=st.integers(1, 300), weights=weights, total=st.integers(1, 40), drop_last=st.booleans())
def test_every_rank_gets_one_batch_per_step_and_each_full_step_its_share(size, weights, total, drop_last):
    shares = apportion(weights, total, minimum=0)
    steps = epoch(size, total, lambda _: shares, len(shares), drop_last=drop_last)
    assert len({len(per_rank) for per_rank in steps}) == 1  # the same number of steps on every rank
    for rank, per_rank in enumerate(steps):
        for batch, block in per_rank:
            assert len(batch) == max(block[rank], 1)  # an empty block still gives the loop a (stand-in) batch
        full = [block for _, block in per_rank if sum(block) == total]
        assert full == [tuple(shares)] * (size // total)
    assert sum(trained(steps).values()) == (size // total * total if drop_last else size)


@given(size=st.integers(1, 300), pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1,
       max_size=5).filter(lambda p: any(a for a, _ in p) and any(b for _, b in p)), total=st.integers(1, 40),
       change=st.integers(0, 40))
def test_shares_that_change_at_any_step_keep_the_blocks_disjoint_and_covering(size, pairs, total, change):
    old = apportion([a for a, _ in pairs], total, minimum=0)
    new = apportion([b for _, b in pairs], total, minimum=0)
    counts = trained(epoch(size, total, lambda step: old if step < change else new, len(pairs)))
    assert sorted(counts) == list(range(size)) and set(counts.values()) == {1}


def test_the_same_seed_and_epoch_give_the_same_blocks_and_epochs_differ():
    def cut(number: int) -> list:
        return epoch(100, 6, lambda _: [1, 2, 3], 3, seed=7, number=number)

    assert cut(1) == cut(1)
    assert cut(1) != cut(2)
