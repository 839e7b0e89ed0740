"""The rules of a partial-allreduce round, with no networking in them: who initiates, when a round fires,
and what one rank holds between rounds (its send buffer, the rounds run, the rounds handed to its caller).

Eager-SGD paper (partial collectives, sections 4-5; Lemma 6.1). ``partial.py`` moves these decisions
over a c10d Store and a gloo group; everything here is tested in one process.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

Mode = Literal["solo", "majority", "quorum", "full"]
MODES: tuple[str, ...] = ("solo", "majority", "quorum", "full")


INITIATOR_STREAM = 0x6D616A6F72  # "major": keeps the initiators' draws apart from other draws on the same seed


def initiator(seed: int, round_index: int, world_size: int) -> int:
    """Majority mode: the rank whose arrival fires ``round_index``.

    A pure function of (seed, round), so every rank draws the same sequence
    without talking to the others (the paper's shared seed, section 4.2), and a
    rank that skipped rounds still agrees on any later one. The draw comes from
    a stream of its own: a run that seeds other per-step draws with the same
    seed (``Emulation``'s stragglers, say) does not get initiators equal to them.
    """
    return int(np.random.default_rng([INITIATOR_STREAM, seed, round_index]).integers(world_size))


GRACE = 0.05
"""Majority mode: the part of its recent step an initiator waits for the ranks still out (see ``grace_s``)."""
GRACE_HISTORY = 9
"""Steps of an initiator's own history its grace is measured on (their median: a meeting's long step is ignored)."""


def grace_s(step_intervals: Sequence[float], grace: float) -> float:
    """How long a majority round's initiator waits, once it arrived, for the ranks still out, in seconds.

    The paper fires at once, so a rank a millisecond behind the initiator (not a straggler, only jitter) sends its
    gradient a round late, stale: with the ranks' times equalized by allocation that is about half of every round.
    Waiting ``grace`` of the initiator's median recent step (the time between its calls) lets them in fresh, while a
    real straggler, late by a good part of a step, is still not waited for. No history yet: no wait.
    """
    return grace * statistics.median(step_intervals) if step_intervals and grace > 0 else 0.0


def fires(mode: Mode, required: int, *, arrivals: int, flushing: int = 0, initiator_in: bool = False) -> bool:
    """Whether a round fires, given what is known about it.

    Args:
        mode: the partial-allreduce mode.
        required: ranks a quorum needs (k for ``quorum``, the world size for ``full``; unused otherwise).
        arrivals: ranks that arrived at the round (called ``allreduce`` with their tensor in it).
        flushing: ranks waiting in ``flush()`` or ``close()``; they count as arrived, with nothing to add.
        initiator_in: majority mode: the round's initiator has arrived or is flushing.

    A round never fires without at least one real arrival, so ranks that all
    flush do not spin empty rounds; without flushing ranks, a quorum round
    fires exactly when k ranks have arrived.
    """
    if arrivals < 1:
        return False
    if mode == "solo":
        return True
    if mode == "majority":
        return initiator_in
    return arrivals + flushing >= required


@dataclass(frozen=True)
class Deposit:
    """Where a caller's tensor went: the round it will travel in, and how the call must proceed."""

    round: int
    """The open round at deposit time: the next one this rank's progress thread runs; the tensor travels in it."""
    missed: bool
    """Rounds ran since the caller's previous call: the call returns them at once instead of waiting, and does
    not arrive anywhere. Its tensor, computed before those rounds, waits passively in the send buffer for the
    next round, as the late process of the paper's Fig. 7 does (section 5): a quorum or a majority counts fresh
    contributions only, in every mode."""
    arrived: bool
    """The call arrives at ``round`` (it did not miss any): its tensor is fresh there."""

    @property
    def last_needed(self) -> int:
        """The last round the call returns: the missed ones, or else the round its tensor travels in."""
        return self.round - 1 if self.missed else self.round


@dataclass(frozen=True)
class Snapshot:
    """What one rank puts into a round: its whole send buffer plus two counters, as one flat payload."""

    round: int
    payload: torch.Tensor
    """``[data..., arrived, parts]``: summed over ranks, the tail gives contributors and parts."""
    arrived: bool
    """This rank arrived at the round (its ``fresh`` flag)."""


class RoundBook:
    """One rank's ledger of rounds, shared by the caller's thread and the progress thread.

    The caller deposits tensors (``deposit``) and collects results
    (``wait_collect``); the progress thread empties the send buffer into each
    round (``take``) and files each round's result (``complete``). Every
    deposited tensor goes into exactly one round (the next ``take``), so nothing
    is lost or counted twice, and every round's result reaches the caller
    exactly once, in order.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.numel = numel
        self._cond = threading.Condition()
        self._buffer = torch.zeros(numel, dtype=dtype, device=device)
        self._parts = 0
        self._arrived = False
        self._results: dict[int, Any] = {}
        self.next_round = 0
        """The round the next ``take`` runs (rounds before it were taken)."""
        self.completed = 0
        """Rounds before this one have a result."""
        self.consumed = 0
        """Rounds before this one were handed to the caller."""
        self.flushes = 0
        """Flushing rounds completed (each ends one ``flush()`` or the ``close()``)."""
        self.error: BaseException | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    def deposit(self, flat: torch.Tensor) -> Deposit:
        """Add ``flat`` to the send buffer (on top of anything carried) and say which round it joins."""
        flat = flat.to(device=self._buffer.device, dtype=self._buffer.dtype)
        with self._cond:
            missed = self.consumed < self.next_round
            arrived = not missed
            self._buffer.add_(flat)
            self._parts += 1
            self._arrived = self._arrived or arrived
            return Deposit(round=self.next_round, missed=missed, arrived=arrived)

    def take(self) -> Snapshot:
        """Empty the send buffer into the next round's payload (the progress thread, once the round fired)."""
        n = self.numel
        with self._cond:
            payload = torch.empty(n + 2, dtype=self._buffer.dtype, device=self._buffer.device)
            payload[:n].copy_(self._buffer)
            payload[n] = 1.0 if self._arrived else 0.0
            payload[n + 1] = self._parts
            snapshot = Snapshot(round=self.next_round, payload=payload, arrived=self._arrived)
            self._buffer.zero_()
            self._parts = 0
            self._arrived = False
            self.next_round += 1
            self._cond.notify_all()
            return snapshot

    def complete(self, round_index: int, result: Any) -> None:
        """File the result of ``round_index`` (rounds complete in order)."""
        with self._cond:
            if round_index != self.completed:
                raise RuntimeError(f"round {round_index} completed out of order (expected {self.completed})")
            self._results[round_index] = result
            self.completed = round_index + 1
            self._cond.notify_all()

    def flushed(self) -> None:
        """Record that the last completed round was a flushing one."""
        with self._cond:
            self.flushes += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record the first error; every waiting and later call raises it."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def wait_collect(self, last: int, timeout_s: float) -> list[Any] | None:
        """Wait until round ``last`` completed; hand over every result from ``consumed`` to ``last``, in order.

        Returns None if ``timeout_s`` passed first. Raises the recorded error, if any.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.completed <= last:
                if self.error is not None:
                    raise self.error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._hand_over(last)

    def collect_completed(self) -> list[Any]:
        """Hand over every completed result the caller has not received yet (possibly none)."""
        with self._cond:
            return self._hand_over(self.completed - 1)

    def wait_change(self, timeout_s: float) -> None:
        """Sleep until a round is taken or completed, an error is recorded, or ``timeout_s`` passed."""
        with self._cond:
            self._cond.wait(timeout_s)

    def _hand_over(self, last: int) -> list[Any]:
        results = [self._results.pop(r) for r in range(self.consumed, last + 1)]
        self.consumed = max(self.consumed, last + 1)
        return results
