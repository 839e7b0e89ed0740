"""Cluster descriptions for the C-ADP planner: devices, their links from the data owner, sample and model size.

A cluster file is TOML; every field is checked on load, and one ConfigError
names every bad field with its device, so a typo never reaches the solver and
one run shows all the fixes a file needs.
"""

from __future__ import annotations

import json
import math
import numbers
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hetdp.errors import ConfigError

_MEGABIT = 1e6
"""Bits per megabit: bandwidths are in megabits per second (1 Gb/s = 1000 Mb/s), as network links are quoted."""


@dataclass(kw_only=True, frozen=True)
class DeviceSpec:
    """One computing device and its link from the data owner (C-ADP paper, Table 1).

    Example TOML entry (``[[devices]]``):

    ```toml
    name = "gpu-0"
    batch_size = 64
    batch_time_s = 0.35          # or: speed = 4.0, with a cluster-level base_batch_time_s
    bandwidth_mbps = 1000        # `inf` for the data owner itself
    latency_ms = 5
    memory_mb = 24000
    fixed_memory_mb = 2500
    activation_mb_per_sample = 200
    ```
    """

    name: str
    """Unique device name, used in plans and error messages."""
    batch_size: int
    """batchsize(i): samples per local batch (>= 1)."""
    batch_time_s: float
    """T_i^batch: seconds for one batch of ``batch_size`` samples, forward and backward (> 0)."""
    bandwidth_mbps: float
    """B_0i: bandwidth of the link from the data owner, megabits per second (> 0; ``math.inf`` for the owner)."""
    latency_ms: float = 0.0
    """alpha_0i: one-way latency of that link, milliseconds (>= 0)."""
    memory_mb: float | None = None
    """G_i: device memory in MB; None means no memory limit."""
    fixed_memory_mb: float = 0.0
    """S_m: memory taken regardless of the batch (model, optimizer state, runtime), MB (>= 0)."""
    activation_mb_per_sample: float = 0.0
    """Delta S_i: extra activation memory per sample of a batch, MB (>= 0)."""
    step_overhead_ms: float = 0.0
    """Milliseconds every training step costs whatever its batch (>= 0). Emulation and ``hetdp bench devices`` use
    it; the C-ADP planner does not."""
    knee: int = 0
    """Batch size at which throughput saturates (>= 0): a smaller forward costs as much as one of ``knee`` samples;
    ``batch_time_s`` is then measured at or above it. Emulation only, as ``step_overhead_ms``."""
    micro_overhead_ms: float = 0.0
    """Milliseconds each forward and backward (micro-batch) costs on top of its samples (>= 0). Emulation only."""

    def __post_init__(self) -> None:
        label = f"device {self.name!r}" if isinstance(self.name, str) else "device"
        problems = _device_problems(label, {field.name: getattr(self, field.name) for field in fields(self)})
        if not problems and self.memory_mb is not None:  # the memory figures are numbers: compare them
            if self.memory_mb <= self.fixed_memory_mb:
                problems.append(
                    f"{label}: memory_mb must exceed fixed_memory_mb ({self.fixed_memory_mb!r} MB), "
                    f"got {self.memory_mb!r}"
                )
            elif self.max_parallelism < 1:
                problems.append(
                    f"{label}: memory_mb {self.memory_mb!r} leaves room for {self.max_parallelism:.3g} samples "
                    f"(P_max, C-ADP eq. 3), fewer than one; raise memory_mb or lower activation_mb_per_sample"
                )
        _raise_all(problems)

    @property
    def max_parallelism(self) -> float:
        """P_max(i) = (G_i - S_m) / Delta S_i (C-ADP eq. 3); inf without a memory limit or activation memory."""
        if self.memory_mb is None or self.activation_mb_per_sample == 0:
            return math.inf
        return (self.memory_mb - self.fixed_memory_mb) / self.activation_mb_per_sample

    @property
    def feasible_batch_size(self) -> int:
        """The batch size the planner uses: ``batch_size`` clamped to floor(P_max) so that constraint (4) holds."""
        return self.batch_size if self.batch_size <= self.max_parallelism else math.floor(self.max_parallelism)

    @property
    def feasible_batch_time_s(self) -> float:
        """Seconds per batch of ``feasible_batch_size``: ``batch_time_s`` scaled by the batch ratio.

        When the batch size is clamped, per-sample time is assumed unchanged (time linear
        in the batch), the only assumption available without re-measuring the device.
        """
        return self.batch_time_s * self.feasible_batch_size / self.batch_size


