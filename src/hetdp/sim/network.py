"""What a collective costs on the simulated network: every allreduce model the simulator knows, in one place.

A model returns its cost split into latency and transfer, so that a report can
say which of the two a large cluster pays for. The models follow the usual
alpha-beta accounting (a message costs one latency plus its bytes over the
link's bandwidth) with the algorithms NCCL and gloo choose between: a ring, a
double binary tree, recursive doubling, and a two-level hierarchy (a ring inside
each node over fast links, a tree between the nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hetdp.errors import ConfigError

Algorithm = Literal["ring", "tree", "doubling", "hierarchical"]
ALGORITHMS: tuple[str, ...] = ("ring", "tree", "doubling", "hierarchical")


@dataclass(frozen=True)
class AllreduceCost:
    """Seconds one allreduce takes, by cause."""

    hops: int
    """Sequential messages on the critical path; each pays one link latency."""
    latency_s: float
    """Seconds of latency on the critical path (``hops`` times the per-hop latency of their links)."""
    transfer_s: float
    """Seconds the payload's bytes spend on the critical path's links."""

    @property
    def total_s(self) -> float:
        return self.latency_s + self.transfer_s

    def __add__(self, other: AllreduceCost) -> AllreduceCost:
        """Two phases run one after the other (a hierarchy's levels)."""
        return AllreduceCost(self.hops + other.hops, self.latency_s + other.latency_s,
                             self.transfer_s + other.transfer_s)


def _seconds(payload_mb: float, bandwidth_gbps: float) -> float:
    """Seconds to move ``payload_mb`` megabytes over a link of ``bandwidth_gbps`` gigabits per second."""
    return payload_mb * 8e6 / (bandwidth_gbps * 1e9)


def ring_allreduce(workers: int, payload_mb: float, latency_s: float, bandwidth_gbps: float) -> AllreduceCost:
    """Ring allreduce (reduce-scatter, then all-gather): 2 (N - 1) hops, each moving 1 / N of the payload.

    Every worker sends and receives 2 (N - 1) / N of the payload, so the transfer
    barely grows with N while the latency term grows linearly: at N = 1,000 and
    50 us per hop it is 0.1 s per allreduce, whatever the bandwidth.
    """
    hops = 2 * (workers - 1)
    transfer_s = hops / workers * _seconds(payload_mb, bandwidth_gbps) if workers else 0.0
    return AllreduceCost(hops=hops, latency_s=hops * latency_s, transfer_s=transfer_s)


def tree_allreduce(workers: int, payload_mb: float, latency_s: float, bandwidth_gbps: float) -> AllreduceCost:
    """Double binary tree (NCCL's tree): a pipelined reduce up a binary tree, then a broadcast down it.

    Two trees, each carrying half of the payload, use every link in both
    directions, so the payload crosses a worker's link about twice whatever N
    (transfer about 2 M / B); the latency is the depth twice, 2 ceil(log2 N) hops
    instead of the ring's 2 (N - 1).
    """
    if workers <= 1:
        return AllreduceCost(hops=0, latency_s=0.0, transfer_s=0.0)
    hops = 2 * math.ceil(math.log2(workers))
    return AllreduceCost(hops=hops, latency_s=hops * latency_s, transfer_s=2 * _seconds(payload_mb, bandwidth_gbps))


def doubling_allreduce(workers: int, payload_mb: float, latency_s: float, bandwidth_gbps: float) -> AllreduceCost:
    """Recursive doubling (hetdp's small-payload allreduce over gloo): log2(N) exchanges of the whole payload.

    Workers beyond the largest power of two fold into a partner first and get the
    sum back last: two more hops. Fewest latencies, but every exchange moves the
    whole payload, so it only pays for small ones.
    """
    if workers <= 1:
        return AllreduceCost(hops=0, latency_s=0.0, transfer_s=0.0)
    exchanges = int(math.log2(workers))
    hops = exchanges + (2 if 2**exchanges < workers else 0)
    return AllreduceCost(hops=hops, latency_s=hops * latency_s, transfer_s=hops * _seconds(payload_mb, bandwidth_gbps))


def hierarchical_allreduce(workers: int, payload_mb: float, latency_s: float, bandwidth_gbps: float, *,
                           local_size: int, local_latency_s: float, local_bandwidth_gbps: float) -> AllreduceCost:
    """Two levels, as NCCL runs a multi-node job: inside each node, then between nodes, then inside again.

    A ring reduce-scatter over the node's ``local_size`` workers (fast links)
    leaves each worker 1 / local_size of the node's sum; the workers holding the
    same piece in every node allreduce it by a double binary tree over the slow
    inter-node links, all pieces at once (one link per worker); a ring all-gather
    inside the node puts the pieces back together. The slow links then carry
    1 / local_size of the payload, with 2 log2(nodes) latencies.
    """
    local = max(1, min(local_size, workers))
    nodes = math.ceil(workers / local)
    inside = ring_allreduce(local, payload_mb, local_latency_s, local_bandwidth_gbps)
    between = tree_allreduce(nodes, payload_mb / local, latency_s, bandwidth_gbps)
    return inside + between


def allreduce_cost(algorithm: str, workers: int, payload_mb: float, latency_s: float, bandwidth_gbps: float, *,
                   local_size: int = 8, local_latency_s: float = 5e-6,
                   local_bandwidth_gbps: float = 200.0) -> AllreduceCost:
    """The cost of one allreduce by ``algorithm`` (see ``ALGORITHMS``); the ``local_*`` settings are the links
    inside a node, which only ``hierarchical`` tells apart from the others.

    Raises:
        ConfigError: an unknown algorithm.
    """
    if algorithm == "hierarchical":
        return hierarchical_allreduce(workers, payload_mb, latency_s, bandwidth_gbps, local_size=local_size,
                                      local_latency_s=local_latency_s, local_bandwidth_gbps=local_bandwidth_gbps)
    models = {"ring": ring_allreduce, "tree": tree_allreduce, "doubling": doubling_allreduce}
    if algorithm not in models:
        raise ConfigError(f"allreduce algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    return models[algorithm](workers, payload_mb, latency_s, bandwidth_gbps)
