"""``hetdp run -n N script.py ...``: a thin wrapper over torch.distributed.run with emulated heterogeneity."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from hetdp.allocate.policy import ENV_ALLOCATION, allocation_policy
from hetdp.cluster.devices import device_models_from_flags, read_device_table
from hetdp.cluster.emulate import Emulation, parse_speed_change, parse_speeds, parse_stragglers
from hetdp.errors import ConfigError
from hetdp.flags import positive_int
from hetdp.launch import run_local
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
        description="Launch SCRIPT on N local ranks through torch.distributed.run. "
        "Emulation settings reach every rank through the environment (hetdp.Emulation.from_env).",
    )
    parser.add_argument("-n", "--nproc", type=positive_int, required=True, help="number of local ranks")
    add_emulation_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the straggler draws (default 0)")
    parser.add_argument("--allocation", metavar="POLICY",
                        help="allocation of a hetdp.DDP whose code chooses none: equal, adaptive or static:W1,W2,...")
    parser.add_argument("--sync", metavar="SYNC", help="synchronization of a hetdp.DDP whose code chooses none: "
                        "allreduce, solo, majority, quorum:K, full, local or local:K")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a worker dies or hangs, start the whole group again (new rendezvous), up to R "
                        "times; the script resumes from its checkpoint ($HETDP_RESTART: the attempt)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    emulation = emulation_from_args(args, args.nproc)
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
    return run_local(script, args.nproc, args.script_args, env=env, report_errors=True,
                     max_restarts=args.max_restarts, on_restart=_announce_restart).returncode


def _announce_restart(attempt: int, returncode: int) -> None:
    print(f"hetdp run: the workers failed (exit {returncode}); restart {attempt}, on a new rendezvous",
          file=sys.stderr, flush=True)
