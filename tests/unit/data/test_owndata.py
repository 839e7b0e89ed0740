"""Steps over each rank's own data (C-ADP): every rank trains all its samples each epoch, in batches of its size."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp.allocate.policy import Adaptive, Equal, Planned, Static
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.data.owndata import OwnData, own_batch_sizes, own_blocks
from hetdp.errors import ConfigError

ranks = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 9)), min_size=1, max_size=5)
"""Every rank's (samples held, batch size)."""


def epoch(own: OwnData, rank: int, *, seed: int = 0, epoch_index: int = 0, drop_last: bool = False):
    sampler = own.sampler(rank, shuffle=True, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch_index)
    return list(sampler), list(sampler.tickets)


@given(ranks)
def test_every_rank_trains_each_of_its_samples_once_an_epoch_in_batches_of_its_size(held):
    own = OwnData(counts=tuple(n for n, _ in held), batch_sizes=tuple(b for _, b in held))
    steps = max(math.ceil(n / b) for n, b in held)
    for rank, (count, size) in enumerate(held):
        batches, tickets = epoch(own, rank)
        assert len(batches) == len(tickets) == steps
        trained = [index for batch, ticket in zip(batches, tickets) if ticket.samples for index in batch]
        assert sorted(trained) == list(range(count))
        assert all(ticket.samples == len(batch) <= size for batch, ticket in zip(batches, tickets) if ticket.samples)
        assert all(len(batch) == 1 for batch, ticket in zip(batches, tickets) if not ticket.samples)  # stand-ins
        # Every rank's ticket tells each step's blocks alike, so the merge's D is known everywhere.
        assert [ticket.block for ticket in tickets] == [own_blocks(own.counts, own.batch_sizes, k, False)
                                                        for k in range(steps)]
        assert sum(sum(ticket.block) for ticket in tickets) == sum(own.counts)
        assert [ticket.last for ticket in tickets] == [k == steps - 1 for k in range(steps)]


def test_drop_last_drops_each_ranks_partial_batch():
    assert own_blocks([10, 4], [4, 4], 2, drop_last=True) == (0, 0)
    assert own_blocks([10, 4], [4, 4], 2, drop_last=False) == (2, 0)
    own = OwnData(counts=(10, 4), batch_sizes=(4, 4))
    batches, tickets = epoch(own, 0, drop_last=True)
    assert len(batches) == 2 and [ticket.block for ticket in tickets] == [(4, 4), (4, 0)]


def test_a_ranks_order_changes_with_the_epoch_and_repeats_with_it():
    own = OwnData(counts=(40,), batch_sizes=(40,))
    assert epoch(own, 0, epoch_index=1)[0] == epoch(own, 0, epoch_index=1)[0]
    assert epoch(own, 0, epoch_index=1)[0] != epoch(own, 0, epoch_index=2)[0]


def test_batch_sizes_come_from_the_cluster_when_planned_and_from_the_loaders_when_equal():
    devices = tuple(DeviceSpec(name=f"d{i}", batch_size=size, batch_time_s=0.1,
                               bandwidth_mbps=100.0) for i, size in enumerate((64, 4)))
    cluster = ClusterSpec(devices=devices, sample_bytes=1000, model_bytes=1000)
    assert own_batch_sizes(Planned(cluster), [1, 1]) == [64, 4]
    assert own_batch_sizes(Equal(), [32, 16]) == [32, 16]
    with pytest.raises(ConfigError, match="the cluster has 2 devices for 3 ranks"):
        own_batch_sizes(Planned(cluster), [1, 1, 1])


@pytest.mark.parametrize("policy", [Adaptive(), Static((1.0, 2.0))])
def test_shares_that_would_move_own_samples_between_ranks_are_refused(policy):
    with pytest.raises(ConfigError, match="cannot move to another"):
        own_batch_sizes(policy, [8, 8])


def test_a_rank_without_samples_is_refused():
    with pytest.raises(ConfigError, match="needs samples on every rank, got \\[0, 5\\]"):
        OwnData(counts=(0, 5), batch_sizes=(4, 4))
