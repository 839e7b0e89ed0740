"""Integer-optimal C-ADP allocation: a branch and bound over the epoch-time threshold.

The objective (C-ADP eq. (7)) is ``max_i s_i D_i + num * max_i (ceil(D_i / bs_i) T_i + c_i)``
with ``s_i = b / B_0i`` and ``c_i`` the per-epoch parameter exchange (eq. (6)). Fix the
second maximum at a threshold E: device i may then take at most
``m_i(E) = bs_i * floor((E - c_i) / T_i)`` samples, and the least first maximum S*(E) is
the D-th smallest per-sample send cost in ``{d s_i : 1 <= d <= m_i(E)}`` (fill the cheapest
send slots first). S*(E) does not increase with E and changes only at the candidate
values ``E = c_i + k T_i``, so the optimum is the least ``S*(E) + num E`` over candidates.
A best-first branch and bound over intervals [a, b] of candidates, with the bound
``S*(b) + num a``, finds that least value and proves it (gap 0).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from hetdp.allocate.cost import CostModel
from hetdp.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class ExactConfig:
    """Limits of the exact search; the defaults prove optimality on every cluster we have tried."""

    max_evaluations: int = 100_000
    """Evaluations of S*(E) (each O(N)) before the search stops and returns its best plan with the
    gap still open (Plan.gap > 0). Random clusters of 10,000 devices need tens to a few hundred."""
    rtol: float = 1e-12
    """Relative tolerance under which bound and best value count as equal (float round-off only)."""

    def __post_init__(self) -> None:
        evaluations = self.max_evaluations
        if isinstance(evaluations, bool) or not isinstance(evaluations, int) or evaluations < 2:
            raise ConfigError(f"max_evaluations must be an integer >= 2, got {self.max_evaluations!r}")
        if not 0 <= self.rtol < 1e-3:
            raise ConfigError(f"rtol must be in [0, 1e-3), got {self.rtol!r}")


@dataclass(frozen=True, eq=False)
class ExactResult:
    """The exact search's allocation, its objective and the lower bound it proved."""

    samples: np.ndarray
    """D_i, int64, summing to the dataset size."""
    total_s: float
    """The objective S*(E) + num E at the best threshold; the allocation's own total is at most this."""
    lower_bound_s: float
    """Proven lower bound on the optimal objective; equals total_s (to rtol) when ``optimal``."""
    evaluations: int
    """Evaluations of S*(E) the search used."""

    @property
    def optimal(self) -> bool:
        return self.lower_bound_s >= self.total_s * (1 - 1e-9)


def solve_exact(
    model: CostModel, dataset_size: int, epochs: int, *, min_samples: int = 0, config: ExactConfig | None = None
) -> ExactResult:
    """Integer-optimal D_1..D_N for eq. (7), each at least ``min_samples``, summing to ``dataset_size``."""
    return _Search(model, dataset_size, epochs, min_samples, config or ExactConfig()).run()


