"""Who takes part in the synchronous exchange: a rank whose compute saves less than the exchange it adds sits out.

The self-adaptive rule gives every rank a share proportional to its speed, so a
group of ranks computes a step of ``total`` samples in ``total / sum(speeds)``
seconds, then exchanges its gradient. A slow rank shortens the compute a little
and lengthens the exchange (one more peer in the allreduce): a GPU beside three
CPU cores trains faster alone. The decision here is a pure function of measured
figures (each rank's seconds per sample, the exchange's seconds at the group
sizes seen, and what today's step costs beyond both), so every rank that holds the same figures decides the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetdp.allocate.apportion import apportion_min_max
from hetdp.errors import ConfigError

GAIN = 0.05
"""A change of membership must shorten the predicted step by at least this fraction: a rank that leaves or rejoins
costs a catch-up broadcast."""
NOISE_MARGIN = 2.0
"""A change of membership must also shorten the predicted step by this many standard errors of the measured step:
a gain inside the noise is no gain, and two groups priced within it would take turns."""


def exchange_s(size: int, measured: Mapping[int, float]) -> float:
    """Seconds of a synchronous exchange among ``size`` ranks: measured at that size, else scaled from the nearest
    measured size as a ring allreduce's traffic per rank, ``(k - 1) / k`` of the gradient; 0 for one rank.

    Raises:
        ConfigError: ``size`` < 1.
    """
    if size < 1:
        raise ConfigError(f"a group has at least one rank, got {size}")
    if size == 1:
        return 0.0
    if size in measured:
        return measured[size]
    known = [k for k in measured if k > 1]
    if not known:
        return 0.0  # never measured: nothing says the exchange costs anything, so nobody sits out for it
    nearest = min(known, key=lambda k: (abs(k - size), k))
    return measured[nearest] * ((size - 1) / size) / ((nearest - 1) / nearest)


def compute_s(members: Sequence[int], sample_s: Sequence[float], total: int, minimum: int = 1) -> float:
    """Predicted seconds of the compute of a step of ``total`` samples shared by ``members`` as the self-adaptive
    rule shares it: whole samples, at least ``minimum`` each, rounded so that the slowest member is fastest
    (``apportion_min_max``). A slow member's least share can outlast the others' whole step, which shares in exact
    proportion to the speeds would hide. Infinite where the members cannot each take ``minimum``."""
    if total < minimum * len(members):
        return math.inf
    shares = apportion_min_max([1.0 / sample_s[rank] for rank in members], total, minimum)
    return max(share * sample_s[rank] for share, rank in zip(shares, members))


def step_s(members: Sequence[int], sample_s: Sequence[float], total: int, measured: Mapping[int, float],
           minimum: int = 1) -> float:
    """Predicted seconds of a step of ``total`` samples shared by ``members`` (``compute_s``), then exchanged among
    them."""
    return compute_s(members, sample_s, total, minimum) + exchange_s(len(members), measured)


@dataclass(frozen=True)
class Membership:
    """A decision: the ranks in the exchange, the step it predicts, and why each other rank sits out."""

    members: tuple[int, ...]
    step_s: float
    """Predicted seconds per step with ``members``."""
    sat_out: dict[int, str] = field(default_factory=dict)
    """Rank -> why it sits out (what its compute would save against what its exchange adds)."""
    by_overhead: bool = False
    """Whether only the charge for the step's work beyond compute and exchange chose ``members`` (a tie for the
    model): a change made so must measure its gain."""


def choose_members(sample_s: Sequence[float | None], measured: Mapping[int, float], total: int,
                   current: Sequence[int], gain: float = GAIN, noise: float = 0.0, minimum: int = 1,
                   overhead_s: float = 0.0) -> Membership:
    """The members that make the step shortest, if they beat ``current`` by ``gain`` and by the noise; else
    ``current``.

    For a given group size the fastest ranks are the best group, so only the
    ``P`` groups of the fastest k ranks are priced (ties by rank: a pure,
    deterministic function). While some rank's speed is unknown (None: never measured) the members stay.
    Every group, today's too, is priced by the same model (``step_s``): today's measured step against another
    group's modelled one would compare two kinds of price, the model's optimism would read as a gain, and groups
    would take turns. What today's step costs beyond compute and exchange (the optimizer, the loop's own work, ranks
    contending for shared cores) the caller measures; where the model finds no group better by the margin, the groups
    it prices within the margin of today's (a tie: it cannot tell them apart) are priced again with ``overhead_s``
    of that work per member, up to today's number (a smaller group may shed some of it, a larger one is not charged
    more than today's pays). What the model still misses the caller measures after a change, and undoes a change
    that measured slower (``Allocator``).

    Args:
        sample_s: each rank's seconds per sample: measured at its last share (a member's, or an absent rank's
            from before it sat out: a rank out of the exchange is modelled, not measured).
        measured: seconds of the exchange at each group size it was measured at (see ``exchange_s``).
        total: samples per step (the global batch).
        current: today's members.
        gain: the least fraction by which a new membership must shorten the step.
        noise: the relative standard error of the figures the prices come from: a new membership must shorten the
            step by ``NOISE_MARGIN`` times it too.
        minimum: the least share of a member.
        overhead_s: seconds of today's step beyond compute and exchange, per current member.

    Raises:
        ConfigError: a speed that is not a positive number, or no current member.
    """
    if not current:
        raise ConfigError("a step needs at least one member")
    for rank, seconds in enumerate(sample_s):
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(f"seconds per sample must be positive, got {seconds!r} (rank {rank})")
    unknown = [rank for rank, seconds in enumerate(sample_s) if seconds is None]
    known = sorted((rank for rank, seconds in enumerate(sample_s) if seconds is not None),
                   key=lambda rank: (sample_s[rank], rank))
    if unknown:
        return Membership(tuple(sorted(current)), math.nan)
    speeds: list[float] = list(sample_s)  # type: ignore[arg-type]

    def modelled(group: Sequence[int]) -> float:
        return step_s(group, speeds, total, measured, minimum)

    def priced(group: Sequence[int]) -> float:
        return modelled(group) + overhead_s * min(len(group), len(current))

    margin = max(gain, NOISE_MARGIN * noise)
    groups = [known[:k] for k in range(1, len(known) + 1)]
    best = min(groups, key=modelled)
    chosen, by_overhead = sorted(current), False
    if sorted(best) != chosen and modelled(best) <= (1.0 - margin) * modelled(current):
        chosen = sorted(best)
    elif overhead_s > 0:  # the charge decides among the groups the model cannot tell from today's
        ties = [group for group in groups if modelled(group) <= (1.0 + margin) * modelled(current)]
        best = min(ties, key=priced)
        if sorted(best) != chosen and priced(best) <= (1.0 - margin) * priced(current):
            chosen, by_overhead = sorted(best), True
    return Membership(tuple(chosen), priced(chosen),
                      {rank: why_out(rank, chosen, speeds, total, measured, minimum, overhead_s)
                       for rank in range(len(speeds)) if rank not in chosen}, by_overhead)


def why_out(rank: int, members: Sequence[int], sample_s: Sequence[float], total: int,
            measured: Mapping[int, float], minimum: int = 1, overhead_s: float = 0.0) -> str:
    """What ``rank`` would save and cost beside ``members``, said in one line (with ``overhead_s``, the step's work
    beyond compute and exchange per member, where it was measured)."""
    saves_s = compute_s(members, sample_s, total, minimum) - compute_s([*members, rank], sample_s, total, minimum)
    adds_s = exchange_s(len(members) + 1, measured) - exchange_s(len(members), measured)
    saves = f"would save {1000 * saves_s:.1f} ms of compute per step" if saves_s > 0 else "would save no compute"
    beyond = f" and {1000 * overhead_s:.1f} ms of the step's other work" if overhead_s > 0 else ""
    return f"its {1.0 / sample_s[rank]:.0f} samples/s {saves}, its exchange adds {1000 * adds_s:.1f} ms{beyond}"
