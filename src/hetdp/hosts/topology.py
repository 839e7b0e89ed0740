"""Emulated hosts as a plan: sites of hosts on switches, rate-limited links, and the ``ip``/``tc`` commands that
build them. Pure: nothing here runs a command, so the plan is tested without root.

Each host is a network namespace with one interface, ``INTERFACE``, on its site's bridge (a switch). A host's rate
limit is a token bucket (tbf) on both ends of its veth pair, one per direction; a site's uplink is a veth pair
between its bridge and a core bridge that joins the sites, with a token bucket at each end. All hosts share one
/24 subnet, so no routing is needed; the root namespace takes no address on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from hetdp.errors import ConfigError

INTERFACE = "eth0"
"""Name of each host's interface, inside its namespace (``GLOO_SOCKET_IFNAME`` on that host)."""
SUBNET = "10.44.0"
"""The hosts' /24: host k is ``SUBNET.(k + 1)``. Each set of emulated hosts has bridges of its own, so two sets may
use the same addresses at once."""
MAX_HOSTS = 200
"""Most hosts one topology holds (addresses .1 to .200 of the /24)."""
BURST_S = 0.002
"""Seconds of traffic a token bucket lets through at once, above its rate (at least ``MIN_BURST_BYTES``)."""
MIN_BURST_BYTES = 16_000
"""Least burst of a token bucket: a few full-size frames, so that one frame never waits for tokens it cannot get."""
QUEUE_MS = 100
"""Milliseconds of traffic a token bucket queues before it drops (tbf's ``latency``), as a router's buffer would."""
NAME_PATTERN = re.compile(r"^hdp(\d+)[a-z]")
"""Interface and namespace names start with ``hdp`` and the id of the process that made them (see ``Names``)."""


@dataclass(kw_only=True, frozen=True)
class Site:
    """Hosts behind one switch, and how fast they reach each other and the other sites."""

    hosts: int
    """Hosts at this site (>= 1)."""
    rate_mbit: float | None = None
    """Each host's own link, in each direction, in Mbit/s (None: unlimited, as fast as a veth pair goes)."""
    uplink_rate_mbit: float | None = None
    """The site's link to the other sites, in each direction, in Mbit/s (None: unlimited). Every flow between this
    site and another shares it."""

    def __post_init__(self) -> None:
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or self.hosts < 1:
            raise ConfigError(f"a site needs at least one host, got hosts={self.hosts!r}")
        for name in ("rate_mbit", "uplink_rate_mbit"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of Mbit/s (or None: unlimited), got {value!r}")


@dataclass(kw_only=True, frozen=True)
class Topology:
    """Sites of emulated hosts; host numbers run across the sites in order (site 0's hosts first)."""

    sites: tuple[Site, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))
        if not self.sites:
            raise ConfigError("a topology needs at least one site")
        if self.host_count > MAX_HOSTS:
            raise ConfigError(f"at most {MAX_HOSTS} emulated hosts, got {self.host_count}")

    @classmethod
    def flat(cls, hosts: int, rate_mbit: float | None = None) -> Topology:
        """``hosts`` hosts on one switch, each behind a link of ``rate_mbit`` (None: unlimited)."""
        return cls(sites=(Site(hosts=hosts, rate_mbit=rate_mbit),))

    @property
    def host_count(self) -> int:
        return sum(site.hosts for site in self.sites)

    def site_of(self, host: int) -> int:
        """The site that holds ``host``."""
        first = 0
        for index, site in enumerate(self.sites):
            if host < first + site.hosts:
                return index
            first += site.hosts
        raise ConfigError(f"host {host} is not in this topology of {self.host_count} hosts")

    @property
    def joined(self) -> bool:
        """Whether the sites hang off a core bridge (more than one site)."""
        return len(self.sites) > 1


def address(host: int) -> str:
    """The address of ``host`` on the hosts' network."""
    return f"{SUBNET}.{host + 1}"


@dataclass(frozen=True)
class Names:
    """The names of one set of emulated hosts' namespaces and interfaces: ``hdp`` and an owner id (the process that
    made them), so that leftovers of a run that died are known by their owner, and two sets never collide. Linux
    caps interface names at 15 characters: ``hdp`` + 7 digits + 5 more."""

    owner: int

    def __post_init__(self) -> None:
        if not 0 <= self.owner < 10**7:
            raise ConfigError(f"the owner id must have at most 7 digits, got {self.owner!r}")

    def namespace(self, host: int) -> str:
        return f"hdp{self.owner}n{host}"

    def host_link(self, host: int) -> str:
        """The root-namespace end of ``host``'s veth pair, on its site's bridge."""
        return f"hdp{self.owner}h{host}"

    def site_bridge(self, site: int) -> str:
        return f"hdp{self.owner}s{site}"

    def core_bridge(self) -> str:
        return f"hdp{self.owner}c"

    def uplink(self, site: int, end: str) -> str:
        """An end of ``site``'s uplink: ``"s"`` on the site's bridge, ``"c"`` on the core bridge."""
        return f"hdp{self.owner}u{site}{end}"


