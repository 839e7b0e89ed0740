"""Integer apportionment: split a total into integer shares proportional to weights."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from hetdp.errors import ConfigError


def apportion(weights: Sequence[float], total: int, minimum: int = 1, *,
              caps: Sequence[int | None] | None = None) -> list[int]:
    """Split ``total`` into integers proportional to ``weights``, each at least ``minimum``.

    Largest-remainder (Hamilton) method on what is left after every share gets
    its minimum, so the shares always sum to ``total`` exactly and each lies
    within one of its exact proportional value (given the minimum). With ``caps``
    (per rank, None: no cap) no share exceeds its cap: the proportional values are
    clipped to [minimum, cap] at one common level (water-filling from both sides).

    Raises:
        ConfigError: a weight is negative or not finite, all weights are zero,
            ``total < minimum * len(weights)``, or ``total`` above the sum of the caps.
    """
    quotas, shares = _quotas(weights, total, minimum, caps)
    # Largest remainders first; ties go to the larger weight, then the lower index, for determinism.
    order = sorted((i for i in range(len(shares)) if _below_cap(shares, caps, i)),
                   key=lambda i: (-(quotas[i] - shares[i]), -weights[i], i))
    for index in order[: total - sum(shares)]:
        shares[index] += 1
    return shares


def apportion_min_max(speeds: Sequence[float], total: int, minimum: int = 1, *,
                      caps: Sequence[int | None] | None = None) -> list[int]:
    """Integer shares summing to ``total`` whose slowest rank, ``max(share / speed)``, is as fast as can be.

    That is what a step waits for, so the adaptive allocator rounds this way. From
    the floors of the proportional values, each leftover unit goes to the rank
    whose time after taking it is least, a rank taking more than one if that is
    cheapest: speeds [0.25, 0.25, 4.25] of 200 are [10, 10, 180] (a 42.4 step),
    where every floor-or-ceiling rounding of [10.5, 10.5, 178.9] takes 44.
    Greedy is exact here because some min-max optimum lies at or above every floor.
    """
    _, shares = _quotas(speeds, total, minimum, caps)
    cost_of_one_more = [((shares[i] + 1) / speeds[i], i) for i in range(len(shares))
                        if speeds[i] > 0 and _below_cap(shares, caps, i)]
    heapq.heapify(cost_of_one_more)
    for _ in range(total - sum(shares)):
        _, index = heapq.heappop(cost_of_one_more)
        shares[index] += 1
        if _below_cap(shares, caps, index):
            heapq.heappush(cost_of_one_more, ((shares[index] + 1) / speeds[index], index))
    return shares


def _below_cap(shares: list[int], caps: Sequence[int | None] | None, index: int) -> bool:
    return caps is None or caps[index] is None or shares[index] < caps[index]  # type: ignore[operator]


def _quotas(weights: Sequence[float], total: int, minimum: int,
            caps: Sequence[int | None] | None = None) -> tuple[list[float], list[int]]:
    """Validate; return each share's exact proportional value and its floor (minimum and caps included)."""
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
    if caps is not None and any(cap is not None for cap in caps):
        return _capped_quotas(weights, total, minimum, caps)
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


def _capped_quotas(weights: Sequence[float], total: int, minimum: int,
                   caps: Sequence[int | None]) -> tuple[list[float], list[int]]:
    """Quotas ``clip(level * weight, minimum, cap)`` summing to ``total``, the level solved exactly.

    The sum is continuous, piecewise linear and non-decreasing in the level, with
    breakpoints where a rank meets its minimum or its cap: find the segment where
    it reaches ``total`` and solve that segment's linear equation.
    """
    if len(caps) != len(weights):
        raise ConfigError(f"caps gives {len(caps)} values for {len(weights)} weights")
    limits = [math.inf if cap is None else cap for cap in caps]
    for index, cap in enumerate(limits):
        if cap < minimum:
            raise ConfigError(f"caps must be >= the minimum {minimum}, got {cap} at index {index}")
    room = sum(minimum if weight == 0 else cap for weight, cap in zip(weights, limits))
    if total > room:
        raise ConfigError(f"total {total} exceeds the sum of the caps, {room} (caps {list(caps)})")

    def quota(weight: float, cap: float, level: float) -> float:
        # Compared with the breakpoints as computed below, so that at a rank's breakpoint it is exactly at its bound.
        if weight == 0 or level <= minimum / weight:
            return float(minimum)
        return float(cap) if level >= cap / weight else level * weight

    def quotas_at(level: float) -> list[float]:
        return [quota(weight, cap, level) for weight, cap in zip(weights, limits)]

    breaks = sorted({0.0} | {bound / weight for weight, cap in zip(weights, limits) if weight > 0
                             for bound in (minimum, cap) if math.isfinite(bound)})
    low = 0.0
    for high in breaks:
        if math.fsum(quotas_at(high)) >= total:
            break
        low = high
    else:  # past the last break the uncapped ranks grow without bound
        high = low + total / min(weight for weight, cap in zip(weights, limits) if weight > 0 and cap == math.inf)
    at_low, at_high = math.fsum(quotas_at(low)), math.fsum(quotas_at(high))
    level = high if at_high == at_low else low + (total - at_low) * (high - low) / (at_high - at_low)
    quotas = quotas_at(level)
    return quotas, [min(math.floor(quota + 1e-9), int(min(cap, total))) for quota, cap in zip(quotas, limits)]
