"""Measure a running group as a C-ADP cluster: batch time, memory per sample, and each link from the data owner.

Every rank measures its own T_i^batch and memory (eq. 3's G_i, S_m, Delta S_i);
rank 0, the data owner, times round trips to every other rank for B_0i and
alpha_0i. The result is a ``hetdp.cluster.spec.ClusterSpec`` that
``hetdp.plan`` and ``hetdp plan`` read.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hetdp.cluster.emulate import Emulation, Link
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.errors import ConfigError
from hetdp.runtime import Timeouts, barrier, global_rank, local_device, synchronize, wait_for

log = logging.getLogger(__name__)

MB = 1e6
"""Bytes per megabyte in cluster files (memory and activation sizes)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True, frozen=True)
class ProbeConfig:
    """What the probe measures, and how many times."""

    batch_size: int = 32
    """batchsize(i) every rank is timed at (and written to the cluster file)."""
    warmup: int = 2
    """Untimed batches first (allocator, kernels and caches settle)."""
    repeats: int = 5
    """Timed batches per rank; the median is kept."""
    payload_bytes: int = 4_000_000
    """Size of the timed transfer for bandwidth; larger is more precise on fast links and slower on slow ones."""
    pings: int = 5
    """Round trips per size and link; the median is kept."""
    sample_bytes: float | None = None
    """b written to the file; None: the bytes of one real sample (input and target)."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """``round_s`` bounds every timed transfer (emulated links included)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "repeats", "pings", "payload_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"probe {name} must be >= 1, got {getattr(self, name)!r}")
        if self.warmup < 0:
            raise ConfigError(f"probe warmup must be >= 0, got {self.warmup!r}")
        if self.sample_bytes is not None and not self.sample_bytes >= 0:
            raise ConfigError(f"probe sample_bytes must be >= 0, got {self.sample_bytes!r}")


def link_from_round_trips(small_s: float, large_s: float, extra_bytes: float) -> tuple[float, float]:
    """(bandwidth_mbps, latency_ms) from round-trip times of a small and a large message.

    A round trip of n bytes and a tiny reply takes 2 alpha + 8 n / B, so the
    small one gives alpha = small_s / 2 and the difference gives B =
    8 extra_bytes / (large_s - small_s). A difference at or below zero (a link
    faster than the clock can tell) gives an infinite bandwidth.
    """
    if not (small_s >= 0 and large_s >= 0 and extra_bytes > 0):
        raise ConfigError(f"need times >= 0 and extra_bytes > 0, got {small_s!r}, {large_s!r}, {extra_bytes!r}")
    spread_s = large_s - small_s
    bandwidth_mbps = 8.0 * extra_bytes / spread_s / 1e6 if spread_s > 0 else math.inf
    return bandwidth_mbps, 1000.0 * small_s / 2.0


def activation_bytes_per_sample(model: nn.Module, inputs: torch.Tensor) -> float:
    """Bytes of activations one sample keeps alive for the backward pass: an estimate from forward hooks.

    Sums the input and the output of every leaf module (what autograd saves, give
    or take in-place layers and the transient gradient buffers of the backward),
    divided by the batch. Used where no allocator reports peak memory (CPU).
    """
    total = [inputs.numel() * inputs.element_size()]

    def count(_module: nn.Module, _args: object, output: object) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        total[0] += sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return total[0] / max(len(inputs), 1)


@dataclass(frozen=True)
class Measured:
    """One rank's own measurements (before the links are known)."""

    name: str
    batch_time_s: float
    memory_mb: float | None
    fixed_memory_mb: float
    activation_mb_per_sample: float