def owner_of(name: str) -> int | None:
    """The owner id in a namespace or interface name that ``Names`` made, None for any other name."""
    match = NAME_PATTERN.match(name)
    return int(match.group(1)) if match else None


def token_bucket(device: str, rate_mbit: float, *, namespace: str | None = None) -> list[str]:
    """The ``tc`` command that limits ``device``'s egress to ``rate_mbit`` with a token bucket."""
    burst_bytes = max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * BURST_S))
    where = ["-n", namespace] if namespace else []
    return ["tc", *where, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
            "burst", str(burst_bytes), "latency", f"{QUEUE_MS}ms"]


def _bridge(name: str) -> list[list[str]]:
    # Bridged frames skip the root namespace's iptables, whose FORWARD policy may drop them (a Docker host's does).
    return [["ip", "link", "add", name, "type", "bridge", "nf_call_iptables", "0"], ["ip", "link", "set", name, "up"]]


def build_commands(topology: Topology, names: Names) -> list[list[str]]:
    """The ``ip`` and ``tc`` commands that build ``topology`` under ``names``, in order."""
    commands: list[list[str]] = []
    for index, site in enumerate(topology.sites):
        commands += _bridge(names.site_bridge(index))
    if topology.joined:
        commands += _bridge(names.core_bridge())
        for index, site in enumerate(topology.sites):
            near, far = names.uplink(index, "s"), names.uplink(index, "c")
            commands += [["ip", "link", "add", near, "type", "veth", "peer", "name", far],
                         ["ip", "link", "set", near, "master", names.site_bridge(index), "up"],
                         ["ip", "link", "set", far, "master", names.core_bridge(), "up"]]
            if site.uplink_rate_mbit is not None:  # out of the site at one end, into it at the other
                commands += [token_bucket(near, site.uplink_rate_mbit), token_bucket(far, site.uplink_rate_mbit)]
    for host in range(topology.host_count):
        site = topology.sites[topology.site_of(host)]
        namespace, link = names.namespace(host), names.host_link(host)
        commands += [
            ["ip", "netns", "add", namespace],
            ["ip", "link", "add", link, "type", "veth", "peer", "name", INTERFACE, "netns", namespace],
            ["ip", "link", "set", link, "master", names.site_bridge(topology.site_of(host)), "up"],
            ["ip", "-n", namespace, "addr", "add", f"{address(host)}/24", "dev", INTERFACE],
            ["ip", "-n", namespace, "link", "set", INTERFACE, "up"],
            ["ip", "-n", namespace, "link", "set", "lo", "up"],
        ]
        if site.rate_mbit is not None:  # the host's upload inside its namespace, its download at the bridge's end
            commands += [token_bucket(INTERFACE, site.rate_mbit, namespace=namespace),
                         token_bucket(link, site.rate_mbit)]
    return commands


def links_to_remove(topology: Topology, names: Names) -> list[str]:
    """The root-namespace interfaces of ``topology``: deleting them (and the namespaces) removes every link."""
    links = [names.host_link(host) for host in range(topology.host_count)]
    if topology.joined:
        links += [names.uplink(index, "s") for index in range(len(topology.sites))] + [names.core_bridge()]
    return links + [names.site_bridge(index) for index in range(len(topology.sites))]


def parse_site(text: str) -> Site:
    """Parse ``HOSTS[:RATE_MBIT[:UPLINK_MBIT]]`` (a rate of ``-`` or empty: unlimited), e.g. ``2::50``.

    Raises:
        ConfigError: not three numbers at most, or a bad value.
    """
    parts = text.split(":")
    if not 1 <= len(parts) <= 3:
        raise ConfigError(f"a site looks like HOSTS[:RATE_MBIT[:UPLINK_MBIT]] (e.g. 2::50), got {text!r}")
    try:
        hosts = int(parts[0])
        rates = [None if part in ("", "-") else float(part) for part in parts[1:]] + [None] * (3 - len(parts))
    except ValueError:
        raise ConfigError(f"a site looks like HOSTS[:RATE_MBIT[:UPLINK_MBIT]] (e.g. 2::50), got {text!r}") from None
    return Site(hosts=hosts, rate_mbit=rates[0], uplink_rate_mbit=rates[1])


def fill_placeholders(command: Sequence[str], host: int, topology: Topology) -> list[str]:
    """``command`` for ``host``: ``{node}``, ``{nodes}``, ``{addr}`` and ``{master_addr}`` (host 0's) filled in."""
    values = {"{node}": str(host), "{nodes}": str(topology.host_count), "{addr}": address(host),
              "{master_addr}": address(0)}
    filled = []
    for word in command:
        for key, value in values.items():
            word = word.replace(key, value)
        filled.append(word)
    return filled
