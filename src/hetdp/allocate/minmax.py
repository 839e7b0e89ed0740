"""The exact min-max allocation: integer shares that make the slowest rank of a step as fast as it can be.

Given each rank's step time as a table over its share, find integer shares
``s_i >= minimum`` summing to ``total`` that minimize ``max_i t_i(s_i)``. This is
the ideal every allocation rule is measured against, and what the piecewise rule
re-plans with. Any step-time curve works (fixed overheads, knees, the jumps of
micro-batching, memory caps as infinite times) as long as it does not decrease
as the share grows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetdp.errors import ConfigError


def min_max_shares(step_s: Sequence[Sequence[float]], total: int, minimum: int = 0) -> list[int]:
    """Exactly minimize the slowest rank's time ``max_i step_s[i][s_i]`` over integer shares summing to ``total``.

    Every rank's time is non-decreasing in its share, so for a threshold T each
    rank can take at most ``m_i(T) = max {s : step_s[i][s] <= T}`` samples and T
    is reachable iff ``sum_i m_i(T) >= total``: the optimum T* is the least such T
    among the table's values (a bisection over them).

    Of the shares that reach T*, these put as few ranks as possible at T*, each
    taking as many samples as it can there; the other ranks are planned again the
    same way with what is left. So a rank that is not the bottleneck keeps the
    slack the others leave it: with times that are only estimates, a rank just
    below a jump (one more micro-batch) stays there instead of crossing it for
    nothing.

    Args:
        step_s: per rank, seconds of a step at share 0, 1, ..., ``total`` (at least ``total + 1`` values);
            ``inf`` where a share is not allowed (above a memory cap).
        total: samples to allocate (the global batch).
        minimum: fewest samples any rank takes.

    Returns:
        The shares, summing to ``total``, each at least ``minimum``.

    Raises:
        ConfigError: a table too short, NaN, decreasing, or no shares that fit every table.
    """
    if total < 0 or minimum < 0:
        raise ConfigError(f"total and minimum must be >= 0, got {total} and {minimum}")
    if not step_s:
        raise ConfigError("min_max_shares needs at least one rank")
    tables = [np.asarray(row, dtype=float)[: total + 1] for row in step_s]
    for rank, table in enumerate(tables):
        if len(table) < total + 1:
            raise ConfigError(f"rank {rank}: a step-time table needs {total + 1} values (shares 0..{total}), "
                              f"got {len(table)}")
        if np.isnan(table).any() or (table[1:] < table[:-1]).any():
            raise ConfigError(f"rank {rank}: step times must not be NaN and must not decrease as the share grows")
    if minimum * len(tables) > total:
        raise ConfigError(f"total {total} cannot give {len(tables)} ranks {minimum} sample(s) each")
    shares = [0] * len(tables)
    ranks, left = list(range(len(tables))), total
    while ranks:
        threshold = _least_threshold([tables[rank] for rank in ranks], left, minimum)
        # Below the threshold every rank can take `below` samples; the rest must come from ranks at it.
        below = {rank: _largest_share(tables[rank], threshold, strict=True) for rank in ranks}
        at = {rank: _largest_share(tables[rank], threshold) for rank in ranks}
        deficit = left - sum(below.values())
        forced = [rank for rank in ranks if below[rank] < minimum]
        # Fewest ranks at the threshold: the widest gaps first; on ties, those slowest below it (they would bound
        # the next level).
        others = sorted((rank for rank in ranks if below[rank] >= minimum),
                        key=lambda r: (below[r] - at[r], -tables[r][below[r]], r))
        chosen = list(forced)
        deficit -= sum(at[rank] - below[rank] for rank in forced)
        for rank in others:
            if deficit <= 0:
                break
            chosen.append(rank)
            deficit -= at[rank] - below[rank]
        ranks = [rank for rank in ranks if rank not in chosen]
        # The chosen ranks take all they can at the threshold, leaving the others at least their minimum.
        excess = max(0, sum(at[rank] for rank in chosen) - (left - minimum * len(ranks)))
        for rank in sorted(chosen, key=lambda r: (-tables[r][at[r]], r)):
            give_back = min(excess, at[rank] - minimum)
            shares[rank] = at[rank] - give_back
            excess -= give_back
        left -= sum(shares[rank] for rank in chosen)
    return shares


def _least_threshold(tables: Sequence[np.ndarray], total: int, minimum: int) -> float:
    """The least time T such that the ranks can take ``total`` samples with every time at most T."""
    floor_s = max(table[minimum] for table in tables)  # no plan is faster than every rank at its minimum
    candidates = np.unique(np.concatenate([table[minimum:] for table in tables]))
    candidates = candidates[np.isfinite(candidates) & (candidates >= floor_s)]
    if not len(candidates) or _capacity(tables, candidates[-1]) < total:
        most = sum(int(np.isfinite(table).sum()) - 1 for table in tables)
        raise ConfigError(f"no shares of {total} samples fit: the ranks can take at most {most} within their "
                          f"finite step times (memory caps)")
    low, high = 0, len(candidates) - 1  # candidates[high] is reachable; find the least reachable one
    while low < high:
        middle = (low + high) // 2
        if _capacity(tables, candidates[middle]) >= total:
            high = middle
        else:
            low = middle + 1
    return float(candidates[low])


def step_time_of(step_s: Sequence[Sequence[float]], shares: Sequence[int]) -> float:
    """The step's time under ``shares``: its slowest rank's, ``max_i step_s[i][shares[i]]``."""
    return max(float(table[share]) for table, share in zip(step_s, shares))


def _largest_share(table: np.ndarray, threshold: float, strict: bool = False) -> int:
    """The largest share whose time is at most (``strict``: below) ``threshold``; -1 if there is none."""
    return int(np.searchsorted(table, threshold, side="left" if strict else "right")) - 1


def _capacity(tables: Sequence[np.ndarray], threshold: float) -> int:
    return sum(_largest_share(table, threshold) for table in tables)
