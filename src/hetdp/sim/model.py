"""Simulate synchronous (equal / static / adaptive) and partial (solo / majority / quorum) data parallelism.

Each worker's compute time for a share is ``share / speed``, times log-normal
jitter, plus a straggler delay drawn per step; the allreduce costs what
``network.py`` says (a ring: ``2 (N - 1)`` latencies plus ``2 (N - 1) / N``
model transfers). The adaptive policy runs the library's own
:class:`~hetdp.allocate.adaptive.AdaptiveAllocator`, so the simulation checks
the rule itself at N = 1,000 and beyond. Every result also says how the
workers' time divided between computing, waiting and the allreduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.apportion import apportion
from hetdp.errors import ConfigError
from hetdp.sim.network import AllreduceCost, ring_allreduce

Strategy = Literal["equal", "static", "adaptive", "solo", "majority", "quorum"]
STRATEGIES: tuple[str, ...] = ("equal", "static", "adaptive", "solo", "majority", "quorum")


@dataclass(kw_only=True, frozen=True)
class SimulatedCluster:
    """Unequal workers joined by a ring allreduce."""

    speeds: tuple[float, ...]
    """Samples per second of each worker."""
    jitter: float = 0.05
    """Sigma of the log-normal noise on every compute time (0: deterministic)."""
    straggler_probability: float = 0.0
    """Chance that a worker is delayed at a given step."""
    straggler_delay_s: float = 0.0
    """Seconds a delayed worker loses."""
    latency_s: float = 50e-6
    """Per-hop latency of the allreduce."""
    bandwidth_gbps: float = 10.0
    """Link bandwidth of the allreduce, gigabits per second."""
    model_mb: float = 40.0
    """Size of the gradient, megabytes."""

    def __post_init__(self) -> None:
        if not self.speeds or min(self.speeds) <= 0 or not all(map(math.isfinite, self.speeds)):
            raise ConfigError(f"speeds must be positive samples per second, got {list(self.speeds)[:8]}")
        if not 0.0 <= self.straggler_probability <= 1.0:
            raise ConfigError(f"straggler_probability must be in [0, 1], got {self.straggler_probability!r}")
        for name in ("jitter", "straggler_delay_s", "latency_s", "model_mb"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.bandwidth_gbps > 0:
            raise ConfigError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps!r}")

    @property
    def size(self) -> int:
        return len(self.speeds)

    def allreduce_cost(self) -> AllreduceCost:
        """One allreduce of the gradient over the ring, split into latency and transfer."""
        return ring_allreduce(self.size, self.model_mb, self.latency_s, self.bandwidth_gbps)

    def allreduce_s(self) -> float:
        """Seconds of one allreduce of the gradient (see :meth:`allreduce_cost`)."""
        return self.allreduce_cost().total_s

    def compute_s(self, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One step's compute time of every worker for ``shares`` samples, noise and stragglers included."""
        noise = rng.lognormal(0.0, self.jitter, self.size) if self.jitter else 1.0
        delayed = rng.random(self.size) < self.straggler_probability
        return shares / np.asarray(self.speeds) * noise + delayed * self.straggler_delay_s


@dataclass(frozen=True)
class SimulationResult:
    """What one strategy did in a simulated run. The three fractions divide the workers' time: they sum to 1."""

    strategy: str
    steps: int
    """Steps (synchronous) or rounds (partial) simulated."""
    seconds: float
    """Simulated wall-clock seconds for all steps."""
    samples_per_s: float
    """Gradient samples applied per second: ``steps * samples_per_step / seconds``."""
    fresh_fraction: float
    """Share of the applied gradients computed from the latest model (1 for synchronous strategies)."""
    final_shares: list[int]
    samples_per_step: float
    """Gradient samples applied per step: the global batch, or in a partial round only the workers that arrived."""
    compute_fraction: float
    """Share of the workers' time spent computing gradients."""
    wait_fraction: float
    """Share spent idle: waiting for the slowest worker (synchronous) or for a round to fire (partial)."""
    allreduce_fraction: float
    """Share spent in the allreduce."""


