"""PartialAllreduce: an allreduce whose rounds wait for one rank (solo), a random initiator (majority),
k ranks (quorum) or everyone (full), instead of always for the slowest one.

Eager-SGD paper (partial collectives), sections 4-6. Rounds run on a progress
thread per process, over its own gloo group, and are activated through a c10d
Store; the round rules are in ``protocol.py``, their store side in ``control.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist

from hetdp.collectives import doubling
from hetdp.collectives.control import FLUSH, GO, IDLE_WAIT_S, LAST, POLL_S, ROLL_CALL_S, RoundControl, StoreLost
from hetdp.collectives.protocol import GRACE, MODES, Deposit, Mode, RoundBook, initiator
from hetdp.errors import ConfigError, HetDPError, PeerTimeoutError
from hetdp.runtime import Timeouts, defer_nccl_watchdog, group_timeout_s

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class Partial:
    """A partial synchronization: when a round of the allreduce may run without every rank (eager-SGD), and, as the
    drop-in's synchronization (``hetdp.DDP(model, sync=hetdp.Partial(...))``), how often the ranks meet.

    In the drop-in, each step waits for a partial allreduce of the gradients, not for every rank. A round's gradient
    is the sample-weighted mean of the contributions it holds (fresh ones, and stale ones carried from rounds their
    rank missed), counted as the part of a step its samples are; a rank that missed rounds applies all of them in its
    next step. Every ``every`` steps and at each epoch's end the ranks meet: they flush the rounds in flight and
    average their parameters (the paper's periodic model synchronization), which is also when an adaptive
    allocation re-plans. ``PartialAllreduce.from_config`` takes the same settings for a partial allreduce of one's
    own.
    """

    mode: Mode = "majority"
    """Who fires a round: the first arrival (``solo``, wait-free), a random initiator shared by all ranks
    (``majority``: half the ranks contribute fresh data on average), the k-th arrival (``quorum``: a guarantee,
    not a statistic) or the last one (``full``: a synchronous allreduce)."""
    quorum: int | None = None
    """k, the arrivals a ``quorum`` round needs (1 <= k <= world size); only for ``mode="quorum"``."""
    every: int = 0
    """The drop-in's meetings (parameter averaging): every this many steps; 0: only at each epoch's end."""
    seed: int = 0
    """Seed of the majority initiators: every rank must use the same one."""
    grace: float = GRACE
    """Majority mode: once arrived, the initiator waits up to this part of its recent step for the ranks still out,
    so that those only a little behind contribute fresh (see ``protocol.grace_s``). 0 fires at once, as the paper
    does; with allocation equalizing the ranks' times, many arrive just after the initiator: the grace lets them in
    fresh, and a real straggler is still not waited for."""
    bypass: bool = True
    """Majority mode: a round whose initiator is the only rank still out, once the others waited out their grace,
    fires without it, unless that initiator was bypassed before and has not arrived at a round since. A rank late
    once, a transient straggler, then holds up no round; a rank late for good is bypassed at most once between two
    of its arrivals, so it falls at most about a round further behind than under the paper's rule. False fires only
    on the initiator's arrival, as the paper does."""
    timeouts: Timeouts | None = None
    """``connect_s``: creating the group and connecting to the store. ``round_s``: how long a call waits for its
    round (to fire, then to be reduced) before a PeerTimeoutError names the rank it waited for; also the gloo
    timeout. ``shutdown_s``: joining the progress thread at ``close()``. Too small a ``round_s`` turns a slow
    initiator into an error; too large one only delays the error a dead peer causes. None: ``Timeouts()``, and in
    the drop-in a round waits its ``step_timeout_s``, as every step does."""
    data_backend: Literal["gloo", "nccl"] = "gloo"
    """Group that carries the data: ``gloo`` (CPU, tensors staged through host memory) or ``nccl`` (CUDA
    tensors stay on the GPU; control still goes through gloo and the store). The drop-in takes ``nccl`` itself
    where its group runs on NCCL."""
    bucket_mb: float = 64.0
    """A round's payload travels in allreduces of at most this many megabytes, issued together."""
    sync_every: InitVar[int | None] = None
    """Deprecated: ``every``."""

    def __post_init__(self, sync_every: int | None) -> None:
        if sync_every is not None:
            warnings.warn("hetdp.Partial(sync_every=K) is deprecated and goes after 0.1.0; use "
                          "hetdp.Partial(every=K), as hetdp.LocalAveraging(every=K)", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "every", sync_every)
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.mode == "quorum":
            if not isinstance(self.quorum, int) or isinstance(self.quorum, bool) or self.quorum < 1:
                raise ConfigError(f"mode='quorum' needs quorum=k, an integer >= 1; got {self.quorum!r}")
        elif self.quorum is not None:
            raise ConfigError(f"quorum={self.quorum!r} only applies to mode='quorum' (mode is {self.mode!r})")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError(f"every must be an integer >= 0 steps (0: per epoch), got {self.every!r}")
        if isinstance(self.grace, bool) or not isinstance(self.grace, (int, float)) or not 0 <= self.grace < 1:
            raise ConfigError(f"grace must be a part of a step, 0 <= grace < 1; got {self.grace!r}")
        if not isinstance(self.bypass, bool):
            raise ConfigError(f"bypass must be True or False, got {self.bypass!r}")
        if self.data_backend not in ("gloo", "nccl"):
            raise ConfigError(f"data_backend must be 'gloo' or 'nccl', got {self.data_backend!r}")
        if not self.bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")

    def describe(self) -> str:
        return f"quorum:{self.quorum}" if self.mode == "quorum" else self.mode

    def required(self, world_size: int) -> int:
        """Arrivals that fire a round: k for quorum, the world size for full, 1 otherwise.

        Raises:
            ConfigError: the quorum is larger than the group.
        """
        if self.mode == "quorum":
            assert self.quorum is not None
            if self.quorum > world_size:
                raise ConfigError(f"quorum={self.quorum} exceeds the group's {world_size} ranks; use 1..{world_size}")
            return self.quorum
        return world_size if self.mode == "full" else 1


def PartialConfig(**settings: Any) -> Partial:  # noqa: N802 (the name of the class it replaces, for a release)
    """Deprecated: ``hetdp.Partial``, here with the paper's round rules (no grace, no bypass) unless given."""
    return Partial(**{"grace": 0.0, "bypass": False, **settings})


@dataclass(frozen=True, eq=False)
class PartialResult:
    """The outcome of one round, identical on every rank except ``fresh``."""

    tensor: torch.Tensor
    """The sum of the contributions the round holds, shaped like the input."""
    round: int
    """Index of the round (0, 1, 2, ...): the same index means the same sum on every rank."""
    contributors: int
    """Ranks that arrived at the round: the paper's active processes (at least k in quorum mode)."""
    fresh: bool
    """Whether this rank arrived at the round (its tensor from an ``allreduce`` call is in the sum)."""
    parts: int = 0
    """Calls whose tensors the sum holds: the contributors' plus stale ones carried from earlier rounds."""
    missed: tuple[PartialResult, ...] = ()
    """Earlier rounds the same call returns, oldest first: rounds run while this rank was away."""
    last: float | None = None
    """The sum's last element, read on the host with the round's counters: a caller that keeps a weight there
    (the drop-in does) reads it without a device round trip (reading ``tensor`` on a GPU would wait for the
    device's whole queue)."""

    @property
    def rounds(self) -> tuple[PartialResult, ...]:
        """Every round this call returned, oldest first (``missed`` then this one)."""
        return (*self.missed, self)


def _describe(tensor_or_numel: torch.Tensor | int) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    """Shape, dtype and device of the tensors a PartialAllreduce will take (an element count: float32 on CPU)."""
    if isinstance(tensor_or_numel, torch.Tensor):
        return tuple(tensor_or_numel.shape), tensor_or_numel.dtype, tensor_or_numel.device
    if isinstance(tensor_or_numel, bool) or not isinstance(tensor_or_numel, int) or tensor_or_numel < 1:
        raise ConfigError(f"tensor_or_numel must be a tensor or a positive element count, got {tensor_or_numel!r}")
    return (tensor_or_numel,), torch.float32, torch.device("cpu")


def _timeouts(timeout: float | datetime.timedelta | Timeouts | None) -> Timeouts:
    if timeout is None:
        return Timeouts()
    if isinstance(timeout, Timeouts):
        return timeout
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return Timeouts(round_s=float(timeout))


class PartialAllreduce:
    """An allreduce that completes without waiting for every rank: solo, majority, quorum-k or full.

    Each call adds ``tensor`` to this rank's send buffer and arrives at the open
    round. A round fires when its mode says so (see ``Partial.mode``);
    every rank then contributes what its buffer holds (fresh data, stale data
    carried from a round it missed, or zeros), and every rank receives the same
    sum. The guarantees are those of the eager-SGD paper's Lemma 6.1:

    - liveness: as long as ranks keep calling, every round completes;
    - safety: a round's sum, ``contributors`` and ``parts`` are the same on
      every rank; the sum holds a subset of the contributions; ``fresh`` says
      whether this rank's tensor is in it;
    - quorum: a ``quorum`` round never fires with fewer than k arrivals
      (``full``: all ranks);
    - conservation: each tensor is summed in exactly one round; one that missed
      a round is carried to the next, never dropped or counted twice.

    A call that finds rounds run since its previous call returns them at once
    (``result.missed`` holds all but the latest), so every rank receives every
    round, in order; its tensor, computed before those rounds, is not an
    arrival but waits in the send buffer for the next round (the paper's
    Fig. 7). A call that finds none arrives at the open round and waits for it.

    Warning:
        Every rank of the group must construct its instances in the same order
        (construction is collective), keep calling ``allreduce`` while others
        may wait on it, and end with ``close()``, which every rank must call.
        Before any other collective between calls (a barrier, an evaluation's
        allreduce, a checkpoint), every rank calls ``flush()``: otherwise a rank
        waiting for a round may wait on a rank that waits in that collective.
        One thread per rank calls ``allreduce``.

    A peer that dies or hangs ends in a ``PeerTimeoutError`` naming it, on every
    surviving rank, after at most ``timeouts.round_s`` plus a roll call of
    ``ROLL_CALL_S`` seconds; the instance is unusable afterwards.

    Examples:
        >>> # on every rank, after torch.distributed.init_process_group("gloo")
        >>> with hetdp.PartialAllreduce(grad.numel(), mode="majority", timeout=30.0) as partial:
        ...     for step in range(steps):
        ...         result = partial.allreduce(local_grad())   # rank 0 may be ahead of rank 1 here
        ...         for r in result.rounds:                    # the same rounds, in the same order, everywhere
        ...             apply(r.tensor / dist.get_world_size())
    """

    def __init__(
        self,
        tensor_or_numel: torch.Tensor | int,
        mode: Mode = "majority",
        quorum: int | None = None,
        group: dist.ProcessGroup | None = None,
        timeout: float | datetime.timedelta | Timeouts | None = None,
        *,
        seed: int = 0,
        grace: float = 0.0,
        bypass: bool = False,
    ) -> None:
        """Create the progress thread, its gloo group and store clients; collective over ``group``.

        Args:
            tensor_or_numel: the tensor each call will pass (its shape, dtype and device), or its element count
                (float32 on the CPU).
            mode, quorum, seed, grace, bypass: see ``Partial``.
            group: the ranks taking part (None: the default group).
            timeout: the round deadline (seconds or a timedelta), or a full ``Timeouts``.

        Raises:
            ConfigError: a bad setting, or torch.distributed is not initialized.
        """
        config = Partial(mode=mode, quorum=quorum, seed=seed, grace=grace, bypass=bypass, timeouts=_timeouts(timeout))
        self._start(tensor_or_numel, config, group)

    @classmethod
    def from_config(
        cls, tensor_or_numel: torch.Tensor | int, config: Partial, group: dist.ProcessGroup | None = None
    ) -> PartialAllreduce:
        """Like the constructor, with every setting from ``config``."""
        instance = cls.__new__(cls)
        instance._start(tensor_or_numel, config, group)
        return instance

    # --- set-up ----------------------------------------------------------------------------------------------

    def _start(
        self, tensor_or_numel: torch.Tensor | int, config: Partial, group: dist.ProcessGroup | None
    ) -> None:
        self._closed = True  # until the thread runs, close() has nothing to do
        self._shape, self._dtype, self._device = _describe(tensor_or_numel)
        self.numel = int(torch.Size(self._shape).numel())
        if not dist.is_initialized():
            raise ConfigError("PartialAllreduce needs torch.distributed: call hetdp.init_distributed() first")
        if config.timeouts is None:
            config = dataclasses.replace(config, timeouts=Timeouts())
        if config.data_backend == "nccl" and self._device.type != "cuda":
            raise ConfigError(f"data_backend='nccl' needs a CUDA tensor, got one on {self._device}")
        self.config = config
        self._ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        if dist.get_rank() not in self._ranks:
            raise ConfigError(f"rank {dist.get_rank()} is not in the group {self._ranks}")
        self.rank = self._ranks.index(dist.get_rank())
        self.world_size = len(self._ranks)
        payload_dtype = self._dtype if self._dtype.itemsize >= 4 else torch.float32  # counters must stay exact
        buffer_device = self._device if config.data_backend == "nccl" else torch.device("cpu")
        self._book = RoundBook(self.numel, payload_dtype, buffer_device)
        self._bucket_numel = max(1, int(config.bucket_mb * 2**20 // payload_dtype.itemsize))
        self._connect(group, required=config.required(self.world_size))
        self._thread = threading.Thread(target=self._progress_main, name=f"hetdp-partial-{self.rank}", daemon=True)
        self._closed = False
        self._thread.start()
        log.debug("rank %d: partial allreduce (%s) of %d elements over ranks %s", self.rank, config.mode,
                  self.numel, self._ranks)

    def _connect(self, group: dist.ProcessGroup | None, required: int) -> None:
        """Open the two store clients (caller, progress thread) and the group the rounds travel on."""
        timeouts = self.config.timeouts
        self._server: dist.TCPStore | None = None
        prefix, host, port, self._hosted = self._exchange_address(group)
        self._store_address = f"{host}:{port}"
        client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeouts.connect_s))
        # The group is built on its own store prefix rather than with dist.new_group: instances can then come
        # and go in any number without clashing group names, and only the group's members take part.
        self._group = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo/", client), self.rank,
                                            self.world_size, datetime.timedelta(seconds=timeouts.round_s))
        self._data_group = self._group
        if self.config.data_backend == "nccl":
            # The payload stays on the GPU and travels over NCCL (checked on one H100; the test suite is CPU-only).
            defer_nccl_watchdog()
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=group_timeout_s("nccl", timeouts.round_s))
            self._data_group = dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "nccl/", client.clone()), self.rank,
                                                     self.world_size, options)
        settings = {"mode": self.config.mode, "required": required, "seed": self.config.seed, "rank": self.rank,
                    "ranks": self._ranks, "round_s": timeouts.round_s, "grace": self.config.grace,
                    "bypass": self.config.bypass}
        self._control = RoundControl(dist.PrefixStore(prefix, client), **settings)
        progress_client = client.clone()
        progress_client.set_timeout(datetime.timedelta(seconds=IDLE_WAIT_S))  # its blocking get awaits activations
        self._progress_control = RoundControl(dist.PrefixStore(prefix, progress_client), **settings)

    def _exchange_address(self, group: dist.ProcessGroup | None) -> tuple[str, str, int, bool]:
        """Group rank 0 picks a key prefix and the store (the launcher's, or one it hosts) and tells the others."""
        message: list[object] = [None]
        if self.rank == 0:
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            hosted = not (host and port)
            if hosted:
                # No launcher store to share: host one here; it lives until this rank closes.
                host = socket.gethostname()
                self._server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                             timeout=datetime.timedelta(seconds=self.config.timeouts.connect_s))
                port = str(self._server.port)
            message = [(f"hetdp/partial/{uuid.uuid4().hex}/", host, int(port), hosted)]
        dist.broadcast_object_list(message, group=group, group_src=0)
        return message[0]  # type: ignore[return-value]

    # --- public surface --------------------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self.config.mode

    def initiator(self, round_index: int) -> int:
        """Majority mode: the group rank whose arrival fires ``round_index`` (the same on every rank)."""
        return initiator(self.config.seed, round_index, self.world_size)

    def allreduce(self, tensor: torch.Tensor) -> PartialResult:
        """Contribute ``tensor`` (left unchanged) and return the next round's result, with any missed before it.

        Returns at once with the rounds run since the previous call if there were
        any (``tensor`` then travels in a later round); otherwise waits for the
        round ``tensor`` travels in.

        Raises:
            PeerTimeoutError: the round did not complete within ``timeouts.round_s`` (the message names the
                rank it waited for), or a peer died; every later call raises it too.
            ConfigError: ``tensor`` has the wrong number of elements.
            HetDPError: the instance is closed.
        """
        self._ensure_open()
        self._check_size(tensor, "allreduce")
        deposit = self._book.deposit(tensor.detach().reshape(-1))
        if deposit.arrived:
            try:
                self._control.arrive(deposit.round)
            except (dist.DistError, RuntimeError) as error:
                self._raise_store_lost(error)
        results = self._await(deposit)
        return self._package(results, tensor)

    def poll(self) -> tuple[PartialResult, ...]:
        """The rounds completed since the last call, oldest first, without contributing or waiting.

        A rank back from a stall can apply them before computing its next tensor,
        so that it works on fresh data; its next ``allreduce`` then returns only the
        rounds completed after this call.

        Raises:
            PeerTimeoutError: a peer died or a round failed earlier.
            HetDPError: the instance is closed.
        """
        self._ensure_open()
        return tuple(self._to_caller(result) for result in self._book.collect_completed())

    def flush(
        self, on_round: Callable[[PartialResult], None] | None = None, tensor: torch.Tensor | None = None
    ) -> tuple[PartialResult, ...]:
        """Wait until every rank flushes, then run one last round that empties every send buffer.

        While the others have not flushed yet, this rank counts as arrived in
        every round (with nothing to add but ``tensor``); the rounds they run
        meanwhile, then the flushing round, are returned. Afterwards every rank has
        received the same rounds and holds nothing: a safe point for other
        collectives (evaluation, checkpoints, barriers), which could otherwise wait
        on a rank that waits on them.

        Args:
            on_round: called with each of those rounds as it completes, before ``flush`` returns (a caller may
                apply them there, so that a rank that finished early keeps following the others).
            tensor: a last contribution, added to the send buffer first: it travels in one of the rounds
                returned, the flushing round at the latest, fresh unless rounds ran since the previous call. Ranks
                that all flush with one run a step that is complete everywhere, as a synchronous allreduce is.

        Returns:
            The rounds this rank had not received yet, oldest first, the flushing round last.

        Raises:
            PeerTimeoutError: no rank arrived and no round completed for ``timeouts.round_s`` seconds (the message
                names a rank that has not flushed), or a peer died meanwhile.
            ConfigError: ``tensor`` has the wrong number of elements.
            HetDPError: the instance is closed.
        """
        self._ensure_open()
        if tensor is not None:
            self._check_size(tensor, "flush")
            self._book.deposit(tensor.detach().reshape(-1))
        return tuple(self._flush(on_round, FLUSH))

    def close(self, on_round: Callable[[PartialResult], None] | None = None) -> tuple[PartialResult, ...]:
        """Flush (see ``flush``), then stop and join the progress thread. Idempotent.

        Returns:
            The rounds this rank had not received yet, oldest first (empty if the instance failed or is closed).

        Raises:
            PeerTimeoutError: as ``flush``; the thread is stopped all the same.
        """
        if self._closed:
            return ()
        self._closed = True
        try:
            if self._book.error is None and self._thread.is_alive():
                return tuple(self._flush(on_round, LAST))
            return ()
        finally:
            self._teardown()

    def __enter__(self) -> PartialAllreduce:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is not None and not isinstance(error, HetDPError) and not self._closed and self._book.error is None:
            # This rank is leaving on an error of its own: tell the others instead of letting them time out.
            self._book.fail(self._control.publish_failure(
                self._ranks[self.rank], f"rank {self._ranks[self.rank]} left on {type(error).__name__}: {error}",
                self._book.next_round))
        if error is None:
            self.close()
        else:
            try:
                self.close()
            except HetDPError:
                log.debug("rank %d: close() after %r failed too", self.rank, error, exc_info=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._book.error else "open"
        return (f"PartialAllreduce(mode={self.mode!r}, numel={self.numel}, rank={self.rank}/{self.world_size}, "
                f"round={self._book.next_round}, {state})")

    # --- the caller's side -----------------------------------------------------------------------------------

    def _await(self, deposit: Deposit) -> list[PartialResult]:
        round_s = self.config.timeouts.round_s
        last = deposit.last_needed
        results = self._book.wait_collect(last, round_s)
        if results is None and self._book.next_round > last:
            # The round is running here: its progress thread diagnoses a stuck reduction itself.
            results = self._book.wait_collect(last, round_s + ROLL_CALL_S + 2.0)
        if results is None:
            self._book.fail(self._stalled(last))
            raise self._book.error  # type: ignore[misc]
        return results

    def _stalled(self, round_index: int) -> PeerTimeoutError:
        """Name the rank a round that never fired waited for, and tell every rank."""
        round_s = self.config.timeouts.round_s
        try:
            missing = self._control.missing_arrivals(round_index)
            ranks = [self._ranks[r] for r in missing]
            if self.mode == "majority":
                why = f"its initiator, rank {ranks[0]}, did not call allreduce (dead, hung, or slower than that)"
            elif ranks:
                why = f"rank(s) {', '.join(map(str, ranks))} did not call allreduce, short of the quorum"
            else:
                why = "it did not complete"
            message = (f"rank {ranks[0] if ranks else '?'}: round {round_index} ({self.mode}) did not fire within "
                       f"{round_s:g} s: {why}")
            return self._control.publish_failure(ranks[0] if ranks else None, message, self._book.next_round)
        except (dist.DistError, RuntimeError) as error:
            return PeerTimeoutError(f"round {round_index} did not fire within {round_s:g} s, and the store at "
                                    f"{self._store_address} stopped answering: {error}", timeout_s=round_s)

    def _check_size(self, tensor: torch.Tensor, call: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != self.numel:
            got = tensor.numel() if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ConfigError(f"{call} expects a tensor of {self.numel} elements, got {got}")

    def _ensure_open(self) -> None:
        if self._closed:
            raise HetDPError("this PartialAllreduce is closed")
        if self._book.error is not None:
            raise self._book.error

    def _raise_store_lost(self, error: BaseException) -> None:
        owner = "rank 0" if self._hosted else "the launcher (MASTER_ADDR:MASTER_PORT)"
        lost = PeerTimeoutError(f"lost the c10d store at {self._store_address} (hosted by {owner}): {error}",
                                rank=None if owner != "rank 0" else self._ranks[0],
                                timeout_s=self.config.timeouts.round_s)
        self._book.fail(lost)
        raise lost from error

    def _package(self, results: list[PartialResult], like: torch.Tensor) -> PartialResult:
        results = [self._to_caller(result, like) for result in results]
        return dataclasses.replace(results[-1], missed=tuple(results[:-1]))

    def _to_caller(self, result: PartialResult, like: torch.Tensor | None = None) -> PartialResult:
        """``result`` with its tensor shaped, typed and placed like ``like`` (default: the declared tensor)."""
        shape, dtype, device = (self._shape, self._dtype, self._device) if like is None else (
            like.shape, like.dtype, like.device)
        tensor = result.tensor
        if tensor.device != device or tensor.dtype != dtype:
            tensor = tensor.to(device=device, dtype=dtype)
        return dataclasses.replace(result, tensor=tensor.view(shape))

    def _flush(self, on_round: Callable[[PartialResult], None] | None, verdict: bytes) -> list[PartialResult]:
        target = self._book.flushes + 1
        try:
            flushing = self._control.flush_and_fire(self._book.next_round, verdict)
        except (dist.DistError, RuntimeError) as error:
            self._raise_store_lost(error)
        out: list[PartialResult] = []
        seen, since = (self._book.completed, flushing), time.monotonic()
        while True:
            done = self._book.flushes >= target
            for result in self._book.collect_completed():
                out.append(self._to_caller(result))
                if on_round is not None:
                    on_round(out[-1])
            if done:
                break
            if self._book.error is not None:
                raise self._book.error
            self._book.wait_change(POLL_S)
            now = time.monotonic()
            state = (self._book.completed, self._control.flushing_count())
            if state != seen:
                seen, since = state, now
            elif now - since > self.config.timeouts.round_s:
                late = [self._ranks[r] for r in self._control.not_flushing()]
                rank = late[0] if late else None
                error = self._control.publish_failure(
                    rank, f"rank {rank} did not flush or close: {len(late)} rank(s) ({late}) still training and no "
                    f"round completed for {self.config.timeouts.round_s:g} s", self._book.next_round)
                self._book.fail(error)
                raise error
        self._control.generation += 1
        return out

    def _teardown(self) -> None:
        if self._book.error is not None:
            # The progress thread may wait on a dead peer until the round's deadline: abort its operations.
            for group in {id(g): g for g in (self._data_group, self._group)}.values():
                group.abort()
        self._thread.join(self.config.timeouts.shutdown_s)
        if self._thread.is_alive():
            log.warning("rank %d: partial-allreduce thread still running after %.3g s", self.rank,
                        self.config.timeouts.shutdown_s)
        elif self._book.error is None:
            if self._hosted:
                # Group rank 0 hosts the store the others may still read: leave together.
                self._group.barrier().wait()
        if not self._thread.is_alive():
            # Dropping the last reference joins gloo's worker threads.
            self._group = self._data_group = None  # type: ignore[assignment]
        self._control = self._progress_control = None  # type: ignore[assignment]
        self._server = None

    # --- the progress thread ---------------------------------------------------------------------------------

    def _progress_main(self) -> None:
        try:
            self._progress_loop()
        except BaseException as error:  # a bug here must reach the caller, not vanish with the thread
            log.exception("rank %d: partial-allreduce thread crashed", self.rank)
            self._book.fail(HetDPError(f"the partial-allreduce thread crashed: {error!r}"))

    def _progress_loop(self) -> None:
        control = self._progress_control
        round_index = 0
        while True:
            try:
                verdict = control.await_activation(round_index)
            except StoreLost as error:
                self._book.fail(PeerTimeoutError(f"lost the c10d store at {self._store_address}: {error}",
                                                 timeout_s=self.config.timeouts.round_s))
                return
            if verdict not in (GO, FLUSH, LAST):
                self._book.fail(control.join_failure())
                return
            snapshot = self._book.take()
            error = self._reduce(snapshot.payload, round_index)
            if error is not None:
                self._book.fail(error)
                return
            last, arrivals, parts = snapshot.payload[self.numel - 1 :].tolist()  # one read of the host (or device)
            self._book.complete(round_index, PartialResult(
                tensor=snapshot.payload[: self.numel].view(self._shape),
                round=round_index,
                contributors=round(arrivals),
                fresh=snapshot.arrived,
                parts=round(parts),
                last=last,
            ))
            if verdict != GO:
                self._book.flushed()
            if self.rank == 0 and round_index >= 2:
                control.forget(round_index - 2)
            if verdict == LAST:
                return
            round_index += 1

    @staticmethod
    def _finished(work: dist.Work, poll: datetime.timedelta) -> bool:
        """Wait up to ``poll`` for a collective ``work``; False if it is still running, its error if it failed.

        A bounded ``wait`` on a gloo collective that expires leaves it running ("Operation timed out!"), and
        wakes as soon as the work ends, where a completion callback would cost two more thread hand-offs.
        """
        try:
            work.wait(poll)
            return True
        except RuntimeError as error:
            if work.is_completed() or "Operation timed out" not in str(error):
                raise
            return False

    def _reduce(self, payload: torch.Tensor, round_index: int) -> PeerTimeoutError | None:
        """Sum ``payload`` over the group in place; on a failure, find who is gone and return the verdict."""
        control = self._progress_control
        round_s = self.config.timeouts.round_s
        deadline = time.monotonic() + round_s
        poll = datetime.timedelta(seconds=POLL_S)

        def wait_collective(work: dist.Work) -> None:
            while not self._finished(work, poll):
                if control.alarm_raised():
                    raise _Abandoned(control.join_failure())
                if time.monotonic() > deadline:
                    raise _Abandoned(control.roll_call(round_index, f"no answer within {round_s:g} s", deadline))

        try:
            if self._data_group is self._group and doubling.is_latency_bound(payload):
                doubling.allreduce(self._group, payload, self.rank, self.world_size, round_index, deadline)
            else:
                for work in [self._data_group.allreduce([chunk]) for chunk in payload.split(self._bucket_numel)]:
                    wait_collective(work)
        except _Abandoned as abandoned:
            return abandoned.error
        except (dist.DistError, RuntimeError) as error:
            log.debug("rank %d: round %d failed: %s", self.rank, round_index, error)
            if control.alarm_raised():
                return control.join_failure()
            try:
                return control.roll_call(round_index, f"{type(error).__name__}: {str(error).splitlines()[0]}",
                                         deadline)
            except (dist.DistError, RuntimeError) as lost:
                return PeerTimeoutError(f"round {round_index} failed ({error}) and the store stopped answering "
                                        f"({lost})", timeout_s=round_s)
        return None


class _Abandoned(Exception):
    """A reduction given up: another rank reported a failure, or the round's deadline passed."""

    def __init__(self, error: PeerTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error
