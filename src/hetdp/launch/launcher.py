"""Start N local worker processes through torch.distributed.run, the way users launch, and hear back from them.

A launch can follow an event log that rank 0 appends to (progress and measured
rows, shown as they come: ``events``), and can take a worker's failure home: one
story per failure. Each worker leaves its failure in the error file torchrun
gives it (``hetdp.runtime.errorfile``): a ``HetDPError`` as one line, with no
traceback; any other exception with its traceback, which the launch's torchrun
prints once, for the rank whose failure started it (not for the ranks stopped
after it: ``agent``). The launch then ends in one line naming that rank, with
its exit code (``failures``), instead of torchrun's tracebacks and failure
summary. The workers start exactly as under torchrun. A launch across nodes
(``nodes``) runs this node's ranks; its failures name each rank's node too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from hetdp.errors import HetDPError, WorkerError
from hetdp.launch.agent import ENV_WORKER_CPP_LOG
from hetdp.launch.events import ENV_EVENTS, Event, EventReader
from hetdp.launch.failures import NO_RANK, first_failure
from hetdp.launch.nodes import Nodes
from hetdp.runtime.errorfile import ERROR_FILE, Report

ENV_RESTART = "HETDP_RESTART"
"""Which attempt of a launch with restarts the workers belong to: 0 first, then 1, 2, ... (each attempt is a fresh
torchrun, whose ``TORCHELASTIC_RESTART_COUNT`` the worker sets to the same)."""
POLL_S = 0.2
"""Seconds between two looks at the workers and their event log."""
SHUTDOWN_S = 5.0
"""Seconds a launch may go on after a worker reported its error, before the launcher SIGKILLs the whole group: a
stopped (SIGSTOP) or wedged worker never acts on torchrun's SIGTERM, and torchrun waits 30 s before its own SIGKILL
(on torch 2.13 its ``--shutdown-timeout`` does not reach a failed group's teardown)."""


def torchrun_command(
    target: str | Path, nproc: int, args: Sequence[str] = (), *, module: bool = False, report_errors: bool = False,
    nodes: Nodes | None = None, attempt: int = 0, log_dir: Path | None = None,
) -> list[str]:
    """The command line that runs ``target`` (a script, or a module if ``module``) on ``nproc`` local ranks, of this
    node's part of a launch across ``nodes`` (None: a one-node launch) in restart ``attempt``.

    With ``report_errors``, torchrun and every worker run under this module, which leaves a worker's failure in
    its error file under ``log_dir`` (torchrun's ``--log-dir``; see ``run_local``).
    """
    runner = ["-m", "hetdp.launch", "torchrun"] if report_errors else ["-m", "torch.distributed.run"]
    where = ["--standalone"] if nodes is None else nodes.torchrun_args(attempt)
    logs = ["--log-dir", str(log_dir)] if log_dir is not None else []
    command = [sys.executable, *runner, *where, *logs, f"--nproc-per-node={nproc}"]
    # "--" ends torchrun's options: its parser would otherwise take a script flag that abbreviates one of its own
    # (a script's --signal read as --signals-to-handle).
    if report_errors:
        command += ["-m", "--", "hetdp.launch", "worker"]
        command += ["-m", str(target)] if module else [str(target)]
    else:
        command += ["-m", "--", str(target)] if module else ["--", str(target)]
    return command + [str(arg) for arg in args]


def run_local(
    target: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    capture: bool = False,
    follow: Callable[[list[Event]], None] | None = None,
    report_errors: bool = False,
    max_restarts: int = 0,
    on_restart: Callable[[int, int], None] | None = None,
    nodes: Nodes | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``target`` on ``nproc`` local ranks and wait; kill the whole process group past ``timeout_s``.

    With ``max_restarts``, a failed launch (a worker killed, crashed, or timed out on a silent peer) is
    started again from scratch, up to that many times: torchrun itself tears the group down, and each
    attempt is a fresh torchrun on a new rendezvous (a free port; across nodes, the endpoint's port plus
    the attempt, so that every node's launcher meets the others there), since torchrun's own restarts
    cannot re-form a gloo group on torch 2.13. Workers read the attempt from ``$HETDP_RESTART`` and resume
    from their checkpoint. A ConfigError is the user's to fix, and is not retried.

    Args:
        target: a script path, or a module name with ``module=True``.
        nproc: local ranks to start.
        args: the target's command-line arguments.
        env: variables added to this process's environment.
        timeout_s: seconds the launch may take (None: no limit).
        capture: return stdout and stderr together as ``stdout`` instead of passing them through.
        follow: called every ``POLL_S`` seconds with the events rank 0 wrote since the last call
            (often none, so it can redraw a progress bar), and once more at the end.
        report_errors: a worker that raises a HetDPError exits with code 2 and no traceback, one that
            raises another exception prints its traceback once (the ranks that fail after it, none), and
            this call raises a WorkerError naming the first rank that failed instead.
        nodes: this node's place in a launch across several (None: every rank is local). Every node
            runs this call with its own ``nodes.rank``; ``nproc`` is this node's ranks.

    Raises:
        ConfigError: (with ``nodes``) no route to node 0, or a bad ``GLOO_SOCKET_IFNAME``.
        HetDPError: the workers were still running after ``timeout_s`` seconds.
        WorkerError: (with ``report_errors``) a worker raised, or this node's rendezvous failed; its message,
            rank and exit code.
    """
    node_env = nodes.worker_env() if nodes is not None else {}
    attempt = 0
    while True:
        restart_env = {**(env or {}), **node_env, ENV_RESTART: str(attempt)}
        completed = _launch_once(target, nproc, args, module=module, env=restart_env, timeout_s=timeout_s,
                                 capture=capture, follow=follow, report_errors=report_errors,
                                 last=attempt == max_restarts, nodes=nodes, attempt=attempt)
        if completed.returncode == 0 or attempt == max_restarts:
            return completed
        attempt += 1
        if on_restart is not None:
            on_restart(attempt, completed.returncode)


def _launch_once(
    target: str | Path,
    nproc: int,
    args: Sequence[str],
    *,
    module: bool,
    env: Mapping[str, str],
    timeout_s: float | None,
    capture: bool,
    follow: Callable[[list[Event]], None] | None,
    report_errors: bool,
    last: bool,
    nodes: Nodes | None,
    attempt: int,
) -> subprocess.CompletedProcess[str]:
    """One torchrun of ``target``. A worker's failure is raised where no restart can get past it (a ConfigError)
    or none is left (``last``); a timeout raises in ``_wait``."""
    with tempfile.TemporaryDirectory(prefix="hetdp-launch-") as folder:
        full_env = {key: value for key, value in os.environ.items() if key not in (ENV_EVENTS, ERROR_FILE)}
        full_env.update(env)  # a launch from inside a worker reports to its own launcher, not to ours
        full_env.setdefault("OMP_NUM_THREADS", "1")
        events = EventReader(Path(folder) / "events.jsonl")
        logs, error_file = Path(folder) / "logs", Path(folder) / "error.json"  # the workers' error files; torchrun's
        if follow is not None:
            full_env[ENV_EVENTS] = str(events.path)
        if report_errors:
            full_env[ERROR_FILE] = str(error_file)
            if nodes is not None:
                full_env[ENV_WORKER_CPP_LOG] = full_env.get("TORCH_CPP_LOG_LEVEL", "")
                full_env["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        command = torchrun_command(target, nproc, args, module=module, report_errors=report_errors, nodes=nodes,
                                   attempt=attempt, log_dir=logs if report_errors else None)
        poll = (lambda: follow(events.read())) if follow is not None else (lambda: None)
        failed = (lambda: any(logs.rglob("error.json"))) if report_errors else (lambda: False)
        where = f" of node {nodes.rank}" if nodes is not None else ""
        completed = _wait(command, full_env, timeout_s, capture, poll, failed, f"{target} on {nproc} ranks{where}")
        if completed.returncode != 0 and report_errors:
            failure = first_failure(Report.read(path) for path in [*logs.rglob("error.json"), error_file])
            if failure is not None and (last or not failure.retry):
                message = failure.message
                if failure.rank == NO_RANK and nodes is not None:
                    message = nodes.describe_join_failure(attempt, message)
                raise WorkerError(message, rank=failure.rank, exit_code=failure.exit_code, output=completed.stdout)
        return completed


def _wait(
    command: list[str],
    env: dict[str, str],
    timeout_s: float | None,
    capture: bool,
    poll: Callable[[], None],
    failed: Callable[[], bool],
    what: str,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a session of its own, calling ``poll`` every POLL_S seconds and once at the end.

    Once ``failed()`` (a worker reported its error), the rest of the group has SHUTDOWN_S seconds to end, then
    the whole session is SIGKILLed, stopped processes included.
    """
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        text=True,
        start_new_session=True,
    )
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at: float | None = None
    try:
        while True:
            try:
                output, _ = process.communicate(timeout=POLL_S)  # retried, it loses no output
                break
            except subprocess.TimeoutExpired:
                poll()
                if failed_at is None and failed():
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() > failed_at + SHUTDOWN_S:
                    _kill_launch(process)
                    output, _ = process.communicate()
                    break
                if deadline_s is not None and time.monotonic() > deadline_s:
                    _kill_launch(process)
                    output, _ = process.communicate()
                    raise HetDPError(f"{what} still running after {timeout_s} s; killed\n{output or ''}") from None
        poll()
    except BaseException:
        if process.poll() is None:
            _kill_launch(process)
            process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, output, None)


def _kill_launch(process: subprocess.Popen[str]) -> None:
    """SIGKILL torchrun and every process under it: torchrun starts each worker in a session of its own, out of
    reach of a signal to torchrun's process group, and a stopped worker acts on nothing else."""
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for descendant in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            descendant.kill()