class _Search:
    """State of one branch-and-bound run; all methods are vectorized O(N) or O(N log N)."""

    def __init__(self, model: CostModel, total: int, epochs: int, minimum: int, config: ExactConfig) -> None:
        self.s = model.send_s_per_sample
        self.c = model.comm_s
        self.t = model.batch_time_s
        self.bs = model.batch_size
        self.total = int(total)
        self.epochs = int(epochs)
        self.minimum = int(minimum)
        self.config = config
        self.k_max = -(-self.total // self.bs)  # more batches than ceil(D / bs) are never useful
        self.k_min = -(-self.minimum // self.bs)
        self.s_floor = float((self.minimum * self.s).max())  # send time of the forced minimum
        self.e_floor = float((self.c + self.k_min * self.t).max())
        self.evaluations = 0

    # -- candidates E = c_i + k t_i, 0 <= k <= k_max_i --------------------------------------
    def batches_within(self, e: float) -> np.ndarray:
        """Per device, the most batches k <= k_max with c_i + k t_i <= e; -1 when e < c_i."""
        k = np.floor((e - self.c) / self.t)
        k = np.where(self.c + (k + 1) * self.t <= e, k + 1, k)  # undo float error in the division
        k = np.where(self.c + k * self.t > e, k - 1, k)
        return np.clip(k, -1, self.k_max).astype(np.int64)

    def prev_candidate(self, e: float, k: np.ndarray | None = None) -> float:
        """The largest candidate <= e (``k``: ``batches_within(e)`` when already known)."""
        k = self.batches_within(e) if k is None else k
        valid = k >= 0
        return float((self.c[valid] + k[valid] * self.t[valid]).max())

    def next_candidate(self, e: float, k: np.ndarray | None = None) -> float:
        """The smallest candidate > e, inf if none."""
        k = (self.batches_within(e) if k is None else k) + 1
        valid = k <= self.k_max
        return float((self.c[valid] + k[valid] * self.t[valid]).min()) if valid.any() else np.inf

    def capacity(self, e: float, k: np.ndarray | None = None) -> np.ndarray | None:
        """m_i(e): most samples device i may take within epoch time e; None if e is infeasible."""
        k = self.batches_within(e) if k is None else k
        if (k < self.k_min).any():
            return None
        m = np.minimum(self.bs * k, self.total)
        return m if m.sum() >= self.total else None

    # -- S*(E) -------------------------------------------------------------------------------
    def least_send(
        self, e: float, bracket: tuple[float, float] | None = None, k: np.ndarray | None = None
    ) -> float:
        """S*(e): least max send time of an allocation whose epoch time is at most e (inf if none).

        ``bracket``: known bounds (S* at a larger and at a smaller threshold), which speed it up.
        """
        self.evaluations += 1
        m = self.capacity(e, k)
        if m is None:
            return np.inf
        return max(_kth_smallest_slot(self.s, m, self.total, bracket), self.s_floor)

    def objective(self, e: float, send: float) -> float:
        return send + self.epochs * e

    def lowest_feasible_e(self) -> float:
        """The least candidate E at which the devices can hold the dataset (bisection over candidates)."""
        lo = self.e_floor
        if self.capacity(lo) is not None:
            return lo
        hi = float((self.c + self.k_max * self.t).max())  # every device may take everything
        while True:
            mid = self.prev_candidate((lo + hi) / 2)
            if mid <= lo:
                mid = self.next_candidate(lo)
            if mid >= hi:
                return hi
            if self.capacity(mid) is not None:
                hi = mid
            else:
                lo = mid

    def allocation(self, e: float, send: float) -> np.ndarray:
        """Integer D_i within thresholds (send, e), summing to the total, each >= minimum."""
        m = self.capacity(e)
        counts = np.minimum(_slots_within(self.s, send), m)
        excess = int(counts.sum()) - self.total
        if excess > 0:
            # Take the surplus back from the devices whose last sample costs most to send, then
            # whose epoch is longest: any removal keeps both thresholds, these also trim the plan.
            key = np.lexsort((-(self.c + -(-counts // self.bs) * self.t), -(counts * self.s)))
            spare = (counts - self.minimum)[key]
            give = np.minimum(spare, np.maximum(0, excess - (np.cumsum(spare) - spare)))
            counts[key] -= give
        return counts

    def run(self) -> ExactResult:
        rtol = self.config.rtol
        e_lo = self.lowest_feasible_e()
        # Beyond the epoch time of the send-optimal allocation, S* cannot fall further.
        send_min = max(_kth_smallest_slot(self.s, np.full_like(self.bs, self.total), self.total), self.s_floor)
        counts = np.minimum(_slots_within(self.s, send_min), self.total)
        e_hi = max(e_lo, float((self.c + -(-counts // self.bs) * self.t).max()))

        send_lo, send_hi = self.least_send(e_lo), self.least_send(e_hi)
        best_e, best_send = min((e_lo, send_lo), (e_hi, send_hi), key=lambda pair: self.objective(*pair))
        best = self.objective(best_e, best_send)
        # Each heap entry is the candidates [first, last], with S*(last) known and S*(first) not
        # (unless first == last); no candidate there beats the bound S*(last) + num * first.
        # S* at the evaluated candidate just before ``first`` bounds S* on the entry from above.
        heap: list[tuple[float, float, float, float, float]] = []

        def push(first: float, last: float, send_last: float, send_before: float) -> None:
            bound = self.objective(first, send_last)
            if first < last and bound < best * (1 - rtol):
                heapq.heappush(heap, (bound, first, last, send_last, send_before))

        push(self.next_candidate(e_lo), e_hi, send_hi, send_lo)
        bound = best
        while heap:
            if heap[0][0] >= best * (1 - rtol):
                break
            if self.evaluations >= self.config.max_evaluations:
                bound = heap[0][0]
                break
            _, first, last, send_last, send_before = heapq.heappop(heap)
            # The largest candidate mid <= the midpoint (>= first, itself a candidate) has the same
            # batches per device as the midpoint: one O(N) pass serves mid, S*(mid) and next(mid).
            k = self.batches_within((first + last) / 2)
            mid = self.prev_candidate(first, k)
            send_mid = self.least_send(mid, bracket=(send_last, send_before), k=k)
            if self.objective(mid, send_mid) < best:
                best, best_e, best_send = self.objective(mid, send_mid), mid, send_mid
            push(first, mid, send_mid, send_before)
            push(self.next_candidate(mid, k), last, send_last, send_mid)
        return ExactResult(
            samples=self.allocation(best_e, best_send),
            total_s=best,
            lower_bound_s=min(bound, best),
            evaluations=self.evaluations,
        )


def _slots_within(s: np.ndarray, send: float) -> np.ndarray:
    """Per device, how many samples d have d * s_i <= send (no limit when s_i == 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.floor(send / s)
    free = s == 0
    d = np.where(free, 0, d)
    d = np.where((d + 1) * s <= send, d + 1, d)  # undo float error in the division
    d = np.where(d * s > send, d - 1, d)
    big = np.iinfo(np.int64).max // 4
    return np.where(free, big, np.minimum(d, big)).astype(np.int64)


def _kth_smallest_slot(
    s: np.ndarray, m: np.ndarray, rank: int, bracket: tuple[float, float] | None = None
) -> float:
    """The rank-th smallest (1-based) of the multiset {d s_i : 1 <= d <= m_i}; requires sum(m) >= rank.

    The slots between two bounds of the answer are listed and the answer selected among them.
    The bounds are ``bracket`` when given and it holds few slots (the search knows S* at the
    neighbouring thresholds), else a continuous relaxation, which brackets the answer within
    about N slots (sum_i min(S/s_i, m_i) loses less than one slot per device to the floor).
    """
    free = s == 0
    rank -= int(m[free].sum())
    if rank <= 0:
        return 0.0
    active = (~free) & (m > 0)
    s, m = s[active], m[active]
    if bracket is not None and np.isfinite(bracket[1]):
        below, upto = _slots_between(s, m, *bracket)
        if int(below.sum()) < rank <= int(upto.sum()) and int((upto - below).sum()) <= 8 * len(s) + 1024:
            return _select(s, below, upto, rank)
    lo, hi = _relaxed_inverse(s, m, np.array([rank, min(rank + len(s), int(m.sum()))], dtype=float))
    return _select(s, *_slots_between(s, m, lo, hi), rank)


def _slots_between(s: np.ndarray, m: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Per device, the slots below ``lo`` and up to ``hi``, both widened by 1e-9 against float error."""
    below = np.minimum(np.floor(lo * (1 - 1e-9) / s), m).astype(np.int64)
    upto = np.minimum(np.floor(hi * (1 + 1e-9) / s), m).astype(np.int64)
    return below, upto


def _select(s: np.ndarray, below: np.ndarray, upto: np.ndarray, rank: int) -> float:
    """The rank-th smallest slot, given that ``below`` slots per device lie under it and ``upto`` reach it."""
    listed = upto - below
    owner = np.repeat(np.arange(len(s)), listed)
    offset = np.arange(len(owner)) - np.repeat(np.cumsum(listed) - listed, listed)
    values = (below[owner] + 1 + offset) * s[owner]
    index = rank - int(below.sum()) - 1
    return float(np.partition(values, index)[index])


def _relaxed_inverse(s: np.ndarray, m: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The S at which sum_i min(S / s_i, m_i) reaches each of ``targets`` (piecewise linear in S)."""
    saturate = m * s
    order = np.argsort(saturate)
    saturate, m_sorted, inv = saturate[order], m[order].astype(float), 1.0 / s[order]
    before = np.cumsum(m_sorted) - m_sorted
    unsaturated = np.cumsum(inv[::-1])[::-1]
    reached = before + saturate * unsaturated
    j = np.minimum(np.searchsorted(reached, targets), len(saturate) - 1)
    return np.minimum((targets - before[j]) / unsaturated[j], saturate[-1])
