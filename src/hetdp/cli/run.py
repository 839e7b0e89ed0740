"""``hetdp run -n N script.py ...``: a thin wrapper over torch.distributed.run with emulated heterogeneity, on one
node or, with ``--nnodes``, on several."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

from hetdp.allocate.policy import ENV_ALLOCATION, allocation_policy
from hetdp.cluster.devices import device_models_from_flags, read_device_table
from hetdp.cluster.emulate import Emulation, parse_speed_change, parse_speeds, parse_stragglers
from hetdp.errors import ConfigError
from hetdp.flags import positive_int
from hetdp.launch import run_local
from hetdp.launch.nodes import Nodes, parse_endpoint
from hetdp.sync.policy import ENV_SYNC, sync_policy


def add_emulation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that make local ranks unequal; shared by `run`, `demo` and the benchmarks."""
    parser.add_argument("--speeds", metavar="V1,V2,...", help="relative speed of each rank, e.g. 1,1,2,4")
    parser.add_argument(
        "--sample-cost-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="synthetic cost of one sample at speed 1 (default 0: stretch measured compute time instead)",
    )
    parser.add_argument("--stragglers", metavar="K:MS", help="delay K random ranks by MS milliseconds at each step")
    parser.add_argument("--speed-change", action="append", default=[], metavar="STEP:V1,V2,...",
                        help="from global step STEP on, the ranks run at speeds V1,V2,... (repeatable)")
    devices = parser.add_argument_group("device models (with --sample-cost-ms, or --devices)")
    devices.add_argument("--devices", metavar="TABLE.toml", help="a device table (cluster file, links optional): "
                         "each rank's speed, per-sample cost, fixed costs, knee and memory cap")
    devices.add_argument("--step-overhead-ms", metavar="MS,...", help="fixed cost of every step, per rank")
    devices.add_argument("--knee", metavar="N,...", help="batch at which throughput saturates, per rank (0: none)")
    devices.add_argument("--max-batch", metavar="N,...", help="memory cap: most samples per forward, per rank (0: none)")
    devices.add_argument("--micro-overhead-ms", metavar="MS,...", help="cost of each micro-batch, per rank")


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that place this node in a launch across several; shared by `run` and `probe`."""
    nodes = parser.add_argument_group("several nodes (run the same command on every node, each with its --node-rank)")
    nodes.add_argument("--nnodes", type=positive_int, default=1, metavar="N", help="nodes in the launch (default 1)")
    nodes.add_argument("--node-rank", type=int, metavar="K",
                       help="this node, from 0 to N-1; node 0 hosts the rendezvous and its ranks come first")
    nodes.add_argument("--rdzv-endpoint", metavar="HOST[:PORT]",
                       help="node 0's address as every node reaches it, and a free port there (default port 29500; "
                       "a restart k meets at PORT+k)")
    nodes.add_argument("--join-timeout-s", type=float, default=180.0, metavar="S",
                       help="give up, in one line, when not every node joined within S seconds (default 180)")


def nodes_from_args(args: argparse.Namespace) -> Nodes | None:
    """This node's place in a launch across several, or None for a one-node launch; raises ConfigError naming the
    missing or bad flag."""
    if args.nnodes == 1 and args.node_rank in (None, 0) and args.rdzv_endpoint is None:
        return None
    if args.rdzv_endpoint is None or args.node_rank is None:
        raise ConfigError(f"--nnodes {args.nnodes} needs --node-rank (this node, 0 to {args.nnodes - 1}) and "
                          f"--rdzv-endpoint (node 0's HOST:PORT), the same endpoint on every node")
    host, port = parse_endpoint(args.rdzv_endpoint)
    return Nodes(count=args.nnodes, rank=args.node_rank, master_addr=host, master_port=port,
                 join_timeout_s=args.join_timeout_s)


def group_ranks(args: argparse.Namespace, nodes: Nodes | None, counts: dict[str, int]) -> int:
    """How many ranks the per-rank flags given must describe; ``counts`` holds how many values each gives, by flag.

    On one node, its ``-n``. Across nodes, the whole group, which each node's own ``-n`` sizes and no node can count
    at launch: the first flag given says it, and every node passes the same list to its workers, each of which
    takes the value at its global rank (node K's ranks follow node K-1's). Every rank checks the list against the
    group's real size when it starts (``Emulation.pacer``).

    Raises:
        ConfigError: across nodes, fewer values than this node's ranks and one for each other node.
    """
    if nodes is None:
        return args.nproc
    if not counts:
        return args.nproc * nodes.count
    flag, count = next(iter(counts.items()))
    least = args.nproc + nodes.count - 1
    if count < least:
        raise ConfigError(f"{flag} gives {count} values, fewer than the {least} ranks of this launch at the least "
                          f"(-n {args.nproc} here and one or more on each of the {nodes.count - 1} other nodes): "
                          "across nodes, give one value per global rank, the same list on every node")
    return count


def _per_rank_counts(args: argparse.Namespace) -> dict[str, int]:
    """How many values each per-rank emulation flag given holds, by flag (a device table: its devices)."""
    texts = {"--speeds": args.speeds}
    texts.update((f"--speed-change {text}", text.partition(":")[2]) for text in args.speed_change)
    texts.update((f"--{name.replace('_', '-')}", getattr(args, name)) for name in
                 ("step_overhead_ms", "knee", "max_batch", "micro_overhead_ms"))
    counts = {flag: len(text.split(",")) for flag, text in texts.items() if text}
    if args.devices is not None:
        counts["--devices"] = len(read_device_table(args.devices).devices)
    return counts


def emulation_from_args(args: argparse.Namespace, nproc: int) -> Emulation:
    """Validate the emulation flags against ``nproc``; raises ConfigError naming the bad flag."""
    speeds = parse_speeds(args.speeds, nproc) if args.speeds else None
    count, delay_ms = parse_stragglers(args.stragglers) if args.stragglers else (0, 0.0)
    if count > nproc:
        raise ConfigError(f"--stragglers asks for {count} delayed ranks among {nproc} processes")
    changes = tuple(sorted(parse_speed_change(text, nproc) for text in getattr(args, "speed_change", [])))
    if changes and speeds is None:
        speeds = (1.0,) * nproc
    emulation = Emulation(
        speeds=speeds,
        sample_cost_ms=args.sample_cost_ms,
        straggler_count=count,
        straggler_delay_ms=delay_ms,
        seed=getattr(args, "seed", 0),
        speed_changes=changes,
        devices=device_models_from_flags(nproc, step_overhead_ms=getattr(args, "step_overhead_ms", None),
                                         knee=getattr(args, "knee", None), max_batch=getattr(args, "max_batch", None),
                                         micro_overhead_ms=getattr(args, "micro_overhead_ms", None)),
    )
    path = getattr(args, "devices", None)
    if path is not None and (args.speeds or args.sample_cost_ms or emulation.devices is not None):
        raise ConfigError("--devices gives every rank's speed, per-sample cost and device model: leave out --speeds, "
                          "--sample-cost-ms and the per-rank device flags")
    return emulation if path is None else _with_device_table(emulation, path, nproc)


def _with_device_table(emulation: Emulation, path: str, nproc: int) -> Emulation:
    """``emulation`` with its speeds, per-sample cost and device models from the table at ``path``."""
    table = read_device_table(path)
    if len(table.devices) != nproc:
        raise ConfigError(f"--devices lists {len(table.devices)} devices for {nproc} processes; give one per process")
    devices = Emulation.from_device_table(table)
    return dataclasses.replace(emulation, speeds=devices.speeds, sample_cost_ms=devices.sample_cost_ms,
                               devices=devices.devices)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="launch a training script on N local ranks (torchrun) with emulated heterogeneity",
        description="Launch SCRIPT on N local ranks through torch.distributed.run, or this node's N ranks of a "
        "launch across several nodes (--nnodes). Emulation settings reach every rank through the environment "
        "(hetdp.Emulation.from_env); across nodes, the per-rank flags give one value per global rank.",
    )
    parser.add_argument("-n", "--nproc", type=positive_int, required=True, help="number of local ranks")
    add_node_arguments(parser)
    add_emulation_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the straggler draws (default 0)")
    parser.add_argument("--allocation", metavar="POLICY",
                        help="allocation of a hetdp.DDP whose code chooses none: equal, adaptive or static:W1,W2,...")
    parser.add_argument("--sync", metavar="SYNC", help="synchronization of a hetdp.DDP whose code chooses none: "
                        "allreduce, solo, majority, quorum:K, full, local or local:K")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a worker dies or hangs, start the whole group again (new rendezvous), up to R "
                        "times; the script resumes from its checkpoint ($TORCHELASTIC_RESTART_COUNT: the attempt)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    nodes = nodes_from_args(args)
    emulation = emulation_from_args(args, group_ranks(args, nodes, _per_rank_counts(args) if nodes else {}))
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"script not found: {script}")
    env = emulation.to_env()
    if args.allocation:
        allocation_policy(args.allocation)  # a bad value fails here, once, not on every rank
        env[ENV_ALLOCATION] = args.allocation
    if args.sync:
        sync_policy(args.sync)
        env[ENV_SYNC] = args.sync
    announce = functools.partial(_announce_restart, nodes)
    return run_local(script, args.nproc, args.script_args, env=env, report_errors=True,
                     max_restarts=args.max_restarts, on_restart=announce, nodes=nodes).returncode


def _announce_restart(nodes: Nodes | None, attempt: int, returncode: int) -> None:
    where = "" if nodes is None else f" at {nodes.master_addr}:{nodes.port(attempt)}"
    print(f"hetdp run: the workers failed (exit {returncode}); restart {attempt}, on a new rendezvous{where}",
          file=sys.stderr, flush=True)
