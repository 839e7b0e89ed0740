"""One launch across several nodes: where they meet, which interface this node speaks on, what its workers call it.

``hetdp run --nnodes N --node-rank K --rdzv-endpoint HOST:PORT`` runs torchrun's static rendezvous: node 0
hosts the store at HOST:PORT, and node K's ranks follow node K-1's, so a rank's node never depends on which node
joined first. The three things that hang a first multi-node launch are handled here: the store's address is the
endpoint the user gave (never this machine's hostname, which several machines, or namespaces, may share), gloo
speaks on the interface that routes to the endpoint (``GLOO_SOCKET_IFNAME``; without it gloo binds to whatever the
hostname resolves to, often 127.0.0.1), and a node that waits for the others gives up after ``join_timeout_s``
with one line instead of torchrun's ten minutes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import psutil

from hetdp.errors import ConfigError
from hetdp.runtime.engines import ENV_NODE, check_interfaces, is_loopback, route_to

DEFAULT_PORT = 29500
"""The rendezvous port when ``--rdzv-endpoint`` gives none (torchrun's)."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (an IPv6 address in brackets) as (host, port); the port defaults to ``DEFAULT_PORT``.

    Raises:
        ConfigError: no host, or a port that is not an integer from 1 to 65535.
    """
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    port = DEFAULT_PORT
    if port_text:
        try:
            port = int(port_text)
        except ValueError:
            port = 0
    if not host or not 1 <= port <= 65535:
        raise ConfigError(f"--rdzv-endpoint must look like HOST:PORT (node 0's address, a port from 1 to 65535), "
                          f"got {text!r}")
    return host, port


@dataclass(kw_only=True, frozen=True)
class Nodes:
    """This node's place in a launch across ``count`` nodes."""

    count: int
    """Nodes in the launch (``--nnodes``)."""
    rank: int
    """This node, from 0 (``--node-rank``); node 0 hosts the rendezvous store."""
    master_addr: str
    """Node 0's address, as every node reaches it (the host of ``--rdzv-endpoint``)."""
    master_port: int = DEFAULT_PORT
    """The store's port on node 0; a restart's attempt k meets at ``master_port + k``."""
    join_timeout_s: float = 180.0
    """Seconds a node waits for all the others at the rendezvous before it gives up, naming the endpoint."""

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ConfigError(f"--nnodes must be a positive integer, got {self.count!r}")
        if not 0 <= self.rank < self.count:
            raise ConfigError(f"--node-rank must be from 0 to {self.count - 1} with --nnodes {self.count}, "
                              f"got {self.rank!r}")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"the rendezvous port must be from 1 to 65535, got {self.master_port!r}")
        if not (self.join_timeout_s > 0 and math.isfinite(self.join_timeout_s)):
            raise ConfigError(f"--join-timeout-s must be > 0 seconds, got {self.join_timeout_s!r}")
        if self.count > 1 and is_loopback(self.master_addr):
            raise ConfigError(f"--rdzv-endpoint {self.master_addr} is this machine's loopback, which the other nodes "
                              f"cannot reach: give node 0's address on the network the nodes share")

    def port(self, attempt: int) -> int:
        """The store's port for restart ``attempt``: each attempt meets afresh, on a port of its own."""
        return self.master_port + attempt

    def torchrun_args(self, attempt: int) -> list[str]:
        """torchrun's options for this node's part of restart ``attempt`` (static rendezvous)."""
        return ["--nnodes", str(self.count), "--node-rank", str(self.rank), "--master-addr", self.master_addr,
                "--master-port", str(self.port(attempt)), "--rdzv-conf", f"timeout={math.ceil(self.join_timeout_s)}"]

    def worker_env(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The variables this node's workers need: its label, and gloo's interface unless the user chose one.

        Raises:
            ConfigError: no route to node 0, or a ``GLOO_SOCKET_IFNAME`` that names no interface of this machine.
        """
        environ = dict(os.environ) if environ is None else environ
        local, interface = route_to(self.master_addr, self.master_port)
        env = {ENV_NODE: f"node {self.rank} ({local})"}
        chosen = environ.get("GLOO_SOCKET_IFNAME")
        if chosen:
            check_interfaces(chosen, psutil.net_if_addrs(),
                             f"unset it to use {interface}, the one that reaches {self.master_addr}")
        elif self.count > 1:
            env["GLOO_SOCKET_IFNAME"] = interface
        return env

    def describe_join_failure(self, attempt: int, error: BaseException) -> str:
        """One line for a rendezvous that did not gather every node within ``join_timeout_s``."""
        endpoint = f"{self.master_addr}:{self.port(attempt)}"
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        if self.rank == 0:
            return (f"node 0: not every node joined the rendezvous at {endpoint} within {self.join_timeout_s:g} s "
                    f"({cause}); start every node with --nnodes {self.count}, its own --node-rank and this "
                    f"--rdzv-endpoint")
        return (f"node {self.rank}: could not meet node 0 at {endpoint} within {self.join_timeout_s:g} s ({cause}); "
                f"is node 0 started, is {self.master_addr} its address as this node reaches it, and is the port open?")
