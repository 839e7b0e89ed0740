"""One step loop for every allocation x synchronization pairing, on simulated time, as the drop-in runs it.

Every rank runs the same steps (the allocated loader cuts each global step into
the ranks' shares). A synchronous step waits for the slowest rank, then the
allreduce. A partial step contributes to the open round of a partial allreduce
and waits only for that round, by the rules of ``collectives/partial.py``: a
solo round fires at its first arrival, a majority round at its initiator's
(the same seeded draw) once the initiator has waited its grace for the others
(or all are in), or, as the drop-in's ``hetdp.Partial`` bypasses an initiator
that is the only rank out and owes no round, once the last other arrival has
waited the same grace for it; a quorum round fires at its k-th arrival. A rank
that finds rounds run since its last call returns at once and its gradient
travels, stale, in the next round. Local steps do not communicate. Partial and
local runs meet (flush the rounds in flight, average the parameters) when the
drop-in meets: every K steps for ``local:K``, and at the end. Adaptive
allocation runs the drop-in's own ``Allocator`` on the simulated compute times,
so it re-plans at the same steps, to the same shares: under partial and local
synchronization on ``MEETING_WINDOW`` measured steps or more after its first
decision (``Allocator.out_of_step_window``), from a gather in the background
whose plan applies ``PLAN_LAG`` steps later, as the drop-in's.
A grace is a part of the rank's current step, where the drop-in takes the median
of its recent ones. Not simulated: a rank's wait for that gather (the last rank
is rarely ``PLAN_LAG`` steps behind).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hetdp.allocate.policy import PLAN_LAG, Adaptive, Allocator, Equal, Static
from hetdp.collectives.protocol import GRACE, initiator
from hetdp.errors import ConfigError

ALLOCATIONS: tuple[str, ...] = ("equal", "static", "adaptive")
SYNCS: tuple[str, ...] = ("allreduce", "solo", "majority", "quorum", "local")
STEP_ENDS, FLUSHES, GRACE_ENDS = 0, 1, 2
"""What a partial run's events are: a rank's step ends, a rank starts to flush, a majority round's grace ends."""


@dataclass(frozen=True)
class Strategy:
    """An allocation x synchronization pairing, named as ``hetdp run --allocation A --sync S`` spells it: ``A+S``."""

    allocation: str = "equal"
    """equal, static (shares proportional to the workers' speeds) or adaptive (the drop-in's default policy)."""
    sync: str = "allreduce"
    """allreduce, solo, majority, quorum or local."""
    k: int = 0
    """quorum: arrivals that fire a round (0: half the ranks, rounded up); local: steps between merges (0: once,
    at the end of the run)."""

    def __post_init__(self) -> None:
        if self.allocation not in ALLOCATIONS:
            raise ConfigError(f"allocation must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}")
        if self.sync not in SYNCS:
            raise ConfigError(f"synchronization must be one of {', '.join(SYNCS)}, got {self.sync!r}")
        if self.k < 0 or (self.k and self.sync not in ("quorum", "local")):
            raise ConfigError(f"only quorum:K and local:K take a count K >= 1, got {self.name!r}")

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """``"adaptive+majority"``, ``"equal+local:10"``, ``"static"`` (allreduce), ``"solo"`` (equal allocation).

        Raises:
            ConfigError: an unknown allocation or synchronization, or a bad K.
        """
        allocation, plus, sync = text.strip().partition("+")
        if not plus and allocation.partition(":")[0] in SYNCS:
            allocation, sync = "equal", allocation
        name, colon, count = (sync or "allreduce").partition(":")
        try:
            k = int(count) if colon else 0
        except ValueError:
            k = -1
        if colon and k < 1:
            raise ConfigError(f"strategy {text.strip()!r}: K must be a positive integer")
        try:
            return cls(allocation, name, k)
        except ConfigError as error:
            raise ConfigError(f"strategy {text.strip()!r}: {error}") from None

    @property
    def name(self) -> str:
        sync = f"{self.sync}:{self.k}" if self.k else self.sync
        return self.allocation if self.sync == "allreduce" else f"{self.allocation}+{sync}"

    @property
    def partial(self) -> bool:
        return self.sync in ("solo", "majority", "quorum")


