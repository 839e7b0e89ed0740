import math
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetdp import ClusterSpec, ConfigError, DeviceSpec, Plan, plan
from hetdp.allocate.alm import AlmConfig
from hetdp.allocate.cost import CostModel
from hetdp.allocate.planner import evaluate


def two_devices() -> ClusterSpec:
    return ClusterSpec(
        devices=(
            DeviceSpec(name="a", batch_size=4, batch_time_s=1.0, bandwidth_mbps=100, latency_ms=10),
            DeviceSpec(name="b", batch_size=8, batch_time_s=2.0, bandwidth_mbps=50),
        ),
        sample_bytes=1e5,  # 0.8 Mbit
        model_bytes=1e6,  # 8 Mbit
    )


def test_cost_model_matches_hand_computed_eqs_2_to_7():
    result = evaluate(two_devices(), [10, 20], epochs=3)
    a, b = result.devices
    # eq. (2): b D_i / B_0i = 0.8 Mbit * 10 / 100 Mb/s and 0.8 * 20 / 50
    assert (a.send_s, b.send_s) == pytest.approx((0.08, 0.32))
    # eq. (5): ceil(10 / 4) * 1.0 s and ceil(20 / 8) * 2.0 s
    assert (a.batches, b.batches) == (3, 3)
    assert (a.compute_s, b.compute_s) == pytest.approx((3.0, 6.0))
    # eq. (6): 2 (alpha + M_m / B) = 2 (0.010 + 8 / 100) and 2 (0 + 8 / 50)
    assert (a.comm_s, b.comm_s) == pytest.approx((0.18, 0.32))
    # eq. (7): max send + num * max (compute + comm) = 0.32 + 3 * 6.32
    assert result.send_s == pytest.approx(0.32)
    assert result.epoch_s == pytest.approx(6.32)
    assert result.total_s == pytest.approx(19.28)
    assert result.method == "given" and math.isnan(result.gap)


def test_device_with_no_data_still_pays_the_per_epoch_merge():
    result = evaluate(two_devices(), [30, 0], epochs=2)
    assert result.devices[1].compute_s == 0 and result.devices[1].comm_s == pytest.approx(0.32)
    assert result.epoch_s == pytest.approx(max(8 * 1.0 + 0.18, 0.32))


def test_data_owner_with_infinite_bandwidth_sends_for_free():
    cluster = ClusterSpec(
        devices=(DeviceSpec(name="owner", batch_size=2, batch_time_s=1.0, bandwidth_mbps=math.inf, latency_ms=1),),
        sample_bytes=1e6,
        model_bytes=1e9,
    )
    result = evaluate(cluster, [5], epochs=4)
    assert result.send_s == 0 and result.devices[0].comm_s == pytest.approx(0.002)
    assert result.total_s == pytest.approx(4 * (3.0 + 0.002))


def test_plan_returns_the_contract_fields():
    result = plan(two_devices(), 100, 3)
    assert isinstance(result, Plan) and result.method == "exact" and result.epochs == 3
    assert sum(result.samples) == 100 and result.batch_sizes == [4, 8]
    assert result.gap == 0 and result.lower_bound_s == pytest.approx(result.total_s)
    assert result.total_s == pytest.approx(result.send_s + 3 * result.epoch_s)
    assert result.total_s == pytest.approx(evaluate(two_devices(), result.samples, 3).total_s)
    as_dict = result.to_dict()
    assert as_dict["devices"][0]["name"] == "a" and as_dict["total_s"] == result.total_s


def test_plan_beats_the_equal_split_on_a_heterogeneous_cluster():
    cluster = ClusterSpec(
        devices=(
            DeviceSpec(name="gpu", batch_size=64, batch_time_s=0.2, bandwidth_mbps=1000),
            DeviceSpec(name="cpu", batch_size=4, batch_time_s=1.0, bandwidth_mbps=50, latency_ms=50),
        ),
        sample_bytes=150_000,
        model_bytes=1e8,
    )
    planned = plan(cluster, 10_000, 5)
    equal = evaluate(cluster, [5000, 5000], 5)
    assert planned.total_s < 0.2 * equal.total_s
    assert planned.samples[0] > planned.samples[1]


def test_batch_above_memory_limit_is_clamped_and_warned():
    cluster = ClusterSpec(
        devices=(
            DeviceSpec(
                name="small", batch_size=16, batch_time_s=1.6, bandwidth_mbps=100, memory_mb=1000,
                fixed_memory_mb=200, activation_mb_per_sample=100,
            ),
        ),
        sample_bytes=0,
        model_bytes=0,
    )
    with pytest.warns(UserWarning, match="'small' 16 -> 8"):
        result = plan(cluster, 20, 1)
    device = result.devices[0]
    assert device.batch_size == 8 and device.batches == 3  # constraint (4): 8 <= P_max = 8
    assert device.compute_s == pytest.approx(3 * 0.8)  # batch time scaled with the batch


