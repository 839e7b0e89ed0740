"""C-ADP training: the data owner plans and delivers each device's data once, devices train locally, models merge.

C-ADP paper, section 3: rank 0, the data owner and parameter server, chooses
D_1..D_N (eq. 7, :func:`hetdp.plan`), sends device i its D_i samples, and every
epoch each device trains on its own samples with its own batch size before the
models merge as w = sum_i (D_i / D) w_i. The run reports the paper's T_send,
T_train and T_total beside the plan's prediction.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from hetdp.allocate.apportion import apportion
from hetdp.allocate.planner import Plan, evaluate
from hetdp.allocate.planner import plan as make_plan
from hetdp.cluster.emulate import Link
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.errors import ConfigError, HetDPError
from hetdp.runtime import Timeouts, barrier, global_rank, local_device
from hetdp.sync.averaging import broadcast_parameters, merge_weights
from hetdp.train.distribute import Transport, distribute
from hetdp.train.local import EpochStats, GradientAllreduce, LossFn, Merge, ParameterAveraging, train_local

log = logging.getLogger(__name__)

INDEX_BYTES = 8
"""Bytes per sample on the wire when only indices travel (int64)."""


@dataclass(kw_only=True, frozen=True)
class CadpConfig:
    """How a C-ADP run allocates, delivers, trains and merges."""

    epochs: int = 10
    """num: epochs of local training, each ending in a merge."""
    allocation: Literal["planned", "equal"] = "planned"
    """planned: the C-ADP optimizer chooses D_i (eq. 7); equal: D / N each (local SGD, DDP)."""
    method: Literal["exact", "alm"] = "exact"
    """Solver of the planned allocation: integer-optimal search, or the paper's Algorithm 1."""
    sync: Literal["epoch", "step"] = "epoch"
    """epoch: weighted parameter averaging after each epoch (C-ADP); step: gradient allreduce every step (DDP)."""
    transport: Transport = "samples"
    """samples: the owner sends the samples; indices: every rank reads shared storage, only indices travel."""
    emulate: bool = False
    """Pace every batch to its device's batch_time_s and every transfer to its link, so that one machine
    behaves like the described cluster. Leave False on a real cluster."""
    seed: int = 0
    """Seed of the data partition and of each rank's per-epoch order."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Deadlines: the delivery may take ``round_s`` plus twice its planned time, a merge ``round_s`` plus twice
    the planned epoch; past them, PeerTimeoutError names the rank."""

    def __post_init__(self) -> None:
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ConfigError(f"epochs must be a positive integer, got {self.epochs!r}")
        choices = {"allocation": ("planned", "equal"), "method": ("exact", "alm"), "sync": ("epoch", "step")}
        choices["transport"] = ("samples", "indices")
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CadpResult:
    """What a C-ADP run did, with the paper's three times (Table 3), identical on every rank but ``samples``."""

    plan: Plan
    """The allocation every rank trained with, and its predicted times."""
    send_s: float
    """T_send: seconds until every device held its data."""
    train_s: float
    """T_train: seconds of training, merges included, from the end of the delivery to the last merge."""
    epochs: list[EpochStats]
    samples: int
    """Samples this rank trained on (D_i)."""

    @property
    def total_s(self) -> float:
        """T_total = T_send + T_train."""
        return self.send_s + self.train_s

    @property
    def prediction_error(self) -> float:
        """|T_total - predicted| / predicted, with the plan's eq. (7) prediction."""
        return abs(self.total_s - self.plan.total_s) / self.plan.total_s if self.plan.total_s > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "send_s": self.send_s,
            "train_s": self.train_s,
            "total_s": self.total_s,
            "predicted_send_s": self.plan.send_s,
            "predicted_total_s": self.plan.total_s,
            "prediction_error": self.prediction_error,
            "samples": self.plan.samples,
            "epoch_s": [stats.seconds for stats in self.epochs],
            "loss": [stats.loss for stats in self.epochs],
        }


