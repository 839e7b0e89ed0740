"""The data owner's partition and the C-ADP run settings, in one process."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp.data.distribute import partition
from hetdp.errors import ConfigError
from hetdp.train.cadp import CadpConfig


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
    ("field", "value"),
    [("epochs", 0), ("allocation", "random"), ("method", "greedy"), ("sync", "never"), ("transport", "email")],
)
def test_cadp_config_names_the_bad_field(field, value):
    with pytest.raises(ConfigError, match=field):
        CadpConfig(**{field: value})