BAD_CALLS = {
    "zero dataset": (dict(dataset_size=0), "dataset_size must be a positive integer"),
    "float dataset": (dict(dataset_size=10.5), "dataset_size must be a positive integer"),
    "zero epochs": (dict(epochs=0), "epochs must be a positive integer"),
    "unknown method": (dict(method="milp"), "method must be one of exact, alm"),
    "dataset too small for the minimum": (dict(dataset_size=3, min_samples=2), "dataset_size 3 is too small"),
    "negative minimum": (dict(min_samples=-1), "min_samples must be a non-negative integer"),
    "unknown option": (dict(method="alm", q=3), "unknown option 'q'"),
    "exact option on alm": (dict(method="alm", max_evaluations=3), "unknown option 'max_evaluations'"),
    "bad alm setting": (dict(method="alm", p=0.5), "p must be >= 1"),
    "wrong config type": (dict(config=AlmConfig()), "config must be a ExactConfig"),
}


@pytest.mark.parametrize("changes, message", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_arguments_raise_config_error(changes, message):
    arguments = {"cluster": two_devices(), "dataset_size": 100, "epochs": 2, **changes}
    with pytest.raises(ConfigError, match=message):
        plan(**arguments)


def test_evaluate_rejects_a_wrong_allocation():
    with pytest.raises(ConfigError, match="samples gives 1 values for 2 devices"):
        evaluate(two_devices(), [3], 1)
    with pytest.raises(ConfigError, match="device 'b': samples must be a non-negative integer, got -1"):
        evaluate(two_devices(), [3, -1], 1)


def test_alm_options_reach_the_solver():
    fine = plan(two_devices(), 1000, 2, method="alm", p=50.0, outer_iterations=5)
    assert fine.method == "alm" and sum(fine.samples) == 1000
    assert fine.gap >= 0 and fine.total_s >= fine.lower_bound_s


@st.composite
def clusters(draw):
    count = draw(st.integers(1, 6))
    devices = []
    for index in range(count):
        memory = draw(st.one_of(st.none(), st.floats(500, 4000)))
        devices.append(
            DeviceSpec(
                name=f"d{index}",
                batch_size=draw(st.integers(1, 64)),
                batch_time_s=draw(st.floats(0.01, 5.0)),
                bandwidth_mbps=draw(st.one_of(st.just(math.inf), st.floats(1.0, 2000.0))),
                latency_ms=draw(st.floats(0, 200)),
                memory_mb=memory,
                fixed_memory_mb=0.0 if memory is None else draw(st.floats(0, 200)),
                activation_mb_per_sample=draw(st.floats(0, 20)),
            )
        )
    return ClusterSpec(
        devices=tuple(devices),
        sample_bytes=draw(st.sampled_from([0.0, 1e3, 1.5e5, 1e6])),
        model_bytes=draw(st.sampled_from([0.0, 1e6, 1e8])),
    )


QUICK_ALM = AlmConfig(outer_iterations=5, inner_iterations=30)


@settings(max_examples=40, deadline=None)
@given(
    cluster=clusters(),
    dataset_size=st.integers(1, 20_000),
    epochs=st.integers(1, 60),
    method=st.sampled_from(["exact", "alm"]),
    min_samples=st.integers(0, 3),
)
def test_every_plan_is_feasible(cluster, dataset_size, epochs, method, min_samples):
    if dataset_size < min_samples * len(cluster.devices):
        with pytest.raises(ConfigError, match="too small"):
            plan(cluster, dataset_size, epochs, method=method, min_samples=min_samples)
        return
    options = {"config": QUICK_ALM} if method == "alm" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # batch clamping is tested on its own
        result = plan(cluster, dataset_size, epochs, method=method, min_samples=min_samples, **options)
        priced = evaluate(cluster, result.samples, epochs)
    assert sum(result.samples) == dataset_size
    assert min(result.samples) >= min_samples
    for device, spec in zip(result.devices, cluster.devices):
        assert 1 <= device.batch_size <= spec.max_parallelism  # constraint (4)
        assert device.batches == -(-device.samples // device.batch_size)
    assert 0 <= result.gap < 1
    assert result.lower_bound_s <= result.total_s * (1 + 1e-12)
    assert result.total_s == pytest.approx(priced.total_s)
    if method == "exact":
        assert result.gap == 0


@settings(max_examples=25, deadline=None)
@given(cluster=clusters(), dataset_size=st.integers(1, 5000), epochs=st.integers(1, 20))
def test_exact_is_never_worse_than_the_equal_split_or_alm(cluster, dataset_size, epochs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        exact = plan(cluster, dataset_size, epochs)
        alm = plan(cluster, dataset_size, epochs, method="alm", config=QUICK_ALM)
    count = len(cluster.devices)
    equal = [dataset_size // count + (i < dataset_size % count) for i in range(count)]
    model = CostModel.from_cluster(cluster)
    assert exact.total_s <= model.total_s(equal, epochs) * (1 + 1e-12)
    assert exact.total_s <= alm.total_s * (1 + 1e-12)
