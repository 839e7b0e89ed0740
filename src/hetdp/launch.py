"""Start N local worker processes through torch.distributed.run, the way users launch, and hear back from them.

A launch can follow an event log that rank 0 appends to (progress and measured
rows, shown as they come), and can take a worker's failure home: one story per
failure. Each worker leaves its failure in the error file torchrun gives it
(``hetdp.errorfile``): a ``HetDPError`` as one line, with no traceback; any other
exception with its traceback, which the launch prints once, for the rank whose
failure started it (not for the ranks stopped after it). The launch then ends in
one line naming that rank, with its exit code, instead of torchrun's tracebacks
and failure summary. The workers start exactly as under torchrun. A launch across
nodes (``nodes``) runs this node's ranks; its failures name each rank's node too
(see ``hetdp.nodes``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from hetdp.errorfile import ERROR_FILE, Report, others_stopped, rank_label, report_of
from hetdp.errors import HetDPError, WorkerError
from hetdp.nodes import Nodes

ENV_EVENTS = "HETDP_EVENTS"
"""Path of the event log rank 0 appends JSON lines to (set only when the launch follows events)."""
ENV_RESTART = "HETDP_RESTART"
"""Which attempt of a launch with restarts the workers belong to: 0 first, then 1, 2, ... (each attempt is a fresh
torchrun, whose ``TORCHELASTIC_RESTART_COUNT`` the worker sets to the same)."""
POLL_S = 0.2
"""Seconds between two looks at the workers and their event log."""
SHUTDOWN_S = 5.0
"""Seconds a launch may go on after a worker reported its error, before the launcher SIGKILLs the whole group: a
stopped (SIGSTOP) or wedged worker never acts on torchrun's SIGTERM, and torchrun waits 30 s before its own SIGKILL
(on torch 2.13 its ``--shutdown-timeout`` does not reach a failed group's teardown)."""

ENV_WORKER_CPP_LOG = "HETDP_WORKER_CPP_LOG_LEVEL"
"""The user's ``TORCH_CPP_LOG_LEVEL`` (empty: unset), handed to the workers of a launch across nodes, whose torchrun
runs at FATAL: a rendezvous that failed is told in one line, not in c10d's stack traces of every retry."""
NO_RANK = -1
"""The rank of a failure report that no worker wrote: the node's rendezvous failed before any rank existed."""

Event = dict[str, Any]


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


# --- the workers' side ------------------------------------------------------------------------------------------


class EventWriter:
    """A worker's end of the event log: one JSON object per line, flushed at once so the launcher sees it.

    Creating it tells the launcher that the workers are up (an event that advances
    nothing). A no-op when the launch does not follow events or ``enabled`` is
    false (give ``enabled=rank == 0`` so that one rank speaks for the group).
    ``path``: the log to append to instead of ``$HETDP_EVENTS`` (a launch across
    emulated hosts, followed by the process that made them).
    """

    def __init__(self, enabled: bool = True, path: str | Path | None = None) -> None:
        path = path or os.environ.get(ENV_EVENTS)
        self._path = Path(path) if enabled and path else None
        self.update(0)

    def write(self, event: Event) -> None:
        if self._path is not None:
            with self._path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(event) + "\n")

    def update(self, n: int = 1, *, row: Event | None = None) -> None:
        """Advance the launcher's progress bar by ``n``; with ``row``, also print that measured row."""
        self.write({"advance": n, **({"row": row} if row is not None else {})})


class EventReader:
    """The launcher's end of the event log: the complete lines written since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[Event]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


@dataclass(frozen=True)
class Failure:
    """The failure a launch ends in: its first rank's report, with every rank that reported the same."""

    message: str
    """One line: what the worker raised, and which rank (or ranks, that raised the same)."""
    rank: int
    exit_code: int
    retry: bool
    """Whether a restart may get past it (no rank raised a ConfigError)."""
    traceback: str | None


def first_failure(reports: Iterable[Report | None]) -> Failure | None:
    """The failure that started the others: the first report whose rank did not fail because a peer did. A rank's
    report may come twice (torchrun copies the first it saw into its own error file)."""
    by_rank = {report.rank: report for report in reports if report is not None}
    ordered = sorted(by_rank.values(), key=lambda report: (report.consequence, report.time))
    if not ordered:
        return None
    first = ordered[0]
    ranks = sorted(report.rank for report in ordered if report.message == first.message)
    message = first.message if first.names_rank else (
        f"{first.message} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})")
    return Failure(message, rank=first.rank, exit_code=first.exit_code,
                   retry=all(report.retry for report in ordered), traceback=first.traceback)