@dataclass(kw_only=True, frozen=True)
class LoopCosts:
    """What each part of a step costs, in seconds; the engine decides who waits for whom."""

    compute_s: Callable[[int, np.ndarray], np.ndarray]
    """(global step, every rank's share) -> every rank's compute seconds for that step: what the drop-in's clock
    measures, from the first forward to the last gradient bucket ready, straggler delays included."""
    loop_s: float = 0.0
    """Seconds of every rank's step outside compute and collectives (loading the batch, the optimizer step)."""
    allreduce_s: float = 0.0
    """Seconds of a synchronous step's gradient allreduce, once the last rank is ready."""
    round_s: float = 0.0
    """Seconds of one partial round, from firing to every rank holding its sum."""
    average_s: float = 0.0
    """Seconds of one parameter averaging (a meeting of partial or local synchronization)."""
    gather_s: float = 0.0
    """Seconds of the small all-gather of step times an adaptive allocation re-plans from."""
    static_weights: Sequence[float] | None = None
    """Weights of the static allocation (the workers' speeds); None: equal."""
    seed: int = 0
    """Seed of the majority initiators, as the partial allreduce draws them."""
    grace: float = GRACE
    """Majority: the part of its step a round's initiator waits for the others, and the last other arrival for the
    initiator before a bypass (``hetdp.Partial.grace``; 0: fire at once)."""
    bypass: bool = True
    """Majority: fire a round without its initiator when it is the only rank out and owes no round, as the drop-in's
    ``hetdp.Partial`` does; False: the paper's rule, always waiting for the initiator."""


@dataclass(frozen=True)
class SimulationResult:
    """What one strategy did in a simulated run. The three fractions divide the workers' time: they sum to 1."""

    strategy: str
    steps: int
    """Steps simulated: every rank runs all of them."""
    seconds: float
    """Simulated wall-clock seconds for all steps, the last meeting included."""
    samples_per_s: float
    """Samples trained per second: ``steps * samples_per_step / seconds``."""
    fresh_fraction: float
    """Share of the gradients that reached their round fresh, computed from the latest model (partial rounds; 1
    otherwise)."""
    final_shares: list[int]
    samples_per_step: float
    """The global batch: every sample is applied, in a partial run by a later round if it missed its own."""
    compute_fraction: float
    """Share of the workers' time spent computing (and in the loop around it)."""
    wait_fraction: float
    """Share spent idle: waiting for the slowest rank, for a partial round to fire, or at a meeting."""
    allreduce_fraction: float
    """Share spent in collectives: allreduces, partial rounds, parameter averaging, gathers."""
    rounds: int = 0
    """Partial rounds run (0 for other synchronizations)."""


class _Run:
    """The state of one simulated run: the clock, the allocation and where the workers' time went."""

    def __init__(self, strategy: Strategy, costs: LoopCosts, world_size: int, global_batch: int,
                 replan_every: int) -> None:
        self.strategy = strategy
        self.costs = costs
        self.world_size = world_size
        policy = {"equal": Equal(), "adaptive": Adaptive(replan_every=replan_every)}.get(strategy.allocation)
        if policy is None:
            policy = Static(tuple(costs.static_weights)) if costs.static_weights is not None else Equal()
        self.allocator = Allocator(policy, world_size, global_batch)
        self.clock_s = 0.0
        self.busy_s = 0.0
        self.collective_s = 0.0
        self.rounds = 0
        self.last_round_end_s = 0.0
        self.fresh = 0
        self.contributions = 0
        self.schedule: list[tuple[int, list[int]]] = [(0, list(self.allocator.shares))]
        """(first step, shares from it on), as the drop-in's: a plan applies from a step after the one it was made."""
        self._pending: list[tuple[np.ndarray, list[int]]] = []
        """Each step since the last gather: every rank's compute seconds and the shares they computed."""

    def shares_at(self, step: int) -> list[int]:
        return next(shares for first, shares in reversed(self.schedule) if first <= step)

    def compute(self, step: int) -> np.ndarray:
        shares = self.shares_at(step)
        seconds = np.asarray(self.costs.compute_s(step, np.asarray(shares, dtype=float)), dtype=float)
        self.busy_s += float(seconds.sum()) + self.world_size * self.costs.loop_s
        self._pending.append((seconds, shares))
        return seconds

    def compute_steps(self, first: int, end: int) -> list[np.ndarray]:
        """Every rank's compute seconds for steps ``first`` to ``end`` of partial or local synchronization, planning
        from gathers in the background: one begun after step k gives a plan from step k + 1 + ``PLAN_LAG``."""
        seconds = []
        for step in range(first, end):
            seconds.append(self.compute(step))
            window_min = self.allocator.out_of_step_window()
            if self.gather_due(window_min=window_min):
                self.plan(step + 1 + PLAN_LAG, window_min=window_min)
        return seconds

    def collective(self, seconds: float) -> None:
        """Every rank spends ``seconds`` in a collective that starts when the last one is ready."""
        self.clock_s += seconds
        self.collective_s += self.world_size * seconds

    def plan(self, first: int, window_min: int = 0) -> None:
        """Record the steps since the last gather, as the drop-in does (those at the current shares), and re-plan
        from ``first`` on if the allocator is due, on at least ``window_min`` measured steps (fewer carry over)."""
        current = self.allocator.shares
        for seconds, shares in self._pending:
            if shares == current:
                self.allocator.measure(seconds.tolist())
        self._pending = []
        if self.allocator.due(min_steps=window_min):
            shares = self.allocator.replan()
            if shares is not None:
                self.schedule.append((first, shares))

    def gather_due(self, window_min: int = 0) -> bool:
        window = self.allocator.window()
        current = self.allocator.shares
        measured = self.allocator.measured + sum(1 for _, shares in self._pending if shares == current)
        return bool(window) and measured >= max(window, window_min)

    def next_meeting(self, step: int, steps: int) -> int:
        """The step after which partial or local ranks next meet (decided from step counts alone, as every rank
        decides it)."""
        every = self.strategy.k if self.strategy.sync == "local" else 0
        return min(step + every, steps) if every else steps

    def result(self, steps: int, global_batch: int) -> SimulationResult:
        worker_s = self.world_size * self.clock_s
        compute = self.busy_s / worker_s if worker_s else 1.0
        collective = self.collective_s / worker_s if worker_s else 0.0
        fresh = self.fresh / self.contributions if self.contributions else 1.0
        return SimulationResult(
            self.strategy.name, steps, self.clock_s, steps * global_batch / self.clock_s if self.clock_s else 0.0,
            fresh, list(self.allocator.shares), samples_per_step=float(global_batch), compute_fraction=compute,
            wait_fraction=max(0.0, 1.0 - compute - collective), allreduce_fraction=collective, rounds=self.rounds)


