"""Where this worker stands in the job, read off the variables of the engine that started it.

torchrun (and ``hetdp run``) set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the store's ``MASTER_ADDR`` /
``MASTER_PORT``. Slurm's ``srun`` sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the step's node list,
but no store. Kubeflow's PyTorchJob sets ``RANK`` and ``WORLD_SIZE`` per pod, and, with ``nprocPerNode`` above 1,
expects torchrun in the pod (its ``PET_*`` variables are torchrun's options): ``RANK`` is then the pod's, not the
process's. Ray Train needs nothing read: its ``TorchConfig`` joins every worker to the process group before the
training function runs (and sets torchrun's variables for code that reads them). Pure functions of the environment,
so that each engine's variables are tested in one process.

Beside the placement, where the worker speaks from: the label its node goes by in error messages, and the network
interface gloo binds to across nodes.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Literal

import psutil

from hetdp.errors import ConfigError

Engine = Literal["torchrun", "slurm", "pytorchjob"]

SLURM_PORT_BASE = 20000
"""Slurm gives no store port: every task of a job derives the same one, ``SLURM_PORT_BASE + job id % 10000``, unless
``MASTER_PORT`` is set (two jobs sharing a first node could otherwise meet on one port; set it there)."""


@dataclass(kw_only=True, frozen=True)
class Placement:
    """This worker's place in the job, and where the job's ranks meet (a TCP store on ``master_addr``)."""

    engine: Engine
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"{self.engine}'s variables place rank {self.rank} in a world of {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(f"{self.engine}'s variables place local rank {self.local_rank} among "
                              f"{self.local_world_size} on its node")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"the store's port must be from 1 to 65535, got {self.master_port}")

    def environ(self) -> dict[str, str]:
        """The variables ``torch.distributed``'s ``env://`` initialisation reads, as torchrun sets them."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def placement(environ: Mapping[str, str] | None = None) -> Placement:
    """This worker's placement, from torchrun's, Slurm's (``srun``) or PyTorchJob's variables, in that order.

    Raises:
        ConfigError: no engine's variables, or an engine's that leave out what a rank needs (named in the message).
    """
    env = os.environ if environ is None else environ
    if "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env:  # torchrun, also under `srun torchrun` and in a pod
        return _torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _slurm(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return _pytorchjob(env)
    raise ConfigError("no launcher's variables (RANK/WORLD_SIZE of torchrun or PyTorchJob, SLURM_PROCID/SLURM_NTASKS "
                      "of srun): start with `hetdp run -n N script.py`, torchrun or srun; under Ray Train, call it "
                      "inside the training function, where Ray has set up the process group")


def _torchrun(env: Mapping[str, str]) -> Placement:
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ConfigError(f"torchrun's variables are incomplete: {', '.join(missing)} unset")
    world_size = _integer(env, "WORLD_SIZE")
    return Placement(engine="torchrun", rank=_integer(env, "RANK"), world_size=world_size,
                     local_rank=_integer(env, "LOCAL_RANK", 0),
                     local_world_size=_integer(env, "LOCAL_WORLD_SIZE", world_size),
                     master_addr=env["MASTER_ADDR"], master_port=_integer(env, "MASTER_PORT"))


def _slurm(env: Mapping[str, str]) -> Placement:
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    master_addr = env.get("MASTER_ADDR") or (first_host(nodes) if nodes else None)
    if not master_addr:
        raise ConfigError("srun's variables name no node (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST unset): set "
                          "MASTER_ADDR to the first node's address")
    if env.get("MASTER_PORT"):
        port = _integer(env, "MASTER_PORT")
    elif env.get("SLURM_JOB_ID"):
        port = SLURM_PORT_BASE + _integer(env, "SLURM_JOB_ID") % 10000
    else:
        raise ConfigError("srun's variables give no job id (SLURM_JOB_ID) to derive the store's port from: set "
                          "MASTER_PORT")
    world_size = _integer(env, "SLURM_NTASKS")
    per_node = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "",
                             _integer(env, "SLURM_NODEID", 0)) or world_size
    return Placement(engine="slurm", rank=_integer(env, "SLURM_PROCID"), world_size=world_size,
                     local_rank=_integer(env, "SLURM_LOCALID", 0), local_world_size=per_node,
                     master_addr=master_addr, master_port=port)


