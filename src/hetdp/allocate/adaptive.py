"""The self-adaptive allocation rule (task-allocation paper, eq. 10), a piecewise refinement, and the state around
them."""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from hetdp.allocate.apportion import apportion, apportion_min_max
from hetdp.allocate.minmax import min_max_shares
from hetdp.allocate.steptime import StepTime, fit_step_time
from hetdp.errors import ConfigError

POINTS_PER_RANK = 6
"""Measured shares a rank's fitted step time remembers (the latest); older ones may predate a change of speed."""
VERDICTS_TO_REJECT = 2
"""Trials a plan must fail before it is not tried again. One verdict can be a random straggler's doing (a rank
delayed in three of a trial's four steps reads as slower than before); a plan banned for it stayed out for good."""


class Proposal(NamedTuple):
    """The rule's re-plan for one window, computed without changing the allocator."""

    shares: list[int]
    step_s: float
    """The step's seconds at the current shares, on the speeds the rule read."""
    predicted_step_s: float
    """The step's seconds under ``shares``."""
    speeds: list[float]
    """The speeds the rule read (smoothed, under the paper's rule with ``smoothing``): its memory if adopted."""


def rebalance(shares: Sequence[int], seconds: Sequence[float], total: int, minimum: int = 1, *,
              caps: Sequence[int | None] | None = None) -> list[int]:
    """Self-adaptive rule: new share proportional to measured speed (share / seconds).

    Task-allocation paper, eq. 10: ``w_i <- C * (w_i / t_i) / sum_j (w_j / t_j)``,
    rounded so the shares still sum to ``total`` (C) with the shortest step any
    integer shares allow (``apportion_min_max``; the paper only says it rounds,
    and rounding each share to its floor or ceiling can cost a few percent of a
    step, more than the gain a re-plan must show). With ``caps``, no share
    exceeds its cap and the others take the rest in proportion.
    """
    return apportion_min_max(measured_speeds(shares, seconds), total, minimum, caps=caps)