def simulate(
    cluster: SimulatedCluster,
    strategy: Strategy,
    *,
    global_batch: int,
    steps: int,
    replan_every: int = 10,
    quorum: int | None = None,
    seed: int = 0,
) -> SimulationResult:
    """Run ``steps`` steps of ``strategy`` on ``cluster`` and measure its throughput."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if steps < 1 or global_batch < cluster.size:
        raise ConfigError(f"need steps >= 1 and global_batch >= {cluster.size} workers, got {steps}, {global_batch}")
    rng = np.random.default_rng(seed)
    if strategy in ("solo", "majority", "quorum"):
        return _simulate_partial(cluster, strategy, global_batch, steps, quorum, rng)
    return _simulate_synchronous(cluster, strategy, global_batch, steps, replan_every, rng)


def _simulate_synchronous(
    cluster: SimulatedCluster, strategy: str, global_batch: int, steps: int, replan_every: int, rng: np.random.Generator
) -> SimulationResult:
    weights = list(cluster.speeds) if strategy == "static" else None
    allocator = AdaptiveAllocator(cluster.size, global_batch, initial=weights)
    allreduce_s = cluster.allreduce_s()
    clock_s, window, busy_s, idle_s = 0.0, np.zeros(cluster.size), 0.0, 0.0
    for step in range(1, steps + 1):
        compute = cluster.compute_s(np.asarray(allocator.shares, dtype=float), rng)
        clock_s += compute.max() + allreduce_s
        busy_s += compute.sum()
        idle_s += (compute.max() - compute).sum()  # everyone waits for the slowest before the allreduce
        window += compute
        if strategy == "adaptive" and step % replan_every == 0:
            allocator.update(window.tolist(), replan_every)
            window[:] = 0.0
    worker_s = cluster.size * clock_s
    return SimulationResult(strategy, steps, clock_s, steps * global_batch / clock_s, 1.0, allocator.shares,
                            samples_per_step=float(global_batch), compute_fraction=busy_s / worker_s,
                            wait_fraction=idle_s / worker_s, allreduce_fraction=steps * allreduce_s / clock_s)


def _simulate_partial(
    cluster: SimulatedCluster, mode: str, global_batch: int, steps: int, quorum: int | None, rng: np.random.Generator
) -> SimulationResult:
    """Eager-SGD: a round fires on the first arrival (solo), a random initiator's (majority) or the k-th (quorum).

    Workers ready when it fires contribute and start their next gradient from its
    result; the others keep computing and join a later round, stale if a round
    passed since their model. (Simplification: a late worker restarts after the
    round it joins, as an on-time one does, so partial modes are not flattered.)
    """
    shares = np.asarray(apportion([1.0] * cluster.size, global_batch), dtype=float)
    k = {"solo": 1, "quorum": quorum or (cluster.size + 1) // 2}.get(mode)
    if k is not None and not 1 <= k <= cluster.size:
        raise ConfigError(f"quorum must be in [1, {cluster.size}], got {k}")
    allreduce_s = cluster.allreduce_s()
    started_at = np.zeros(cluster.size)  # each worker's timeline: compute, wait for a round to fire, allreduce, ...
    ready_at = cluster.compute_s(shares, rng)
    model_round = np.zeros(cluster.size, dtype=int)  # the round whose result each pending gradient started from
    round_end_s, fresh, contributions, busy_s, idle_s = 0.0, 0, 0, 0.0, 0.0
    for number in range(steps):
        fire_s = np.partition(ready_at, k - 1)[k - 1] if k else ready_at[rng.integers(cluster.size)]
        fire_s = max(fire_s, round_end_s)
        round_end_s = fire_s + allreduce_s
        arrived = ready_at <= fire_s
        contributions += int(arrived.sum())
        fresh += int((arrived & (model_round == number)).sum())
        busy_s += (ready_at - started_at)[arrived].sum()
        idle_s += (fire_s - ready_at)[arrived].sum()
        started_at = np.where(arrived, round_end_s, started_at)
        ready_at = np.where(arrived, round_end_s + cluster.compute_s(shares, rng), ready_at)
        model_round = np.where(arrived, number + 1, model_round)
    busy_s += (np.minimum(ready_at, round_end_s) - started_at).clip(min=0.0).sum()  # gradients still in progress
    idle_s += (round_end_s - ready_at).clip(min=0.0).sum()  # ready after the last round fired
    samples = contributions * shares.mean()
    worker_s = cluster.size * round_end_s
    return SimulationResult(mode, steps, round_end_s, samples / round_end_s, fresh / max(contributions, 1),
                            shares.astype(int).tolist(), samples_per_step=samples / steps,
                            compute_fraction=busy_s / worker_s, wait_fraction=idle_s / worker_s,
                            allreduce_fraction=contributions * allreduce_s / worker_s)
