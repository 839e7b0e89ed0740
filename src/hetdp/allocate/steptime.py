"""A rank's step time as a function of its share, from what it measured: the piecewise rule's model.

The task-allocation paper's rule assumes time proportional to the share. Where a
rank runs its share as micro-batches (a memory cap), time jumps wherever one more
sample needs one more micro-batch, and no shares equalize the ranks' times: the
rule oscillates around the jump or stalls before it. Here such a rank's time is
``per_forward * ceil(share / chunk) + per_sample * share``: the micro-batch size
``chunk`` is known (the loop decides it), the cost of one more micro-batch is
fitted to the times measured at the shares tried so far, and the line runs
through the latest measurement, as the paper's does. Elsewhere it is the
paper's proportional model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetdp.errors import ConfigError


@dataclass(frozen=True)
class StepTime:
    """One rank's step time, in seconds, at any share."""

    per_forward_s: float
    """Seconds each micro-batch costs on top of its samples."""
    per_sample_s: float
    """Seconds per sample."""
    chunk: int | None
    """The most samples one forward holds on this rank (None: the whole share in one)."""

    def forwards(self, share: int) -> int:
        return max(1, math.ceil(share / self.chunk)) if self.chunk else 1

    def seconds(self, share: int) -> float:
        return self.per_forward_s * self.forwards(share) + self.per_sample_s * share

    def table(self, total: int, cap: int | None = None) -> list[float]:
        """Seconds at shares 0..total, ``inf`` above ``cap`` (shares the rank may not take)."""
        return [self.seconds(share) if cap is None or share <= cap else math.inf for share in range(total + 1)]


def fit_step_time(points: Sequence[tuple[int, float]], chunk: int | None = None) -> StepTime:
    """A rank's step time from its measured ``(share, seconds per step)`` points, oldest first.

    The model runs through the latest point, as the paper's does, so re-planning
    stays the paper's fixed-point iteration (equal times, which is the best step
    where time is continuous in the share) and the noise of one measurement moves
    it no more than it moves the paper's. Only the cost of one more micro-batch of
    ``chunk`` samples comes from all the points: a non-negative least-squares fit
    of ``fixed + per_forward * forwards + per_sample * share``. Where every share
    measured ran as the same number of micro-batches, the fixed cost cannot be
    told from the micro-batch cost and all of it counts per micro-batch: that
    predicts a gain from fewer, fuller micro-batches, so a plan explores towards
    them and its own measurement then separates the two.

    A rank that never splits its share (``chunk`` None), a single share measured,
    or times that do not grow with the share (noise on nearby shares) give the
    paper's model: time proportional to the share, through the latest point.

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
    latest_share, latest_s = points[-1]
    proportional = StepTime(0.0, latest_s / latest_share, chunk)
    shares = np.array([share for share, _ in points], dtype=float)
    if chunk is None or len(set(shares.tolist())) < 2:
        return proportional
    # scipy here, not with hetdp: only ranks that run micro-batches fit a step time (see _t_quantile in adaptive.py)
    from scipy.optimize import nnls

    seconds = np.array([value for _, value in points], dtype=float)
    forwards = np.ceil(shares / chunk)
    if len(set(forwards.tolist())) > 1:
        coefficients, _ = nnls(np.stack([np.ones_like(shares), forwards, shares], axis=1), seconds)
        per_forward = float(coefficients[1])
    else:
        coefficients, _ = nnls(np.stack([np.ones_like(shares), shares], axis=1), seconds)
        if not coefficients[1] > 0:
            return proportional
        per_forward = float(coefficients[0] / forwards[0])
    latest_forwards = max(1, math.ceil(latest_share / chunk))
    per_forward = min(per_forward, latest_s / latest_forwards)  # the latest point's time bounds its parts
    return StepTime(per_forward, max(0.0, latest_s - per_forward * latest_forwards) / latest_share, chunk)
