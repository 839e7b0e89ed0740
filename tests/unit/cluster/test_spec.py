import math
import textwrap

import pytest

from hetdp import ClusterSpec, ConfigError, DeviceSpec

GOOD = textwrap.dedent(
    """
    sample_bytes = 150000
    model_bytes = 1e8
    dataset_size = 1000
    base_batch_time_s = 0.8
    base_batch_size = 64

    [[devices]]
    name = "gpu-0"
    batch_size = 64
    batch_time_s = 0.2
    bandwidth_mbps = 1000
    latency_ms = 5
    memory_mb = 24000
    fixed_memory_mb = 2000
    activation_mb_per_sample = 100

    [[devices]]
    name = "cpu-2"
    batch_size = 8
    speed = 0.5
    bandwidth_mbps = 50

    [[devices]]
    name = "owner"
    batch_size = 16
    batch_time_s = 1.0
    bandwidth_mbps = inf
    """
)


def write(tmp_path, text):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_loads_every_field_and_resolves_speed_to_batch_time(tmp_path):
    cluster = ClusterSpec.from_toml(write(tmp_path, GOOD))
    gpu, cpu, owner = cluster.devices
    assert (cluster.sample_bytes, cluster.model_bytes, cluster.dataset_size) == (150000, 1e8, 1000)
    assert gpu == DeviceSpec(
        name="gpu-0",
        batch_size=64,
        batch_time_s=0.2,
        bandwidth_mbps=1000,
        latency_ms=5,
        memory_mb=24000,
        fixed_memory_mb=2000,
        activation_mb_per_sample=100,
    )
    # speed 0.5 at batch 8: base 0.8 s per 64 samples -> 0.1 s per 8 samples at speed 1 -> 0.2 s
    assert cpu.batch_time_s == pytest.approx(0.2)
    assert cpu.memory_mb is None and cpu.max_parallelism == math.inf
    assert owner.bandwidth_mbps == math.inf
    assert cluster.send_s_per_sample(owner) == 0.0


def test_max_parallelism_is_eq_3():
    device = DeviceSpec(
        name="d", batch_size=8, batch_time_s=1.0, bandwidth_mbps=10, memory_mb=1000, fixed_memory_mb=200,
        activation_mb_per_sample=100,
    )
    assert device.max_parallelism == 8.0  # (1000 - 200) / 100
    assert device.feasible_batch_size == 8


def test_batch_above_p_max_is_clamped_with_proportional_time():
    device = DeviceSpec(
        name="d", batch_size=16, batch_time_s=2.0, bandwidth_mbps=10, memory_mb=1000, fixed_memory_mb=250,
        activation_mb_per_sample=100,
    )
    assert device.max_parallelism == 7.5
    assert device.feasible_batch_size == 7
    assert device.feasible_batch_time_s == pytest.approx(2.0 * 7 / 16)


def test_to_toml_round_trips(tmp_path):
    cluster = ClusterSpec.from_toml(write(tmp_path, GOOD))
    again = ClusterSpec.from_toml(write(tmp_path, cluster.to_toml()))
    assert again == cluster


def test_to_toml_round_trips_odd_names_and_no_dataset_size(tmp_path):
    cluster = ClusterSpec(
        devices=(DeviceSpec(name='rank "1" \\ é', batch_size=1, batch_time_s=1e-5, bandwidth_mbps=0.5),),
        sample_bytes=0,
        model_bytes=0.0,
    )
    assert ClusterSpec.from_toml(write(tmp_path, cluster.to_toml())) == cluster


def device_table(**fields):
    base = {"name": '"cpu-2"', "batch_size": 8, "batch_time_s": 1.0, "bandwidth_mbps": 100}
    base.update(fields)
    lines = ["[[devices]]"]
    for key, value in base.items():
        if value is not None:
            lines.append(f"{key} = {value}")
    return "\n".join(lines)


HEADER = "sample_bytes = 1000\nmodel_bytes = 1000\n"

