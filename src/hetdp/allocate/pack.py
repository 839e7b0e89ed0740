"""Cost-balanced steps for variable-length data: each rank's block of a step costs its share of the step's cost.

With sequences of unequal length, equal sample counts are unequal work (the
eager-SGD paper's UCF101 videos run 29 to 1,776 frames). Here a rank's share is
a fraction of the step's cost (its tokens, frames, or any cost per sample the
user gives), and the step's samples are packed into per-rank blocks that meet
those fractions: the longest-processing-time rule for machines of unequal speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hetdp.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class CostBalance:
    """Variable-length data: the cost of every sample, and how the drop-in's steps use it.

    Pass it to ``hetdp.DDP.allocate(loader, cost=...)``. A step still takes the next
    ``global_batch`` samples of the epoch's order, so training sees the same global
    batches as with sample counts; only who computes which of them changes.
    """

    cost: Sequence[float]
    """Cost of every sample of the dataset, by index (> 0): its tokens, frames, or any measure of its work."""
    pack: bool = True
    """Pack each step into per-rank blocks whose costs follow the shares (``pack_by_cost``). False: cut blocks by
    sample count, as without costs; the costs then only pace emulation and weigh gradients (the count-balanced
    baseline of ``hetdp bench imbalance``)."""
    mean_over: Literal["cost", "samples"] = "cost"
    """What the loss of a rank's batch is a mean over: its cost units ("cost": one loss term per token, as in
    language modelling) or its samples ("samples": one per sequence, as in classification). Each rank's gradient
    is weighted by its part of that over the step, so their sum is exactly the mean over the global step."""

    def __post_init__(self) -> None:
        values = tuple(float(value) for value in self.cost)
        bad = next((index for index, value in enumerate(values) if not (math.isfinite(value) and value > 0)), None)
        if bad is not None:
            raise ConfigError(f"sample costs must be positive numbers, got {values[bad]!r} at index {bad}")
        if self.mean_over not in ("cost", "samples"):
            raise ConfigError(f"mean_over must be cost or samples, got {self.mean_over!r}")
        object.__setattr__(self, "cost", values)

    @classmethod
    def of(cls, cost: CostBalance | Sequence[float] | Any) -> CostBalance:
        """``cost`` as is, or per-sample costs (a sequence, array or tensor) with the defaults."""
        return cost if isinstance(cost, CostBalance) else cls(cost=[float(value) for value in cost])


def pack_by_cost(costs: Sequence[float], shares: Sequence[float]) -> list[list[int]]:
    """Split samples of costs ``costs`` into one block per rank, rank r's block costing about
    ``shares[r] / sum(shares)`` of the total.

    Samples go in decreasing cost, each to the rank whose load relative to its
    share would be least after taking it (ties: the lower rank). Every rank with a
    positive share gets at least one sample when there are enough samples (taken
    from the rank holding the most), a rank with share 0 gets none, and the result
    depends only on the arguments, so every rank computes the same blocks. For the
    last sample placed on the most loaded rank r, ``load_r / target_r <= 1 + (N - 1)
    max(costs) / sum(costs)`` for N ranks with a positive share.

    Args:
        costs: the cost of each sample of the step (> 0), in the step's order.
        shares: each rank's weight (>= 0, not all 0): the allocation's shares.

    Returns:
        Per rank, the positions in ``costs`` of its samples, in increasing order.

    Raises:
        ConfigError: a cost that is not positive, or shares that are negative or all zero.
    """
    if any(not (cost > 0) for cost in costs):
        raise ConfigError(f"sample costs must be positive numbers, got {min(costs)!r}")
    if any(not (share >= 0) for share in shares) or not sum(shares) > 0:
        raise ConfigError(f"shares must be >= 0 and not all zero, got {list(shares)}")
    active = [rank for rank, share in enumerate(shares) if share > 0]
    blocks: list[list[int]] = [[] for _ in shares]
    loads = {rank: 0.0 for rank in active}
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    for index in order:
        cost = costs[index]
        rank = min(active, key=lambda r: ((loads[r] + cost) / shares[r], r))
        blocks[rank].append(index)
        loads[rank] += cost
    for rank in active:  # a rank with a share joins every step it can: take a sample from the fullest block
        if not blocks[rank]:
            donor = max(active, key=lambda r: (len(blocks[r]), -r))
            if len(blocks[donor]) < 2:
                break
            smallest = min(blocks[donor], key=lambda i: (costs[i], i))
            blocks[donor].remove(smallest)
            blocks[rank].append(smallest)
    return [sorted(block) for block in blocks]


def block_costs(costs: Sequence[float], blocks: Sequence[Sequence[int]]) -> list[float]:
    """The total cost of each block."""
    return [float(sum(costs[i] for i in block)) for block in blocks]

