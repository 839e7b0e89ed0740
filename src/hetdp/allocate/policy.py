"""The allocation axis: who computes how much of every step, as small frozen specs behind one runtime interface.

``Equal`` (plain DDP), ``Static`` (your weights), ``Adaptive`` (re-planned from
measured compute times, task-allocation paper) and ``Planned`` (the C-ADP
optimizer on a cluster description) all give per-rank shares of a fixed global
batch; only ``Adaptive`` changes them as it measures. Strings name the common
ones: ``"equal"``, ``"adaptive"`` (``"adaptive:paper"``, ``"adaptive:piecewise"`` to fix its rule),
``"static:W1,W2,..."``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

import numpy as np

from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.apportion import apportion
from hetdp.allocate.membership import GAIN, NOISE_MARGIN, choose_members, why_out
from hetdp.allocate.planner import plan
from hetdp.cluster.spec import ClusterSpec
from hetdp.errors import ConfigError

NOISY = 0.1
"""A window whose mean step time is known no better than this (relative standard error) waits for more steps."""
MAX_WINDOW = 16
"""The longest a noisy window grows, in steps."""
MEMBERSHIP_STEPS = MAX_WINDOW
"""Steps a changed membership is measured for before it may change again. A change is decided on a window (two
steps at first), and a window that short, on a new group, may be noise enough to undo it at once: each change
costs a catch-up, and groups priced within the noise would take turns."""
MEETING_WINDOW = 10
"""Under partial and local synchronization, where random stragglers put the ranks out of step, an adaptive
allocation re-plans on no fewer measured steps after its first decision (``Allocator.out_of_step_window``: the
drop-in's rule, which the simulator mirrors)."""
PLAN_LAG = 2
"""Partial and local synchronization: steps a rank runs between handing its step times to a planning gather and
waiting for everyone's. The ranks there are not in step, and a gather completes only once the last rank joins it;
begun in the background and awaited this many steps later (the plan applies from then on), it has usually completed,
where a blocking gather (a meeting) would make every rank wait for the one furthest behind. A rank that does wait
keeps the partial rounds firing meanwhile (``Synchronizer.standby``)."""
TYPICAL_QUANTILE = 0.25
"""The quantile of a rank's per-step compute times that stands for its speed. A delay (a random straggler, a pause)
only ever lengthens a step, so a low quantile reads through up to three delayed steps in four, where the median
fails at half: with one straggler drawn among four ranks at every step, some rank is delayed in half of a 10-step
window about once in four windows, and a median would plan it as a slow device."""

ENV_ALLOCATION = "HETDP_ALLOCATION"
"""Set by ``hetdp run --allocation``: the allocation of a drop-in whose code does not choose one."""


def _positive_weights(weights: Sequence[float], what: str) -> None:
    if not weights or any(not (w >= 0) for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"{what} must be numbers >= 0 with a positive sum, got {list(weights)}")


@dataclass(frozen=True)
class Equal:
    """Every rank computes the same share (plain DDP): the baseline."""

    def describe(self) -> str:
        return "equal"


@dataclass(frozen=True)
class Static:
    """Shares proportional to fixed ``weights``, one per rank (for instance the devices' known speeds)."""

    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        _positive_weights(self.weights, "static weights")

    def describe(self) -> str:
        return "static:" + ",".join(f"{w:g}" for w in self.weights)


@dataclass(kw_only=True, frozen=True)
class Adaptive:
    """Shares re-planned from measured compute times (task-allocation paper, eq. 10), guarded against noise.

    Beyond the paper, once the shares are stable the allocation keeps watching at
    a small cost (one gather of a few numbers every ``watch_every`` steps) and plans
    again when some rank's speed moves by ``drift``, or a plan for the measured speeds would shorten the step by
    as much, for ``sustain`` checks in a row.
    """

    weights: tuple[float, ...] | None = None
    """The starting point, one weight per rank; None: equal."""
    replan_every: int = 2
    """Steps between re-plans until stable; 0: once per epoch, as in the paper."""
    tolerance: float = 0.02
    """A re-plan must shorten the predicted step by at least this fraction."""
    patience: int = 2
    """Calm re-plans in a row after which the shares are stable."""
    smoothing: float = 0.0
    """Weight of past speed estimates against the newest (0: the newest alone)."""
    drift: float | None = 0.2
    """Once stable, plan again when a rank runs this fraction slower or faster, or a plan would make the step this
    fraction shorter, sustained; None: freeze (paper)."""
    sit_out: bool = True
    """Under allreduce, a rank whose compute saves less than the exchange it adds leaves the step's exchange (its share
    goes to the others) and rejoins when a re-plan shows it pays (``allocate.membership``); False: every rank always
    takes part."""
    sustain: int = 2
    """Drift checks in a row that must see the change."""
    watch_every: int = 4
    """Steps between drift checks once stable."""
    rule: Literal["auto", "paper", "piecewise"] = "auto"
    """How a re-plan sets shares: "paper", proportional to measured speed (task-allocation paper, eq. 10);
    "piecewise", the exact min-max shares for step times that count each rank's micro-batches, each one's cost
    fitted to the measurements: for memory caps that split shares, where the paper's rule stalls at a jump;
    "auto", piecewise where some rank runs its share as micro-batches, the paper's rule elsewhere."""

    def __post_init__(self) -> None:
        if self.weights is not None:
            _positive_weights(self.weights, "adaptive starting weights")
        for name in ("replan_every", "watch_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an integer >= 0 steps, got {value!r}")
        if self.watch_every < 1:
            raise ConfigError(f"watch_every must be >= 1 step, got {self.watch_every}")
        if self.rule not in ("auto", "paper", "piecewise"):
            raise ConfigError(f"rule must be auto, paper or piecewise, got {self.rule!r}")

    def describe(self) -> str:
        return "adaptive" if self.rule == "auto" else f"adaptive:{self.rule}"


@dataclass(frozen=True)
class Planned:
    """Shares from the C-ADP optimizer on a cluster description, one device per rank.

    Over a dataset every rank shares, rank i takes D_i / D of every step: the plan
    weighs compute against each device's link (C-ADP paper, eq. 7) for ``epochs``
    epochs of the dataset. Over each rank's own data (``allocate(loader,
    own_data=True)``, what ``hetdp.distribute`` delivered by the plan), device i
    trains its D_i samples in batches of its own ``batch_size`` every epoch.
    """

    cluster: ClusterSpec
    _: KW_ONLY
    epochs: int = 1
    """Epochs the plan is for (a shared dataset's shares only)."""
    method: Literal["exact", "alm"] = "exact"
    """The planner's solver (a shared dataset's shares only): integer-optimal, or the paper's Algorithm 1."""

    def describe(self) -> str:
        return f"planned({self.method})"


AllocationPolicy = Equal | Static | Adaptive | Planned


def allocation_policy(spec: str | AllocationPolicy | None = None) -> AllocationPolicy:
    """The spec for ``spec``: a policy as is, ``"equal"``, ``"adaptive"``, ``"adaptive:piecewise"``,
    ``"static:W1,W2,..."``, or None for ``$HETDP_ALLOCATION`` (set by ``hetdp run --allocation``) and else
    ``"adaptive"``.

    Raises:
        ConfigError: an unknown name or bad weights.
    """
    if isinstance(spec, Equal | Static | Adaptive | Planned):
        return spec
    if spec is None:
        spec = os.environ.get(ENV_ALLOCATION) or "adaptive"
    if not isinstance(spec, str):
        raise ConfigError(f"allocation must be a name or hetdp.Equal / Static / Adaptive / Planned, got {spec!r}")
    name, _, argument = spec.partition(":")
    if spec == "equal":
        return Equal()
    if spec == "adaptive":
        return Adaptive()
    if spec == "adaptive:paper":
        return Adaptive(rule="paper")
    if spec == "adaptive:piecewise":
        return Adaptive(rule="piecewise")
    if name == "static" and argument:
        try:
            return Static(tuple(float(w) for w in argument.split(",")))
        except ValueError:
            pass
    raise ConfigError(
        f"allocation must be equal, adaptive, adaptive:paper, adaptive:piecewise or static:W1,W2,... ; got {spec!r}"
    )


_NORMAL = statistics.NormalDist()
QUANTILE_ERROR = math.sqrt(TYPICAL_QUANTILE * (1.0 - TYPICAL_QUANTILE)) / _NORMAL.pdf(_NORMAL.inv_cdf(TYPICAL_QUANTILE))
"""The standard error of a quantile of n normal steps, in units of a mean's (sigma / sqrt(n)): 1.36 for the lower
quartile. A re-plan read off the typical time must beat that noise, not a mean's."""

HALF_NORMAL_SD = math.sqrt(1.0 - 2.0 / math.pi)
"""The standard deviation of the lower half of normal noise, per unit of the noise's own (0.603)."""


def _typical(seconds: Sequence[float]) -> float:
    """The value that stands for a window's per-step ``seconds``: their lower quartile (``TYPICAL_QUANTILE``)."""
    return float(np.quantile(seconds, TYPICAL_QUANTILE))


def _spread_below_median(times: Sequence[float]) -> float:
    """The timing noise a low quantile of ``times`` (two or more) carries: the standard deviation their lower half
    shows, scaled to the whole's as for normal noise; for two values, their own.

    Delays only lengthen steps, so the steps a random straggler delayed sit in the upper half, where the low
    quantile does not read. Their spread is not noise to it: counted (as the median absolute deviation did), two
    delays in four steps made a window look too noisy to plan on, and with one random rank delayed per step the
    first plan waited for 7 to 8 steps on average where 4 tell the speeds. A rank delayed in most steps of a
    window still shows: its delays reach the lower half.
    """
    if len(times) == 2:
        return statistics.stdev(times)
    return statistics.stdev(sorted(times)[: (len(times) + 1) // 2]) / HALF_NORMAL_SD


@dataclass(frozen=True)
class _Trial:
    """A membership change on trial: the members before it, their measured step, why the others sat out, the
    speeds the change was decided on, and whether it must measure a gain (it was decided on the step's work beyond
    compute and exchange, which the model only apportions)."""

    members: list[int]
    step_s: float
    sat_out: dict[int, str]
    speeds: list[float | None]
    needs_gain: bool = False


class Allocator:
    """The shares of one run, under any policy: what every rank computes of each step of ``total`` samples.

    Only an adaptive policy moves them, from the per-step compute times the caller
    gathers from every rank (``observe``); the others only say no gather is due.
    Every rank that observes the same figures holds the same shares. ``caps`` (per
    rank, None: none) bound every policy's shares from above: a rank's memory
    where the loop runs its share as one forward. ``chunks`` are the most samples
    each rank runs per forward, for the piecewise rule's micro-batch count.
    """

    def __init__(self, policy: AllocationPolicy, world_size: int, total: int, *, dataset_size: int | None = None,
                 minimum: int = 1, caps: Sequence[int | None] | None = None,
                 chunks: Sequence[int | None] | None = None, membership: bool = False) -> None:
        if total < minimum * world_size:
            raise ConfigError(f"a global batch of {total} cannot give {world_size} ranks {minimum} sample(s) each")
        self.policy = policy
        self.world_size = world_size
        self.total = total
        self.minimum = minimum
        self.caps = None if caps is None else list(caps)
        self.chunks = None if chunks is None else list(chunks)
        weights = self._weights(policy, world_size, dataset_size)
        self.members = list(range(world_size))
        """The ranks in the step's exchange; the others sit out with no share (adaptive allocation only)."""
        self.decides_membership = membership and isinstance(policy, Adaptive) and policy.sit_out and world_size > 1
        """Whether re-plans also decide who sits out (the caller's synchronization exchanges every step)."""
        self.sat_out: dict[int, str] = {}
        """Rank -> why it sits out, as of the last re-plan."""
        self.sample_s: list[float | None] = [None] * world_size
        """Each rank's seconds per sample, as last measured (a rank that sits out keeps its last: it is modelled)."""
        self.exchange_s: dict[int, float] = {}
        """Seconds of the step's exchange, by the number of members it was measured with."""
        self._in_membership: int | None = None
        """Steps measured since the members last changed (None: they never did)."""
        self._trial: _Trial | None = None
        """The members before the last change, until the new ones' measured step has been held against theirs."""
        self._refused: dict[tuple[int, ...], list[float | None]] = {}
        """Memberships that measured slower than their predecessors, with the speeds they were tried at."""
        self.adaptive = None
        if isinstance(policy, Adaptive) and world_size > 1:  # a rank alone has no shares to re-plan
            self.adaptive = self._rule(self.members, weights)
            self.shares = list(self.adaptive.shares)
        else:
            self.shares = apportion(weights or [1.0] * world_size, total, minimum if weights is None else 0,
                                    caps=caps)
        self.replans = 0
        """Times the shares changed."""
        self._window: list[list[float]] = []
        """Every rank's compute seconds for each measured step at the current shares, not yet re-planned on."""
        self._waits: list[list[float]] = []
        """Every rank's wait seconds for the same steps (where the caller gave them)."""
        self._periods: list[list[float]] = []
        """Every rank's step period for the same steps (where the caller gave them; 0: unknown)."""
        self._extended: int | None = None
        """The longer window a too noisy one asked for."""
        self._proposed_from = 0
        """Steps of the window the last re-plan was made from."""

    def _rule(self, members: Sequence[int], weights: Sequence[float] | None) -> AdaptiveAllocator:
        """The self-adaptive rule over ``members`` (weights: every rank's starting point, or None for equal)."""
        policy: Adaptive = self.policy  # type: ignore[assignment]
        rule = policy.rule
        if rule == "auto":
            chunks = self.chunks
            rule = "piecewise" if chunks is not None and any(chunks[m] is not None for m in members) else "paper"
        return AdaptiveAllocator(
            len(members), self.total, self.minimum, initial=None if weights is None else [weights[m] for m in members],
            smoothing=policy.smoothing, tolerance=policy.tolerance, patience=policy.patience, drift=policy.drift,
            sustain=policy.sustain, rule=rule, caps=None if self.caps is None else [self.caps[m] for m in members],
            chunks=None if self.chunks is None else [self.chunks[m] for m in members],
        )

    def _full(self, member_shares: Sequence[int]) -> list[int]:
        """Every rank's share from the members' (0 for a rank that sits out)."""
        shares = [0] * self.world_size
        for rank, share in zip(self.members, member_shares):
            shares[rank] = share
        return shares

    @staticmethod
    def _weights(policy: AllocationPolicy, world_size: int, dataset_size: int | None) -> list[float] | None:
        if isinstance(policy, Static | Adaptive):
            weights = policy.weights
        elif isinstance(policy, Planned):
            if len(policy.cluster.devices) != world_size:
                raise ConfigError(
                    f"the cluster has {len(policy.cluster.devices)} devices for {world_size} ranks; give one per rank"
                )
            if dataset_size is None:
                raise ConfigError("a planned allocation needs the dataset size (a map-style dataset)")
            weights = plan(policy.cluster, dataset_size, policy.epochs, method=policy.method).samples
        else:
            return None
        if weights is not None and len(weights) != world_size:
            raise ConfigError(f"{policy.describe()} gives {len(weights)} weights for {world_size} ranks")
        return None if weights is None else [float(w) for w in weights]

    @property
    def stable(self) -> bool:
        return self.adaptive is None or self.adaptive.stable

    def window(self) -> int | None:
        """Measured steps to gather before the next re-plan: k, 0 for each epoch's end, or None when the shares
        no longer move (not adaptive, or stable and frozen). Noisy windows ask for more (see ``replan``)."""
        if self.adaptive is None:
            return None
        policy: Adaptive = self.policy  # type: ignore[assignment]
        if self.adaptive.stable:
            window = policy.watch_every if policy.drift is not None else None
        else:
            window = policy.replan_every
        if window is None:
            return None
        # A trial is judged on as many steps as the plan it tries was made from: a shorter window's noise (a random
        # straggler in two steps, say) would roll back a plan that a longer one found to pay.
        trial_steps = self._proposed_from if self.adaptive.trial is not None else 0
        return max(window, self._extended or 0, trial_steps) if window else window

    def out_of_step_window(self) -> int:
        """The fewest measured steps a re-plan takes where random stragglers put the ranks out of step (partial and
        local synchronization): ``MEETING_WINDOW``, except for the first decision. The shares that one replaces were
        never measured, and on unequal devices equal shares cost every step more than a short window's noise risks
        (the noise guard still lengthens a window too noisy to plan on, and a trial rolls back a plan that proves
        slower)."""
        return MEETING_WINDOW if self._proposed_from else 0

    @property
    def measured(self) -> int:
        """Steps measured at the current shares and not yet used by a re-plan."""
        return len(self._window)

    def measure(self, compute_s: Sequence[float], wait_s: Sequence[float] | None = None,
                period_s: Sequence[float] | None = None) -> None:
        """Record one step at the current shares: every rank's compute seconds (and wait seconds, which tell the
        exchange's time; and periods, the seconds from the rank's previous step's start to this one's, which tell
        what the step costs beyond both). A step some member did not time (it ran no forward with gradients) tells
        nothing of the speeds and is left out; a rank that sits out runs stand-ins, and its figures are not read."""
        if self.adaptive is not None and all(compute_s[rank] > 0 for rank in self.members):
            if self._in_membership is not None:
                self._in_membership += 1
            self._window.append(list(compute_s))
            self._waits.append(list(wait_s) if wait_s is not None else [])
            self._periods.append(list(period_s) if period_s is not None else [])

    def due(self, epoch_end: bool = False, min_steps: int = 0) -> bool:
        """Whether enough steps were measured to re-plan (at an epoch's end, any for a per-epoch policy); fewer
        than ``min_steps`` never are, and count towards the next re-plan."""
        window = self.window()
        if window is None:
            self._window, self._waits, self._periods = [], [], []
            return False
        measured = len(self._window)
        return measured >= max(min_steps, 1) and (measured >= window if window > 0 else epoch_end)

    def replan(self) -> list[int] | None:
        """Re-plan from the measured steps; return the new shares if they changed.

        A rank's per-step times are summarized by a low quantile (``TYPICAL_QUANTILE``),
        so steps that a random straggler delayed do not read as a slower device;
        the spread of their lower half (``_spread_below_median``; both values of a
        two-step window) is the noise a re-plan must beat. A window too noisy to tell
        anything (its mean's relative error above ``NOISY``) is kept and doubled,
        up to ``MAX_WINDOW`` steps, rather than decided on, until the shares are
        stable. A stable allocation's watch for drift decides on its own window: a
        speed that changed inside it reads as noise there, and a window grown over
        the steps after it held the change back for up to ``MAX_WINDOW`` steps; the
        watch's margin already grows with the window's noise.
        """
        if self.adaptive is None or not self._window:
            return None
        compute_s = [[row[rank] for row in self._window] for rank in self.members]  # members x steps
        steps = len(self._window)
        typical = [float(np.quantile(times, TYPICAL_QUANTILE)) for times in compute_s]
        if self._regroup(typical):
            return list(self.shares)
        step_cv = None
        if steps > 1:
            spreads = [_spread_below_median(times) / value for times, value in zip(compute_s, typical)]
            step_cv = QUANTILE_ERROR * (sum(s * s for s in spreads) / len(spreads)) ** 0.5
            if step_cv / math.sqrt(steps) > NOISY and steps < MAX_WINDOW and not self.adaptive.stable:
                self._extended = min(2 * steps, MAX_WINDOW)
                return None
        self._window, self._waits, self._periods, self._extended = [], [], [], None
        before = list(self.shares)
        self.shares = self._full(self.adaptive.update([value * steps for value in typical], steps, step_cv=step_cv))
        self._proposed_from = steps
        if self.shares == before:
            return None
        self.replans += 1
        return list(self.shares)

    def _regroup(self, typical: Sequence[float]) -> bool:
        """Decide who takes part from the window (the members' typical compute seconds per step, their waits and
        periods); return whether the members changed, and then start the rule afresh over the new ones.

        A member's seconds per sample are measured; a rank that sits out keeps the last it showed (its stand-in
        steps time nothing of its device). The exchange is what the last member to finish computing waits: the
        least wait of a step. Groups are compared by the model (``choose_members``), each member charged an equal
        part of what today's step measured beyond compute and exchange (``_measured_step``). Each change is a
        trial: once the new members ran ``MEMBERSHIP_STEPS`` steps, their measured step is held against their
        predecessors', and a change that measured slower (what the model misses: ranks that share cores or a bus),
        or, where only that charge decided it, no faster, is undone, and not tried again until some rank's speed
        moved by the policy's ``drift``.
        """
        if not self.decides_membership:
            return False
        for rank, seconds in zip(self.members, typical):
            if self.shares[rank] > 0:
                self.sample_s[rank] = seconds / self.shares[rank]
        waits = [wait for wait in self._waits if wait]
        if waits and len(self.members) > 1:
            self.exchange_s[len(self.members)] = _typical([min(wait[r] for r in self.members) for wait in waits])
        now_s, noise, beyond_s = self._measured_step()
        margin = max(GAIN, NOISE_MARGIN * noise)
        settled = self._in_membership is None or self._in_membership >= MEMBERSHIP_STEPS
        if settled and self._trial is not None and now_s is not None:
            trial, self._trial = self._trial, None
            bound = (1.0 - margin) if trial.needs_gain else (1.0 + margin)
            if now_s > bound * trial.step_s:  # the change measured slower (or no faster) than the members before it
                self._refused[tuple(self.members)] = trial.speeds
                self._switch(trial.members, trial.sat_out)
                return True
        overhead_s = beyond_s / len(self.members)
        decision = choose_members(self.sample_s, self.exchange_s, self.total, self.members, noise=noise,
                                  minimum=self.minimum, overhead_s=overhead_s)
        if list(decision.members) == self.members:
            self.sat_out = decision.sat_out
            return False
        if not settled:  # too soon after the last change to tell a gain from noise
            self._hold(decision.members, f"held out until the members have run {MEMBERSHIP_STEPS} steps since the "
                                         "last change")
            return False
        if self._was_refused(decision.members):
            self._hold(decision.members, "held out: the group measured slower with it than without it")
            return False
        if self.caps is not None and not self._fits(decision.members):
            return False  # the members' memory caps could not hold a step: nobody leaves
        self._trial = None if now_s is None else _Trial(list(self.members), now_s, dict(self.sat_out),
                                                        list(self.sample_s), decision.by_overhead)
        self._switch(decision.members, decision.sat_out)
        return True

    def _measured_step(self) -> tuple[float | None, float, float]:
        """Today's step over the window at its typical (lower-quartile) value, the relative standard error of that
        value, and the seconds of it beyond the members' compute and exchange; (None, 0, 0) where the caller gave no
        waits.

        The step is the members' longest period (one step's start to the next: the optimizer, the loop's own work
        and contention for shared cores included) where the caller gave periods, else their longest compute plus
        wait; what lies beyond is the typical period less the typical compute plus wait, 0 without periods."""
        rows = [(compute, wait, period) for compute, wait, period in zip(self._window, self._waits, self._periods)
                if wait]
        if not rows:
            return None, 0.0, 0.0
        busy = [max(compute[r] + wait[r] for r in self.members) for compute, wait, _ in rows]
        periods = [max(period[r] for r in self.members) for _, _, period in rows
                   if period and all(period[r] > 0 for r in self.members)]
        steps_s = periods or busy
        now_s = _typical(steps_s)
        noise = 0.0
        if len(steps_s) > 1 and now_s > 0:
            noise = QUANTILE_ERROR * _spread_below_median(steps_s) / now_s / math.sqrt(len(steps_s))
        return now_s, noise, max(now_s - _typical(busy), 0.0) if periods else 0.0

    def _hold(self, proposed: Sequence[int], why: str) -> None:
        """Keep today's members although the model proposes ``proposed``: each rank out says what it would save and
        cost beside today's members, and those the model would bring back say why they stay out."""
        speeds: list[float] = self.sample_s  # type: ignore[assignment]  (every rank measured: a decision was made)
        self.sat_out = {rank: why_out(rank, self.members, speeds, self.total, self.exchange_s, self.minimum)
                        + (f"; {why}" if rank in proposed else "")
                        for rank in range(self.world_size) if rank not in self.members}

    def _switch(self, members: Sequence[int], sat_out: dict[int, str]) -> None:
        """Make ``members`` the exchange's, and start the rule afresh over them from their speeds."""
        self.members, self.sat_out = list(members), dict(sat_out)
        self._in_membership = 0
        self.adaptive = self._rule(self.members, [1.0 / seconds if seconds else 1.0 for seconds in self.sample_s])
        self.shares = self._full(self.adaptive.shares)
        self._window, self._waits, self._periods, self._extended, self._proposed_from = [], [], [], None, 0
        self.replans += 1

    def _was_refused(self, members: Sequence[int]) -> bool:
        """Whether ``members`` measured slower than their predecessors at speeds still within ``drift`` of today's."""
        seen = self._refused.get(tuple(members))
        if seen is None:
            return False
        policy: Adaptive = self.policy  # type: ignore[assignment]  (only an adaptive policy decides membership)
        drift = policy.drift if policy.drift is not None else Adaptive.drift
        if any(then is not None and now is not None and abs(now - then) > drift * then
               for then, now in zip(seen, self.sample_s)):
            del self._refused[tuple(members)]
            return False
        return True

    def _fits(self, members: Sequence[int]) -> bool:
        """Whether ``members`` alone can hold a step of ``total`` samples under their memory caps (None: no cap)."""
        caps = [self.caps[rank] for rank in members]  # type: ignore[index]
        return any(cap is None for cap in caps) or sum(caps) >= self.total  # type: ignore[arg-type]

    def take(self, shares: Sequence[int]) -> None:
        """Make ``shares`` the run's from now on, set by hand (``hetdp.DDP.set_shares``): the ranks with a share are
        the members (under allreduce the others sit out), and an adaptive rule goes on from them.

        Raises:
            ConfigError: not one share >= 0 per rank summing to the global batch, or a share above its rank's cap.
        """
        shares = list(shares)
        counts = all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shares)
        if len(shares) != self.world_size or not counts or sum(shares) != self.total:
            raise ConfigError(f"shares must be {self.world_size} integers >= 0 summing to the global batch of "
                              f"{self.total}, got {shares}")
        over = [rank for rank, (n, cap) in enumerate(zip(shares, self.caps or [None] * self.world_size))
                if cap is not None and n > cap]
        if over:
            raise ConfigError(f"shares {shares} exceed the memory cap of rank {over[0]} ({self.caps[over[0]]})")
        self.shares = shares
        self.members = [rank for rank, n in enumerate(shares) if n > 0]
        self.sat_out = {rank: "its share was set to 0 (set_shares)" for rank in range(self.world_size)
                        if rank not in self.members}
        if self.adaptive is not None:
            self.adaptive = self._rule(self.members, [float(n) for n in shares])
        self._window, self._waits, self._periods, self._extended, self._proposed_from = [], [], [], None, 0
        self._in_membership = 0

    def observe(self, compute_s: Sequence[Sequence[float]]) -> list[int] | None:
        """Measure a window of steps (each rank's per-step seconds, ranks x steps) and re-plan from it."""
        for step in zip(*compute_s):
            self.measure(step)
        return self.replan()

    def state_dict(self) -> dict[str, Any]:
        return {"shares": list(self.shares), "replans": self.replans,
                "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
                "members": list(self.members), "sat_out": dict(self.sat_out), "sample_s": list(self.sample_s),
                "exchange_s": dict(self.exchange_s), "in_membership": self._in_membership,
                "trial": None if self._trial is None else dataclasses.asdict(self._trial),
                "refused": [[list(members), speeds] for members, speeds in self._refused.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["shares"]) != self.world_size or sum(state["shares"]) != self.total:
            raise ConfigError(
                f"saved shares {state['shares']} do not fit {self.world_size} ranks and a global batch of {self.total}"
            )
        self.shares = list(state["shares"])
        self.replans = int(state.get("replans", 0))
        members = [int(rank) for rank in state.get("members", range(self.world_size))]
        if self.adaptive is not None and members != self.members:
            self.members = members
            self.adaptive = self._rule(members, None)
        self.sat_out = {int(rank): why for rank, why in state.get("sat_out", {}).items()}
        self.sample_s = list(state.get("sample_s", self.sample_s))
        self.exchange_s = {int(size): float(seconds) for size, seconds in state.get("exchange_s", {}).items()}
        self._in_membership = state.get("in_membership")
        trial = state.get("trial")
        self._trial = None if trial is None else _Trial(
            [int(rank) for rank in trial["members"]], float(trial["step_s"]),
            {int(rank): why for rank, why in trial["sat_out"].items()}, list(trial["speeds"]),
            bool(trial.get("needs_gain", False)))
        self._refused = {tuple(int(rank) for rank in members): list(speeds)
                         for members, speeds in state.get("refused", [])}
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])