def simulate_strategy(strategy: Strategy, costs: LoopCosts, *, world_size: int, global_batch: int, steps: int,
                      replan_every: int = 2) -> SimulationResult:
    """Run ``steps`` steps of ``strategy`` on simulated time and measure its throughput.

    ``replan_every`` is the adaptive policy's (``hetdp.Adaptive``): steps between re-plans until the shares settle.

    Raises:
        ConfigError: fewer than one step, a global batch smaller than the ranks, or a quorum above them.
    """
    if steps < 1 or world_size < 1 or global_batch < world_size:
        raise ConfigError(f"need steps >= 1 and global_batch >= {world_size} workers, got {steps}, {global_batch}")
    if strategy.sync == "quorum" and strategy.k > world_size:
        raise ConfigError(f"quorum must be in [1, {world_size}], got {strategy.k}")
    run = _Run(strategy, costs, world_size, global_batch, replan_every)
    if strategy.sync == "allreduce":
        _synchronous(run, steps)
    else:
        step = 0
        while step < steps:
            end = run.next_meeting(step, steps)
            starts = np.full(world_size, run.clock_s)
            ends = _partial_steps(run, step, end, starts) if strategy.partial else _local_steps(run, step, end, starts)
            _meet(run, ends, end)
            step = end
    return run.result(steps, global_batch)


def _synchronous(run: _Run, steps: int) -> None:
    """Each step: every rank's loop and compute, the wait for the slowest, the allreduce; gathers when due."""
    for step in range(steps):
        compute = run.compute(step)
        run.clock_s += run.costs.loop_s + float(compute.max())
        run.collective(run.costs.allreduce_s)
        if run.gather_due():
            run.collective(run.costs.gather_s)
            run.plan(step + 1)
    run.collective(run.costs.gather_s)  # the figures of the epoch's end


def _local_steps(run: _Run, first: int, end: int, starts: np.ndarray) -> np.ndarray:
    """Steps ``first`` to ``end`` without communication: each rank's own time; returns when each one is done."""
    ends = starts.copy()
    for seconds in run.compute_steps(first, end):
        ends += run.costs.loop_s + seconds
    return ends


