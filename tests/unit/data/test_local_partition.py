"""The data owner's partition, and the settings of its delivery, in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import hetdp
from hetdp.data.distribute import partition
from hetdp.errors import ConfigError


@given(st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=10), st.integers(0, 2**32 - 1))
def test_partition_gives_disjoint_shares_of_the_planned_sizes_covering_the_dataset(counts, seed):
    shares = partition(counts, seed=seed)
    assert [len(share) for share in shares] == counts
    joined = np.concatenate(shares) if shares else np.array([])
    assert sorted(joined.tolist()) == list(range(sum(counts)))


def test_partition_depends_only_on_the_seed():
    assert all(np.array_equal(a, b) for a, b in zip(partition([5, 7], seed=3), partition([5, 7], seed=3)))
    assert not np.array_equal(partition([5, 7], seed=3)[0], partition([5, 7], seed=4)[0])


def test_partition_rejects_negative_counts():
    with pytest.raises(ConfigError, match=">= 0"):
        partition([3, -1])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"samples": [3, 4]}, "one count >= 0 per rank"),
        ({"transport": "email"}, "transport must be 'samples' or 'indices'"),
        ({"transfer_s": [1.0, 2.0]}, "transfer_s gives 2 values for 1 ranks"),
        ({"samples": [6]}, "samples sum to 6 but the owner's dataset has 7"),
    ],
)
def test_a_bad_delivery_is_a_config_error_naming_what_is_wrong(one_rank, settings, message):
    with pytest.raises(ConfigError, match=message):
        hetdp.distribute(**{"dataset": TensorDataset(torch.arange(7)), "samples": [7], **settings})
