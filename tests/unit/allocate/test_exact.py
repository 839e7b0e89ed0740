import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetdp import ClusterSpec, ConfigError, DeviceSpec
from hetdp.allocate.cost import CostModel
from hetdp.allocate.exact import ExactConfig, solve_exact
from hetdp.bench.planner import random_cluster


def compositions(total, parts):
    """Every way to write ``total`` as an ordered sum of ``parts`` non-negative integers."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        bounds = (-1, *cuts, total + parts - 1)
        yield [bounds[i + 1] - bounds[i] - 1 for i in range(parts)]


def brute_force(model, total, epochs, minimum=0):
    return min(
        model.total_s(split, epochs) for split in compositions(total, model.size) if min(split) >= minimum
    )


@st.composite
def small_instances(draw):
    count = draw(st.integers(1, 4))
    devices = tuple(
        DeviceSpec(
            name=f"d{i}",
            batch_size=draw(st.integers(1, 5)),
            # Few distinct batch times make ties between devices' epoch candidates common.
            batch_time_s=draw(st.one_of(st.sampled_from([0.5, 1.0, 1.5, 3.0]), st.floats(0.05, 3.0))),
            bandwidth_mbps=draw(st.sampled_from([10.0, 50.0, 100.0, 1000.0, math.inf])),
            latency_ms=draw(st.sampled_from([0.0, 5.0, 50.0])),
        )
        for i in range(count)
    )
    cluster = ClusterSpec(
        devices=devices,
        sample_bytes=draw(st.sampled_from([0.0, 1e5, 1e6])),
        model_bytes=draw(st.sampled_from([0.0, 1e6, 1e7])),
    )
    total = draw(st.integers(1, 24 if count < 4 else 14))
    minimum = draw(st.integers(0, 2)) if total >= 2 * count else 0
    return CostModel.from_cluster(cluster), total, draw(st.integers(1, 5)), minimum


@settings(max_examples=150, deadline=None)
@given(instance=small_instances())
def test_exact_equals_brute_force_on_small_instances(instance):
    model, total, epochs, minimum = instance
    result = solve_exact(model, total, epochs, min_samples=minimum)
    assert result.samples.sum() == total and result.samples.min() >= minimum
    assert model.total_s(result.samples, epochs) == pytest.approx(
        brute_force(model, total, epochs, minimum), rel=1e-12, abs=1e-15
    )
    assert result.optimal


def test_exact_on_a_hand_solved_instance():
    # a: 4 samples per 1 s batch, b: 8 per 1 s batch, b is the owner (free sends).
    # 100 samples: 4 k_a + 8 k_b >= 100 needs max(k_a, k_b) >= 9; then a takes the least:
    # b = 72 (9 batches), a = 28 (7 batches) -> 0.8 Mbit * 28 / 100 Mb/s + 3 * (9 + 0) = 27.224.
    cluster = ClusterSpec(
        devices=(
            DeviceSpec(name="a", batch_size=4, batch_time_s=1.0, bandwidth_mbps=100.0),
            DeviceSpec(name="b", batch_size=8, batch_time_s=1.0, bandwidth_mbps=math.inf),
        ),
        sample_bytes=1e5,
        model_bytes=0,
    )
    model = CostModel.from_cluster(cluster)
    result = solve_exact(model, 100, 3)
    assert result.samples.tolist() == [28, 72]
    assert model.total_s(result.samples, 3) == pytest.approx(27.224)


@pytest.mark.parametrize("devices", [1000, 10_000])
def test_exact_proves_optimality_on_large_random_clusters(devices):
    rng = np.random.default_rng(devices)
    model = CostModel.from_cluster(random_cluster(devices, rng))
    result = solve_exact(model, 1000 * devices, 10)
    assert result.samples.sum() == 1000 * devices
    assert result.optimal and result.lower_bound_s == pytest.approx(result.total_s, rel=1e-12)
    assert model.total_s(result.samples, 10) <= result.total_s * (1 + 1e-12)


def test_an_exhausted_search_reports_its_open_gap():
    rng = np.random.default_rng(3)
    model = CostModel.from_cluster(random_cluster(200, rng))
    result = solve_exact(model, 400_000, 1, config=ExactConfig(max_evaluations=3))
    full = solve_exact(model, 400_000, 1)
    assert result.samples.sum() == 400_000 and not result.optimal
    assert result.lower_bound_s <= full.total_s * (1 + 1e-12) <= result.total_s * (1 + 1e-12)


@pytest.mark.parametrize(
    "changes, message",
    [({"max_evaluations": 1}, "max_evaluations must be an integer >= 2"), ({"rtol": -1.0}, "rtol must be in")],
)
def test_bad_exact_config_raises(changes, message):
    with pytest.raises(ConfigError, match=message):
        ExactConfig(**changes)
