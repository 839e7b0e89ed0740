import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError, Emulation
from hetdp.cluster.devices import DeviceModel, device_models_from_flags, device_table, micro_batches, read_device_table

TABLE = {
    "devices": [
        {"name": "a6000", "batch_size": 64, "batch_time_s": 0.032, "memory_mb": 48000, "fixed_memory_mb": 3000,
         "activation_mb_per_sample": 200, "step_overhead_ms": 8, "knee": 32, "micro_overhead_ms": 4},
        {"name": "2080ti", "batch_size": 32, "batch_time_s": 0.040, "memory_mb": 11000, "fixed_memory_mb": 3000,
         "activation_mb_per_sample": 200},
    ]
}


def test_a_step_costs_overhead_plus_each_micro_batch_at_least_its_knee():
    device = DeviceModel(step_overhead_ms=10, knee=32, max_batch=48, micro_overhead_ms=4)
    assert device.step_ms(40, sample_ms=1.0) == 10 + 4 + 40
    assert device.step_ms(50, sample_ms=1.0) == 10 + 2 * 4 + 2 * 32  # 25 + 25, each below the knee
    assert device.step_ms(96, sample_ms=1.0) == 10 + 2 * 4 + 96


def test_a_loop_that_overruns_the_cap_is_priced_as_the_cap_requires():
    device = DeviceModel(max_batch=48, micro_overhead_ms=4)
    assert device.step_ms(96, sample_ms=1.0, forwards=1) == device.step_ms(96, sample_ms=1.0) == 2 * 4 + 96
    assert device.step_ms(96, sample_ms=1.0, forwards=4) == 4 * 4 + 96


@given(samples=st.integers(0, 1000), count=st.integers(1, 50))
def test_micro_batches_are_near_equal_and_keep_every_sample(samples, count):
    pieces = micro_batches(samples, count)
    assert len(pieces) == count and sum(pieces) == samples and max(pieces) - min(pieces) <= 1


@given(shares=st.lists(st.integers(0, 500), min_size=2, max_size=2))
def test_step_time_never_decreases_with_the_share(shares):
    device = DeviceModel(step_overhead_ms=3, knee=40, max_batch=64, micro_overhead_ms=7)
    low, high = sorted(shares)
    assert device.step_ms(low, 0.5) <= device.step_ms(high, 0.5)


def test_a_device_table_needs_no_link_fields_and_becomes_an_emulation():
    emulation = Emulation.from_device_table(device_table(TABLE), seed=3)
    assert emulation.sample_cost_ms == pytest.approx(1.25)  # the slowest device's time per sample
    assert emulation.speeds == pytest.approx((2.5, 1.0))
    a6000, rtx = emulation.devices
    assert a6000 == DeviceModel(step_overhead_ms=8, knee=32, max_batch=225, micro_overhead_ms=4,  # (48000-3000)/200
                                memory_mb=48000, fixed_memory_mb=3000, activation_mb_per_sample=200)
    assert rtx.max_batch == 40 and rtx.knee == 0
    assert emulation.block_s(1, 80) == pytest.approx(80 * 1.25 / 1000)  # two micro-batches, no overheads
    assert Emulation.from_env(emulation.to_env()) == emulation


def test_padding_prices_the_micro_batches_the_step_ran():
    emulation = Emulation(speeds=(1.0,), sample_cost_ms=1.0, devices=(DeviceModel(max_batch=10, micro_overhead_ms=5),))
    assert emulation.padding_s(0, measured_s=0.0, samples=20, forwards=4) == pytest.approx((4 * 5 + 20) / 1000)
    assert emulation.padding_s(0, measured_s=0.0, samples=20) == pytest.approx((2 * 5 + 20) / 1000)


def test_a_forward_above_the_emulated_cap_warns_once():
    emulation = Emulation(sample_cost_ms=0.001, devices=(DeviceModel(max_batch=10),))
    pacer = emulation.pacer(0, 1)
    with pytest.warns(RuntimeWarning, match="above its emulated memory cap of 10"):
        pacer.finish(0, 20, 0.0, forwards=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pacer.finish(1, 20, 0.0, forwards=1)


def test_table_file_errors_name_the_file_and_device(tmp_path):
    path = tmp_path / "devices.toml"
    path.write_text('[[devices]]\nname = "gpu"\nbatch_size = 8\nbatch_time_s = 0.1\nknee = -1\n')
    with pytest.raises(ConfigError, match=r"devices.toml: device 'gpu': knee must be >= 0"):
        read_device_table(path)
    with pytest.raises(ConfigError, match="cannot read device table"):
        read_device_table(tmp_path / "missing.toml")


def test_flags_give_one_model_per_rank_and_zero_means_no_cap():
    models = device_models_from_flags(2, step_overhead_ms="0,20", max_batch="0,64")
    assert models == (DeviceModel(), DeviceModel(step_overhead_ms=20.0, max_batch=64))
    assert device_models_from_flags(2) is None


@pytest.mark.parametrize(("flags", "message"), [
    ({"knee": "1.5,2"}, "--knee must be integers >= 0"),
    ({"step_overhead_ms": "-1,0"}, "--step-overhead-ms must be numbers >= 0"),
    ({"micro_overhead_ms": "1"}, "gives 1 values for 2 processes"),
])
def test_bad_flags_are_config_errors(flags, message):
    with pytest.raises(ConfigError, match=message):
        device_models_from_flags(2, **flags)


def test_device_models_need_a_per_sample_cost():
    with pytest.raises(ConfigError, match="sample_cost_ms > 0"):
        Emulation(devices=(DeviceModel(),))
