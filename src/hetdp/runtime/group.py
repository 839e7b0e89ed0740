"""Process-group set-up and the one family of deadlines every blocking call in hetdp uses."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from hetdp.errors import ConfigError, PeerTimeoutError
from hetdp.floor import check_framework
from hetdp.runtime import liveness
from hetdp.runtime.engines import gloo_interface, placement
from hetdp.runtime.errorfile import record_uncaught
from hetdp.runtime.forks import guard_forks
from hetdp.runtime.teardown import collect_at_exit

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class Timeouts:
    """Deadlines, in seconds, for the three kinds of wait in a distributed run.

    Too small a value turns a slow but healthy peer into a ``PeerTimeoutError``;
    too large a value only delays the error a dead peer causes.
    """

    connect_s: float = 120.0
    """Rendezvous and process-group creation: every rank must have started by then."""
    round_s: float = 60.0
    """One collective round or step: a peer silent for longer is reported by rank."""
    shutdown_s: float = 10.0
    """Joining helper threads and tearing down groups at ``close()``."""

    def __post_init__(self) -> None:
        for name in ("connect_s", "round_s", "shutdown_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"timeouts.{name} must be > 0 seconds, got {value!r}")


def init_distributed(backend: str | None = None, timeouts: Timeouts | None = None) -> tuple[int, int]:
    """Join the default process group, once, wherever the engine that started this worker put it; return (rank,
    world size).

    The placement comes from torchrun's (and ``hetdp run``'s), Slurm ``srun``'s or a PyTorchJob's variables
    and is set as torchrun's variables for the rest of the process (``LOCAL_RANK``,
    ``MASTER_ADDR``...). Under Ray Train the group already exists: Ray's ``TorchConfig`` joins every worker before
    the training function runs, and this returns Ray's rank and world size. Across nodes, gloo speaks on the
    interface that reaches ``MASTER_ADDR`` unless ``GLOO_SOCKET_IFNAME`` says otherwise (hetdp's
    gloo groups under NCCL use it too). The backend defaults to NCCL when every rank on this machine has a
    GPU of its own and gloo otherwise (NCCL refuses two ranks on one GPU, as when four emulated workers share a
    laptop's GPU). A process already in a group keeps it, so library code may call this freely. Under torchrun, a
    worker's uncaught exception is left in its error file as one line naming its rank, which torchrun's failure
    summary shows as the root cause.

    Raises:
        ConfigError: no engine's variables, or incomplete ones (the message names what is missing); a
            ``GLOO_SOCKET_IFNAME`` naming an interface this machine lacks; in a Ray Train worker, a Ray older than
            2.60, hetdp's floor for Ray Train.
    """
    if dist.is_initialized():
        ray = sys.modules.get("ray")
        if ray is not None and "ray.train" in sys.modules:  # Ray Train made the group: hetdp meets Ray here
            check_framework("ray", ray.__version__, user="hetdp under Ray Train")
        return dist.get_rank(), dist.get_world_size()
    record_uncaught()
    place = placement()
    os.environ.update(place.environ())  # torch's env:// initialisation, and code that reads LOCAL_RANK, find them
    interface = gloo_interface(place, os.environ, psutil.net_if_addrs())
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    timeouts = timeouts or Timeouts()
    backend = backend or ("nccl" if gpu_per_local_rank() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(place.local_rank)
        defer_nccl_watchdog()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeouts.connect_s))
    collect_at_exit()
    guard_forks()
    log.debug("rank %d of %d joined with %s (%s)", dist.get_rank(), dist.get_world_size(), backend, place.engine)
    return dist.get_rank(), dist.get_world_size()


NCCL_ERROR_HANDLING = "2"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` for the groups hetdp creates, unless the user set it: on a collective past its
timeout NCCL's watchdog aborts the communicators but leaves the process alive (CleanUpOnly), so that the next wait
raises in Python and becomes a ``PeerTimeoutError`` naming the dead peer. torch's default (3) ends the process
from the watchdog's thread, before any heartbeat can say who died."""


def defer_nccl_watchdog() -> None:
    """Let NCCL groups created from now on abort their communicators on a timeout rather than the process (see
    ``NCCL_ERROR_HANDLING``); a value the user set is kept. NCCL reads it as each group is created."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)


def group_timeout_s(backend: str, timeout_s: float) -> float:
    """The timeout of a process group whose collectives hetdp waits on for ``timeout_s`` seconds.

    The order of events when a peer dies: a wait of hetdp's fails after ``timeout_s``, then the heartbeat names
    the culprit within ``liveness.VERDICT_S``, then the ``PeerTimeoutError`` is raised. NCCL's watchdog times
    collectives out on its own and, with torch's default error handling, ends the process: its timeout must come
    after both. gloo has no watchdog: its timeout is the wait's.
    """
    return timeout_s + liveness.VERDICT_S if backend == "nccl" else timeout_s


def new_step_group(timeout_s: float) -> dist.ProcessGroup:
    """Collective: a new group of every rank for a model's steps, whose failures surface within ``timeout_s`` as a
    ``PeerTimeoutError`` naming the peer (see ``group_timeout_s``)."""
    backend = dist.get_backend()
    if backend == "nccl":
        defer_nccl_watchdog()
    guard_forks()  # a script that made its own group forks its loader's workers beside this one's threads
    return dist.new_group(timeout=datetime.timedelta(seconds=group_timeout_s(backend, timeout_s)))


def host_group(group: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    """Collective over ``group``: ``group`` itself under gloo, else a gloo group of the same ranks, for small exchanges
    that must not wait on a device (step figures: under NCCL their gather would queue behind the step's kernels, and
    reading it back would wait for them)."""
    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True,
                          timeout=datetime.timedelta(seconds=timeout_s))


def gpu_per_local_rank() -> bool:
    """Whether this machine has a GPU for each of its ranks (torchrun's LOCAL_WORLD_SIZE)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks


def local_device() -> torch.device:
    """The device this rank computes on: its local GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a wall-clock reading measures finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


PEER_FAILURE_SIGNS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "pair closure",
    "communicator was aborted",
)
"""Lower-case fragments of the errors gloo and NCCL raise, as plain RuntimeErrors, when a peer died or went
silent past a deadline (for example gloo's "Connection closed by peer" and "Timed out waiting 3000ms")."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether a collective failed because a peer died or hung, rather than from a bug or a bad argument."""
    if isinstance(error, dist.DistError):
        return not isinstance(error, dist.DistStoreError) or "timeout" in str(error).lower()
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(sign in text for sign in PEER_FAILURE_SIGNS)


def peer_failure(rank: int | None, what: str, timeout_s: float, error: BaseException,
                 group: dist.ProcessGroup | None = None) -> PeerTimeoutError:
    """The PeerTimeoutError a collective's failure on ``rank`` becomes: it names the silent or stuck peer when
    ``group`` has a heartbeat (see ``hetdp.runtime.liveness``), else this rank, and the deadline."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    verdict = liveness.diagnose(group)
    if verdict is not None and verdict.culprits:
        culprit = verdict.culprits[0]
        there = liveness.elsewhere(group, culprit)
        where = f"; rank {culprit} ran on {there}" if there is not None else ""
        return PeerTimeoutError(f"{verdict.describe()}: {what} on rank {rank} failed within {timeout_s:g} s "
                                f"({text}){where}", rank=culprit, timeout_s=timeout_s)
    return PeerTimeoutError(
        f"rank {rank}: {what} failed within {timeout_s:g} s: a peer died or hung ({text})",
        rank=rank,
        timeout_s=timeout_s,
    )


@contextlib.contextmanager
def peer_failures(what: str, timeout_s: float, group: dist.ProcessGroup | None = None, *,
                  rank: int | None = None) -> Iterator[None]:
    """Turn a peer's failure inside the block's collectives over ``group`` into a PeerTimeoutError naming it, as
    seen from ``rank`` (default: this process's rank in the default group); also for the synchronous collectives
    (object collectives), which take no deadline of their own but ``group``'s."""
    try:
        yield
    except RuntimeError as error:
        if not is_peer_failure(error):
            raise
        if rank is None and dist.is_initialized():
            rank = dist.get_rank()
        raise peer_failure(rank, what, timeout_s, error, group) from error


def wait_for(work: dist.Work, what: str, timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
    """Wait for an asynchronous collective or transfer over ``group``; a silent peer becomes a PeerTimeoutError.

    Raises:
        PeerTimeoutError: ``what`` did not finish within ``timeout_s`` seconds.
    """
    with peer_failures(what, timeout_s, group):
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def barrier(group: dist.ProcessGroup | None = None, timeout_s: float = Timeouts.round_s) -> None:
    """Wait until every rank of ``group`` gets here, at most ``timeout_s`` seconds (any backend)."""
    wait_for(dist.all_reduce(torch.zeros(1, device=local_device()), group=group, async_op=True), "barrier", timeout_s,
             group)


def global_rank(rank: int, group: dist.ProcessGroup | None = None) -> int:
    """The default-group rank of ``rank`` in ``group``, which point-to-point calls and ``src`` arguments take."""
    return rank if group is None else dist.get_global_rank(group, rank)
