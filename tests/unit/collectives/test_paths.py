"""The collective paths a group's devices allow: one answer for every rank, whatever its own device."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp.collectives.paths import agree
from hetdp.errors import ConfigError


def test_a_gpu_rank_beside_cpu_ranks_over_gloo_doubles_through_host_copies():
    paths = agree("gloo", ["cuda", "cpu", "cpu", "cpu"])
    assert paths.point_to_point and paths.host_copies and paths.mixed


def test_cpu_ranks_over_gloo_double_in_place():
    paths = agree("gloo", ["cpu"] * 4)
    assert paths.point_to_point and not paths.host_copies and not paths.mixed


def test_gpus_over_nccl_use_the_backends_own_collectives_on_the_device():
    paths = agree("nccl", ["cuda"] * 2)
    assert not paths.point_to_point and not paths.host_copies


def test_nccl_with_a_cpu_rank_is_one_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"ranks \[1\] are not.*gloo"):
        agree("nccl", ["cuda", "cpu"])


@given(st.sampled_from(["gloo", "nccl"]), st.lists(st.sampled_from(["cpu", "cuda"]), min_size=1, max_size=8))
def test_every_rank_derives_the_same_paths_from_the_same_gathered_devices(backend, kinds):
    try:
        paths = agree(backend, kinds)
    except ConfigError:
        assert backend == "nccl" and "cpu" in kinds
        return
    assert paths == agree(backend, list(kinds))  # a pure function of what every rank holds
    assert paths.host_copies == (backend == "gloo" and "cuda" in kinds)
