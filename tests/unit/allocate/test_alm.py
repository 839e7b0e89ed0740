import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ClusterSpec, ConfigError, DeviceSpec
from hetdp.allocate.alm import AlmConfig, relaxed_optimum, round_preserving_sum, round_to_batches, solve_alm
from hetdp.allocate.cost import CostModel
from hetdp.allocate.exact import solve_exact


def cluster_of(*devices, sample_bytes=1.5e5, model_bytes=1e7):
    specs = tuple(
        DeviceSpec(name=f"d{i}", batch_size=bs, batch_time_s=t, bandwidth_mbps=bw, latency_ms=lat)
        for i, (bs, t, bw, lat) in enumerate(devices)
    )
    return CostModel.from_cluster(ClusterSpec(devices=specs, sample_bytes=sample_bytes, model_bytes=model_bytes))


# Instances whose optimum is known in closed form: (model, dataset size, epochs, optimal total seconds).
KNOWN = {
    # Six equal devices, 960 samples = 10 batches of 16 each: send 1.2 Mbit * 160 / 100 Mb/s,
    # epoch 10 * 0.5 s + 2 * (5 ms + 80 Mbit / 100 Mb/s).
    "identical devices": (
        cluster_of(*[(16, 0.5, 100.0, 5.0)] * 6),
        960,
        5,
        1.2 * 160 / 100 + 5 * (5.0 + 2 * (0.005 + 0.8)),
    ),
    # Free sends; GPUs do 64 samples per 0.5 s batch, CPUs 16 (4x slower): 25 batches each hold
    # 2 * 64 * 25 + 2 * 16 * 25 = 4000 samples, and 24 batches cannot.
    "compute only, 4x speed spread": (
        cluster_of(*[(64, 0.5, 1000.0, 0.0)] * 2, *[(16, 0.5, 1000.0, 0.0)] * 2, sample_bytes=0.0, model_bytes=0.0),
        4000,
        3,
        3 * 25 * 0.5,
    ),
    # Negligible compute, links of 100, 200 and 400 Mb/s: shares proportional to bandwidth,
    # 1000 / 2000 / 4000 samples of 1.2 Mbit each take 12 s on every link.
    "send only, 4x bandwidth spread": (
        cluster_of((1000, 1e-6, 100.0, 0.0), (1000, 1e-6, 200.0, 0.0), (1000, 1e-6, 400.0, 0.0), model_bytes=0.0),
        7000,
        1,
        12.0 + 4 * 1e-6,
    ),
}


@pytest.mark.parametrize("model, total, epochs, optimum", KNOWN.values(), ids=KNOWN.keys())
def test_alm_is_within_one_percent_of_a_known_optimum(model, total, epochs, optimum):
    exact = solve_exact(model, total, epochs)
    assert model.total_s(exact.samples, epochs) == pytest.approx(optimum, rel=1e-12)
    alm = solve_alm(model, total, epochs)
    assert alm.sum() == total and alm.min() >= 0
    assert model.total_s(alm, epochs) <= optimum * 1.01


def test_relaxed_optimum_balances_a_two_speed_cluster():
    # Continuous optimum of eq. (10) with free sends: x proportional to speed, 4:1.
    model = cluster_of((64, 0.5, 1000.0, 0.0), (16, 0.5, 1000.0, 0.0), sample_bytes=0.0, model_bytes=0.0)
    relaxed = relaxed_optimum(model, 5000, 1, AlmConfig())
    assert relaxed.sum() == pytest.approx(5000, rel=1e-4)
    assert relaxed[0] / relaxed[1] == pytest.approx(4.0, rel=0.03)  # p = 100 leaves a 4^(1/99) ~ 1.4% tilt


@given(
    relaxed=st.lists(st.floats(0, 1e4), min_size=1, max_size=12),
    total=st.integers(0, 50_000),
    minimum=st.integers(0, 5),
)
def test_nearest_rounding_keeps_the_sum_and_stays_within_one_sample(relaxed, total, minimum):
    relaxed = np.array(relaxed)
    if total < minimum * len(relaxed):
        with pytest.raises(ConfigError):
            round_preserving_sum(relaxed, total, minimum)
        return
    shares = round_preserving_sum(relaxed, total, minimum)
    assert shares.sum() == total and shares.min() >= minimum
    extra = np.maximum(relaxed - minimum, 0)
    if extra.sum() > 0:
        target = minimum + extra * (total - minimum * len(relaxed)) / extra.sum()
        assert np.abs(shares - target).max() < 1 + 1e-6


@given(
    batches=st.lists(st.integers(1, 64), min_size=1, max_size=10),
    weights=st.data(),
    total=st.integers(1, 20_000),
    minimum=st.integers(0, 3),
)
def test_batch_rounding_keeps_the_sum_and_the_minimum(batches, weights, total, minimum):
    if total < minimum * len(batches):
        return
    model = cluster_of(*[(bs, 1.0, 100.0, 0.0) for bs in batches])
    raw = np.array(weights.draw(st.lists(st.floats(0.01, 10), min_size=len(batches), max_size=len(batches))))
    relaxed = raw * total / raw.sum()
    shares = round_to_batches(model, relaxed, total, 2, minimum)
    assert shares.sum() == total and shares.min() >= minimum


def test_nearest_rounding_is_available():
    model = cluster_of(*[(16, 0.5, 100.0, 5.0)] * 3)
    shares = solve_alm(model, 1001, 2, config=AlmConfig(rounding="nearest"))
    assert shares.sum() == 1001 and shares.max() - shares.min() <= 1


BAD_CONFIGS = {
    "p below 1": ({"p": 0.5}, "p must be >= 1"),
    "negative rho": ({"rho": -1.0}, "rho must be a positive finite number"),
    "zero mu0": ({"mu0": 0.0}, "mu0 must be a positive finite number"),
    "mu_decay above 1": ({"mu_decay": 1.5}, r"mu_decay must be in \(0, 1\]"),
    "zero eta_decay": ({"eta_decay": 0.0}, r"eta_decay must be in \(0, 1\]"),
    "infinite lambda0": ({"lambda0": float("inf")}, "lambda0 must be a finite number"),
    "zero outer iterations": ({"outer_iterations": 0}, "outer_iterations must be a positive integer"),
    "unknown rounding": ({"rounding": "up"}, "rounding must be 'batches' or 'nearest'"),
}


@pytest.mark.parametrize("changes, message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_alm_config_raises(changes, message):
    with pytest.raises(ConfigError, match=message):
        AlmConfig(**changes)
