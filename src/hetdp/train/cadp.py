"""C-ADP as ``hetdp bench cadp`` runs it: plan, deliver once, train through the drop-in, and time each part.

C-ADP paper, section 3: rank 0, the data owner, chooses D_1..D_N (eq. 7,
:func:`hetdp.plan`) and sends device i its D_i samples (:func:`hetdp.distribute`);
the training is the drop-in's, on each rank's own data:
``hetdp.DDP(model, hetdp.Planned(cluster), "local")`` with
``model.allocate(loader, own_data=True)`` trains device i's samples in batches of
its own size and merges as w = sum_i (D_i / D) w_i at each epoch's end (the
baselines: ``"equal"``, and ``"allreduce"`` for DDP's per-step gradient mean).
``train_cadp`` is the benchmark's harness around that loop: it sleeps the emulated
model transfers (the drop-in emulates compute, not links) and reports the paper's
T_send, T_train and T_total beside the plan's prediction. It left the public API
(``hetdp.train_cadp`` warns and goes in the next release): a script writes the
loop itself (examples/cadp_train.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hetdp.allocate.apportion import apportion
from hetdp.allocate.planner import Plan, evaluate
from hetdp.allocate.planner import plan as make_plan
from hetdp.allocate.policy import Planned
from hetdp.cluster.emulate import Emulation, Link, sleep
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.data.distribute import Transport, distribute
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError, HetDPError
from hetdp.figures.metrics import EpochReport
from hetdp.runtime import Timeouts, barrier, global_rank, local_device

log = logging.getLogger(__name__)

INDEX_BYTES = 8
"""Bytes per sample on the wire when only indices travel (int64)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    """Pace every batch to its device's time per sample (batch_time_s / batch_size, the drop-in's emulation) and
    every transfer to its link, so that one machine behaves like the described cluster. Leave False on a real
    cluster."""
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
    epochs: list[EpochReport]
    """The drop-in's report of every epoch (its ``loss`` is the mean over every rank's samples)."""
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
            "epoch_s": [report.epoch_s for report in self.epochs],
            "loss": [report.loss for report in self.epochs],
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
    on_epoch: Callable[[EpochReport], None] | None = None,
    group: dist.ProcessGroup | None = None,
) -> CadpResult:
    """Plan (on rank 0), deliver, train locally and merge for ``config.epochs`` epochs, timing each part.

    Rank r trains as ``cluster.devices[r]``; rank 0, the data owner, trains too (give
    its device ``bandwidth_mbps = inf``). A device the plan gives no samples sits the
    training out (its ``epochs`` are empty) and waits for the others.

    Args:
        model: the model, the same architecture on every rank; rank 0's parameters start everyone.
        optimizer: this rank's optimizer over ``model``'s parameters.
        dataset: the training set on rank 0; on other ranks None, unless ``transport`` is
            ``"indices"`` (shared storage), where every rank passes the same dataset.
        cluster: the devices, their links and the sizes b and M_m.
        config: allocation, merge, transport and emulation settings.
        plan: an allocation to use instead of planning (rank 0's is used everywhere).
        loss_fn: the training loss.
        on_epoch: called on every rank with each epoch's report, after its merge.
        group: the process group (None: the default group).

    .. warning::
        Collective: every rank of ``group`` calls it with the same cluster and config.

    Raises:
        ConfigError: the group does not match the cluster, or the plan does not match the dataset.
        PeerTimeoutError: a transfer or merge waited past its deadline.
    """
    config = config or CadpConfig()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if world_size != len(cluster.devices):
        raise ConfigError(f"the cluster has {len(cluster.devices)} devices but the group has {world_size} ranks; "
                          "launch one rank per device, the data owner first")
    plan = _owner_plan(dataset, cluster, config, plan, group)
    sample_bytes = cluster.sample_bytes if config.transport == "samples" else INDEX_BYTES
    transfer_s = [_link_s(d, n * sample_bytes) for d, n in zip(cluster.devices, plan.samples)]
    # Deadlines grow with the planned work, so a long but healthy delivery or epoch is never cut short.
    delivery_timeout_s = config.timeouts.round_s + 2 * max(transfer_s)
    merge_timeout_s = config.timeouts.round_s + 2 * plan.epoch_s

    model.to(local_device())
    barrier(group, config.timeouts.round_s)
    started = time.perf_counter()
    local = distribute(dataset, plan.samples, transport=config.transport,
                       transfer_s=transfer_s if config.emulate else None, seed=config.seed, group=group,
                       timeout_s=delivery_timeout_s)
    barrier(group, delivery_timeout_s)
    delivered = time.perf_counter()

    # A device the plan gives no samples sits the training out (C-ADP: D_i = 0), in no group of the drop-in's.
    trains = [r for r, n in enumerate(plan.samples) if n > 0]
    trainers = group if len(trains) == world_size else dist.new_group([global_rank(r, group) for r in trains])
    history = []
    if rank in trains:
        members = replace(cluster, devices=tuple(cluster.devices[r] for r in trains))
        history = _train(model, optimizer, local.data, members, config, loss_fn, on_epoch, trainers, merge_timeout_s)
        if trainers is not group:
            dist.destroy_process_group(trainers)
    barrier(group, config.timeouts.round_s + 2 * plan.total_s)
    finished = time.perf_counter()
    return CadpResult(plan=plan, send_s=delivered - started, train_s=finished - delivered, epochs=history,
                      samples=plan.samples[rank])


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, data: TensorDataset, cluster: ClusterSpec,
           config: CadpConfig, loss_fn: LossFn, on_epoch: Callable[[EpochReport], None] | None,
           group: dist.ProcessGroup | None, timeout_s: float) -> list[EpochReport]:
    """The drop-in's loop over this device's own samples, one device of ``cluster`` per rank of ``group``."""
    planned = config.allocation == "planned"
    allocation = Planned(cluster, epochs=config.epochs, method=config.method) if planned else "equal"
    ddp = DistributedDataParallel(model, allocation, "local" if config.sync == "epoch" else "allreduce",
                                  step_timeout_s=timeout_s, emulation=_emulation(cluster.devices, config.emulate),
                                  process_group=group)
    rank = ddp.rank
    loader = ddp.allocate(DataLoader(data, batch_size=cluster.devices[rank].feasible_batch_size), shuffle=True,
                          seed=config.seed, own_data=True)
    # The drop-in emulates compute, not links: the model's trips to and from the owner are slept here, before the
    # epoch under local training (the merge ends it), after every step under per-step allreduce.
    model_s = [_link_s(d, cluster.model_bytes) if config.emulate else 0.0 for d in cluster.devices]
    trip_s, step_trip_s = (2 * model_s[rank], 0.0) if config.sync == "epoch" else (0.0, 2 * max(model_s))
    history = []
    with ddp:
        for epoch in range(config.epochs):
            loader.sampler.set_epoch(epoch)
            sleep(trip_s)
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss = loss_fn(ddp(inputs), targets)
                loss.backward()
                ddp.record_loss(loss)
                optimizer.step()
                sleep(step_trip_s)
            history.append(ddp.last_epoch)
            if on_epoch is not None:
                on_epoch(history[-1])
    return history


def _emulation(devices: Sequence[DeviceSpec], emulate: bool) -> Emulation:
    """Each device's time per sample (batch_time_s / batch_size) as the drop-in's emulation; none without ``emulate``
    (also not ``hetdp run``'s: the cluster file describes the devices)."""
    if not emulate:
        return Emulation()
    sample_ms = [1000.0 * d.batch_time_s / d.batch_size for d in devices]
    return Emulation(speeds=tuple(max(sample_ms) / ms for ms in sample_ms), sample_cost_ms=max(sample_ms))


def _link_s(device: DeviceSpec, nbytes: float) -> float:
    """Seconds to move ``nbytes`` from the data owner to ``device`` (alpha + size / B; 0 behind an infinite link)."""
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

