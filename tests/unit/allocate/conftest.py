"""Fixtures shared by the allocation tests."""

import bisect
import math

import pytest


def water_level_quotas(weights, total, minimum):
    """Exact shares ``max(minimum, level * weight)`` summing to ``total``, the level found by bisection.

    An oracle independent of the library's pin-and-re-split loop.
    """
    low, high = 0.0, total / min(w for w in weights if w > 0)
    for _ in range(200):
        level = (low + high) / 2
        if sum(max(minimum, level * w) for w in weights) < total:
            low = level
        else:
            high = level
    return [max(minimum, high * w) for w in weights]


@pytest.fixture(scope="session")
def quotas():
    return water_level_quotas


def least_slowest_time(speeds, total, minimum, caps=None):
    """The least ``max(share / speed)`` of any integer shares in [minimum, cap] summing to ``total``.

    An oracle by search, not greedy: shares fit under a time t iff each rank's largest share within t,
    ``floor(t * speed)`` up to its cap, is at least the minimum and they add up to ``total``; the least such t is one of the times
    ``k / speed`` a share can take.
    """
    limits = [total if cap is None else cap for cap in (caps or [None] * len(speeds))]

    def fits(time):
        largest = [min(limit, math.floor(time * speed + 1e-9)) for speed, limit in zip(speeds, limits)]
        return min(largest) >= minimum and sum(largest) >= total

    candidates = sorted({k / speed for speed, limit in zip(speeds, limits) for k in range(minimum, limit + 1)})
    return candidates[bisect.bisect_left(candidates, True, key=fits)]


@pytest.fixture(scope="session")
def shortest_step():
    return least_slowest_time
