import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.sim.network import (
    ALGORITHMS,
    allreduce_cost,
    doubling_allreduce,
    hierarchical_allreduce,
    ring_allreduce,
    tree_allreduce,
)

LINK = {"payload_mb": 40.0, "latency_s": 50e-6, "bandwidth_gbps": 10.0}


def test_a_ring_pays_2_n_minus_1_latencies_and_2_n_minus_1_over_n_transfers():
    cost = ring_allreduce(1000, payload_mb=40.0, latency_s=50e-6, bandwidth_gbps=10.0)
    assert cost.hops == 1998
    assert cost.latency_s == 1998 * 50e-6
    assert abs(cost.transfer_s - 1998 / 1000 * 40e6 * 8 / 10e9) < 1e-12
    assert cost.total_s == cost.latency_s + cost.transfer_s


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_single_worker_pays_nothing(algorithm):
    assert allreduce_cost(algorithm, 1, **LINK).total_s == 0.0


def test_a_tree_pays_twice_its_depth_in_latencies_and_about_twice_the_payload():
    cost = tree_allreduce(1000, **LINK)
    assert cost.hops == 2 * 10
    assert cost.transfer_s == pytest.approx(2 * 40e6 * 8 / 10e9)


@given(workers=st.integers(2, 100_000))
def test_tree_latency_grows_with_log_n_and_never_exceeds_the_rings(workers):
    tree, ring = tree_allreduce(workers, **LINK), ring_allreduce(workers, **LINK)
    assert tree.hops == 2 * math.ceil(math.log2(workers))
    assert tree.latency_s <= ring.latency_s
    assert tree_allreduce(2 * workers, **LINK).hops == tree.hops + 2


@given(workers=st.integers(2, 100_000))
def test_doubling_moves_the_whole_payload_at_every_exchange(workers):
    cost = doubling_allreduce(workers, **LINK)
    exchanges = int(math.log2(workers))
    assert cost.hops == exchanges + (0 if 2**exchanges == workers else 2)
    assert cost.transfer_s == pytest.approx(cost.hops * 40e6 * 8 / 10e9)


@pytest.mark.parametrize("workers", [1_000, 10_000])
def test_a_hierarchy_beats_the_ring_at_scale_over_slow_links_between_nodes(workers):
    hierarchy = hierarchical_allreduce(workers, **LINK, local_size=8, local_latency_s=5e-6, local_bandwidth_gbps=200.0)
    assert hierarchy.total_s < ring_allreduce(workers, **LINK).total_s
    assert hierarchy.total_s < tree_allreduce(workers, **LINK).total_s  # slow links carry an eighth of the payload


def test_a_hierarchy_of_one_node_is_the_ring_inside_it():
    inside = {"local_latency_s": 5e-6, "local_bandwidth_gbps": 200.0}
    assert hierarchical_allreduce(8, **LINK, local_size=8, **inside) == ring_allreduce(8, 40.0, 5e-6, 200.0)


def test_an_unknown_algorithm_is_rejected():
    with pytest.raises(ConfigError, match="allreduce algorithm must be one of ring, tree, doubling, hierarchical"):
        allreduce_cost("butterfly", 4, **LINK)
