"""The pure parts of local training: merge weights and each rank's order of its own data."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hetdp.data.owndata import epoch_order
from hetdp.errors import ConfigError
from hetdp.sync.averaging import merge_weights


def test_merge_weights_are_each_devices_share_of_the_data():
    assert merge_weights([300, 100, 0, 600]) == [0.3, 0.1, 0.0, 0.6]


@given(st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=12).filter(any))
def test_merge_weights_sum_to_one_and_follow_the_counts(counts):
    weights = merge_weights(counts)
    assert sum(weights) == pytest.approx(1.0)
    for (a, wa), (b, wb) in zip(zip(counts, weights), zip(counts[1:], weights[1:])):
        assert (a < b) == (wa < wb)


@pytest.mark.parametrize("counts", [[0, 0, 0], [3, -1, 2]])
def test_merge_weights_reject_empty_or_negative_counts(counts):
    with pytest.raises(ConfigError, match="sample counts"):
        merge_weights(counts)


def test_epoch_order_is_a_permutation_that_differs_by_epoch_and_rank():
    first = epoch_order(50, seed=1, epoch=0, rank=0)
    assert sorted(first.tolist()) == list(range(50))
    assert torch.equal(first, epoch_order(50, seed=1, epoch=0, rank=0))
    assert not torch.equal(first, epoch_order(50, seed=1, epoch=1, rank=0))
    assert not torch.equal(first, epoch_order(50, seed=1, epoch=0, rank=1))
