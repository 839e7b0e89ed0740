"""A sharded rank's cap: what its memory leaves beside its shard of the state and FSDP2's buffers, per sample; and a
resumed run's shares brought within its caps."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hetdp.allocate.caps import shard_cap, within_caps
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


def test_shares_within_their_caps_stay_as_they_are():
    assert within_caps([6, 2, 4], [8, None, 4], 1) == [6, 2, 4]
    assert within_caps([6, 2, 4], None, 1) == [6, 2, 4]


def test_shares_above_a_cap_are_split_again_within_the_caps_in_their_proportion():
    assert within_caps([6, 2, 4], [4, 4, 4], 1) == [4, 4, 4]
    assert within_caps([8, 0, 4], [4, None, 9], 1) == [4, 0, 8]  # the rank that sat out stays out
    assert within_caps([8, 0, 4], [4, 3, 5], 1) == [4, 3, 5]  # the members' caps cannot hold 12: it takes part


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.one_of(st.none(), st.integers(2, 30))), min_size=1, max_size=6),
       st.integers(0, 2))
def test_shares_brought_within_the_caps_keep_the_step_and_its_members_where_they_can(ranks, minimum):
    shares, caps = [share for share, _ in ranks], [cap for _, cap in ranks]
    total = sum(shares)
    assume(total >= 1 and any(shares))
    assume(all(share == 0 or share >= minimum for share in shares))
    assume(None in caps or sum(caps) >= total)  # check_fits refuses the rest at allocate
    fitted = within_caps(shares, caps, minimum)
    assert sum(fitted) == total
    assert all(cap is None or share <= cap for share, cap in zip(fitted, caps))
    if all(cap is None or share <= cap for share, cap in zip(shares, caps)):
        assert fitted == shares
    members = [rank for rank, share in enumerate(shares) if share]
    if None in [caps[rank] for rank in members] or sum(caps[rank] for rank in members) >= total:
        assert [rank for rank, share in enumerate(fitted) if share] == members
        assert all(fitted[rank] >= minimum for rank in members)
