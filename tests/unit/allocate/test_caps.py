"""A sharded rank's cap: what its memory leaves beside its shard of the state and FSDP2's buffers, per sample."""

from __future__ import annotations

import pytest

from hetdp.allocate.caps import shard_cap
from hetdp.errors import ConfigError


def test_the_cap_is_the_memory_left_beside_the_shard_over_the_bytes_of_a_sample():
    assert shard_cap(10e6, 4e6, 1e6, device="d") == 6
    assert shard_cap(10e6, 4e6, 0.7e6, device="d") == 8  # floor(6 / 0.7)


def test_memory_that_does_not_grow_with_the_batch_caps_nothing():
    assert shard_cap(10e6, 4e6, 0.0, device="d") is None


def test_a_device_too_small_for_its_shard_plus_one_sample_names_itself_and_the_bytes_it_would_need():
    with pytest.raises(ConfigError, match=r"^the 8 GB card cannot hold its shard plus one sample: it would need "
                                          r"8,500 MB \(8,000 MB of model state and FSDP buffers, 500 MB per sample\) "
                                          r"and has 8,200 MB"):
        shard_cap(8.2e9, 8.0e9, 0.5e9, device="the 8 GB card")
