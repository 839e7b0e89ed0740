"""Fixtures shared by the allocation tests."""

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
