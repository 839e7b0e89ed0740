"""The self-adaptive allocation rule (task-allocation paper, eq. 10) and the state around it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hetdp.allocate.apportion import apportion, apportion_min_max
from hetdp.errors import ConfigError


def rebalance(shares: Sequence[int], seconds: Sequence[float], total: int, minimum: int = 1) -> list[int]:
    """Self-adaptive rule: new share proportional to measured speed (share / seconds).

    Task-allocation paper, eq. 10: ``w_i <- C * (w_i / t_i) / sum_j (w_j / t_j)``,
    rounded so the shares still sum to ``total`` (C), each the floor or ceiling of
    its exact value, the leftover units placed where they lengthen the step least
    (``apportion_min_max``; the paper only says it rounds).
    """
    return apportion_min_max(measured_speeds(shares, seconds), total, minimum)


def measured_speeds(shares: Sequence[int], seconds: Sequence[float]) -> list[float]:
    """Samples per second of each rank: ``shares[i] / seconds[i]``."""
    if len(shares) != len(seconds):
        raise ConfigError(f"got {len(seconds)} compute times for {len(shares)} ranks")
    for rank, value in enumerate(seconds):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"compute times must be positive seconds, got {value!r} (rank {rank})")
    return [share / value for share, value in zip(shares, seconds)]


class AdaptiveAllocator:
    """Keep per-rank shares of a fixed total and re-plan them from measured compute times.

    Each ``update`` applies the paper's rule to speeds smoothed by an exponential
    moving average (``smoothing`` is the weight of the past; 0 trusts the newest
    measurement alone). A re-plan is applied only if it pays: if the predicted step
    time under the new shares is at least ``tolerance`` (a fraction) below the
    measured one; otherwise the shares stay, so timing noise on equal workers moves
    nothing. After ``patience`` calm updates in a row the allocation is *stable*
    and, as the paper does, re-planning stops (unless ``freeze_when_stable`` is False).

    The allocator is pure state: the caller gathers the times from every rank, and
    every rank holding the same times computes the same shares.

    Example::

        >>> allocator = AdaptiveAllocator(world_size=2, total=12)
        >>> allocator.shares
        [6, 6]
        >>> allocator.update([3.0, 1.0])  # rank 1 did the same work 3x faster
        [3, 9]
    """

    def __init__(
        self,
        world_size: int,
        total: int,
        minimum: int = 1,
        *,
        initial: Sequence[float] | None = None,
        smoothing: float = 0.0,
        tolerance: float = 0.02,
        patience: int = 1,
        freeze_when_stable: bool = True,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if not 0.0 <= smoothing < 1.0:
            raise ConfigError(f"smoothing must be in [0, 1), got {smoothing!r}")
        if not tolerance >= 0:
            raise ConfigError(f"tolerance must be >= 0, got {tolerance!r}")
        if patience < 1:
            raise ConfigError(f"patience must be >= 1, got {patience}")
        if initial is not None and len(initial) != world_size:
            raise ConfigError(f"initial gives {len(initial)} weights for {world_size} ranks")
        self.total = total
        self.minimum = minimum
        self.smoothing = smoothing
        self.tolerance = tolerance
        self.patience = patience
        self.freeze_when_stable = freeze_when_stable
        self.shares = apportion(initial or [1.0] * world_size, total, minimum)
        self.speeds: list[float] | None = None
        self.calm_updates = 0
        self.updates = 0

    @property
    def stable(self) -> bool:
        """Whether the shares stopped moving (then ``update`` keeps them if frozen)."""
        return self.calm_updates >= self.patience

    def update(self, compute_seconds: Sequence[float]) -> list[int]:
        """Re-plan from each rank's compute time for its current share; return the new shares."""
        if self.stable and self.freeze_when_stable:
            return list(self.shares)
        speeds = measured_speeds(self.shares, compute_seconds)
        if self.speeds is not None and self.smoothing:
            speeds = [self.smoothing * old + (1 - self.smoothing) * new for old, new in zip(self.speeds, speeds)]
        self.speeds = speeds
        new_shares = apportion_min_max(speeds, self.total, self.minimum)
        measured_step_s = max(share / speed for share, speed in zip(self.shares, speeds))
        predicted_step_s = max(share / speed for share, speed in zip(new_shares, speeds))
        too_small_a_gain = self.tolerance > 0 and predicted_step_s > (1.0 - self.tolerance) * measured_step_s
        if too_small_a_gain or new_shares == self.shares:
            self.calm_updates += 1
        else:
            self.calm_updates = 0
            self.shares = new_shares
        self.updates += 1
        return list(self.shares)

    def state_dict(self) -> dict[str, Any]:
        return {
            "shares": list(self.shares),
            "speeds": self.speeds,
            "calm_updates": self.calm_updates,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["shares"]) != len(self.shares) or sum(state["shares"]) != self.total:
            raise ConfigError(
                f"allocator state has shares {state['shares']}, which do not fit {len(self.shares)} ranks "
                f"and total {self.total}"
            )
        self.shares = list(state["shares"])
        self.speeds = state["speeds"]
        self.calm_updates = state["calm_updates"]
        self.updates = state["updates"]
