"""Emulated hosts for tests and benchmarks: network namespaces on rate-limited links, standing in for machines.

``python -m hetdp.hosts --hosts 2 --rate-mbit 100 -- COMMAND`` runs COMMAND on each of two hosts (``{node}`` and
``{master_addr}`` filled in per host) and removes them afterwards, even when the command fails. It needs root;
without it, it says so in one line and exits with code 2.
"""

from hetdp.hosts.netns import EmulatedHosts, HostsUnavailable, check_available
from hetdp.hosts.topology import INTERFACE, Site, Topology, address

__all__ = ["INTERFACE", "EmulatedHosts", "HostsUnavailable", "Site", "Topology", "address", "check_available"]
