"""``hetdp simulate``: compare the strategies on a simulated cluster of any size, in seconds."""

from __future__ import annotations

import argparse

import numpy as np

from hetdp.cluster.emulate import parse_speeds
from hetdp.errors import ConfigError
from hetdp.files import write_json
from hetdp.report import format_table
from hetdp.sim.model import STRATEGIES, SimulatedCluster, simulate


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate equal / static / adaptive / solo / majority / quorum on many unequal workers",
        description="Step-level simulation of each strategy on a cluster of unequal workers (speeds given, or "
        "drawn log-normally), with per-step jitter and random stragglers; prints throughput per strategy.",
    )
    parser.add_argument("--speeds", help="samples per second of each worker, e.g. 100,100,200,400")
    parser.add_argument("--workers", type=int, default=1000, help="workers drawn when --speeds is not given")
    parser.add_argument("--speed-spread", type=float, default=0.6, help="sigma of log-normal speeds (default 0.6)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, default all")
    parser.add_argument("--global-batch", type=int, help="samples per step (default 64 per worker)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--replan-every", type=int, default=10, help="adaptive: steps between re-plans")
    parser.add_argument("--jitter", type=float, default=0.05, help="sigma of log-normal noise on compute times")
    parser.add_argument("--straggler-probability", type=float, default=0.01)
    parser.add_argument("--straggler-delay-ms", type=float, default=300.0)
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0)
    parser.add_argument("--model-mb", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.speeds:
        speeds = parse_speeds(args.speeds)
    elif args.workers >= 1:
        rng = np.random.default_rng(args.seed)
        speeds = tuple(float(v) for v in 1000.0 * rng.lognormal(0.0, args.speed_spread, args.workers))
    else:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    strategies = [name.strip() for name in args.strategies.split(",")]
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    cluster = SimulatedCluster(
        speeds=speeds,
        jitter=args.jitter,
        straggler_probability=args.straggler_probability,
        straggler_delay_s=args.straggler_delay_ms / 1000.0,
        bandwidth_gbps=args.bandwidth_gbps,
        model_mb=args.model_mb,
    )
    global_batch = args.global_batch or 64 * cluster.size
    results = [
        simulate(cluster, strategy, global_batch=global_batch, steps=args.steps, replan_every=args.replan_every,
                 seed=args.seed)
        for strategy in strategies
    ]
    baseline = next((r for r in results if r.strategy == "equal"), results[0])
    rows = [
        {
            "strategy": r.strategy,
            "samples/s": round(r.samples_per_s),
            f"vs {baseline.strategy}": r.samples_per_s / baseline.samples_per_s,
            "fresh fraction": r.fresh_fraction,
            "simulated s": r.seconds,
        }
        for r in results
    ]
    ideal = sum(speeds) / (cluster.size * min(speeds))
    print(format_table(rows, title=f"{cluster.size} workers, global batch {global_batch}, {args.steps} steps; "
                                   f"ideal allocation speedup {ideal:.2f}"))
    if args.json:
        write_json(args.json, {"workers": cluster.size, "global_batch": global_batch, "ideal_speedup": ideal,
                               "results": [{**vars(r), "seconds": float(r.seconds),
                                            "samples_per_s": float(r.samples_per_s)} for r in results]})
    return 0
