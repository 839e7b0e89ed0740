"""``hetdp simulate``: compare the strategies on a simulated cluster of any size, in seconds."""

from __future__ import annotations

import argparse
import sys

import numpy as np
from tqdm import tqdm

from hetdp.cluster.emulate import parse_speeds
from hetdp.errors import ConfigError
from hetdp.files import write_json
from hetdp.report import format_table
from hetdp.sim.model import STRATEGIES, SimulatedCluster, SimulationResult, simulate

DEFAULT_WORKERS = 1000
COLUMNS = """\
columns: samples/step: gradient samples applied per step (the global batch; in a partial round, only
  the gradients that arrived in time); samples/s = steps x samples/step / simulated s; fresh %: applied
  gradients computed from the latest model (a stale one started before the previous round); compute, wait,
  allreduce %: how the workers' time divides between computing, idling (for the slowest worker, or for a
  partial round to fire) and the allreduce."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate equal / static / adaptive / solo / majority / quorum on many unequal workers",
        description="Step-level simulation of each strategy on a cluster of unequal workers (speeds given, or "
        "drawn log-normally), with per-step jitter, random stragglers and a ring-allreduce cost; prints the "
        "throughput of each strategy and where the workers' time goes.",
        epilog=COLUMNS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--speeds", metavar="V1,V2,...",
                        help="relative speed of each worker, as in `hetdp run` and `hetdp demo` (e.g. 1,1,2,4)")
    parser.add_argument("--samples-per-s", type=float, default=1000.0, metavar="R",
                        help="samples per second of a worker of speed 1 (default 1000)")
    parser.add_argument("--workers", type=int, metavar="N", help=f"workers, their speeds drawn log-normally when "
                        f"--speeds is not given (default {DEFAULT_WORKERS}); with --speeds, its count")
    parser.add_argument("--speed-spread", type=float, default=0.6, metavar="SIGMA",
                        help="sigma of the drawn log-normal speeds, median 1 (default 0.6)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), metavar="S1,S2,...",
                        help=f"comma-separated, from {', '.join(STRATEGIES)} (default all)")
    parser.add_argument("--global-batch", type=int, metavar="B", help="samples per step (default 64 per worker)")
    parser.add_argument("--steps", type=int, default=200, metavar="N",
                        help="steps (synchronous) or rounds (partial) per strategy (default 200)")
    parser.add_argument("--replan-every", type=int, default=10, metavar="N",
                        help="adaptive: steps between re-plans (default 10)")
    parser.add_argument("--quorum", type=int, metavar="K", help="quorum: arrivals that fire a round (default N/2)")
    parser.add_argument("--jitter", type=float, default=0.05, metavar="SIGMA",
                        help="sigma of log-normal noise on every compute time (default 0.05; 0: none)")
    parser.add_argument("--straggler-probability", type=float, default=0.01, metavar="P",
                        help="chance that a worker is delayed at a given step (default 0.01)")
    parser.add_argument("--straggler-delay-ms", type=float, default=300.0, metavar="MS",
                        help="milliseconds a delayed worker loses (default 300)")
    parser.add_argument("--latency-us", type=float, default=50.0, metavar="US",
                        help="latency of one allreduce hop, microseconds (default 50)")
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0, metavar="GBPS",
                        help="link bandwidth of the allreduce, gigabits per second (default 10)")
    parser.add_argument("--model-mb", type=float, default=40.0, metavar="MB",
                        help="gradient size, megabytes (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of speeds, jitter and stragglers (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one JSON object to PATH")
    parser.set_defaults(handler=run)


def worker_speeds(args: argparse.Namespace) -> tuple[float, ...]:
    """Relative speeds from --speeds, or drawn for --workers; raises ConfigError when the two disagree."""
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    if args.speeds:
        speeds = parse_speeds(args.speeds)
        if args.workers is not None and args.workers != len(speeds):
            raise ConfigError(f"--speeds gives {len(speeds)} values for --workers {args.workers}; "
                              "give one per worker, or leave --workers out")
        return speeds
    if not args.speed_spread >= 0:
        raise ConfigError(f"--speed-spread must be >= 0, got {args.speed_spread!r}")
    rng = np.random.default_rng(args.seed)
    return tuple(float(v) for v in rng.lognormal(0.0, args.speed_spread, args.workers or DEFAULT_WORKERS))


def run(args: argparse.Namespace) -> int:
    if args.json and args.json.endswith("/"):
        raise ConfigError(f"--json needs a file path, got the folder {args.json!r}")
    speeds = worker_speeds(args)
    strategies = [name.strip() for name in args.strategies.split(",")]
    unknown = [name for name in strategies if name not in STRATEGIES]
    if unknown:
        raise ConfigError(f"--strategies: unknown {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    check_flags(args, len(speeds))
    cluster = SimulatedCluster(
        speeds=tuple(args.samples_per_s * v for v in speeds),
        jitter=args.jitter,
        straggler_probability=args.straggler_probability,
        straggler_delay_s=args.straggler_delay_ms / 1000.0,
        latency_s=args.latency_us / 1e6,
        bandwidth_gbps=args.bandwidth_gbps,
        model_mb=args.model_mb,
    )
    global_batch = args.global_batch or 64 * cluster.size
    results = [
        simulate(cluster, strategy, global_batch=global_batch, steps=args.steps, replan_every=args.replan_every,
                 quorum=args.quorum, seed=args.seed)
        for strategy in tqdm(strategies, desc="strategies", unit="strategy", leave=False, disable=None,
                             file=sys.stderr)
    ]
    print(render(cluster, global_batch, results, args))
    if args.json:
        write_json(args.json, {"workers": cluster.size, "global_batch": global_batch,
                               "ideal_speedup": ideal_speedup(cluster),
                               "allreduce": vars(cluster.allreduce_cost()),
                               "results": [{**vars(r), "seconds": float(r.seconds)} for r in results]})
        print(f"figures written to {args.json}")
    return 0


def check_flags(args: argparse.Namespace, workers: int) -> None:
    """Reject a bad number under the name of its flag, in the flag's unit."""
    global_batch = args.global_batch if args.global_batch is not None else workers
    bounds = [
        ("--steps", args.steps, args.steps >= 1, ">= 1"),
        ("--replan-every", args.replan_every, args.replan_every >= 1, ">= 1"),
        ("--global-batch", global_batch, global_batch >= workers, f">= {workers}, one sample per worker"),
        ("--quorum", args.quorum, args.quorum is None or 1 <= args.quorum <= workers, f"in [1, {workers}]"),
        ("--samples-per-s", args.samples_per_s, 0 < args.samples_per_s < np.inf, "> 0"),
        ("--straggler-probability", args.straggler_probability, 0 <= args.straggler_probability <= 1, "in [0, 1]"),
        ("--bandwidth-gbps", args.bandwidth_gbps, 0 < args.bandwidth_gbps <= np.inf, "> 0"),
    ]
    bounds += [(f"--{name.replace('_', '-')}", getattr(args, name), 0 <= getattr(args, name) < np.inf, ">= 0")
               for name in ("jitter", "straggler_delay_ms", "latency_us", "model_mb")]
    for flag, value, good, allowed in bounds:
        if not good:
            raise ConfigError(f"{flag} must be {allowed}, got {value!r}")