def _worker(argv: list[str]) -> None:
    """Run a script (``PATH ARGS``) or a module (``-m NAME ARGS``) as ``python`` would, leaving its failure in
    torchrun's error file for the launch: a HetDPError's line, another exception's line and traceback (from the
    script's own frames), which the launch prints once."""
    from hetdp.runtime import is_peer_failure

    module = argv[0] == "-m"
    target, rest = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *rest]
    os.environ["TORCHELASTIC_RESTART_COUNT"] = os.environ.get(ENV_RESTART, "0")  # each attempt is a fresh torchrun
    error_file = os.environ.get(ERROR_FILE)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(target).resolve().parent)  # as `python script.py` sets it
            runpy.run_path(target, run_name="__main__")
    except SystemExit as error:
        if error.code not in (0, None) and error_file:
            code = error.code if isinstance(error.code, int) else 1
            Report(rank=int(os.environ.get("RANK", "0")), message=f"{rank_label()} exited with {error.code!r}"
                   f"{others_stopped()}", exit_code=code).write(error_file)
        elif error.code in (0, None):
            _warn_if_settings_unused()
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        if not error_file:
            raise
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            trace = trace.tb_next  # the launcher's own frames: the user's traceback starts at their script
        told = "".join(traceback.format_exception(type(error), error, trace))
        report = report_of(error, consequence=is_peer_failure(error), traceback=told)
        report.write(error_file)
        sys.exit(report.exit_code)
    _warn_if_settings_unused()


def _warn_if_settings_unused() -> None:
    """On rank 0 of a launch whose emulation, allocation or synchronization settings no step of a drop-in
    (``hetdp.DDP``, ``hetdp.fully_shard``) used (a plain torch DDP script, or an allocated loader never iterated), say
    so in one line."""
    from hetdp.allocate.policy import ENV_ALLOCATION
    from hetdp.cluster.emulate import Emulation
    from hetdp.sync.policy import ENV_SYNC

    if os.environ.get("RANK", "0") != "0":
        return
    chosen = [name for name, is_set in (("emulation", Emulation.from_env().active),
                                        ("--allocation", bool(os.environ.get(ENV_ALLOCATION))),
                                        ("--sync", bool(os.environ.get(ENV_SYNC)))) if is_set]
    coordinator = sys.modules.get("hetdp.ddp.coordinator")
    if chosen and (coordinator is None or coordinator.StepCoordinator.steps_in_process == 0):
        print(f"hetdp: warning: the {' and '.join(chosen)} settings did nothing: no step ran through a hetdp drop-in's "
              "allocated loader (a plain torch DDP script? model.allocate(loader)'s result not iterated?)",
              file=sys.stderr, flush=True)


def _torchrun(argv: list[str]) -> None:
    """torchrun, minus its logs and failure summary when a worker fails: the failure that started the others is told
    instead, its traceback once and its line in this launch's error file. A worker that died without a word (killed,
    crashed) gets its line here, from torchrun's first observed failure."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # "Sending process ... closing signal", "failed"
    worker_level = os.environ.pop(ENV_WORKER_CPP_LOG, None)
    if worker_level is not None:  # this process read FATAL as it started; its workers log as the user asked
        os.environ.pop("TORCH_CPP_LOG_LEVEL")
        if worker_level:
            os.environ["TORCH_CPP_LOG_LEVEL"] = worker_level
    try:
        main(argv)
    except DistError as error:  # the rendezvous of a launch across nodes: the others never came, or never answered
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        Report(rank=NO_RANK, message=text, exit_code=2).write(os.environ[ERROR_FILE])
        sys.exit(2)
    except ChildFailedError as error:
        reports = {rank: Report.of(failure.error_file_data) for rank, failure in error.failures.items()}
        told = [report for report in reports.values() if report is not None]
        wordless = [rank for rank, report in reports.items() if report is None]
        if wordless:
            rank = min(wordless, key=lambda r: error.failures[r].timestamp)
            died = error.failures[rank]
            if not told or (all(report.consequence for report in told) and died.exitcode < 0):
                # died without a word (killed, crashed): torchrun's first observed failure tells it
                how = f"signal {died.signal_name()}" if died.exitcode < 0 else f"exit code {died.exitcode}"
                stopped = "; the other ranks were stopped" if len(error.failures) > 1 else ""
                report = Report(rank=rank, message=f"{rank_label(rank)} died ({how}){stopped}",
                                exit_code=128 - died.exitcode if died.exitcode < 0 else died.exitcode)
                report.write(os.environ[ERROR_FILE])
                told.append(report)
        failure = first_failure(told)
        if failure.traceback:
            print(failure.traceback, end="", file=sys.stderr, flush=True)
        sys.exit(failure.exit_code)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("torchrun", "worker"):
        sys.exit("usage: python -m hetdp.launch torchrun|worker ... (started by hetdp.launch.run_local)")
    (_torchrun if sys.argv[1] == "torchrun" else _worker)(sys.argv[2:])