def _partial_steps(run: _Run, first: int, end: int, starts: np.ndarray) -> np.ndarray:
    """Steps ``first`` to ``end`` through a partial allreduce, one event at a time in time order (see the module
    docstring); returns when each rank, done with its steps, starts to flush."""
    n, costs, mode = run.world_size, run.costs, run.strategy.sync
    required = run.strategy.k or (n + 1) // 2
    compute = run.compute_steps(first, end)
    consumed = np.full(n, run.rounds)  # rounds handed to each rank's caller so far
    next_step = np.zeros(n, dtype=int)  # index into compute of each rank's next step
    ends = np.zeros(n)
    flushing: set[int] = set()
    arrived: dict[int, None] = {}  # ranks waiting at the open round, in arrival order
    owed: set[int] = set()  # majority: initiators bypassed that have not arrived since
    graced_round = -1  # majority: the round whose grace is running, if any
    # (time, rank, kind, round): a rank's step ends, it starts to flush, or a round's grace ends
    events = [(starts[i] + costs.loop_s + compute[0][i], i, STEP_ENDS, -1) for i in range(n)]
    heapq.heapify(events)

    def grace_s(rank: int) -> float:
        """A grace, ``costs.grace`` of the rank's step, as the drop-in's is of its recent steps."""
        return costs.grace * (costs.loop_s + float(compute[min(next_step[rank], len(compute) - 1)][rank]))

    def wait(until_s: float) -> bool:
        """Start the open round's grace (once), until ``until_s``; the round does not fire yet."""
        nonlocal graced_round
        if graced_round != run.rounds:
            graced_round = run.rounds
            heapq.heappush(events, (until_s, -1, GRACE_ENDS, run.rounds))
        return False

    def fires(now_s: float, rank: int, graced: bool) -> bool:
        """Whether the open round fires now; ``graced``: its grace just ran out."""
        if not arrived:
            return False
        if mode == "solo":
            return True
        if mode != "majority":
            return len(arrived) + len(flushing) >= required
        leader = initiator(costs.seed, run.rounds, n)
        if leader in flushing:
            return True
        last_call = graced or not costs.grace
        if leader in arrived:  # the initiator waits its grace for the others, unless all are in
            return len(arrived) == n or last_call or wait(now_s + grace_s(leader))
        if costs.bypass and len(arrived) == n - 1 and not flushing and leader not in owed:
            if last_call:
                owed.add(leader)
                return True
            return wait(now_s + grace_s(rank))  # the last other arrival waits the grace for the initiator
        return False

    def resume(rank: int, free_s: float) -> None:
        next_step[rank] += 1
        done = next_step[rank] >= len(compute)
        start_s = free_s if done else free_s + costs.loop_s + compute[next_step[rank]][rank]
        heapq.heappush(events, (start_s, rank, FLUSHES if done else STEP_ENDS, -1))

    def fire(now_s: float) -> None:
        begin = max(now_s, run.last_round_end_s)
        run.last_round_end_s = begin + costs.round_s
        run.fresh += len(arrived)
        run.contributions += len(arrived)
        run.collective_s += len(arrived) * (run.last_round_end_s - now_s)
        run.rounds += 1
        waiting = list(arrived)
        arrived.clear()
        for rank in waiting:
            consumed[rank] = run.rounds
            resume(rank, run.last_round_end_s)

    while events:
        now_s, rank, kind, round_index = heapq.heappop(events)
        if kind == GRACE_ENDS:
            if round_index != run.rounds:  # the round fired before its grace ran out
                continue
        elif kind == FLUSHES:  # a flushing rank counts as arrived: it may fire the open round (majority, quorum)
            ends[rank] = now_s
            flushing.add(rank)
        elif consumed[rank] < run.rounds:  # rounds ran since its last call: it takes them and goes on, stale
            run.contributions += 1
            free_s = max(now_s, run.last_round_end_s)
            run.collective_s += free_s - now_s
            consumed[rank] = run.rounds
            resume(rank, free_s)
            continue
        else:
            arrived[rank] = None
            owed.discard(rank)
        if fires(now_s, rank, graced=kind == GRACE_ENDS):
            fire(now_s)
    return ends


def _meet(run: _Run, ends: np.ndarray, step: int) -> None:
    """The ranks meet once the last one is done: a flushing round (partial), parameter averaging, the gather of
    step times riding on it; an adaptive allocation re-plans."""
    run.clock_s = float(ends.max())
    if run.strategy.partial:
        run.clock_s = max(run.clock_s, run.last_round_end_s)
        run.collective(run.costs.round_s)
        run.rounds += 1
        run.last_round_end_s = run.clock_s
    run.collective(run.costs.average_s)
    run.plan(step, window_min=run.allocator.out_of_step_window())
