"""Emulated hosts made real: network namespaces joined by rate-limited veth links, commands run inside them, and a
teardown that always runs.

Building them needs root (or CAP_NET_ADMIN), iproute2's ``ip`` and ``tc``, and the tbf qdisc. Where any is
missing, ``check_available`` raises ``HostsUnavailable`` with one line saying which; tests that need hosts
skip with that line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

import psutil

from hetdp.errors import HetDPError
from hetdp.hosts.topology import INTERFACE, Names, Topology, address, build_commands, links_to_remove, owner_of

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 10.0
"""Longest one ``ip`` or ``tc`` command may take."""
STOP_S = 5.0
"""Seconds a host's processes get after SIGTERM, at teardown, before SIGKILL."""
POLL_S = 0.2
"""Seconds between two looks at the commands running on the hosts."""


class HostsUnavailable(HetDPError):
    """This machine cannot build emulated hosts (not root, no iproute2, no network namespaces or no tbf)."""


def _ip(command: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command; with ``check``, a failure raises HetDPError quoting the command and its error."""
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise HetDPError(f"`{' '.join(command)}` failed: {done.stderr.strip() or f'exit code {done.returncode}'}")
    return done


def check_available() -> None:
    """Raise ``HostsUnavailable`` (one line: what is missing) unless this process can build emulated hosts."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise HostsUnavailable(f"emulated hosts need iproute2's {' and '.join(missing)}, not found on PATH")
    if os.geteuid() != 0:
        raise HostsUnavailable("emulated hosts need root (network namespaces and tc); run as root or skip them")
    names = Names(os.getpid())
    try:
        done = _ip(["ip", "netns", "add", names.namespace(999)], check=False)
        if done.returncode != 0:
            raise HostsUnavailable(f"emulated hosts need network namespaces: `ip netns add` failed: "
                                   f"{done.stderr.strip()}")
        tbf = _ip(["tc", "-n", names.namespace(999), "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
                   "burst", "16000", "latency", "100ms"], check=False)
        if tbf.returncode != 0:
            raise HostsUnavailable(f"emulated hosts need the tbf qdisc: `tc qdisc add ... tbf` failed: "
                                   f"{tbf.stderr.strip()}")
    finally:
        _ip(["ip", "netns", "del", names.namespace(999)], check=False)


def remove_leftovers() -> list[str]:
    """Remove the namespaces and interfaces of emulated hosts whose owner process is gone (a run killed before its
    teardown); return their names. Those of a live owner are left alone: another run may be using them."""
    def orphaned(name: str) -> bool:
        owner = owner_of(name)
        return owner is not None and not psutil.pid_exists(owner)

    removed = []
    listed = _ip(["ip", "-o", "link", "show"], check=False).stdout
    for line in listed.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if orphaned(name) and _ip(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(name)
    for line in _ip(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if orphaned(name):
            _kill_namespace(name)
            _ip(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def _kill_namespace(namespace: str) -> None:
    """SIGKILL every process in ``namespace``."""
    pids = _ip(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


class EmulatedHosts:
    """N hosts as network namespaces on rate-limited links, torn down on exit whatever happened inside.

    Each host has one interface, ``eth0``, at ``addresses[k]``; a command runs on a host with ``start`` (or on
    every host with ``run``) and sees only that host's network. Host 0's address is where a launch across the
    hosts meets (its rendezvous endpoint).

    Examples:
        with EmulatedHosts(Topology.flat(2, rate_mbit=100)) as hosts:
            done = hosts.run([["hetdp", "run", "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint",
                               f"{hosts.addresses[0]}:29500", "-n", "2", "train.py"] for k in range(2)],
                             timeout_s=300)

    One set is open at a time in a process: its names carry the process's id.

    Raises:
        HostsUnavailable: (on entry) this machine cannot build them; the message says why.
        HetDPError: (on entry) another set is open in this process.
    """

    _open_in_process: ClassVar[int | None] = None
    """The id of the process whose set is open, if any (a forked child starts with none open)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.names = Names(os.getpid())
        self.addresses = [address(host) for host in range(topology.host_count)]
        self.interface = INTERFACE
        self._processes: list[tuple[int, subprocess.Popen[bytes]]] = []
        self._logs = tempfile.TemporaryDirectory(prefix="hetdp-hosts-")

    def __enter__(self) -> Self:
        if EmulatedHosts._open_in_process == os.getpid():
            raise HetDPError("another set of emulated hosts is open in this process; close it first")
        check_available()
        removed = remove_leftovers()
        if removed:
            log.warning("removed the leftovers of emulated hosts whose run died: %s", ", ".join(removed))
        self._tear_down()  # this process's own, if an earlier set in it was not closed
        try:
            for command in build_commands(self.topology, self.names):
                _ip(command)
        except BaseException:
            self._tear_down()
            raise
        EmulatedHosts._open_in_process = os.getpid()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process on the hosts and remove them (idempotent)."""
        try:
            self._tear_down()
        finally:
            self._logs.cleanup()
            EmulatedHosts._open_in_process = None

    def start(self, host: int, command: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``command`` on ``host`` (in a session of its own), its output to a log that ``output`` reads."""
        if not 0 <= host < self.topology.host_count:
            raise HetDPError(f"no host {host}: there are {self.topology.host_count}")
        log_file = open(self._log_path(host), "ab")  # noqa: SIM115 (the child holds it; ours closes below)
        try:
            process = subprocess.Popen(["ip", "netns", "exec", self.names.namespace(host), *command],
                                       env={**os.environ, **(env or {})}, cwd=cwd, stdout=log_file,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log_file.close()
        self._processes.append((host, process))
        return process

    def output(self, host: int) -> str:
        """Everything the commands started on ``host`` printed so far."""
        path = self._log_path(host)
        return path.read_text(errors="replace") if path.exists() else ""

    def run(self, commands: Sequence[Sequence[str]], *, timeout_s: float, env: Mapping[str, str] | None = None,
            cwd: str | Path | None = None, poll: Callable[[], None] | None = None
            ) -> list[subprocess.CompletedProcess[str]]:
        """Run ``commands[k]`` on host k, all at once, and wait for every one; one result per host, with its output.
        ``poll`` is called every ``POLL_S`` seconds meanwhile (to follow the commands' progress).

        Raises:
            HetDPError: a command was still running after ``timeout_s`` seconds (every host's are then killed).
        """
        if len(commands) != self.topology.host_count:
            raise HetDPError(f"{len(commands)} commands for {self.topology.host_count} hosts; give one per host")
        started = [self.start(host, command, env=env, cwd=cwd) for host, command in enumerate(commands)]
        deadline_s = time.monotonic() + timeout_s
        while any(process.poll() is None for process in started):
            if time.monotonic() > deadline_s:
                running = [str(host) for host, p in enumerate(started) if p.poll() is None]
                self._stop_processes()
                raise HetDPError(f"the commands on host{'s' if len(running) > 1 else ''} {', '.join(running)} were "
                                 f"still running after {timeout_s:g} s; killed")
            if poll is not None:
                poll()
            time.sleep(POLL_S)
        return [subprocess.CompletedProcess(list(command), process.returncode, self.output(host), None)
                for host, (command, process) in enumerate(zip(commands, started))]

    def cut(self, host: int) -> None:
        """Take ``host`` off the network, then kill everything on it: its peers hear nothing more from it (no
        connection is closed, no reset sent), as when a machine loses power or its link."""
        _ip(["ip", "link", "del", self.names.host_link(host)], check=False)
        _kill_namespace(self.names.namespace(host))

    def _log_path(self, host: int) -> Path:
        return Path(self._logs.name) / f"host-{host}.log"

    def _stop_processes(self) -> None:
        """SIGTERM the sessions started here, then SIGKILL whatever is left after STOP_S, and everything else in the
        namespaces (a process that left its session)."""
        running = [process for _, process in self._processes if process.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline_s = time.monotonic() + STOP_S
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline_s - time.monotonic(), 0.0))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for host in range(self.topology.host_count):
            _kill_namespace(self.names.namespace(host))
        for process in running:
            process.wait()

    def _tear_down(self) -> None:
        """Stop the processes, then delete this set's interfaces and namespaces; what is already gone is skipped."""
        self._stop_processes()
        for link in links_to_remove(self.topology, self.names):
            _ip(["ip", "link", "del", link], check=False)
        for host in range(self.topology.host_count):
            _ip(["ip", "netns", "del", self.names.namespace(host)], check=False)