def ideal_speedup(cluster: SimulatedCluster) -> float:
    """Allocation's best case over an equal split, compute alone: sum(v) / (N min v)."""
    return sum(cluster.speeds) / (cluster.size * min(cluster.speeds))


def render(cluster: SimulatedCluster, global_batch: int, results: list[SimulationResult],
           args: argparse.Namespace) -> str:
    """The table, its column definitions, and where the time goes that allocation cannot win back."""
    baseline = next((r for r in results if r.strategy == "equal"), results[0])
    quorum = args.quorum or (cluster.size + 1) // 2
    rows = [
        {
            "strategy": r.strategy if r.strategy != "quorum" else f"quorum k={quorum}",
            "steps": r.steps,
            "samples/step": round(r.samples_per_step),
            "simulated s": r.seconds,
            "samples/s": round(r.samples_per_s),
            f"vs {baseline.strategy}": r.samples_per_s / baseline.samples_per_s,
            "fresh %": round(100 * r.fresh_fraction, 1),
            "compute %": round(100 * r.compute_fraction, 1),
            "wait %": round(100 * r.wait_fraction, 1),
            "allreduce %": round(100 * r.allreduce_fraction, 1),
        }
        for r in results
    ]
    title = (f"{cluster.size} workers, {sum(cluster.speeds):,.0f} samples/s in all ({args.samples_per_s:g} x "
             f"relative speed), global batch {global_batch}")
    cost = cluster.allreduce_cost()
    straggled = 1.0 - (1.0 - cluster.straggler_probability) ** cluster.size
    return "\n".join([
        format_table(rows, title=title),
        COLUMNS,
        (f"ideal allocation speedup {ideal_speedup(cluster):.2f} = sum of speeds / (N x slowest), compute alone. "
         "What allocation cannot win back, per step:"),
        f"  compute {global_batch / sum(cluster.speeds):.3g} s at a perfect allocation;",
        (f"  stragglers {cluster.straggler_delay_s:g} s in {100 * straggled:.0f}% of steps "
         f"(1 - (1 - {cluster.straggler_probability:g})^{cluster.size}: a synchronous step waits for its slowest);"
         if straggled > 0 else "  stragglers: none;"),
        (f"  allreduce {cost.total_s:.3g} s = latency {cost.latency_s:.3g} s (2(N-1) = {cost.hops} hops x "
         f"{cluster.latency_s * 1e6:g} us) + transfer {cost.transfer_s:.3g} s (2(N-1)/N x {cluster.model_mb:g} MB at "
         f"{cluster.bandwidth_gbps:g} Gb/s)."),
    ])