BAD_FILES = {
    "negative bandwidth": (
        HEADER + device_table(bandwidth_mbps=-5),
        "device 'cpu-2': bandwidth_mbps must be > 0, got -5",
    ),
    "zero bandwidth": (HEADER + device_table(bandwidth_mbps=0), "device 'cpu-2': bandwidth_mbps must be > 0"),
    "nan bandwidth": (HEADER + device_table(bandwidth_mbps="nan"), "device 'cpu-2': bandwidth_mbps must be finite"),
    "text bandwidth": (
        HEADER + device_table(bandwidth_mbps='"fast"'),
        "device 'cpu-2': bandwidth_mbps must be a number",
    ),
    "zero batch": (HEADER + device_table(batch_size=0), "device 'cpu-2': batch_size must be >= 1, got 0"),
    "fractional batch": (HEADER + device_table(batch_size=2.5), "device 'cpu-2': batch_size must be an integer"),
    "bool batch": (HEADER + device_table(batch_size="true"), "device 'cpu-2': batch_size must be an integer"),
    "negative batch time": (HEADER + device_table(batch_time_s=-1), "device 'cpu-2': batch_time_s must be > 0"),
    "infinite batch time": (HEADER + device_table(batch_time_s="inf"), "device 'cpu-2': batch_time_s must be finite"),
    "negative latency": (HEADER + device_table(latency_ms=-1), "device 'cpu-2': latency_ms must be >= 0"),
    "memory below fixed": (
        HEADER + device_table(memory_mb=100, fixed_memory_mb=200),
        "device 'cpu-2': memory_mb must exceed fixed_memory_mb",
    ),
    "memory below one sample": (
        HEADER + device_table(memory_mb=1000, fixed_memory_mb=900, activation_mb_per_sample=200),
        "device 'cpu-2': memory_mb 1000 leaves room for 0.5 samples",
    ),
    "negative activation": (
        HEADER + device_table(activation_mb_per_sample=-1),
        "device 'cpu-2': activation_mb_per_sample must be >= 0",
    ),
    "negative fixed memory": (
        HEADER + device_table(fixed_memory_mb=-1),
        "device 'cpu-2': fixed_memory_mb must be >= 0",
    ),
    "typo in a field": (HEADER + device_table(bandwith_mbps=10), "device 'cpu-2': unknown field 'bandwith_mbps'"),
    "missing batch size": (HEADER + device_table(batch_size=None), "device 'cpu-2': missing field 'batch_size'"),
    "missing bandwidth": (HEADER + device_table(bandwidth_mbps=None), "device 'cpu-2': missing field 'bandwidth_mbps'"),
    "missing batch time": (HEADER + device_table(batch_time_s=None), "device 'cpu-2': missing field 'batch_time_s'"),
    "missing name": (HEADER + device_table(name=None), "devices[0]: missing field 'name'"),
    "empty name": (HEADER + device_table(name='""'), "name must be a non-empty string"),
    "speed without base": (
        HEADER + device_table(batch_time_s=None, speed=2),
        "device 'cpu-2': speed needs a cluster-level base_batch_time_s",
    ),
    "speed and batch time": (HEADER + device_table(speed=2), "device 'cpu-2': give either batch_time_s or speed"),
    "zero speed": (
        "base_batch_time_s = 1\n" + HEADER + device_table(batch_time_s=None, speed=0),
        "device 'cpu-2': speed must be > 0",
    ),
    "duplicate names": (HEADER + device_table() + "\n" + device_table(), "device 'cpu-2': name must be unique"),
    "negative sample size": (
        "sample_bytes = -1\nmodel_bytes = 1\n" + device_table(),
        "cluster: sample_bytes must be >= 0, got -1",
    ),
    "missing model size": ("sample_bytes = 1\n" + device_table(), "cluster: missing field 'model_bytes'"),
    "zero dataset size": (HEADER + "dataset_size = 0\n" + device_table(), "cluster: dataset_size must be >= 1"),
    "unknown top-level field": (HEADER + "epochs = 3\n" + device_table(), "cluster: unknown field 'epochs'"),
    "no devices": (HEADER, "devices: a cluster needs at least one"),
    "devices not tables": (HEADER + "devices = [1, 2]", "devices[0] must be a table"),
    "not toml": ("sample_bytes = = 3", "not valid TOML"),
}


@pytest.mark.parametrize("text, message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_field_raises_config_error_naming_field_and_device(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        ClusterSpec.from_toml(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        ClusterSpec.from_toml(tmp_path / "absent.toml")


def test_programmatic_construction_is_validated_too():
    with pytest.raises(ConfigError, match="device 'x': bandwidth_mbps must be > 0, got -5"):
        DeviceSpec(name="x", batch_size=1, batch_time_s=1.0, bandwidth_mbps=-5)
    with pytest.raises(ConfigError, match="devices: a cluster needs at least one device"):
        ClusterSpec(devices=(), sample_bytes=1, model_bytes=1)


def test_one_load_reports_every_bad_field_of_every_device(tmp_path):
    text = ("sample_bytes = -1\nmodel_bytes = 1\nbase_batch_time_s = 0\n"
            + device_table(batch_size=0, latency_ms=-2) + "\n"
            + device_table(name='"gpu-1"', bandwidth_mbps=None, batch_time_s=None, speed=2, colour='"red"'))
    with pytest.raises(ConfigError) as error:
        ClusterSpec.from_toml(write(tmp_path, text))
    message = str(error.value)
    for problem in ("cluster: sample_bytes must be >= 0, got -1",
                    "cluster: base_batch_time_s must be > 0, got 0",
                    "device 'cpu-2': batch_size must be >= 1, got 0",
                    "device 'cpu-2': latency_ms must be >= 0, got -2",
                    "device 'gpu-1': unknown field 'colour'",
                    "device 'gpu-1': missing field 'bandwidth_mbps'"):
        assert problem in message
    assert message.count(";") == 5 and "\n" not in message
