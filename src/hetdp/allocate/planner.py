"""The C-ADP planner: how many samples each device receives, and the predicted send, epoch and total time.

``plan`` picks a solver (``exact``: integer-optimal, ``alm``: the paper's Algorithm 1)
and returns a ``Plan``; ``evaluate`` prices any given allocation with the
same cost model (eqs. (2)-(7) of the C-ADP paper, see ``hetdp.allocate.cost``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import numpy as np

from hetdp.allocate.alm import AlmConfig, solve_alm
from hetdp.allocate.cost import CostModel
from hetdp.allocate.exact import ExactConfig, solve_exact
from hetdp.cluster.spec import ClusterSpec
from hetdp.errors import ConfigError

METHODS = ("exact", "alm")
"""The solvers ``plan`` accepts."""


@dataclass(frozen=True)
class DevicePlan:
    """One device's share of the dataset and its predicted times."""

    name: str
    samples: int
    """D_i: samples this device receives, once, and trains on every epoch."""
    batch_size: int
    """Local batch size, <= P_max (constraint (4)); smaller than configured when memory forced it."""
    batches: int
    """ceil(D_i / batch_size): local steps per epoch."""
    send_s: float
    """T_send,i: seconds to receive the samples (eq. 2)."""
    compute_s: float
    """T_comp,i: seconds of computation per epoch (eq. 5)."""
    comm_s: float
    """T_comm,i: seconds of parameter exchange per epoch (eq. 6)."""

    @property
    def epoch_s(self) -> float:
        """compute_s + comm_s: this device's time for one epoch."""
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class Plan:
    """An allocation of the dataset over a cluster with its predicted times (C-ADP eq. (7)).

    ``gap`` is the relative optimality gap ``(total_s - lower_bound_s) / total_s``, where
    ``lower_bound_s`` is a proven lower bound on the optimal ``total_s`` of this problem:
    for ``exact`` the bound its search proved (gap 0 when it proved optimality), for
    ``alm`` the exact solver's optimum (so the gap is the ALM's distance to optimal),
    and ``nan`` for ``evaluate``, which does not solve anything.
    """

    method: str
    devices: tuple[DevicePlan, ...]
    epochs: int
    send_s: float
    """T_send = max_i T_send,i: seconds until every device holds its data."""
    epoch_s: float
    """max_i (T_comp,i + T_comm,i): seconds per epoch."""
    total_s: float
    """send_s + epochs * epoch_s: the eq. (7) objective."""
    gap: float
    """(total_s - lower_bound_s) / total_s; 0 means proved optimal, nan means not computed."""
    lower_bound_s: float = math.nan
    """A proven lower bound on the optimal total_s (nan when not computed)."""

    @property
    def samples(self) -> list[int]:
        return [device.samples for device in self.devices]

    @property
    def batch_sizes(self) -> list[int]:
        return [device.batch_size for device in self.devices]

    @property
    def dataset_size(self) -> int:
        return sum(self.samples)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (nan becomes None), devices as a list of dicts."""
        result: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "devices":
                value = [asdict(device) for device in value]
            elif isinstance(value, float) and math.isnan(value):
                value = None
            result[field.name] = value
        return result


def evaluate(cluster: ClusterSpec, samples: Sequence[int], epochs: int) -> Plan:
    """Price a given allocation (for example an equal split) with the eqs. (2)-(7) cost model.

    Raises:
        ConfigError: ``samples`` does not give one non-negative integer per device, or ``epochs < 1``.
    """
    _check_epochs(epochs)
    model = CostModel.from_cluster(cluster)
    counts = _check_samples(samples, model)
    _warn_clamped(cluster)
    return _make_plan(model, counts, epochs, method="given", lower_bound_s=math.nan)


def plan(
    cluster: ClusterSpec,
    dataset_size: int,
    epochs: int,
    method: Literal["exact", "alm"] = "exact",
    **options: Any,
) -> Plan:
    """Choose how many samples each device receives so that eq. (7)'s total time is least.

    Args:
        cluster: the devices and their links.
        dataset_size: D, samples to distribute (every sample goes to exactly one device).
        epochs: num, epochs of local training, each followed by a weighted merge.
        method: ``"exact"`` (an integer-optimal search) or ``"alm"`` (the paper's
            Algorithm 1, an augmented Lagrangian method).
        **options: ``min_samples`` (int, default 0: samples every device must receive; a
            device may otherwise get none and only take part in the merge), or any setting
            of the method's solver by name (e.g. ``p=200`` for ALM).

    Returns:
        The plan; ``plan.samples`` sums to ``dataset_size``.

    Raises:
        ConfigError: a bad argument or option, or an infeasible problem (``dataset_size <
            min_samples * devices``).

    A configured batch size above P_max (eq. (3)) is clamped to floor(P_max), with its
    batch time scaled in proportion and a warning; a device whose memory cannot hold
    one sample is rejected when the cluster is built.
    """
    if method not in METHODS:
        raise ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    _check_epochs(epochs)
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, (int, np.integer)) or dataset_size < 1:
        raise ConfigError(f"dataset_size must be a positive integer, got {dataset_size!r}")
    dataset_size = int(dataset_size)
    min_samples = options.pop("min_samples", 0)
    if isinstance(min_samples, bool) or not isinstance(min_samples, (int, np.integer)) or min_samples < 0:
        raise ConfigError(f"min_samples must be a non-negative integer, got {min_samples!r}")
    model = CostModel.from_cluster(cluster)
    if dataset_size < min_samples * model.size:
        raise ConfigError(
            f"dataset_size {dataset_size} is too small to give each of {model.size} devices "
            f"min_samples={min_samples}; lower min_samples or use fewer devices"
        )
    _warn_clamped(cluster)

    exact_config = _config(ExactConfig, options if method == "exact" else {})
    exact = solve_exact(model, dataset_size, epochs, min_samples=int(min_samples), config=exact_config)
    if method == "exact":
        return _make_plan(model, exact.samples, epochs, method="exact", lower_bound_s=exact.lower_bound_s)
    alm_config = _config(AlmConfig, options)
    alm_samples = solve_alm(model, dataset_size, epochs, min_samples=int(min_samples), config=alm_config)
    return _make_plan(model, alm_samples, epochs, method="alm", lower_bound_s=exact.lower_bound_s)


def _config(kind: type, options: dict[str, Any]) -> Any:
    """Build ``kind`` from ``config=`` or from its field names; any other option is an error."""
    options = dict(options)
    config = options.pop("config", None)
    names = {field.name for field in fields(kind)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; {kind.__name__} takes: {', '.join(sorted(names))}")
    if config is not None:
        if not isinstance(config, kind):
            raise ConfigError(f"config must be a {kind.__name__}, got {type(config).__name__}")
        return replace(config, **options) if options else config
    return kind(**options)


def _make_plan(model: CostModel, samples: np.ndarray, epochs: int, *, method: str, lower_bound_s: float) -> Plan:
    samples = np.asarray(samples, dtype=np.int64)
    send = model.send_s(samples)
    compute = model.compute_s(samples)
    batches = model.batches(samples)
    devices = tuple(
        DevicePlan(
            name=model.names[i],
            samples=int(samples[i]),
            batch_size=int(model.batch_size[i]),
            batches=int(batches[i]),
            send_s=float(send[i]),
            compute_s=float(compute[i]),
            comm_s=float(model.comm_s[i]),
        )
        for i in range(model.size)
    )
    send_s = float(send.max())
    epoch_s = float((compute + model.comm_s).max())
    total_s = send_s + epochs * epoch_s
    if math.isnan(lower_bound_s):
        gap = math.nan
    else:
        # Clip float noise: a bound a few ulps above the plan's own total is the same value.
        gap = max(0.0, (total_s - lower_bound_s) / total_s) if total_s > 0 else 0.0
        if gap < 1e-12:
            gap = 0.0
    return Plan(
        method=method,
        devices=devices,
        epochs=epochs,
        send_s=send_s,
        epoch_s=epoch_s,
        total_s=total_s,
        gap=gap,
        lower_bound_s=min(lower_bound_s, total_s) if not math.isnan(lower_bound_s) else math.nan,
    )


def _check_epochs(epochs: Any) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
        raise ConfigError(f"epochs must be a positive integer, got {epochs!r}")


def _check_samples(samples: Sequence[int], model: CostModel) -> np.ndarray:
    values = list(samples)
    if len(values) != model.size:
        raise ConfigError(f"samples gives {len(values)} values for {model.size} devices; give one per device")
    for name, value in zip(model.names, values):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"device {name!r}: samples must be a non-negative integer, got {value!r}")
    return np.array(values, dtype=np.int64)


def _warn_clamped(cluster: ClusterSpec) -> None:
    clamped = [d for d in cluster.devices if d.feasible_batch_size < d.batch_size]
    if clamped:
        detail = ", ".join(f"{d.name!r} {d.batch_size} -> {d.feasible_batch_size}" for d in clamped)
        warnings.warn(
            f"batch size above the memory limit P_max (C-ADP eq. 4), clamped: {detail}", UserWarning, stacklevel=3
        )
