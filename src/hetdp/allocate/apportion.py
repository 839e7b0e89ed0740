"""Integer apportionment: split a total into integer shares proportional to weights."""

from __future__ import annotations

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
    weight_sum = math.fsum(weights)
    if weight_sum <= 0:
        raise ConfigError(f"weights must not all be zero, got {list(weights)}")

    spare = total - minimum * count
    quotas = [spare * weight / weight_sum for weight in weights]
    shares = [math.floor(quota) for quota in quotas]
    leftover = spare - sum(shares)
    # Largest remainders first; ties go to the larger weight, then the lower index, for determinism.
    order = sorted(range(count), key=lambda i: (-(quotas[i] - shares[i]), -weights[i], i))
    for index in order[:leftover]:
        shares[index] += 1
    return [share + minimum for share in shares]
