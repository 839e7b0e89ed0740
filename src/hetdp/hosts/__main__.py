"""``python -m hetdp.hosts``: run a command on each of N emulated hosts, then remove the hosts."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hetdp.errors import ConfigError, HetDPError
from hetdp.flags import OneLineParser, positive_int
from hetdp.hosts.netns import EmulatedHosts
from hetdp.hosts.topology import Site, Topology, fill_placeholders, parse_site


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m hetdp.hosts",
        description="Make emulated hosts (network namespaces on rate-limited links), run COMMAND on each, print "
        "each host's output, and remove the hosts, also when COMMAND fails. In COMMAND, {node} is the host's "
        "number, {nodes} the number of hosts, {addr} its address and {master_addr} host 0's. Needs root.",
        epilog="Example: python -m hetdp.hosts --hosts 2 --rate-mbit 100 -- hetdp run --nnodes {nodes} "
        "--node-rank {node} --rdzv-endpoint {master_addr}:29500 -n 2 train.py",
    )
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--hosts", type=positive_int, metavar="N", help="N hosts on one switch")
    shape.add_argument("--site", action="append", type=str, metavar="HOSTS[:RATE_MBIT[:UPLINK_MBIT]]",
                       help="a site of HOSTS hosts, each behind RATE_MBIT, the site behind an uplink of "
                       "UPLINK_MBIT (a rate left empty: unlimited); repeat for each site, e.g. --site 2 --site 2::50")
    parser.add_argument("--rate-mbit", type=float, metavar="MBIT", help="with --hosts: each host's link, Mbit/s")
    parser.add_argument("--timeout-s", type=float, default=600.0, metavar="S",
                        help="kill every host's command after S seconds (default 600)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS: what each host runs")
    return parser


def topology_from_args(args: argparse.Namespace) -> Topology:
    if args.site:
        if args.rate_mbit is not None:
            raise ConfigError("--rate-mbit goes with --hosts; give a site's rate in --site HOSTS:RATE_MBIT")
        return Topology(sites=tuple(parse_site(text) for text in args.site))
    return Topology(sites=(Site(hosts=args.hosts, rate_mbit=args.rate_mbit),))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise ConfigError("give the command each host runs after --")
        if not args.timeout_s > 0:
            raise ConfigError(f"--timeout-s must be > 0, got {args.timeout_s!r}")
        topology = topology_from_args(args)
        with EmulatedHosts(topology) as hosts:
            done = hosts.run([fill_placeholders(command, host, topology) for host in range(topology.host_count)],
                             timeout_s=args.timeout_s)
    except HetDPError as error:
        print(f"python -m hetdp.hosts: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    for host, result in enumerate(done):
        print(f"--- host {host} ({hosts.addresses[host]}): exit code {result.returncode} ---")
        print(result.stdout, end="" if result.stdout.endswith("\n") or not result.stdout else "\n")
    return next((result.returncode for result in done if result.returncode != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
