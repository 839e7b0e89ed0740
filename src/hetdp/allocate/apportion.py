"""Integer apportionment: split a total into integer shares proportional to weights."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from hetdp.errors import ConfigError


def apportion(weights: Sequence[float], total: int, minimum: int = 1) -> list[int]:
    """Split ``total`` into integers proportional to ``weights``, each at least ``minimum``.

    Largest-remainder (Hamilton) method on what is left after every share gets
    its minimum, so the shares always sum to ``total`` exactly and each lies
    within one of its exact proportional value (given the minimum).

    Raises:
        ConfigError: a weight is negative or not finite, all weights are zero, or
            ``total < minimum * len(weights)``.
    """
    quotas, shares = _quotas(weights, total, minimum)
    # Largest remainders first; ties go to the larger weight, then the lower index, for determinism.
    order = sorted(range(len(shares)), key=lambda i: (-(quotas[i] - shares[i]), -weights[i], i))
    for index in order[: total - sum(shares)]:
        shares[index] += 1
    return shares


def apportion_min_max(speeds: Sequence[float], total: int, minimum: int = 1) -> list[int]:
    """Like ``apportion``, but the leftover units go where they cost the least time.

    Each share is still the floor or the ceiling of its proportional value, but of
    those roundings this one minimizes the slowest rank's time ``share / speed``:
    each leftover unit goes to the rank whose time after taking it is smallest.
    That is what a step waits for, so the adaptive allocator rounds this way.
    """
    _, shares = _quotas(speeds, total, minimum)
    # Each rank is rounded up at most once: the leftover units go to the ranks whose time after one more is least.
    cost_of_one_more = [((shares[i] + 1) / speeds[i], i) for i in range(len(shares)) if speeds[i] > 0]
    for _, index in heapq.nsmallest(total - sum(shares), cost_of_one_more):
        shares[index] += 1
    return shares


def _quotas(weights: Sequence[float], total: int, minimum: int) -> tuple[list[float], list[int]]:
    """Validate; return each share's exact proportional value and its floor (minimum included)."""
    count = len(weights)
    if count == 0:
        raise ConfigError("apportion needs at least one weight")
    for index, weight in enumerate(weights):
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"weights must be finite and >= 0, got {weight!r} at index {index}")
    if minimum < 0:
        raise ConfigError(f"minimum must be >= 0, got {minimum}")
    if total < minimum * count:
        raise ConfigError(f"total {total} cannot give {count} shares of at least {minimum}")
    if math.fsum(weights) <= 0:
        raise ConfigError(f"weights must not all be zero, got {list(weights)}")
    # Proportional values, with any below the minimum pinned to it and the rest re-split (water-filling),
    # so a minimum that binds for one rank does not skew the others: [1, 1, 2, 4] of 128 is 16, 16, 32, 64.
    pinned: set[int] = set()
    while True:
        free_total = total - minimum * len(pinned)
        free_weight = math.fsum(weight for index, weight in enumerate(weights) if index not in pinned)
        quotas = [minimum if index in pinned else free_total * weight / free_weight for index, weight in enumerate(weights)]
        below = {index for index, quota in enumerate(quotas) if quota < minimum and index not in pinned}
        if not below:
            return quotas, [math.floor(quota) for quota in quotas]
        pinned |= below