@dataclass(kw_only=True, frozen=True)
class ClusterSpec:
    """A data owner (parameter server) and the devices it trains with (C-ADP paper, section 3).

    Example file:

    ```toml
    sample_bytes = 150_000         # b: bytes per sample (150 KB, an ImageNet image)
    model_bytes = 2.5e8            # M_m: bytes of model parameters
    dataset_size = 100_000         # optional: D, the default of `hetdp plan --dataset-size`
    base_batch_time_s = 1.2        # optional: seconds per batch at speed 1, for devices given by `speed`
    base_batch_size = 64           # optional: the batch size base_batch_time_s was measured at

    [[devices]]
    name = "gpu-0"
    batch_size = 64
    speed = 4.0
    bandwidth_mbps = 1000
    ```

    A device gives either ``batch_time_s`` or ``speed``. With ``speed``,
    ``batch_time_s = base_batch_time_s / speed``, scaled by ``batch_size /
    base_batch_size`` when ``base_batch_size`` is given (same per-sample cost).
    """

    devices: tuple[DeviceSpec, ...]
    """The computing devices, in rank order (rank i + 1 is ``devices[i]`` when rank 0 is the data owner)."""
    sample_bytes: float
    """b: bytes per training sample (>= 0; 0 when devices share storage and only indices travel)."""
    model_bytes: float
    """M_m: bytes of model parameters, sent to and from every device once per epoch (>= 0)."""
    dataset_size: int | None = None
    """Optional D, training samples the cluster is planned for: the default of ``hetdp plan --dataset-size``."""

    def __post_init__(self) -> None:
        devices = tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        problems = [] if devices else ["devices: a cluster needs at least one device"]
        for index, device in enumerate(devices):
            if not isinstance(device, DeviceSpec):
                problems.append(f"devices[{index}] must be a DeviceSpec, got {type(device).__name__}")
        names = [device.name for device in devices if isinstance(device, DeviceSpec)]
        for name in sorted({name for name in names if names.count(name) > 1}):
            problems.append(f"device {name!r}: name must be unique, it appears {names.count(name)} times")
        problems += _cluster_problems({"sample_bytes": self.sample_bytes, "model_bytes": self.model_bytes,
                                       "dataset_size": self.dataset_size})
        _raise_all(problems)

    @property
    def names(self) -> list[str]:
        return [device.name for device in self.devices]

    def send_s_per_sample(self, device: DeviceSpec) -> float:
        """Seconds to send one sample to ``device``: b / B_0i (C-ADP eq. 2 per sample)."""
        return 8.0 * self.sample_bytes / (device.bandwidth_mbps * _MEGABIT)

    def comm_s(self, device: DeviceSpec) -> float:
        """Per-epoch parameter exchange with ``device``: 2 (alpha_0i + M_m / B_0i) (C-ADP eq. 6)."""
        return 2.0 * (device.latency_ms / 1000.0 + 8.0 * self.model_bytes / (device.bandwidth_mbps * _MEGABIT))

    @classmethod
    def from_toml(cls, path: str | Path) -> ClusterSpec:
        """Load and validate a cluster file.

        Raises:
            ConfigError: the file is missing or not TOML, or a field is missing, unknown
                or out of range; the message names the file, the device and the field.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read cluster file {str(path)!r}: {error.strerror or error}") from error
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: not valid TOML: {error}") from error
        try:
            return cls.from_dict(data)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from error

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Build from the parsed TOML structure (top-level keys and a ``devices`` list of tables).

        Raises:
            ConfigError: every bad field at once, ``; ``-separated, each with its device.
        """
        problems = _field_problems("cluster", data, allowed=_CLUSTER_KEYS, required=("sample_bytes", "model_bytes"))
        problems += _cluster_problems(data)
        base_time, base_size = data.get("base_batch_time_s"), data.get("base_batch_size")
        if _number_problem("cluster", "base_batch_time_s", base_time, positive=True):
            base_time = 1.0  # reported above; a stand-in lets the devices given by speed be checked too
        entries = data.get("devices")
        devices = []
        if not isinstance(entries, list) or not entries:
            problems.append("devices: a cluster needs at least one [[devices]] table")
        else:
            for index, entry in enumerate(entries):
                try:
                    devices.append(_device_from_dict(entry, index, base_time, base_size, "base_batch_time_s" in data))
                except ConfigError as error:
                    problems.append(str(error))
        _raise_all(problems)
        return cls(
            devices=tuple(devices),
            sample_bytes=data["sample_bytes"],
            model_bytes=data["model_bytes"],
            dataset_size=data.get("dataset_size"),
        )

    def to_toml(self) -> str:
        """Render as a cluster file that ``from_toml`` reads back to an equal ClusterSpec."""
        lines = [
            "# hetdp cluster description (C-ADP): devices and their links from the data owner.",
            f"sample_bytes = {_toml_value(self.sample_bytes)}",
            f"model_bytes = {_toml_value(self.model_bytes)}",
        ]
        if self.dataset_size is not None:
            lines.append(f"dataset_size = {self.dataset_size}")
        for device in self.devices:
            lines += ["", "[[devices]]"]
            for field in fields(DeviceSpec):
                value = getattr(device, field.name)
                if value is not None:
                    lines.append(f"{field.name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


_CLUSTER_KEYS = frozenset(
    {"sample_bytes", "model_bytes", "dataset_size", "base_batch_time_s", "base_batch_size", "devices"}
)
_DEVICE_KEYS = frozenset(field.name for field in fields(DeviceSpec)) | {"speed"}


def _device_from_dict(
    entry: Any, index: int, base_time: float | None, base_size: Any, base_given: bool
) -> DeviceSpec:
    """One ``[[devices]]`` table as a DeviceSpec; raises one ConfigError naming every bad field of it."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"devices[{index}] must be a table, got {entry!r}")
    name = entry.get("name")
    label = f"device {name!r}" if isinstance(name, str) and name else f"devices[{index}]"
    problems = _field_problems(label, entry, allowed=_DEVICE_KEYS, required=("name", "batch_size", "bandwidth_mbps"))
    problems += _device_problems(label, entry)
    values = {key: value for key, value in entry.items() if key != "speed"}
    if "speed" in entry:
        if "batch_time_s" in entry:
            problems.append(f"{label}: give either batch_time_s or speed, not both")
        problems += filter(None, [_number_problem(label, "speed", entry["speed"], positive=True)])
        if not base_given:
            problems.append(f"{label}: speed needs a cluster-level base_batch_time_s (or give batch_time_s)")
        if not problems and base_time is not None:
            scale = entry["batch_size"] / base_size if isinstance(base_size, int) and base_size >= 1 else 1.0
            values["batch_time_s"] = base_time * scale / entry["speed"]
    elif "batch_time_s" not in entry:
        problems.append(f"{label}: missing field 'batch_time_s' (or 'speed')")
    _raise_all(problems)
    return DeviceSpec(**values)


def _device_problems(label: str, values: Mapping[str, Any]) -> list[str]:
    """What is wrong with each device field present in ``values`` (the memory comparisons aside)."""
    problems = []
    if "name" in values and (not isinstance(values["name"], str) or not values["name"].strip()):
        problems.append(f"{label}: name must be a non-empty string, got {values['name']!r}")
    if "batch_size" in values:
        problems.append(_int_problem(label, "batch_size", values["batch_size"], minimum=1))
    if "knee" in values:
        problems.append(_int_problem(label, "knee", values["knee"], minimum=0))
    for key, positive, allow_inf in _DEVICE_NUMBERS:
        if values.get(key) is not None:
            problems.append(_number_problem(label, key, values[key], positive=positive, allow_inf=allow_inf))
    return [problem for problem in problems if problem]


_DEVICE_NUMBERS = (
    ("batch_time_s", True, False),
    ("bandwidth_mbps", True, True),
    ("latency_ms", False, False),
    ("memory_mb", True, False),
    ("fixed_memory_mb", False, False),
    ("activation_mb_per_sample", False, False),
    ("step_overhead_ms", False, False),
    ("micro_overhead_ms", False, False),
)
"""(field, must be > 0, may be inf) for each numeric device field."""


def _cluster_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with each top-level field present in ``values``."""
    problems = [_number_problem("cluster", key, values[key]) for key in ("sample_bytes", "model_bytes") if key in values]
    problems.append(_number_problem("cluster", "base_batch_time_s", values.get("base_batch_time_s"), positive=True))
    for key in ("dataset_size", "base_batch_size"):
        if values.get(key) is not None:
            problems.append(_int_problem("cluster", key, values[key], minimum=1))
    return [problem for problem in problems if problem]


def _field_problems(label: str, data: Mapping[str, Any], *, allowed: frozenset[str], required: Sequence[str]) -> list[str]:
    """Every unknown field and every missing required one, naming ``label``."""
    problems = [
        f"{label}: unknown field {key!r} (allowed: {', '.join(sorted(allowed))})" for key in sorted(set(data) - allowed)
    ]
    return problems + [f"{label}: missing field {key!r}" for key in required if key not in data]


def _int_problem(label: str, key: str, value: Any, *, minimum: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return f"{label}: {key} must be an integer, got {value!r}"
    if value < minimum:
        return f"{label}: {key} must be >= {minimum}, got {value!r}"
    return None


def _number_problem(
    label: str, key: str, value: Any, *, positive: bool = False, allow_inf: bool = False
) -> str | None:
    """What is wrong with a numeric field; None for a good value, and for None (an optional field left out)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{label}: {key} must be a number, got {value!r}"
    if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        return f"{label}: {key} must be finite, got {value!r}"
    if positive and not value > 0:
        return f"{label}: {key} must be > 0, got {value!r}"
    if not positive and value < 0:
        return f"{label}: {key} must be >= 0, got {value!r}"
    return None


def _raise_all(problems: Sequence[str]) -> None:
    """One ConfigError for every problem found, on one line."""
    if problems:
        raise ConfigError("; ".join(problems))


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, numbers.Integral):
        return str(int(value))
    value = float(value)
    return "inf" if math.isinf(value) else repr(value)
