"""A rank's step time as a function of its share, fitted to what it measured: the piecewise rule's model.

The task-allocation paper's rule assumes time proportional to the share. Where a
rank runs its share as micro-batches (a memory cap), time jumps wherever one more
sample needs one more micro-batch, and no shares equalize the ranks' times: the
rule oscillates around the jump or stalls before it. Here such a rank's time is
``overhead + per_forward * ceil(share / chunk) + per_sample * share``, where the
micro-batch size ``chunk`` is known (the loop decides it) and the three
coefficients are fitted, non-negative, to the times measured at the shares tried
so far. Elsewhere it is the paper's proportional model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from hetdp.errors import ConfigError


@dataclass(frozen=True)
class StepTime:
    """One rank's fitted step time, in seconds, at any share."""

    overhead_s: float
    """Seconds every step costs whatever the share."""
    per_forward_s: float
    """Seconds each micro-batch costs on top of its samples."""
    per_sample_s: float
    """Seconds per sample."""
    chunk: int | None
    """The most samples one forward holds on this rank (None: the whole share in one)."""

    def forwards(self, share: int) -> int:
        return max(1, math.ceil(share / self.chunk)) if self.chunk else 1

    def seconds(self, share: int) -> float:
        return self.overhead_s + self.per_forward_s * self.forwards(share) + self.per_sample_s * share

    def table(self, total: int, cap: int | None = None) -> list[float]:
        """Seconds at shares 0..total, ``inf`` above ``cap`` (shares the rank may not take)."""
        return [self.seconds(share) if cap is None or share <= cap else math.inf for share in range(total + 1)]


def fit_step_time(points: Sequence[tuple[int, float]], chunk: int | None = None) -> StepTime:
    """Fit a rank's step time to its measured ``(share, seconds per step)`` points, oldest first.

    A rank that never splits its share (``chunk`` None) keeps the paper's model:
    time proportional to the share, through its latest point. Its time is then a
    continuous curve, on which the rule's fixed point (equal times) is already the
    best step, and a fitted fixed cost would only add the noise of its estimate.

    A rank that runs micro-batches of ``chunk`` samples gets a non-negative least
    squares fit. Shares with different micro-batch counts: all three coefficients;
    a cost per sample of 0 is a staircase (micro-batches below the device's knee
    cost the same whatever their size). Shares that all run as the same count: a
    fixed cost plus a cost per sample, the fixed cost counted per micro-batch,
    since the two cannot be told apart: that predicts a gain from fewer, fuller
    micro-batches, so a plan explores towards them and its own measurement then
    separates the two costs. A fit in which time does not grow with the share
    (noise on nearby shares), or a single share measured, falls back to the
    proportional model.

    Raises:
        ConfigError: no point, a share below 1, or a time that is not a positive number.
    """
    if not points:
        raise ConfigError("fitting a step time needs at least one measured (share, seconds) point")
    for share, seconds in points:
        if share < 1 or not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(f"measured points need shares >= 1 and positive seconds, got ({share}, {seconds})")
    if chunk is not None and chunk < 1:
        raise ConfigError(f"chunk must be >= 1 sample (or None), got {chunk}")
    latest_share, latest_seconds = points[-1]
    proportional = StepTime(0.0, 0.0, latest_seconds / latest_share, chunk)
    shares = np.array([share for share, _ in points], dtype=float)
    if chunk is None or len(set(shares.tolist())) < 2:
        return proportional
    seconds = np.array([value for _, value in points], dtype=float)
    forwards = np.ceil(shares / chunk)
    varied = len(set(forwards.tolist())) > 1
    columns = [np.ones_like(shares), forwards, shares] if varied else [np.ones_like(shares), shares]
    coefficients, _ = nnls(np.stack(columns, axis=1), seconds)
    if varied and coefficients[1] + coefficients[2] > 0:
        return StepTime(float(coefficients[0]), float(coefficients[1]), float(coefficients[2]), chunk)
    if not varied and coefficients[1] > 0:
        return StepTime(0.0, float(coefficients[0] / forwards[0]), float(coefficients[1]), chunk)
    return proportional
