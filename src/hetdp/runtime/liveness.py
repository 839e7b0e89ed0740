"""Heartbeats on the process group's store, so that a failed collective can say which peer went silent.

A gloo or NCCL collective that times out says only that it timed out, and every
survivor blames nobody. Each rank of a drop-in's group therefore beats into the
c10d store once a second, from a thread of its own, with how far its training
got. A killed, SIGSTOPped or wedged process stops beating. When a collective
fails, the rank reads every beat twice, ``SILENCE_S`` apart: a rank whose beat
did not move is silent; a rank that beats but has not reached the failed
collective is stuck (a hang in its own code, or a step slower than the
deadline). The first verdict reached is published, and every survivor raises
that one, so a survivor that exits first is never mistaken for the culprit.

A stopped heartbeat leaves its two store clients to the next one in the same
process: every new client costs a connection and, in c10d, a reverse lookup of
the store's address, which a resolver that drops a burst of queries (16 ranks
building a model at once) holds up for its whole timeout, 5 s by default.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import distributed_c10d

from hetdp.runtime.engines import node_label

log = logging.getLogger(__name__)

BEAT_S = 1.0
"""Seconds between two beats of a rank."""
SILENCE_S = 2.5
"""A rank whose beat did not move in this long (more than two beats) is silent."""
STORE_TIMEOUT_S = 5.0
"""Longest wait for one store operation of a heartbeat or a diagnosis."""
VERDICT_S = SILENCE_S + 2 * STORE_TIMEOUT_S
"""Longest a survivor takes to name the culprit once a collective failed: two reads of the beats ``SILENCE_S``
apart, and the store's slowest answers. A watchdog that ends the process sooner (NCCL's) must wait past it."""

_watched: dict[int, Heartbeat] = {}
"""The running heartbeat of each process group, by ``id(group)``."""
_idle_clients: dict[tuple[int, int], list[tuple[dist.Store, dist.Store]]] = {}
"""Store clients of stopped heartbeats, by (process id, the default store's id): a forked child never takes its
parent's."""
_idle_lock = threading.Lock()


@dataclass(frozen=True)
class Verdict:
    """Who a failed collective waited on: ``silent`` ranks stopped beating, ``stuck`` ones beat but lag behind."""

    silent: tuple[int, ...] = ()
    stuck: tuple[int, ...] = ()

    @property
    def culprits(self) -> tuple[int, ...]:
        return self.silent or self.stuck

    def describe(self) -> str:
        """The verdict as the start of an error message ('' when it names nobody)."""
        if self.silent:
            return (f"{_ranks(self.silent)} stopped answering (no heartbeat for {SILENCE_S:g} s: killed, stopped "
                    f"or hung)")
        if self.stuck:
            verb = "is" if len(self.stuck) == 1 else "are"
            return (f"{_ranks(self.stuck)} {verb} alive but never joined (stuck in its own code, or slower than the "
                    f"deadline)")
        return ""

    def encode(self) -> bytes:
        return f"{','.join(map(str, self.silent))};{','.join(map(str, self.stuck))}".encode()

    @staticmethod
    def decode(value: bytes) -> Verdict:
        silent, _, stuck = value.decode().partition(";")
        return Verdict(tuple(int(r) for r in silent.split(",") if r), tuple(int(r) for r in stuck.split(",") if r))


def step_progress(steps_done: int, started: bool, reached: bool, epoch_ends: int) -> int:
    """How far a rank got, for its heartbeat: three points a step. The first once its forward started, so that a rank
    held up before its forward (loading data, a hang in its own code) is behind one that waits in a forward's
    collective (FSDP2's all-gather, torch DDP's buffer broadcast); the second once the started step's gradient
    synchronizes (``reached``, which counts only in a started step: a clock may still hold the last step's). And a
    point for each epoch end the rank entered (``epoch_ends``): every rank meets there between two steps, so one held
    up after its epoch's last step is behind those that wait in the epoch's gather of figures."""
    return 3 * steps_done + epoch_ends + int(started) + int(started and reached)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def judge(before: Sequence[tuple[int, int] | None], after: Sequence[tuple[int, int] | None], me: int,
          ranks: Sequence[int]) -> Verdict:
    """The verdict from two reads of every rank's (beats, progress), ``SILENCE_S`` apart, as rank ``me`` sees it.

    ``None`` is a rank that never beat. Ranks are named as ``ranks`` (the default group's numbering).
    """
    mine = after[me][1] if after[me] is not None else 0
    silent, stuck = [], []
    for rank, (first, last) in enumerate(zip(before, after)):
        if rank == me:
            continue
        if first is None or last is None or last[0] == first[0]:
            silent.append(ranks[rank])
        elif last[1] < mine:
            stuck.append(ranks[rank])
    return Verdict(tuple(silent), tuple(stuck))


class Heartbeat:
    """One rank's beat in ``group`` and its diagnosis of a failed collective; collective to create.

    ``progress`` says how far this rank got (any number that grows as it trains, the same scale on every rank).
    It beats into the store the default process group was initialised with, so it works under every launcher and
    init method; if that store cannot be reached it does nothing and diagnoses nobody: the heartbeat only names culprits, training never waits on it.
    """

    def __init__(self, group: dist.ProcessGroup, progress: Callable[[], int]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self._progress = progress
        message = [f"hetdp/live/{uuid.uuid4().hex}/" if self.rank == 0 else None]
        dist.broadcast_object_list(message, group=group, group_src=0)
        self._prefix: str = message[0]  # type: ignore[assignment]
        self._address: tuple[int, int] | None = None
        """(process id, the default store's id) of the store clients, once connected."""
        self._store, self._beater = self._connect()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._verdict: Verdict | None = None

    def _connect(self) -> tuple[dist.Store | None, dist.Store | None]:
        """Two clients of the process group's own store, one for diagnoses and one for the beating thread (a client
        is not shared between threads): a stopped heartbeat's if this process has some, else clones of the store
        that initialised the default group, whatever its init method (``env://``, ``tcp://``, ``file://``, an
        engine's); (None, None) if there is none or it does not answer."""
        try:
            base = distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):  # a group given a store object of the caller's own
            return None, None
        self._address = (os.getpid(), id(base))
        with _idle_lock:
            idle = _idle_clients.get(self._address)
            if idle:
                return idle.pop()
        try:
            store, beater = base.clone(), base.clone()
        except (dist.DistError, RuntimeError) as error:
            log.warning("rank %d: no heartbeat, the process group's store did not answer (%s); a failed collective "
                        "will not name its culprit", self.ranks[self.rank], error)
            return None, None
        for client in (store, beater):
            client.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return store, beater

    def start(self) -> Heartbeat:
        """Beat once now, then every ``BEAT_S`` seconds until ``stop()``; a failed collective may consult it."""
        if self._beater is None:
            return self
        beats = 1
        try:
            self._beat(self._beater, beats)
            self._beater.set(f"{self._prefix}node/{self.rank}", node_label())
        except (dist.DistError, RuntimeError) as error:
            log.warning("rank %d: no heartbeat, the store did not take a beat (%s)", self.ranks[self.rank], error)
            return self
        self._thread = threading.Thread(target=self._run, args=(self._beater, beats),
                                        name=f"hetdp-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        _watched[id(self.group)] = self
        atexit.register(self.stop)  # before interpreter shutdown, which a thread inside the store must not see
        return self

    def stop(self) -> None:
        """Stop beating (idempotent); once the beating thread has ended, its store clients go to the next heartbeat."""
        self._stopped.set()
        if _watched.get(id(self.group)) is self:
            del _watched[id(self.group)]
        if self._thread is not None:
            self._thread.join(timeout=STORE_TIMEOUT_S)
            ended = not self._thread.is_alive()
            self._thread = None
            atexit.unregister(self.stop)
            if ended:
                self._release_clients()

    def _release_clients(self) -> None:
        """Leave both store clients to the next heartbeat of this process (after any diagnosis using them)."""
        with self._lock:
            store, beater, self._store, self._beater = self._store, self._beater, None, None
        if self._address is not None and store is not None and beater is not None:
            with _idle_lock:
                _idle_clients.setdefault(self._address, []).append((store, beater))

    def diagnose(self) -> Verdict | None:
        """Who the failed collective waited on; the same verdict on every rank that asks (the first one reached).

        Blocks about ``SILENCE_S`` seconds the first time; None when there is no store or it does not answer.
        """
        with self._lock:
            if self._verdict is None and self._store is not None:
                try:
                    self._verdict = self._reach_verdict(self._store)
                except (dist.DistError, RuntimeError) as error:
                    log.warning("rank %d: the store did not answer a diagnosis: %s", self.ranks[self.rank], error)
            return self._verdict

    def node_of(self, rank: int) -> str | None:
        """Where ``rank`` (of the group) runs, as it said itself: its ``hetdp run`` node label, else its host; None
        if it said nothing or the store does not answer."""
        key = f"{self._prefix}node/{rank}"
        with self._lock:
            try:
                return self._store.get(key).decode() if self._store is not None and self._store.check([key]) else None
            except (dist.DistError, RuntimeError):
                return None

    def _reach_verdict(self, store: dist.Store) -> Verdict:
        key = self._prefix + "verdict"
        if store.check([key]):
            return Verdict.decode(store.get(key))
        before = self._read(store)
        time.sleep(SILENCE_S)  # this rank's own thread beats on meanwhile
        if store.check([key]):  # another survivor got there first (and may have exited since)
            return Verdict.decode(store.get(key))
        verdict = judge(before, self._read(store), self.rank, self.ranks)
        return Verdict.decode(store.compare_set(key, "", verdict.encode()))

    def _read(self, store: dist.Store) -> list[tuple[int, int] | None]:
        values: list[tuple[int, int] | None] = []
        for rank in range(len(self.ranks)):
            key = f"{self._prefix}{rank}"
            if store.check([key]):
                beats, progress = store.get(key).decode().split()
                values.append((int(beats), int(progress)))
            else:
                values.append(None)
        return values

    def _beat(self, store: dist.Store, beats: int) -> None:
        store.set(f"{self._prefix}{self.rank}", f"{beats} {self._progress()}")

    def _run(self, store: dist.Store, beats: int) -> None:
        while not self._stopped.wait(BEAT_S):
            beats += 1
            try:
                self._beat(store, beats)
            except (dist.DistError, RuntimeError) as error:  # a slow store, or the launcher is gone: try again
                log.debug("rank %d: a heartbeat was lost: %s", self.ranks[self.rank], error)


def elsewhere(group: dist.ProcessGroup | None, culprit: int) -> str | None:
    """Where the default-group rank ``culprit`` runs, if not where this rank does (None: the same place, or unknown)."""
    heartbeat = _watched.get(id(group)) if group is not None else None
    if heartbeat is None or culprit not in heartbeat.ranks:
        return None
    there = heartbeat.node_of(heartbeat.ranks.index(culprit))
    return there if there is not None and there != heartbeat.node_of(heartbeat.rank) else None


def diagnose(group: dist.ProcessGroup | None) -> Verdict | None:
    """The verdict of ``group``'s heartbeat on a failed collective, if the group has one."""
    heartbeat = _watched.get(id(group)) if group is not None else None
    return heartbeat.diagnose() if heartbeat is not None else None
