import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.sim.model import SimulatedCluster, simulate

COMPUTE_BOUND = {"jitter": 0.0, "model_mb": 0.0, "latency_s": 0.0}


def throughput(cluster, strategy, **kwargs):
    return simulate(cluster, strategy, global_batch=kwargs.pop("global_batch", 800), steps=60, **kwargs).samples_per_s


def test_on_equal_workers_every_allocation_is_the_same():
    cluster = SimulatedCluster(speeds=(100.0,) * 4, **COMPUTE_BOUND)
    assert throughput(cluster, "equal") == throughput(cluster, "static") == throughput(cluster, "adaptive")


@given(speeds=st.lists(st.floats(10.0, 80.0), min_size=2, max_size=6))
def test_adaptive_allocation_reaches_the_combined_speed_when_compute_bound(speeds):
    cluster = SimulatedCluster(speeds=tuple(speeds), **COMPUTE_BOUND)
    result = simulate(cluster, "adaptive", global_batch=4000, steps=200, replan_every=1)  # one equal step first
    assert result.samples_per_s >= 0.95 * sum(speeds)
    assert throughput(cluster, "equal", global_batch=4000) <= len(speeds) * min(speeds) * 1.01  # up to rounding


def test_partial_rounds_wait_for_fewer_workers_than_synchronous_steps():
    cluster = SimulatedCluster(speeds=(100.0,) * 8, straggler_probability=0.2, straggler_delay_s=1.0, jitter=0.1)
    seconds = {mode: simulate(cluster, mode, global_batch=800, steps=100).seconds for mode in
               ("equal", "majority", "solo")}
    assert seconds["solo"] < seconds["majority"] < seconds["equal"]


def test_only_gradients_started_from_the_latest_model_count_as_fresh():
    cluster = SimulatedCluster(speeds=(100.0,) * 4, **COMPUTE_BOUND)
    assert simulate(cluster, "quorum", quorum=4, global_batch=400, steps=20).fresh_fraction == 1.0


def test_same_seed_same_result():
    cluster = SimulatedCluster(speeds=(50.0, 100.0, 200.0), straggler_probability=0.1, straggler_delay_s=0.2)
    assert simulate(cluster, "majority", global_batch=300, steps=50, seed=3) == simulate(
        cluster, "majority", global_batch=300, steps=50, seed=3
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"speeds": (1.0, 0.0)}, "speeds"), ({"speeds": (1.0,), "straggler_probability": 2.0}, "straggler_probability"),
     ({"speeds": (1.0,), "bandwidth_gbps": 0.0}, "bandwidth_gbps")],
)
def test_bad_clusters_are_rejected(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SimulatedCluster(**kwargs)


def test_unknown_strategy_is_rejected():
    with pytest.raises(ConfigError, match="strategy 'gossip': allocation must be one of"):
        simulate(SimulatedCluster(speeds=(1.0,)), "gossip", global_batch=10, steps=1)


STRAGGLY = {"speeds": (100.0, 150.0, 200.0, 400.0, 50.0), "straggler_probability": 0.1, "straggler_delay_s": 0.5,
            "jitter": 0.1}


@pytest.mark.parametrize("strategy", ["equal", "static", "adaptive", "solo", "majority", "quorum"])
def test_throughput_is_steps_times_samples_per_step_over_time(strategy):
    result = simulate(SimulatedCluster(**STRAGGLY), strategy, global_batch=500, steps=80)
    assert result.samples_per_s == pytest.approx(result.steps * result.samples_per_step / result.seconds)
    if strategy in ("equal", "static", "adaptive"):
        assert result.samples_per_step == 500
    else:
        assert 0 < result.samples_per_step <= 500  # a partial round applies only the gradients that arrived


@pytest.mark.parametrize("strategy", ["equal", "static", "adaptive", "solo", "majority", "quorum"])
def test_compute_wait_and_allreduce_divide_the_workers_time(strategy):
    result = simulate(SimulatedCluster(**STRAGGLY), strategy, global_batch=500, steps=80)
    fractions = (result.compute_fraction, result.wait_fraction, result.allreduce_fraction)
    assert all(0 <= fraction <= 1 for fraction in fractions)
    assert sum(fractions) == pytest.approx(1.0)


def test_perfect_static_allocation_on_a_quiet_cluster_only_computes_and_allreduces():
    cluster = SimulatedCluster(speeds=(100.0, 200.0, 400.0), jitter=0.0, latency_s=0.01, model_mb=1.0)
    result = simulate(cluster, "static", global_batch=700, steps=10)
    assert result.wait_fraction == pytest.approx(0.0, abs=1e-12)
    assert result.allreduce_fraction == pytest.approx(cluster.allreduce_s() / (1.0 + cluster.allreduce_s()))