def _pytorchjob(env: Mapping[str, str]) -> Placement:
    per_pod = env.get("PET_NPROC_PER_NODE", "1")
    if per_pod != "1":
        raise ConfigError(f"PyTorchJob with nprocPerNode={per_pod} sets RANK to the pod's index, not this process's: "
                          "start the script with torchrun in the pod (`torchrun script.py`: the operator's PET_* "
                          "variables are its options)")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ConfigError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} not: a PyTorchJob sets all four; "
                          "elsewhere, start with torchrun or `hetdp run`")
    return Placement(engine="pytorchjob", rank=_integer(env, "RANK"), world_size=_integer(env, "WORLD_SIZE"),
                     local_rank=0, local_world_size=1, master_addr=env["MASTER_ADDR"],
                     master_port=_integer(env, "MASTER_PORT"))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-09,12],cpu3`` gives ``gpu07`` (a range keeps its zero padding)."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ConfigError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Tasks on node ``node`` of a Slurm ``TASKS_PER_NODE`` value (``2(x3),1``: 2 on nodes 0-2, 1 on node 3)."""
    counts: list[int] = []
    for part in filter(None, tasks_per_node.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else None


def _integer(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise ConfigError(f"{name} is unset")
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None


ENV_NODE = "HETDP_NODE"
"""This node's label in a launch across nodes (``node 1 (10.0.0.2)``), set for its workers by ``hetdp run``."""


def node_label() -> str:
    """Where this worker runs, as error messages name it: its ``hetdp run`` node label, else ``host NAME``."""
    return os.environ.get(ENV_NODE) or f"host {socket.gethostname()}"


def route_to(host: str, port: int) -> tuple[str, str]:
    """(this machine's address, its interface) on the way to ``host``: what the kernel would send from.

    Raises:
        ConfigError: ``host`` does not resolve, or no route leads to it.
    """
    try:
        family, kind, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(target)  # a datagram socket's connect sends nothing: it only picks the route
            local = probe.getsockname()[0]
    except OSError as error:
        raise ConfigError(f"no route from this node to {host}:{port} ({error.strerror or error})") from error
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == local for entry in addresses):
            return local, name
    raise ConfigError(f"this node reaches {host} from {local}, which no interface holds")


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_interfaces(chosen: str, interfaces: Collection[str], instead: str) -> None:
    """Refuse a ``GLOO_SOCKET_IFNAME`` that names an interface this machine lacks (gloo's own error is a C++ enforce
    failure); ``instead`` says what to do about it.

    Raises:
        ConfigError: naming the missing interfaces and the machine's own.
    """
    unknown = [name for name in chosen.split(",") if name not in interfaces]
    if unknown:
        raise ConfigError(f"GLOO_SOCKET_IFNAME names {', '.join(unknown)}, which this node does not have (its "
                          f"interfaces: {', '.join(sorted(interfaces))}); {instead}")


def gloo_interface(place: Placement, environ: Mapping[str, str], interfaces: Collection[str],
                   route: Callable[[str, int], tuple[str, str]] = route_to) -> str | None:
    """The interface gloo should speak on, for ``GLOO_SOCKET_IFNAME`` (None: leave gloo its own choice).

    Without one, gloo binds to whatever this machine's hostname resolves to, often 127.0.0.1 or 127.0.1.1 (the
    hostname's line in /etc/hosts), and a job across nodes hangs until its timeout. Where the ranks span several
    nodes and the user chose nothing, the interface this node reaches ``MASTER_ADDR`` from is the one the nodes
    share. One node keeps gloo's choice (loopback serves it), and so does a ``MASTER_ADDR`` that does not resolve
    yet (a Kubernetes service before its DNS record: the process group's own retries wait for it). A
    ``MASTER_ADDR`` that resolves to this machine's loopback from a name (node 0's hostname in its /etc/hosts)
    leaves nothing to pick, and warns: the other nodes cannot reach a gloo bound there.

    Raises:
        ConfigError: a ``GLOO_SOCKET_IFNAME`` naming an interface this machine lacks.
    """
    chosen = environ.get("GLOO_SOCKET_IFNAME")
    if chosen:
        check_interfaces(chosen, interfaces, "set it to the interface the nodes share, or unset it")
        return None
    if place.local_world_size >= place.world_size or is_loopback(place.master_addr):
        return None
    try:
        local, interface = route(place.master_addr, place.master_port)
    except ConfigError:
        return None
    if is_loopback(local):
        warnings.warn(f"hetdp: MASTER_ADDR {place.master_addr} resolves to this machine's loopback ({local}), and "
                      f"the job spans nodes ({place.local_world_size} of {place.world_size} ranks here): the other "
                      "nodes cannot reach gloo there; set GLOO_SOCKET_IFNAME to the interface the nodes share, or "
                      "MASTER_ADDR to this node's address on it", stacklevel=3)
        return None
    return interface
