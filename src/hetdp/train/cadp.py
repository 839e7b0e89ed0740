"""C-ADP training: the data owner plans and delivers each device's data once, devices train locally, models merge.

C-ADP paper, section 3: rank 0, the data owner and parameter server, chooses
D_1..D_N (eq. 7, :func:`hetdp.plan`), sends device i its D_i samples
(:func:`hetdp.distribute`), and every epoch each device trains on its own
samples with its own batch size before the models merge as w = sum_i (D_i / D) w_i.
The training is the drop-in's: ``hetdp.DDP(model, ..., "local")`` trains each
rank alone and merges by that weighted average at the epoch's end (``sync="step"``:
``"allreduce"``, DDP's gradient mean every step, the baseline). ``train_cadp``
only plans, delivers, cuts each rank's batches of its own data, sleeps the
emulated model transfers (the drop-in emulates compute, not links) and reports
the paper's T_send, T_train and T_total beside the plan's prediction:
``hetdp bench cadp`` runs it. It left the public API (``hetdp.train_cadp`` warns
and goes in the next release): a script calls ``hetdp.plan``,
``hetdp.distribute`` and ``hetdp.DDP`` itself (examples/cadp_train.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from hetdp.allocate.apportion import apportion
from hetdp.allocate.planner import Plan, evaluate
from hetdp.allocate.planner import plan as make_plan
from hetdp.cluster.emulate import Emulation, Link, sleep
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.errors import ConfigError, HetDPError
from hetdp.runtime import Timeouts, barrier, global_rank, local_device
from hetdp.train.ddp import DistributedDataParallel
from hetdp.train.distribute import Transport, distribute
from hetdp.train.metrics import EpochReport

log = logging.getLogger(__name__)

INDEX_BYTES = 8
"""Bytes per sample on the wire when only indices travel (int64)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

REBUILD_STEPS = 2
"""Steps every rank computes, with a stand-in if it has no batch: torch's DDP rebuilds its gradient buckets in a
collective at a rank's second forward."""


def epoch_order(size: int, *, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """The order in which ``rank`` visits its ``size`` local samples in ``epoch``: a permutation seeded by all three."""
    state = int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])
    return torch.randperm(size, generator=torch.Generator().manual_seed(state))


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
        on_epoch: called on every rank with each epoch's report, after its merge.
        group: the process group (None: the default group).

    .. warning::
        Collective: every rank of ``group`` calls it with the same cluster and config.

    Example::

        >>> # on every rank, under `hetdp run -n 4 train.py` or torchrun
        >>> hetdp.init_distributed()
        >>> cluster = hetdp.ClusterSpec.from_toml("cluster.toml")
        >>> train_set = hetdp.datasets.load_digits().train if dist.get_rank() == 0 else None
        >>> result = train_cadp(model, optimizer, train_set, cluster, CadpConfig(epochs=10))
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
    sample_bytes = cluster.sample_bytes if config.transport == "samples" else INDEX_BYTES
    transfer_s = [_link_s(d, n * sample_bytes) if n else 0.0 for d, n in zip(devices, counts)]

    # Deadlines grow with the planned work, so a long but healthy delivery or epoch is never cut short.
    delivery_timeout_s = timeout_s + 2 * max(transfer_s)
    merge_timeout_s = timeout_s + 2 * plan.epoch_s

    if config.sync == "step" and 0 in counts:
        raise ConfigError(f"sync='step' needs every rank to train (a synchronous step runs on every rank); the "
                          f"plan gives {counts} samples: give the data owner a device, or plan min_samples >= 1")

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

    batch_sizes = [1] * offset + [d.batch_size for d in plan.devices]
    # The steps are cut here, from each rank's own data, so the model's allocation is never consulted (there is no
    # allocate); every rank runs as many steps as the rank with the most batches (see _train_epoch).
    ddp = DistributedDataParallel(model, "equal", "local" if config.sync == "epoch" else "allreduce",
                                  step_timeout_s=merge_timeout_s, emulation=_emulation(devices, config.emulate),
                                  process_group=group)
    # The drop-in emulates compute, not links: the model's trips to and from the owner are slept here.
    model_s = [_link_s(d, cluster.model_bytes) if config.emulate else 0.0 for d in devices]
    trip_s, step_trip_s = (model_s[rank], 0.0) if config.sync == "epoch" else (0.0, 2 * max(model_s))
    history = []
    try:
        for epoch in range(config.epochs):
            ddp.begin_epoch(epoch)
            sleep(trip_s)  # the global model arrives
            _train_epoch(ddp, optimizer, local.data, counts, batch_sizes, epoch, config.seed, loss_fn, step_trip_s)
            sleep(trip_s)  # the local model leaves
            history.append(ddp.end_epoch())
            if on_epoch is not None:
                on_epoch(history[-1])
    finally:
        ddp.close()
    finished = time.perf_counter()
    return CadpResult(
        plan=plan, send_s=delivered - started, train_s=finished - delivered, epochs=history, samples=counts[rank]
    )


def _train_epoch(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, data: TensorDataset,
                 counts: list[int], batch_sizes: list[int], epoch: int, seed: int, loss_fn: LossFn,
                 step_trip_s: float) -> None:
    """One epoch of this rank's batches of its own data, in a seeded order, as the drop-in's steps: every rank runs
    as many as the rank with the most batches, and under per-step allreduce a rank out of batches joins a step with
    the drop-in's stand-in, weighted 0."""
    inputs, targets = data.tensors
    rank = ddp.rank
    size = batch_sizes[rank]
    order = epoch_order(len(inputs), seed=seed, epoch=epoch, rank=rank).to(inputs.device)
    # A stand-in's sample: this rank's first, or zeros shaped like one where it holds none (an owner that only merges).
    stand_in = (inputs[:1], targets[:1]) if len(inputs) else (
        inputs.new_zeros((1, *inputs.shape[1:])), targets.new_zeros((1, *targets.shape[1:])))
    steps = max(-(-n // b) for n, b in zip(counts, batch_sizes))
    synchronous = ddp.synchronizer.meets_every_step
    for step in range(steps):
        index = order[step * size : (step + 1) * size]
        ddp.begin_step(len(index), sum(min(b, max(0, n - step * b)) for n, b in zip(counts, batch_sizes)))
        # Under local training a rank out of batches has nothing to compute: its step only counts the others' samples
        # towards the merge's D. It joins a rank's first two steps with a stand-in all the same: torch's DDP rebuilds
        # its gradient buckets at a rank's second forward, in a collective.
        if len(index) or synchronous or ddp.steps_done < REBUILD_STEPS:
            optimizer.zero_grad()
            batch = (inputs[index], targets[index]) if len(index) else stand_in
            loss = loss_fn(ddp(batch[0]), batch[1])
            loss.backward()
            ddp.record_loss(loss)
            # A stand-in's local gradient is zero, and stepping on it would still move a momentum optimizer.
            if len(index) or synchronous:
                optimizer.step()
        ddp.end_step()
        sleep(step_trip_s)


def _emulation(devices: list[DeviceSpec | None], emulate: bool) -> Emulation:
    """Each device's time per sample (batch_time_s / batch_size) as the drop-in's emulation; none without ``emulate``
    (also not ``hetdp run``'s: the cluster file describes the devices)."""
    if not emulate:
        return Emulation()
    sample_ms = [1000.0 * d.batch_time_s / d.batch_size if d is not None else None for d in devices]
    slowest_ms = max(ms for ms in sample_ms if ms is not None)
    return Emulation(speeds=tuple(1.0 if ms is None else slowest_ms / ms for ms in sample_ms),
                     sample_cost_ms=slowest_ms)


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