def train_cadp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: TensorDataset | None,
    cluster: ClusterSpec,
    config: CadpConfig | None = None,
    *,
    plan: Plan | None = None,
    loss_fn: LossFn = nn.functional.cross_entropy,
    on_epoch: Callable[[EpochStats], None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> CadpResult:
    """Plan (on rank 0), deliver, train locally and merge for ``config.epochs`` epochs.

    Rank r trains as ``cluster.devices[r]`` when the group has one rank per device
    (rank 0, the data owner, trains too: give it ``bandwidth_mbps = inf``), or as
    ``cluster.devices[r - 1]`` when the group has one more rank, which then only
    owns the data and merges (the paper's parameter server).

    Args:
        model: the model, the same architecture on every rank; rank 0's parameters start everyone.
        optimizer: this rank's optimizer over ``model``'s parameters.
        dataset: the training set on rank 0; on other ranks None, unless ``transport`` is
            ``"indices"`` (shared storage), where every rank passes the same dataset.
        cluster: the devices, their links and the sizes b and M_m.
        config: allocation, merge, transport and emulation settings.
        plan: an allocation to use instead of planning (rank 0's is used everywhere).
        loss_fn: the training loss.
        on_epoch: called on every rank after each epoch's merge.
        group: the process group (None: the default group).

    .. warning::
        Collective: every rank of ``group`` calls it with the same cluster and config.

    Example::

        >>> # on every rank, under `hetdp run -n 4 train.py` or torchrun
        >>> hetdp.init_distributed()
        >>> cluster = hetdp.ClusterSpec.from_toml("cluster.toml")
        >>> train_set = hetdp.datasets.load_digits().train if dist.get_rank() == 0 else None
        >>> result = hetdp.train_cadp(model, optimizer, train_set, cluster, hetdp.CadpConfig(epochs=10))
        >>> result.send_s, result.train_s, result.plan.total_s

    Raises:
        ConfigError: the group does not match the cluster, or the plan does not match the dataset.
        PeerTimeoutError: a transfer or merge waited past its deadline.
    """
    config = config or CadpConfig()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    offset = world_size - len(cluster.devices)
    if offset not in (0, 1):
        raise ConfigError(
            f"the cluster has {len(cluster.devices)} devices but the group has {world_size} ranks; "
            f"launch one rank per device, or one more for a data owner that does not train"
        )
    timeout_s = config.timeouts.round_s
    plan = _owner_plan(dataset, cluster, config, plan, group)
    counts = [0] * offset + plan.samples
    devices: list[DeviceSpec | None] = [None] * offset + list(cluster.devices)
    device = devices[rank]
    sample_bytes = cluster.sample_bytes if config.transport == "samples" else INDEX_BYTES
    transfer_s = [_link_s(d, n * sample_bytes) if n else 0.0 for d, n in zip(devices, counts)]

    # Deadlines grow with the planned work, so a long but healthy delivery or epoch is never cut short.
    delivery_timeout_s = timeout_s + 2 * max(transfer_s)
    merge_timeout_s = timeout_s + 2 * plan.epoch_s

    model.to(local_device())
    barrier(group, timeout_s)
    started = time.perf_counter()
    local = distribute(
        dataset,
        counts,
        transport=config.transport,
        transfer_s=transfer_s if config.emulate else None,
        seed=config.seed,
        group=group,
        timeout_s=delivery_timeout_s,
    )
    barrier(group, delivery_timeout_s)
    delivered = time.perf_counter()

    broadcast_parameters(model, group=group, timeout_s=merge_timeout_s)
    batch_sizes = [1] * offset + [d.batch_size for d in plan.devices]
    merge = _merge(model, config, cluster, devices, counts, batch_sizes, rank, group, merge_timeout_s)
    try:
        history = train_local(
            model,
            optimizer,
            local.data,
            merge,
            batch_size=batch_sizes[rank],
            epochs=config.epochs,
            batch_time_s=device.feasible_batch_time_s if device else 0.0,
            emulate=config.emulate,
            seed=config.seed,
            loss_fn=loss_fn,
            on_epoch=on_epoch,
        )
    finally:
        merge.close()
    finished = time.perf_counter()
    return CadpResult(
        plan=plan, send_s=delivered - started, train_s=finished - delivered, epochs=history, samples=counts[rank]
    )


def _merge(
    model: nn.Module,
    config: CadpConfig,
    cluster: ClusterSpec,
    devices: list[DeviceSpec | None],
    counts: list[int],
    batch_sizes: list[int],
    rank: int,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> Merge:
    """The merge of ``config.sync`` for this rank, with its emulated model-transfer time (one way)."""
    model_bytes = cluster.model_bytes
    if config.sync == "epoch":
        link_s = _link_s(devices[rank], model_bytes) if config.emulate else 0.0
        return ParameterAveraging(merge_weights(counts)[rank], link_s=link_s, group=group, timeout_s=timeout_s)
    if 0 in counts:
        raise ConfigError(f"sync='step' needs every rank to train (a synchronous step runs on every rank); the "
                          f"plan gives {counts} samples: give the data owner a device, or plan min_samples >= 1")
    # A synchronous allreduce moves at the pace of its slowest link, on every rank.
    slowest_s = max(_link_s(d, model_bytes) for d in devices) if config.emulate else 0.0
    return GradientAllreduce(model, counts, batch_sizes, link_s=slowest_s, group=group, timeout_s=timeout_s)


def _link_s(device: DeviceSpec | None, nbytes: float) -> float:
    """Seconds to move ``nbytes`` from the data owner to ``device`` (alpha + size / B); 0 for the owner itself."""
    if device is None:
        return 0.0
    return Link(bandwidth_mbps=device.bandwidth_mbps, latency_ms=device.latency_ms).transfer_s(nbytes)


def _owner_plan(
    dataset: TensorDataset | None,
    cluster: ClusterSpec,
    config: CadpConfig,
    given: Plan | None,
    group: dist.ProcessGroup | None,
) -> Plan:
    """Rank 0 plans (or checks the given plan) and every rank receives its plan, or its error."""
    message: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            message[0] = _plan_for(dataset, cluster, config, given)
        except HetDPError as error:
            message[0] = f"{type(error).__name__}: {error}"
    # The object collective waits under the group's own timeout (set when the group was created).
    dist.broadcast_object_list(message, src=global_rank(0, group), group=group)
    if isinstance(message[0], str):
        raise ConfigError(f"rank 0 could not plan: {message[0]}")
    return message[0]


def _plan_for(dataset: TensorDataset | None, cluster: ClusterSpec, config: CadpConfig, given: Plan | None) -> Plan:
    if dataset is None:
        raise ConfigError("rank 0 is the data owner and needs the dataset, got None")
    size = len(dataset)
    if given is not None:
        names = [d.name for d in given.devices]
        if names != cluster.names:
            raise ConfigError(f"the plan is for devices {names}, the cluster has {cluster.names}")
        if given.dataset_size != size:
            raise ConfigError(f"the plan distributes {given.dataset_size} samples but the dataset has {size}")
        return given
    if config.allocation == "equal":
        return evaluate(cluster, apportion([1.0] * len(cluster.devices), size, minimum=0), config.epochs)
    return make_plan(cluster, size, config.epochs, method=config.method)

