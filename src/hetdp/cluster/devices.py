"""Device models for emulation: what a real accelerator's step costs beyond ``samples x cost / speed``.

A GPU has a fixed cost per step, its throughput rises with the batch up to a
knee, and its memory caps one forward, so a larger share runs as several
micro-batches, each with its own overhead. A step's time is then not a smooth
function of the share: it jumps where one more sample needs one more micro-batch.
The models come from per-rank flags or from a device table (a cluster file,
``ClusterSpec``, whose link fields may be left out).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class DeviceModel:
    """How one rank's step time grows with its share, on top of its per-sample cost.

    A step of ``s`` samples run as ``n`` near-equal micro-batches ``b_1..b_n`` takes
    ``step_overhead_ms + sum_k (micro_overhead_ms + max(b_k, knee) * sample_ms)``,
    where ``n`` is at least ``ceil(s / max_batch)``.
    """

    step_overhead_ms: float = 0.0
    """Milliseconds every step costs whatever its share (kernel launches, host work, the optimizer step)."""
    knee: int = 0
    """Batch size at which throughput saturates: a forward of fewer samples costs as much as one of ``knee``
    (0: none, time linear from the first sample)."""
    max_batch: int | None = None
    """Memory cap: the most samples one forward may hold; a larger share runs as micro-batches. None: no cap."""
    micro_overhead_ms: float = 0.0
    """Milliseconds each forward and backward (micro-batch) costs on top of its samples."""
    memory_mb: float | None = None
    """The device's memory in MB (the device table's ``memory_mb``; None: unlimited). ``max_batch`` is what it leaves
    a replica (``hetdp.DDP``); the sharded drop-in (``hetdp.fully_shard``) caps a share by what it leaves once the
    rank's shard of the model's state is placed."""
    fixed_memory_mb: float = 0.0
    """MB the device holds whatever the batch, beside the model's state (runtime, workspace): the sharded drop-in's
    reading of the table's ``fixed_memory_mb``, to which it adds the shard it measured."""
    activation_mb_per_sample: float = 0.0
    """MB of activations one more sample holds (the table's); 0: the sharded drop-in probes the model's own."""

    def __post_init__(self) -> None:
        for name in ("step_overhead_ms", "micro_overhead_ms"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a number of milliseconds >= 0, got {value!r}")
        for name in ("fixed_memory_mb", "activation_mb_per_sample"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a number of MB >= 0, got {value!r}")
        if self.memory_mb is not None and not (isinstance(self.memory_mb, int | float) and self.memory_mb > 0):
            raise ConfigError(f"memory_mb must be a number of MB > 0 (or None: unlimited), got {self.memory_mb!r}")
        if isinstance(self.knee, bool) or not isinstance(self.knee, int) or self.knee < 0:
            raise ConfigError(f"knee must be an integer >= 0 samples, got {self.knee!r}")
        if self.max_batch is not None and (
                isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1):
            raise ConfigError(f"max_batch must be an integer >= 1 sample (or None: no cap), got {self.max_batch!r}")

    def forwards(self, samples: float) -> int:
        """The fewest micro-batches that hold ``samples`` under the memory cap (at least one)."""
        return max(1, math.ceil(samples / self.max_batch)) if self.max_batch else 1

    def step_ms(self, samples: float, sample_ms: float, forwards: int | None = None) -> float:
        """Milliseconds of a step of ``samples`` at ``sample_ms`` per sample, run as ``forwards`` micro-batches.

        ``forwards`` below what the cap needs (a loop that ran more than ``max_batch`` in one forward, which a
        real device would not survive) is priced as the cap's count; None prices the cap's count.
        """
        count = max(forwards or 1, self.forwards(samples))
        padded = sum(max(piece, self.knee) for piece in micro_batches(samples, count))
        return self.step_overhead_ms + count * self.micro_overhead_ms + padded * sample_ms


def micro_batches(samples: float, count: int) -> list[float]:
    """``samples`` split into ``count`` near-equal micro-batches (whole samples differ by at most one).

    Near-equal, not full ones and a remainder: a small remainder would run below a
    device's knee and cost as much as a full micro-batch.
    """
    if count < 1:
        raise ConfigError(f"a step needs at least one micro-batch, got {count}")
    if samples != int(samples):  # work measured in cost units, not whole samples
        return [samples / count] * count
    whole, extra = divmod(int(samples), count)
    return [whole + (1 if k < extra else 0) for k in range(count)]


def parse_per_rank(text: str, flag: str, nproc: int | None, *, integer: bool = False) -> tuple[float, ...]:
    """Parse ``"0,0,20,80"``: one number >= 0 per rank (integers with ``integer``).

    Raises:
        ConfigError: a value is not a number >= 0 (or not an integer), or the count differs from ``nproc``.
    """
    values: list[float] = []
    for rank, item in enumerate(text.split(",")):
        try:
            value = int(item) if integer else float(item)
        except ValueError:
            value = -1
        if not (math.isfinite(value) and value >= 0):
            kind = "integers" if integer else "numbers"
            raise ConfigError(f"{flag} must be {kind} >= 0, got {item.strip()!r} (rank {rank})")
        values.append(value)
    if nproc is not None and len(values) != nproc:
        raise ConfigError(f"{flag} gives {len(values)} values for {nproc} processes; give one per process")
    return tuple(values)


def device_models_from_flags(nproc: int, *, step_overhead_ms: str | None = None, knee: str | None = None,
                             max_batch: str | None = None, micro_overhead_ms: str | None = None
                             ) -> tuple[DeviceModel, ...] | None:
    """Device models from per-rank flag values (``--step-overhead-ms 0,0,20,80`` ...); None if no flag is given.

    A ``max_batch`` of 0 means no cap for that rank.
    """
    if all(value is None for value in (step_overhead_ms, knee, max_batch, micro_overhead_ms)):
        return None
    zeros = (0,) * nproc
    overheads = parse_per_rank(step_overhead_ms, "--step-overhead-ms", nproc) if step_overhead_ms else zeros
    knees = parse_per_rank(knee, "--knee", nproc, integer=True) if knee else zeros
    caps = parse_per_rank(max_batch, "--max-batch", nproc, integer=True) if max_batch else zeros
    micro = parse_per_rank(micro_overhead_ms, "--micro-overhead-ms", nproc) if micro_overhead_ms else zeros
    return tuple(DeviceModel(step_overhead_ms=float(o), knee=int(k), max_batch=int(c) or None,
                             micro_overhead_ms=float(m)) for o, k, c, m in zip(overheads, knees, caps, micro))


def read_device_table(path: str | Path) -> ClusterSpec:
    """Load a device table: a cluster file (``ClusterSpec``) whose link fields may be left out.

    ``sample_bytes`` and ``model_bytes`` default to 0 and each device's
    ``bandwidth_mbps`` to ``inf``: emulating compute needs no network.

    Raises:
        ConfigError: the file is missing, not TOML, or a field is bad (named with its device).
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read device table {str(path)!r}: {error.strerror or error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from error
    return device_table(data, label=str(path))


def device_table(data: dict, *, label: str = "device table") -> ClusterSpec:
    """A device table from its parsed TOML structure (see ``read_device_table``)."""
    data = {"sample_bytes": 0, "model_bytes": 0, **data}
    devices = data.get("devices")
    if isinstance(devices, list):
        data["devices"] = [{"bandwidth_mbps": math.inf, **entry} if isinstance(entry, dict) else entry
                           for entry in devices]
    try:
        return ClusterSpec.from_dict(data)
    except ConfigError as error:
        raise ConfigError(f"{label}: {error}") from error


def device_model(device: DeviceSpec) -> DeviceModel:
    """The emulation model of one device: its overheads, knee, and memory cap floor(P_max) (C-ADP eq. 3)."""
    cap = device.max_parallelism
    return DeviceModel(step_overhead_ms=device.step_overhead_ms, knee=device.knee,
                       max_batch=None if math.isinf(cap) else math.floor(cap),
                       micro_overhead_ms=device.micro_overhead_ms, memory_mb=device.memory_mb,
                       fixed_memory_mb=device.fixed_memory_mb,
                       activation_mb_per_sample=device.activation_mb_per_sample)


def per_sample_ms(cluster: ClusterSpec) -> list[float]:
    """Each device's milliseconds per sample at full throughput: ``batch_time_s / batch_size``."""
    return [1000.0 * device.batch_time_s / device.batch_size for device in cluster.devices]
