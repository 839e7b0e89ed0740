"""A simulated cluster of unequal workers, and every allocation x synchronization pairing run on it.

Each worker's compute time for a share is ``share / speed``, times log-normal
jitter, plus a straggler delay drawn per step; a collective costs what
``network.py`` says for the chosen algorithm (ring, tree, doubling or
hierarchical). ``engine.py`` runs the steps; every result also says how the
workers' time divided between computing, waiting and collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetdp.errors import ConfigError
from hetdp.sim.engine import LoopCosts, SimulationResult, Strategy, simulate_strategy
from hetdp.sim.network import ALGORITHMS, AllreduceCost, allreduce_cost

STRATEGIES: tuple[str, ...] = ("equal", "static", "adaptive", "equal+solo", "equal+majority", "adaptive+majority",
                               "adaptive+quorum", "adaptive+local:10")
"""The strategies ``hetdp simulate`` compares by default: allocation alone, synchronization alone, both."""
PARTIAL_ROUND_HOPS = 1
"""Latencies a partial round pays on top of its allreduce: the activation that fires it, through the store."""


@dataclass(kw_only=True, frozen=True)
class SimulatedCluster:
    """Unequal workers joined by a network whose allreduce runs one of ``ALGORITHMS``."""

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
    algorithm: str = "ring"
    """Allreduce algorithm: ring, tree (double binary tree), doubling or hierarchical (see ``network.py``)."""
    local_size: int = 8
    """hierarchical: workers per node, joined by the fast links below."""
    local_latency_s: float = 5e-6
    """hierarchical: per-hop latency inside a node."""
    local_bandwidth_gbps: float = 200.0
    """hierarchical: link bandwidth inside a node, gigabits per second."""

    def __post_init__(self) -> None:
        if not self.speeds or min(self.speeds) <= 0 or not all(map(math.isfinite, self.speeds)):
            raise ConfigError(f"speeds must be positive samples per second, got {list(self.speeds)[:8]}")
        if not 0.0 <= self.straggler_probability <= 1.0:
            raise ConfigError(f"straggler_probability must be in [0, 1], got {self.straggler_probability!r}")
        for name in ("jitter", "straggler_delay_s", "latency_s", "model_mb"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not (self.bandwidth_gbps > 0 and self.local_bandwidth_gbps > 0):
            raise ConfigError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps!r}, {self.local_bandwidth_gbps!r}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.local_size < 1 or not self.local_latency_s >= 0:
            raise ConfigError(f"local_size must be >= 1 and local_latency_s >= 0, got {self.local_size!r}, "
                              f"{self.local_latency_s!r}")

    @property
    def size(self) -> int:
        return len(self.speeds)

    def allreduce_cost(self) -> AllreduceCost:
        """One allreduce of the gradient by ``algorithm``, split into latency and transfer."""
        return allreduce_cost(self.algorithm, self.size, self.model_mb, self.latency_s, self.bandwidth_gbps,
                              local_size=self.local_size, local_latency_s=self.local_latency_s,
                              local_bandwidth_gbps=self.local_bandwidth_gbps)

    def allreduce_s(self) -> float:
        """Seconds of one allreduce of the gradient (see ``allreduce_cost``)."""
        return self.allreduce_cost().total_s

    def compute_s(self, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One step's compute time of every worker for ``shares`` samples, noise and stragglers included."""
        noise = rng.lognormal(0.0, self.jitter, self.size) if self.jitter else 1.0
        delayed = rng.random(self.size) < self.straggler_probability
        return shares / np.asarray(self.speeds) * noise + delayed * self.straggler_delay_s

    def loop_costs(self, seed: int = 0) -> LoopCosts:
        """The engine's view of this cluster: compute drawn from ``seed``, collectives priced by ``algorithm``.

        A partial round is an allreduce plus the activation that fires it; a meeting's parameter averaging is an
        allreduce of the model, as large as the gradient; the re-plan's gather of a few numbers is left out.
        """
        rng = np.random.default_rng(seed)
        allreduce_s = self.allreduce_s()
        return LoopCosts(compute_s=lambda step, shares: self.compute_s(shares, rng), allreduce_s=allreduce_s,
                         round_s=allreduce_s + PARTIAL_ROUND_HOPS * self.latency_s, average_s=allreduce_s,
                         static_weights=self.speeds, seed=seed)


def simulate(
    cluster: SimulatedCluster,
    strategy: str | Strategy,
    *,
    global_batch: int,
    steps: int,
    replan_every: int = 2,
    quorum: int | None = None,
    seed: int = 0,
) -> SimulationResult:
    """Run ``steps`` steps of ``strategy`` (``"adaptive+majority"``, see ``Strategy.parse``) on ``cluster``.

    Args:
        replan_every: adaptive allocation: steps between re-plans until the shares settle.
        quorum: k of a quorum strategy that names none (default: half the workers, rounded up).

    Raises:
        ConfigError: an unknown strategy, or settings that do not fit the cluster.
    """
    if isinstance(strategy, str):
        strategy = Strategy.parse(strategy)
    if strategy.sync == "quorum" and not strategy.k and quorum is not None:
        if not 1 <= quorum <= cluster.size:
            raise ConfigError(f"quorum must be in [1, {cluster.size}], got {quorum}")
        strategy = Strategy(strategy.allocation, "quorum", quorum)
    return simulate_strategy(strategy, cluster.loop_costs(seed), world_size=cluster.size, global_batch=global_batch,
                             steps=steps, replan_every=replan_every)
