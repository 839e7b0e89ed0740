"""The control plane of partial allreduce: round activation, arrivals, closing and failure reports, on a c10d Store.

Each thread of a rank owns one ``RoundControl`` over its own store client (a
client blocked in ``wait`` cannot serve another thread). The rules it applies
live in ``protocol.py``; here they become store operations:

- ``act/R``: the verdict on round R, written once with ``compare_set``: ``go``
  (run it), ``flush`` (run it: every rank is flushing, this round empties every
  send buffer), ``last`` (the same, then stop: every rank is closing) or ``fail``.
- ``arr/R``, ``who/R``: arrivals at round R (majority, quorum, full).
- ``owed/I``: majority with bypass: rank I's round was bypassed and I has not arrived at a round since.
- ``flush/G``, ``flush/G/I``: ranks waiting in their G-th ``flush()`` or ``close()``.
- ``alarm``, ``alive/I``, ``failed``: a failure being diagnosed, the roll call
  that finds who is gone, and the one verdict every survivor raises.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence

import torch.distributed as dist

from hetdp.collectives.protocol import GRACE_HISTORY, Mode, fires, grace_s, initiator
from hetdp.errors import PeerTimeoutError

log = logging.getLogger(__name__)

GO, FLUSH, LAST, FAIL = b"go", b"flush", b"last", b"fail"

POLL_S = 0.05
"""How often a waiting thread looks for a failure reported by another rank."""
GRACE_POLL_S = 0.0005
"""How often a majority initiator in its grace looks at the arrivals."""
ROLL_CALL_S = 2.0
"""How long past the round's deadline a rank that hit a failure waits for the others to answer its roll call;
the silent ones are named."""
IDLE_WAIT_S = 3600.0
"""One blocking wait of an idle progress thread for the next activation (it simply waits again after)."""


class StoreLost(ConnectionError):
    """The c10d store stopped answering (its host is gone)."""


class RoundControl:
    """One thread's view of the rounds' control keys (see the module docstring).

    Args:
        store: a store client owned by the calling thread, already prefixed for one PartialAllreduce.
        mode, required, seed: the partial-allreduce settings (``required``: the quorum size, or the world size).
        rank, ranks: this rank in the group, and the default-group rank of every group rank (for messages).
        round_s: the round deadline, quoted in error messages.
        grace: majority mode: the part of its recent step an initiator waits for the others (``protocol.grace_s``).
        bypass: majority mode: fire a round without its initiator when it is the only rank out (``Partial``).
    """

    def __init__(
        self, store: dist.Store, *, mode: Mode, required: int, seed: int, rank: int, ranks: Sequence[int],
        round_s: float, grace: float = 0.0, bypass: bool = False,
    ) -> None:
        self._store = store
        self.mode = mode
        self.required = required
        self.seed = seed
        self.rank = rank
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.round_s = round_s
        self.generation = 0
        """Flushes this rank completed: the ranks in flush/G are those waiting in the next one."""
        self.grace = grace
        self.bypass = bypass
        self._last_round = 0
        """The round this rank last arrived at (majority with bypass)."""
        self._arrived_at: float | None = None
        self._steps: collections.deque[float] = collections.deque(maxlen=GRACE_HISTORY)
        """This rank's recent times between two arrivals: its steps, what its grace is a part of."""

    # --- the caller's thread ---------------------------------------------------------------------------------

    def arrive(self, round_index: int) -> None:
        """Announce this rank's arrival at ``round_index`` and fire the round if the mode says it may."""
        key = f"act/{round_index}"
        now = time.monotonic()
        if self.mode == "majority" and self.grace > 0:  # the only rule that needs this rank's steps
            if self._arrived_at is not None:
                self._steps.append(now - self._arrived_at)
            self._arrived_at = now
        if self.mode == "solo":
            self._store.compare_set(key, "", GO)
            return
        if self.mode == "majority":
            leader = initiator(self.seed, round_index, self.world_size)
            if self.bypass:
                self._settle_owed(round_index)
            if leader == self.rank:
                self._wait_for_the_others(round_index, until=now + grace_s(self._steps, self.grace))
                self._store.compare_set(key, "", GO)
                return
            # Count first, then look at the initiator: a flushing initiator does the reverse, so one of us sees
            # the other (see flush_and_fire).
            arrivals = self._store.add(f"arr/{round_index}", 1)
            if self._store.check([f"flush/{self.generation}/{leader}"]):
                self._store.compare_set(key, "", GO)
            elif self.bypass and arrivals == self.world_size - 1:
                self._bypass(round_index, leader, until=now + grace_s(self._steps, self.grace))
            return
        arrivals = self._store.add(f"arr/{round_index}", 1)
        self._store.append(f"who/{round_index}", f"{self.rank},")
        flushing = 0 if arrivals >= self.required else self.flushing_count()
        if fires(self.mode, self.required, arrivals=arrivals, flushing=flushing):
            self._store.compare_set(key, "", GO)

    def _settle_owed(self, round_index: int) -> None:
        """Majority with bypass, on arriving: if a round this rank initiated ran since its last arrival, it may have
        been bypassed there; arriving now, it owes nothing any more."""
        previous, self._last_round = self._last_round, round_index
        if any(initiator(self.seed, r, self.world_size) == self.rank for r in range(previous, round_index)):
            self._store.delete_key(f"owed/{self.rank}")

    def _bypass(self, round_index: int, leader: int, until: float) -> None:
        """The last arrival but the initiator: give the initiator until ``until``, then fire without it, unless it
        was bypassed before and has not arrived since (it then owes a round: the others wait for it, as the paper's
        rule does, so a rank late for good is not left ever further behind)."""
        key = f"act/{round_index}"
        if self._store.check([f"owed/{leader}"]):
            return
        while time.monotonic() < until:
            if self._store.check([key]):
                return
            time.sleep(GRACE_POLL_S)
        # Owed first, then fired: the initiator's next arrival, which comes after this round ran, finds and clears it.
        self._store.set(f"owed/{leader}", str(round_index).encode())
        self._store.compare_set(key, "", GO)

    def _wait_for_the_others(self, round_index: int, until: float) -> None:
        """Majority initiator: until ``until``, or until every other rank arrived (a flushing one never will)."""
        while time.monotonic() < until and int(self._store.add(f"arr/{round_index}", 0)) < self.world_size - 1:
            time.sleep(GRACE_POLL_S)

    def flush_and_fire(self, next_round: int, verdict: bytes) -> int:
        """Announce that this rank is flushing; fire rounds its absence would block; the last one in ends the flush.

        The last rank to flush writes ``verdict`` (FLUSH, or LAST when closing) on the first round without one:
        that round empties every send buffer. Returns the number of ranks flushing so far, this one included.
        """
        self._store.set(f"flush/{self.generation}/{self.rank}", b"1")
        flushing = self._store.add(f"flush/{self.generation}", 1)
        if flushing < self.world_size:
            # Only rounds at most one ahead of ours can have arrivals waiting on them.
            for round_index in (next_round, next_round + 1):
                if self._fires_without_flushing(round_index, flushing):
                    self._store.compare_set(f"act/{round_index}", "", GO)
            return flushing
        round_index = next_round
        while self._store.compare_set(f"act/{round_index}", "", verdict) == GO:
            round_index += 1
        return flushing

    def flushing_count(self) -> int:
        return int(self._store.add(f"flush/{self.generation}", 0))

    def not_flushing(self) -> list[int]:
        """Group ranks that have not called this ``flush()`` or ``close()``."""
        return [r for r in range(self.world_size) if not self._store.check([f"flush/{self.generation}/{r}"])]

    def missing_arrivals(self, round_index: int) -> list[int]:
        """Group ranks a stalled round is waiting for (the initiator, or those outside the quorum)."""
        if self.mode == "majority":
            return [initiator(self.seed, round_index, self.world_size)]
        if self.mode == "solo":
            return []
        present: set[int] = set()
        if self._store.check([f"who/{round_index}"]):
            present = {int(item) for item in self._store.get(f"who/{round_index}").decode().split(",") if item}
        return [r for r in range(self.world_size) if r not in present]

    def publish_failure(self, rank: int | None, message: str, next_round: int) -> PeerTimeoutError:
        """Record the verdict (the first one recorded wins), wake every progress thread, return the error to raise."""
        error = self._settle(rank, message)
        self._store.set("alarm", b"1")
        self._poke(next_round)
        return error

    # --- the progress thread ---------------------------------------------------------------------------------

    def await_activation(self, round_index: int) -> bytes:
        """Block until ``round_index`` has a verdict and return it; an idle rank may wait indefinitely.

        One blocking ``get`` (the client's timeout is ``IDLE_WAIT_S``) rather than a ``wait`` and then a
        ``get``: a round trip less to the store on every rank's critical path.

        Raises:
            StoreLost: the store's host is gone.
        """
        key = f"act/{round_index}"
        while True:
            try:
                return self._store.get(key)
            except dist.DistStoreError as error:
                if "timeout" not in str(error).lower():
                    raise StoreLost(str(error)) from error
            except (dist.DistError, RuntimeError) as error:
                raise StoreLost(str(error)) from error

    def alarm_raised(self) -> bool:
        """Another rank is diagnosing a failure: stop waiting on the allreduce and answer its roll call."""
        return self._store.check(["alarm"])

    def roll_call(self, round_index: int, cause: str, round_deadline: float) -> PeerTimeoutError:
        """Find the ranks that stopped answering after ``round_index`` failed here; return the verdict to raise.

        A live rank may be blocked on a send or receive until its own deadline for the round (``round_deadline``,
        a ``time.monotonic()`` reading): the roll call lasts until ``ROLL_CALL_S`` past it.
        """
        self._store.set(f"alive/{self.rank}", b"1")
        self._store.set("alarm", b"1")
        self._poke(round_index)
        deadline = max(time.monotonic(), round_deadline) + ROLL_CALL_S
        missing = self._silent()
        while missing and time.monotonic() < deadline and not self._store.check(["failed"]):
            time.sleep(POLL_S)
            missing = self._silent()
        if missing:
            names = ", ".join(str(self.ranks[r]) for r in missing)
            rank = self.ranks[missing[0]]
            message = (
                f"rank {rank} stopped answering: round {round_index} ({self.mode}) failed on rank "
                f"{self.ranks[self.rank]} ({cause}), and rank(s) {names} did not answer the roll call "
                f"within {ROLL_CALL_S:g} s (round deadline {self.round_s:g} s)"
            )
        else:
            rank = None
            message = f"round {round_index} ({self.mode}) failed on rank {self.ranks[self.rank]} ({cause})"
        return self._settle(rank, message)

    def join_failure(self) -> PeerTimeoutError:
        """Answer another rank's roll call, then wait for its verdict and return it."""
        self._store.set(f"alive/{self.rank}", b"1")
        patience = self.round_s + ROLL_CALL_S + 1.0  # a roll call may last until past its round's deadline
        deadline = time.monotonic() + patience
        while not self._store.check(["failed"]):
            if time.monotonic() > deadline:
                return PeerTimeoutError(f"a peer reported a failure but gave no verdict within {patience:g} s",
                                        timeout_s=self.round_s)
            time.sleep(POLL_S)
        return self._decode(self._store.get("failed"))

    def forget(self, round_index: int) -> None:
        """Delete the keys of a round every rank is done with (rank 0 does it, two rounds behind)."""
        for key in (f"act/{round_index}", f"arr/{round_index}", f"who/{round_index}"):
            self._store.delete_key(key)

    # --- shared ---------------------------------------------------------------------------------------------

    def _fires_without_flushing(self, round_index: int, flushing: int) -> bool:
        if self.mode == "solo":
            return False  # a solo caller fires its own round: nobody waits on a flushing rank
        arrivals = int(self._store.add(f"arr/{round_index}", 0))
        if self.mode == "majority":
            leader = initiator(self.seed, round_index, self.world_size)
            return arrivals >= 1 and self._store.check([f"flush/{self.generation}/{leader}"])
        return fires(self.mode, self.required, arrivals=arrivals, flushing=flushing)

    def _silent(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank and not self._store.check([f"alive/{r}"])]

    def _poke(self, round_index: int) -> None:
        """Wake progress threads blocked on an activation: no thread is more than one round from another."""
        for index in (round_index, round_index + 1):
            self._store.compare_set(f"act/{index}", "", FAIL)

    def _settle(self, rank: int | None, message: str) -> PeerTimeoutError:
        encoded = f"{-1 if rank is None else rank}\n{message}".encode()
        return self._decode(self._store.compare_set("failed", "", encoded))

    def _decode(self, value: bytes) -> PeerTimeoutError:
        rank_text, _, message = value.decode().partition("\n")
        rank = int(rank_text)
        return PeerTimeoutError(message, rank=None if rank < 0 else rank, timeout_s=self.round_s)
