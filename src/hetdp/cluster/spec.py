"""Cluster descriptions for the C-ADP planner: devices, their links from the data owner, sample and model size.

A cluster file is TOML; every field is checked on load and a bad one raises a
ConfigError that names the field and the device, so a typo never reaches the solver.
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

    Example TOML entry (``[[devices]]``)::

        name = "gpu-0"
        batch_size = 64
        batch_time_s = 0.35          # or: speed = 4.0, with a cluster-level base_batch_time_s
        bandwidth_mbps = 1000        # `inf` for the data owner itself
        latency_ms = 5
        memory_mb = 24000
        fixed_memory_mb = 2500
        activation_mb_per_sample = 200
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
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"{label}: name must be a non-empty string, got {self.name!r}")
        _check_int(label, "batch_size", self.batch_size, minimum=1)
        _check_number(label, "batch_time_s", self.batch_time_s, positive=True)
        _check_number(label, "bandwidth_mbps", self.bandwidth_mbps, positive=True, allow_inf=True)
        _check_number(label, "latency_ms", self.latency_ms)
        _check_number(label, "fixed_memory_mb", self.fixed_memory_mb)
        _check_number(label, "activation_mb_per_sample", self.activation_mb_per_sample)
        _check_number(label, "step_overhead_ms", self.step_overhead_ms)
        _check_int(label, "knee", self.knee, minimum=0)
        _check_number(label, "micro_overhead_ms", self.micro_overhead_ms)
        if self.memory_mb is not None:
            _check_number(label, "memory_mb", self.memory_mb, positive=True)
            if self.memory_mb <= self.fixed_memory_mb:
                raise ConfigError(
                    f"{label}: memory_mb must exceed fixed_memory_mb ({self.fixed_memory_mb!r} MB), "
                    f"got {self.memory_mb!r}"
                )
            if self.max_parallelism < 1:
                raise ConfigError(
                    f"{label}: memory_mb {self.memory_mb!r} leaves room for {self.max_parallelism:.3g} samples "
                    f"(P_max, C-ADP eq. 3), fewer than one; raise memory_mb or lower activation_mb_per_sample"
                )

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

    Example file::

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
        if not devices:
            raise ConfigError("devices: a cluster needs at least one device")
        for index, device in enumerate(devices):
            if not isinstance(device, DeviceSpec):
                raise ConfigError(f"devices[{index}] must be a DeviceSpec, got {type(device).__name__}")
        seen: set[str] = set()
        for device in devices:
            if device.name in seen:
                raise ConfigError(f"device {device.name!r}: name must be unique, it appears twice")
            seen.add(device.name)
        _check_number("cluster", "sample_bytes", self.sample_bytes)
        _check_number("cluster", "model_bytes", self.model_bytes)
        if self.dataset_size is not None:
            _check_int("cluster", "dataset_size", self.dataset_size, minimum=1)

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
        """Build from the parsed TOML structure (top-level keys and a ``devices`` list of tables)."""
        _check_fields("cluster", data, allowed=_CLUSTER_KEYS, required=("sample_bytes", "model_bytes"))
        base_time = data.get("base_batch_time_s")
        base_size = data.get("base_batch_size")
        if base_time is not None:
            _check_number("cluster", "base_batch_time_s", base_time, positive=True)
        if base_size is not None:
            _check_int("cluster", "base_batch_size", base_size, minimum=1)
        entries = data.get("devices")
        if not isinstance(entries, list) or not entries:
            raise ConfigError("devices: a cluster needs at least one [[devices]] table")
        devices = []
        for index, entry in enumerate(entries):
            devices.append(_device_from_dict(entry, index, base_time, base_size))
        return cls(
            devices=tuple(devices),
            sample_bytes=data["sample_bytes"],
            model_bytes=data["model_bytes"],
            dataset_size=data.get("dataset_size"),
        )

    def to_toml(self) -> str:
        """Render as a cluster file that :meth:`from_toml` reads back to an equal ClusterSpec."""
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
    entry: Any, index: int, base_time: float | None, base_size: int | None
) -> DeviceSpec:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"devices[{index}] must be a table, got {entry!r}")
    name = entry.get("name")
    label = f"device {name!r}" if isinstance(name, str) and name else f"devices[{index}]"
    if "name" not in entry:
        raise ConfigError(f"{label}: missing field 'name'")
    _check_fields(label, entry, allowed=_DEVICE_KEYS, required=("batch_size", "bandwidth_mbps"))
    values = {key: value for key, value in entry.items() if key != "speed"}
    if "speed" in entry:
        if "batch_time_s" in entry:
            raise ConfigError(f"{label}: give either batch_time_s or speed, not both")
        speed = entry["speed"]
        _check_number(label, "speed", speed, positive=True)
        if base_time is None:
            raise ConfigError(f"{label}: speed needs a cluster-level base_batch_time_s (or give batch_time_s)")
        _check_int(label, "batch_size", entry["batch_size"], minimum=1)
        scale = entry["batch_size"] / base_size if base_size is not None else 1.0
        values["batch_time_s"] = base_time * scale / speed
    elif "batch_time_s" not in entry:
        raise ConfigError(f"{label}: missing field 'batch_time_s' (or 'speed')")
    return DeviceSpec(**values)


def _check_fields(label: str, data: Mapping[str, Any], *, allowed: frozenset[str], required: Sequence[str]) -> None:
    """Reject the first unknown field, then the first missing required one, naming ``label``."""
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ConfigError(f"{label}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    for key in required:
        if key not in data:
            raise ConfigError(f"{label}: missing field {key!r}")


def _check_int(label: str, key: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{label}: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{label}: {key} must be >= {minimum}, got {value!r}")


def _check_number(label: str, key: str, value: Any, *, positive: bool = False, allow_inf: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{label}: {key} must be a number, got {value!r}")
    if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        raise ConfigError(f"{label}: {key} must be finite, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{label}: {key} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ConfigError(f"{label}: {key} must be >= 0, got {value!r}")


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, numbers.Integral):
        return str(int(value))
    value = float(value)
    return "inf" if math.isinf(value) else repr(value)