def replan_piecewise(models: Sequence[StepTime], total: int, minimum: int = 1, *,
                     caps: Sequence[int | None] | None = None) -> list[int]:
    """The piecewise rule: the exact min-max shares (``min_max_shares``) for fitted step times (``StepTime``)."""
    limits = caps or [None] * len(models)
    return min_max_shares([model.table(total, cap) for model, cap in zip(models, limits)], total, minimum)


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

    Each ``update`` applies the paper's rule (``rebalance``) to speeds smoothed by
    an exponential moving average (``smoothing`` is the weight of the past; 0
    trusts the newest measurement alone). A re-plan is applied only if it pays: if
    the predicted step time under the new shares is at least ``tolerance`` (a
    fraction) below the measured one, and by more than twice the standard error of
    the window's mean step time when the caller reports the timing noise
    (``step_cv``); otherwise the shares stay, so timing noise on equal workers
    moves nothing. With ``verify``, an applied re-plan is a trial: if the next
    measurement finds the step slower than before it, the old shares come back, and
    a plan that failed ``VERDICTS_TO_REJECT`` trials is not tried again. This
    catches what the rule cannot see, such as ranks that share cores or a bus,
    where one rank's measured speed depends on the others' shares.

    After ``patience`` calm updates in a row the allocation is *stable*. As the
    paper does, re-planning then stops (``drift=None``), unless
    ``freeze_when_stable`` is False. Beyond the paper, with ``drift`` set, a
    stable allocator keeps comparing each update's measured speeds with those it
    settled on, and plans again once some rank runs ``drift`` (a fraction) slower
    or faster for ``sustain`` updates in a row: a co-tenant job or a throttled
    device, which a frozen allocation would leave as the straggler for good. It
    also plans again when, as long, the rule's plan for the measured speeds would
    shorten the step by ``drift``: shares that settled where an early window's
    noise hid a real gain are not kept for good (a plan rejected in trials does
    not count: it was measured not to pay).

    With ``rule="piecewise"`` (beyond the paper), a re-plan is not proportional
    to speed: a rank that runs micro-batches of ``chunks[i]`` samples gets a step
    time through its latest measurement plus a fitted cost per micro-batch
    (``fit_step_time``), and the new shares are the exact min-max ones for those
    times (``min_max_shares``). Where one more sample means one more micro-batch,
    time jumps and no shares equalize the ranks: the paper's rule then stalls
    before the jump or oscillates around it, while the fit learns the jump from
    the measurements on both sides of it. Ranks without micro-batches keep the
    paper's proportional model, so without any the two rules plan alike.

    ``caps`` (per rank, None: no cap) bound the shares from above under either
    rule: a loop that runs each share as one forward cannot exceed its memory.

    The allocator is pure state: the caller gathers the times from every rank, and
    every rank holding the same times computes the same shares.

    Examples:
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
        verify: bool = True,
        drift: float | None = None,
        sustain: int = 2,
        rule: Literal["paper", "piecewise"] = "paper",
        caps: Sequence[int | None] | None = None,
        chunks: Sequence[int | None] | None = None,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if not 0.0 <= smoothing < 1.0:
            raise ConfigError(f"smoothing must be in [0, 1), got {smoothing!r}")
        if not tolerance >= 0:
            raise ConfigError(f"tolerance must be >= 0, got {tolerance!r}")
        if patience < 1:
            raise ConfigError(f"patience must be >= 1, got {patience}")
        if drift is not None and not drift > 0:
            raise ConfigError(f"drift must be a fraction > 0 (or None: freeze once stable), got {drift!r}")
        if sustain < 1:
            raise ConfigError(f"sustain must be >= 1 update, got {sustain}")
        if initial is not None and len(initial) != world_size:
            raise ConfigError(f"initial gives {len(initial)} weights for {world_size} ranks")
        if rule not in ("paper", "piecewise"):
            raise ConfigError(f"rule must be paper or piecewise, got {rule!r}")
        for name, values in (("caps", caps), ("chunks", chunks)):
            if values is not None and len(values) != world_size:
                raise ConfigError(f"{name} gives {len(values)} values for {world_size} ranks")
        _stdtrit()
        self.total = total
        self.minimum = minimum
        self.smoothing = smoothing
        self.tolerance = tolerance
        self.patience = patience
        self.freeze_when_stable = freeze_when_stable
        self.verify = verify
        self.drift = drift
        self.sustain = sustain
        self.rule = rule
        self.caps = None if caps is None else list(caps)
        self.chunks = list(chunks) if chunks is not None else [None] * world_size
        self.shares = apportion(initial or [1.0] * world_size, total, minimum, caps=self.caps)
        self.points: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(world_size)]
        """Per rank, the seconds per step measured at each share it computed (the latest ``POINTS_PER_RANK``)."""
        self.speeds: list[float] | None = None
        self.trial: tuple[list[int], float] | None = None
        """While a re-plan is on trial: the shares it replaced and their measured step seconds."""
        self.rejected: list[list[int]] = []
        """Plans that measured slower than the ones they replaced, once per verdict; proposing one that failed
        ``VERDICTS_TO_REJECT`` trials counts as calm."""
        self.noise_cv = 0.0
        """Relative standard deviation of one step's compute time, pooled over the updates that reported it since
        the shares last changed: other shares have other noise (ranks sharing cores contend differently), and a
        noisy first window must not hold back the re-plans after it."""
        self._noise_reports = 0
        self._noise_dof = 0
        """Degrees of freedom of ``noise_cv``: ranks x (steps - 1) per report."""
        self.calm_updates = 0
        self.updates = 0
        self.settled_speeds: list[float] | None = None
        """The measured speeds the stable shares were kept for: what ``drift`` is measured against."""
        self.unfit_updates = 0
        """Stable updates in a row whose shares no longer fit: speeds moved by ``drift`` or more, or a plan would
        shorten the step by as much."""
        self.restarts = 0
        """Times a stable allocator planned again: a sustained drift, or shares that no longer fit."""

    @property
    def stable(self) -> bool:
        """Whether the shares stopped moving (then ``update`` keeps them, or only watches for drift)."""
        return self.calm_updates >= self.patience

    def update(self, compute_seconds: Sequence[float], steps: int = 1, *, step_cv: float | None = None) -> list[int]:
        """Re-plan from each rank's compute time over ``steps`` steps at its current share; return the new shares.

        ``step_cv``: the relative standard deviation of one step's compute time seen in
        this window (pooled over ranks), if the caller measured it; a re-plan must then
        promise a gain beyond what that noise explains.
        """
        if steps < 1:
            raise ConfigError(f"steps must be >= 1, got {steps}")
        window_shares = [share * steps for share in self.shares]
        measured = measured_speeds(window_shares, compute_seconds)
        self._record(compute_seconds, steps)
        if self.stable and self.freeze_when_stable:
            if self.drift is None:
                return list(self.shares)
            reason = self._unfit(window_shares, measured, compute_seconds, steps, step_cv)
            if reason is None:
                return list(self.shares)
            self._restart(drifted=reason == "drift")
        if step_cv is not None:
            if not (math.isfinite(step_cv) and step_cv >= 0):
                raise ConfigError(f"step_cv must be a finite fraction >= 0, got {step_cv!r}")
            self._noise_reports += 1
            self._noise_dof += len(self.shares) * max(steps - 1, 1)
            self.noise_cv = math.sqrt(self.noise_cv**2 + (step_cv**2 - self.noise_cv**2) / self._noise_reports)
        step_s = max(share / speed for share, speed in zip(self.shares, measured))
        self.updates += 1
        if self.trial is not None:
            replaced_shares, replaced_step_s = self.trial
            self.trial = None
            if step_s > replaced_step_s:
                self.rejected.append(self.shares)
                self._set_shares(replaced_shares)
                self._calm(measured)
                return list(self.shares)
            self.rejected.clear()  # the world changed or the plan paid: earlier verdicts may no longer hold
        proposal = self._proposal(window_shares, measured, compute_seconds)
        self.speeds = proposal.speeds
        new_shares = proposal.shares
        # A 95% bound on the error of the slowest of the ranks' window means (Bonferroni over the ranks, since the
        # largest of several noisy means overstates): Student's t, as a few steps estimate the noise poorly.
        confidence = 1.0 - 0.025 / len(self.shares)
        t_quantile = _t_quantile(self._noise_dof, confidence) if self._noise_dof else 2.0
        required_gain = max(self.tolerance, t_quantile * self.noise_cv / math.sqrt(steps))
        too_small_a_gain = required_gain > 0 and proposal.predicted_step_s > (1.0 - required_gain) * proposal.step_s
        if too_small_a_gain or new_shares == self.shares or self._banned(new_shares):
            self._calm(measured)
        else:
            self.calm_updates = 0
            if self.verify:
                self.trial = (self.shares, step_s)
            self._set_shares(new_shares)
        return list(self.shares)

    def _banned(self, shares: list[int]) -> bool:
        """Whether ``shares`` failed enough trials not to be tried again."""
        return self.rejected.count(shares) >= VERDICTS_TO_REJECT

    def _proposal(self, window_shares: list[int], measured: list[float], compute_seconds: Sequence[float]
                  ) -> Proposal:
        """The rule's re-plan for the window (watching a stable allocation asks for one too, so it changes nothing)."""
        if self.rule == "piecewise":
            models = self.models()
            new_shares = replan_piecewise(models, self.total, self.minimum, caps=self.caps)
            return Proposal(new_shares, max(model.seconds(share) for model, share in zip(models, self.shares)),
                            max(model.seconds(share) for model, share in zip(models, new_shares)), measured)
        return self._proportional(window_shares, measured, compute_seconds)

    def _proportional(self, window_shares: list[int], measured: list[float], compute_seconds: Sequence[float]
                      ) -> Proposal:
        """The paper's re-plan on (smoothed) speeds."""
        speeds = measured
        if self.speeds is not None and self.smoothing:
            speeds = [self.smoothing * old + (1 - self.smoothing) * new for old, new in zip(self.speeds, measured)]
            new_shares = rebalance(window_shares, [w / v for w, v in zip(window_shares, speeds)], self.total,
                                   self.minimum, caps=self.caps)
        else:
            new_shares = rebalance(window_shares, compute_seconds, self.total, self.minimum, caps=self.caps)
        return Proposal(new_shares, max(share / speed for share, speed in zip(self.shares, speeds)),
                        max(share / speed for share, speed in zip(new_shares, speeds)), speeds)

    def _record(self, compute_seconds: Sequence[float], steps: int) -> None:
        """Remember each rank's seconds per step at its current share (the piecewise rule's points)."""
        for points, share, seconds in zip(self.points, self.shares, compute_seconds):
            if share > 0:
                points.pop(share, None)
                points[share] = seconds / steps
                while len(points) > POINTS_PER_RANK:
                    points.popitem(last=False)

    def models(self) -> list[StepTime]:
        """Each rank's step time fitted to its measured points (the piecewise rule's model)."""
        return [fit_step_time(list(points.items()) or [(1, 1.0)], chunk)
                for points, chunk in zip(self.points, self.chunks)]

    def _calm(self, measured: list[float]) -> None:
        self.calm_updates += 1
        if self.stable:
            self.settled_speeds = measured

    def _unfit(self, window_shares: list[int], measured: list[float], compute_seconds: Sequence[float], steps: int,
               step_cv: float | None) -> Literal["drift", "misfit"] | None:
        """Why the stable shares no longer fit, once that held for ``sustain`` updates in a row, beyond ``drift``
        and three standard errors of the window's timing noise: "drift", some rank's speed moved from the settled
        speeds; "misfit", the rule's plan for the measured speeds (one not rejected) would shorten the step. A
        misfit without a drift means the shares settled wrong: a window whose noise was overstated (a rank a
        random straggler delayed in half its steps) hid a real gain until the allocation counted itself calm."""
        margin = max(self.drift, 3.0 * (step_cv or 0.0) / math.sqrt(steps))  # type: ignore[type-var]
        settled = self.settled_speeds or measured
        reason: Literal["drift", "misfit"] | None = None
        if max(abs(new / old - 1.0) for new, old in zip(measured, settled)) >= margin:
            reason = "drift"
        else:
            proposal = self._proposal(window_shares, measured, compute_seconds)
            if (proposal.shares != self.shares and not self._banned(proposal.shares)
                    and proposal.predicted_step_s <= (1.0 - margin) * proposal.step_s):
                reason = "misfit"
        self.unfit_updates = self.unfit_updates + 1 if reason else 0
        return reason if self.unfit_updates >= self.sustain else None

    def _restart(self, drifted: bool) -> None:
        """Plan again: forget the smoothing memory, noise and calm, and after a drift what held for the old speeds,
        the verdicts and every measured point but the window that showed the change."""
        self.calm_updates = self.unfit_updates = 0
        self.speeds = self.trial = self.settled_speeds = None
        self.noise_cv, self._noise_reports, self._noise_dof = 0.0, 0, 0
        if drifted:
            self.rejected = []
            self.points = [OrderedDict(list(points.items())[-1:]) for points in self.points]
        self.restarts += 1

    def _set_shares(self, shares: list[int]) -> None:
        self.shares = shares
        self.noise_cv, self._noise_reports, self._noise_dof = 0.0, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "shares": list(self.shares),
            "speeds": self.speeds,
            "calm_updates": self.calm_updates,
            "updates": self.updates,
            "trial": self.trial,
            "rejected": self.rejected,
            "noise_cv": self.noise_cv,
            "noise_reports": self._noise_reports,
            "noise_dof": self._noise_dof,
            "settled_speeds": self.settled_speeds,
            "unfit_updates": self.unfit_updates,
            "restarts": self.restarts,
            "points": [list(points.items()) for points in self.points],
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
        trial = state.get("trial")
        self.trial = None if trial is None else (list(trial[0]), float(trial[1]))
        self.rejected = [list(shares) for shares in state.get("rejected", [])]
        self.noise_cv = float(state.get("noise_cv", 0.0))
        self._noise_reports = int(state.get("noise_reports", 0))
        self._noise_dof = int(state.get("noise_dof", 0))
        self.settled_speeds = state.get("settled_speeds")
        self.unfit_updates = int(state.get("unfit_updates", 0))
        self.restarts = int(state.get("restarts", 0))
        self.points = [OrderedDict((int(share), float(seconds)) for share, seconds in points)
                       for points in state.get("points", [[] for _ in self.points])]


@functools.cache
def _stdtrit() -> Callable[[float, float], Any]:
    """scipy's Student's t quantile, imported by a process's first allocator, before its loop: importing scipy with
    hetdp (about 0.5 s of CPU) would charge every launcher and CLI command, and at the first re-plan it stalled a
    training step (seen on a GPU: the loop stood still for the import)."""
    from scipy.special import stdtrit

    return stdtrit


def _t_quantile(dof: int, probability: float) -> float:
    return float(_stdtrit()(dof, probability))