def probe_cluster(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: ProbeConfig | None = None,
    *,
    emulation: Emulation | None = None,
    links: Sequence[Link | None] | None = None,
    loss_fn: LossFn = nn.functional.cross_entropy,
    group: dist.ProcessGroup | None = None,
) -> ClusterSpec:
    """Measure every rank of ``group`` and return the cluster, the same on every rank; rank 0 is the data owner.

    Ranks take turns: one times its batches while the others wait, so ranks that
    share a machine do not slow each other down, and rank 0 times one link at a time.

    Args:
        model: the model to time; its parameters give M_m.
        inputs, targets: real samples (at least one); the timed batch repeats them up to ``batch_size``.
        config: batch size, repetitions and transfer sizes.
        emulation: stretches each rank's batch time (``hetdp run --speeds``); None: from the environment.
        links: an emulated link per rank (rank 0's is ignored) that a receiving rank adds to
            each real transfer; None: real links only.
        loss_fn: the training loss.
        group: the process group (None: the default group).

    Warning:
        Collective: every rank of ``group`` calls it with the same config and link list.

    Raises:
        ConfigError: bad arguments, or a measurement the cluster file rejects.
        PeerTimeoutError: a transfer did not finish within ``config.timeouts.round_s``.
    """
    config = config or ProbeConfig()
    emulation = emulation if emulation is not None else Emulation.from_env()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if links is not None and len(links) != world_size:
        raise ConfigError(f"links gives {len(links)} values for {world_size} ranks; give one per rank")
    if len(inputs) < 1 or len(inputs) != len(targets):
        raise ConfigError(f"need at least one sample and one target per input, got {len(inputs)} and {len(targets)}")
    device = local_device()
    model.to(device)
    repeat = -(-config.batch_size // len(inputs))
    batch_inputs = inputs.repeat(repeat, *[1] * (inputs.dim() - 1))[: config.batch_size].to(device)
    batch_targets = targets.repeat(repeat, *[1] * (targets.dim() - 1))[: config.batch_size].to(device)
    timeout_s = config.timeouts.round_s

    mine: Measured | None = None
    for turn in range(world_size):
        if turn == rank:
            mine = _measure_self(model, batch_inputs, batch_targets, config, emulation, rank, loss_fn)
        barrier(group, timeout_s)
    own = [None] * world_size
    dist.all_gather_object(own, mine, group=group)

    measured_links = [(math.inf, 0.0)] * world_size
    for peer in range(1, world_size):
        if rank == 0:
            measured_links[peer] = _time_link(peer, config, group, device)
        elif rank == peer:
            _answer_pings(config, links[rank] if links else None, group, device)
    shared = [measured_links]
    dist.broadcast_object_list(shared, src=global_rank(0, group), group=group)

    sample_bytes = config.sample_bytes
    if sample_bytes is None:
        sample_bytes = float(sum(t[0].numel() * t[0].element_size() for t in (inputs, targets)))
    devices = tuple(
        DeviceSpec(
            name=m.name,
            batch_size=config.batch_size,
            batch_time_s=m.batch_time_s,
            bandwidth_mbps=bandwidth,
            latency_ms=latency,
            memory_mb=m.memory_mb,
            fixed_memory_mb=m.fixed_memory_mb,
            activation_mb_per_sample=m.activation_mb_per_sample,
        )
        for m, (bandwidth, latency) in zip(own, shared[0])
    )
    model_bytes = float(sum(p.numel() * p.element_size() for p in model.parameters()))
    return ClusterSpec(devices=devices, sample_bytes=sample_bytes, model_bytes=model_bytes)


def _measure_self(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: ProbeConfig,
    emulation: Emulation,
    rank: int,
    loss_fn: LossFn,
) -> Measured:
    """This rank's batch time (median, forward and backward, emulation applied) and memory figures."""
    batch_time_s = median_batch_s(model, inputs, targets, loss_fn, repeats=config.repeats, warmup=config.warmup,
                                  around=lambda: emulation.compute(rank, len(inputs)))
    memory_mb, fixed_mb, activation_mb = _memory(model, inputs, targets, loss_fn)
    kind = "cuda" if inputs.device.type == "cuda" else "cpu"
    return Measured(
        name=f"rank{rank}-{kind}",
        batch_time_s=batch_time_s,
        memory_mb=memory_mb,
        fixed_memory_mb=fixed_mb,
        activation_mb_per_sample=activation_mb,
    )


def median_batch_s(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn, *, repeats: int,
                   warmup: int, around: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
                   ) -> float:
    """Median seconds of ``repeats`` forward and backward passes of ``model`` on one batch, each timed inside
    ``around()`` (an emulation's pacing, say), after ``warmup`` untimed ones; the gradients are zeroed before each."""

    def batch() -> None:
        model.zero_grad(set_to_none=False)
        loss_fn(model(inputs), targets).backward()
        synchronize(inputs.device)

    for _ in range(warmup):
        batch()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with around():
            batch()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _memory(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn
) -> tuple[float | None, float, float]:
    """(G_i, S_m, Delta S_i) in MB: measured peaks on a GPU, an estimate on a CPU.

    GPU: the allocator's peak during forward and backward at two batch sizes;
    Delta S is the slope, S_m what is left at zero samples, G_i the device memory.
    CPU: Delta S from ``activation_bytes_per_sample``; S_m = parameters and
    their gradients; G_i = physical memory shared by the ranks of this machine
    (``LOCAL_WORLD_SIZE``). The optimizer's state is not counted in S_m.
    """
    device = inputs.device
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        sizes = (len(inputs), max(1, len(inputs) // 2)) if len(inputs) > 1 else (2, 1)
        peaks = []
        for size in sizes:
            chunk_inputs = inputs.repeat(2, *[1] * (inputs.dim() - 1))[:size]
            chunk_targets = targets.repeat(2, *[1] * (targets.dim() - 1))[:size]
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            model.zero_grad(set_to_none=False)
            loss_fn(model(chunk_inputs), chunk_targets).backward()
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device))
        per_sample = max((peaks[0] - peaks[1]) / (sizes[0] - sizes[1]), 0.0)
        fixed = max(peaks[0] - sizes[0] * per_sample, 2 * param_bytes)
        total = torch.cuda.get_device_properties(device).total_memory
        return total / MB, fixed / MB, per_sample / MB
    per_sample = activation_bytes_per_sample(model, inputs)
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    total = None
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / local_ranks / MB
    return total, 2 * param_bytes / MB, per_sample / MB


def _message_sizes(config: ProbeConfig) -> tuple[int, int]:
    """Float32 elements of the tiny and the large probe message."""
    return 1, max(config.payload_bytes // 4, 1)


def _time_link(
    peer: int, config: ProbeConfig, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[float, float]:
    """Rank 0: median round trips of a tiny and a large message to ``peer``; returns (bandwidth_mbps, latency_ms)."""
    reply = torch.zeros(1, dtype=torch.float32, device=device)
    peer_global, deadline_s = global_rank(peer, group), config.timeouts.round_s
    medians = []
    for count in _message_sizes(config):
        payload = torch.zeros(count, dtype=torch.float32, device=device)
        trips = []
        for _ in range(config.pings):
            started = time.perf_counter()
            wait_for(dist.isend(payload, peer_global, group=group), f"probe message to rank {peer}", deadline_s)
            wait_for(dist.irecv(reply, peer_global, group=group), f"probe reply of rank {peer}", deadline_s)
            trips.append(time.perf_counter() - started)
        medians.append(statistics.median(trips))
    tiny, large = _message_sizes(config)
    return link_from_round_trips(medians[0], medians[1], (large - tiny) * 4)


def _answer_pings(
    config: ProbeConfig, link: Link | None, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """A peer: receive each probe message, hold it as long as the emulated link would, and reply."""
    reply = torch.ones(1, dtype=torch.float32, device=device)
    owner, deadline_s = global_rank(0, group), config.timeouts.round_s
    for count in _message_sizes(config):
        buffer = torch.empty(count, dtype=torch.float32, device=device)
        for _ in range(config.pings):
            wait_for(dist.irecv(buffer, owner, group=group), "probe message from rank 0", deadline_s)
            if link is not None:  # the message and the reply, each over the emulated link
                time.sleep(link.transfer_s(count * 4) + link.transfer_s(4))
            wait_for(dist.isend(reply, owner, group=group), "probe reply to rank 0", deadline_s)
