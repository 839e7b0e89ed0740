"""``hetdp simulate``: compare the strategies on a simulated cluster of any size, in seconds, or project them to
several sizes (``--scales``) under each allreduce algorithm (``--allreduce``)."""

from __future__ import annotations

import argparse
import sys

import numpy as np
from tqdm import tqdm

from hetdp.cluster.emulate import parse_speeds
from hetdp.errors import ConfigError
from hetdp.files import write_json
from hetdp.report import format_table
from hetdp.sim.engine import Strategy
from hetdp.sim.model import STRATEGIES, SimulatedCluster, SimulationResult, simulate
from hetdp.sim.network import ALGORITHMS

DEFAULT_WORKERS = 1000
BATCH_PER_WORKER = 64
"""The global batch's samples per worker when --global-batch is not given, and in every projection."""
COLUMNS = """\
strategies: ALLOCATION+SYNC as `hetdp run --allocation A --sync S` spells them: equal, static (shares by speed) or
  adaptive (the drop-in's own re-planning), with allreduce (the default), solo, majority, quorum[:K] or local[:K]
  (parameter averaging every K steps); partial and local runs meet (flush, average) as the drop-in does.
columns: samples/step: the global batch (a partial step's gradient that missed its round travels in the next);
  samples/s = steps x samples/step / simulated s; fresh %: gradients that reached their round computed from the
  latest model; compute, wait, allreduce %: how the workers' time divides between computing, idling (for the
  slowest worker, for a partial round to fire, at a meeting) and collectives."""
HOPS = {"ring": "2(N-1)", "tree": "2 ceil(log2 N)", "doubling": "log2 N, +2 beyond a power of 2",
        "hierarchical": "2(L-1) in a node + 2 ceil(log2 nodes)"}
"""How many latencies each allreduce algorithm pays, for the footer."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate allocation x synchronization strategies on many unequal workers, or project them to scales",
        description="Step-level simulation of each strategy on a cluster of unequal workers (speeds given, or "
        "drawn log-normally), with per-step jitter, random stragglers and the cost of a ring, tree, doubling or "
        "hierarchical allreduce; prints the throughput of each strategy and where the workers' time goes. With "
        "--scales, a projection table instead: each strategy's samples/s over the first one's at each number of "
        "workers.",
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
                        help=f"comma-separated ALLOCATION+SYNC (default {','.join(STRATEGIES)})")
    parser.add_argument("--allreduce", default="ring", metavar="A1,A2,...",
                        help=f"allreduce algorithm(s), comma-separated, from {', '.join(ALGORITHMS)}; one table each "
                        "(default ring)")
    parser.add_argument("--scales", metavar="N1,N2,...",
                        help="project every strategy to these numbers of workers (e.g. 100,1000,10000; speeds drawn, "
                        f"or --speeds repeated; global batch {BATCH_PER_WORKER} per worker) instead of one table")
    parser.add_argument("--global-batch", type=int, metavar="B",
                        help=f"samples per step (default {BATCH_PER_WORKER} per worker)")
    parser.add_argument("--steps", type=int, default=200, metavar="N",
                        help="steps per strategy, every worker runs all of them (default 200)")
    parser.add_argument("--replan-every", type=int, default=2, metavar="N",
                        help="adaptive: steps between re-plans until the shares settle (default 2, as hetdp.Adaptive)")
    parser.add_argument("--quorum", type=int, metavar="K",
                        help="quorum without :K: arrivals that fire a round (default N/2, rounded up)")
    parser.add_argument("--jitter", type=float, default=0.05, metavar="SIGMA",
                        help="sigma of log-normal noise on every compute time (default 0.05; 0: none)")
    parser.add_argument("--straggler-probability", type=float, default=0.01, metavar="P",
                        help="chance that a worker is delayed at a given step (default 0.01)")
    parser.add_argument("--straggler-delay-ms", type=float, default=300.0, metavar="MS",
                        help="milliseconds a delayed worker loses (default 300)")
    parser.add_argument("--latency-us", type=float, default=50.0, metavar="US",
                        help="latency of one allreduce hop between nodes, microseconds (default 50)")
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0, metavar="GBPS",
                        help="link bandwidth between nodes, gigabits per second (default 10)")
    parser.add_argument("--local-size", type=int, default=8, metavar="L",
                        help="hierarchical: workers per node (default 8)")
    parser.add_argument("--local-latency-us", type=float, default=5.0, metavar="US",
                        help="hierarchical: latency of one hop inside a node, microseconds (default 5)")
    parser.add_argument("--local-bandwidth-gbps", type=float, default=200.0, metavar="GBPS",
                        help="hierarchical: link bandwidth inside a node, gigabits per second (default 200)")
    parser.add_argument("--model-mb", type=float, default=40.0, metavar="MB",
                        help="gradient size, megabytes (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of speeds, jitter and stragglers (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one JSON object to PATH")
    parser.set_defaults(handler=run)


def worker_speeds(args: argparse.Namespace, workers: int | None = None) -> tuple[float, ...]:
    """Relative speeds from --speeds, or drawn for --workers (or ``workers``); raises ConfigError when the two
    disagree."""
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
    count = workers or args.workers or DEFAULT_WORKERS
    return tuple(float(v) for v in rng.lognormal(0.0, args.speed_spread, count))


def run(args: argparse.Namespace) -> int:
    if args.json and args.json.endswith("/"):
        raise ConfigError(f"--json needs a file path, got the folder {args.json!r}")
    strategies = parse_strategies(args.strategies)
    algorithms = parse_list(args.allreduce, "--allreduce", ALGORITHMS)
    if args.scales:
        return project(args, strategies, algorithms, parse_scales(args.scales))
    speeds = worker_speeds(args)
    check_flags(args, len(speeds))
    global_batch = args.global_batch or BATCH_PER_WORKER * len(speeds)
    tables, figures = [], {"workers": len(speeds), "global_batch": global_batch, "allreduce": {}, "results": []}
    for algorithm in algorithms:
        cluster = make_cluster(args, speeds, algorithm)
        results = run_strategies(cluster, strategies, global_batch, args)
        tables.append(render(cluster, global_batch, results, args))
        figures["ideal_speedup"] = ideal_speedup(cluster)
        figures["allreduce"][algorithm] = vars(cluster.allreduce_cost())
        figures["results"] += [{**vars(r), "allreduce": algorithm, "seconds": float(r.seconds)} for r in results]
    print("\n\n".join([*tables, COLUMNS]))
    if args.json:
        write_json(args.json, figures)
        print(f"figures written to {args.json}")
    return 0


def parse_list(text: str, flag: str, choices: tuple[str, ...]) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in choices]
    if unknown:
        raise ConfigError(f"{flag}: unknown {unknown[0]!r}; choose from {', '.join(choices)}")
    return names


def parse_strategies(text: str) -> list[Strategy]:
    strategies = []
    for name in text.split(","):
        try:
            strategies.append(Strategy.parse(name))
        except ConfigError as error:
            raise ConfigError(f"--strategies: unknown {name.strip()!r} ({error})") from None
    return strategies


def parse_scales(text: str) -> list[int]:
    try:
        scales = [int(item.replace("_", "")) for item in text.split(",")]
    except ValueError:
        scales = []
    if not scales or min(scales) < 1:
        raise ConfigError(f"--scales needs worker counts >= 1, got {text!r}")
    return scales


def make_cluster(args: argparse.Namespace, speeds: tuple[float, ...], algorithm: str) -> SimulatedCluster:
    """The simulated cluster of the flags, with ``speeds`` relative to ``--samples-per-s``."""
    return SimulatedCluster(
        speeds=tuple(args.samples_per_s * v for v in speeds),
        jitter=args.jitter,
        straggler_probability=args.straggler_probability,
        straggler_delay_s=args.straggler_delay_ms / 1000.0,
        latency_s=args.latency_us / 1e6,
        bandwidth_gbps=args.bandwidth_gbps,
        model_mb=args.model_mb,
        algorithm=algorithm,
        local_size=args.local_size,
        local_latency_s=args.local_latency_us / 1e6,
        local_bandwidth_gbps=args.local_bandwidth_gbps,
    )


def run_strategies(cluster: SimulatedCluster, strategies: list[Strategy], global_batch: int,
                   args: argparse.Namespace) -> list[SimulationResult]:
    return [
        simulate(cluster, strategy, global_batch=global_batch, steps=args.steps, replan_every=args.replan_every,
                 quorum=args.quorum, seed=args.seed)
        for strategy in tqdm(strategies, desc=f"{cluster.size} workers, {cluster.algorithm}", unit="strategy",
                             leave=False, disable=None, file=sys.stderr)
    ]


def project(args: argparse.Namespace, strategies: list[Strategy], algorithms: list[str], scales: list[int]) -> int:
    """Each strategy's samples/s and speedup over the first strategy at every scale, one table per algorithm."""
    base = list(parse_speeds(args.speeds)) if args.speeds else None
    rows: list[dict] = []
    for workers in scales:
        speeds = tuple(base[i % len(base)] for i in range(workers)) if base else worker_speeds(args, workers)
        global_batch = BATCH_PER_WORKER * workers
        check_flags(args, workers, global_batch=global_batch)
        for algorithm in algorithms:
            cluster = make_cluster(args, speeds, algorithm)
            results = run_strategies(cluster, strategies, global_batch, args)
            rows += [{"allreduce": algorithm, "workers": workers, "strategy": r.strategy,
                      "samples_per_s": r.samples_per_s, "vs_first": r.samples_per_s / results[0].samples_per_s,
                      "allreduce_s": cluster.allreduce_s(), "ideal_speedup": ideal_speedup(cluster)} for r in results]
    print(render_projection(rows, strategies, algorithms, scales, args))
    if args.json:
        write_json(args.json, {"scales": scales, "global_batch_per_worker": BATCH_PER_WORKER, "projection": rows})
        print(f"figures written to {args.json}")
    return 0


def render_projection(rows: list[dict], strategies: list[Strategy], algorithms: list[str], scales: list[int],
                      args: argparse.Namespace) -> str:
    """One table per algorithm (a row per strategy, a column per scale), under a line of the assumptions."""
    cell = {(r["allreduce"], r["workers"], r["strategy"]): r for r in rows}
    speeds = f"speeds {args.speeds} repeated" if args.speeds else f"speeds log-normal (sigma {args.speed_spread:g})"
    inside = (f", {args.local_size} per node at {args.local_latency_us:g} us, {args.local_bandwidth_gbps:g} Gb/s"
              if "hierarchical" in algorithms else "")
    first = strategies[0].name
    header = (f"projection: samples/s as a multiple of {first}'s at the same scale ({speeds}, x "
              f"{args.samples_per_s:g} samples/s; global batch {BATCH_PER_WORKER} per worker; {args.steps} steps; "
              f"jitter {args.jitter:g}; stragglers {args.straggler_probability:g} x {args.straggler_delay_ms:g} ms; "
              f"gradient {args.model_mb:g} MB; links {args.latency_us:g} us, {args.bandwidth_gbps:g} Gb/s between "
              f"nodes{inside})")
    lines = [header]
    for algorithm in algorithms:
        table = [{"strategy": s.name, **{f"{n:,} workers": cell[algorithm, n, s.name]["vs_first"] for n in scales}}
                 for s in strategies]
        costs = ", ".join(f"{cell[algorithm, n, first]['allreduce_s']:.3g} s at {n:,}" for n in scales)
        ideal = ", ".join(f"{cell[algorithm, n, first]['ideal_speedup']:.2f}" for n in scales)
        lines += ["", format_table(table, title=f"{algorithm} allreduce ({costs}; ideal allocation speedup {ideal})")]
    return "\n".join(lines)


def check_flags(args: argparse.Namespace, workers: int, global_batch: int | None = None) -> None:
    """Reject a bad number under the name of its flag, in the flag's unit."""
    if global_batch is None:
        global_batch = args.global_batch if args.global_batch is not None else workers
    bounds = [
        ("--steps", args.steps, args.steps >= 1, ">= 1"),
        ("--replan-every", args.replan_every, args.replan_every >= 1, ">= 1"),
        ("--global-batch", global_batch, global_batch >= workers, f">= {workers}, one sample per worker"),
        ("--quorum", args.quorum, args.quorum is None or 1 <= args.quorum <= workers, f"in [1, {workers}]"),
        ("--samples-per-s", args.samples_per_s, 0 < args.samples_per_s < np.inf, "> 0"),
        ("--straggler-probability", args.straggler_probability, 0 <= args.straggler_probability <= 1, "in [0, 1]"),
        ("--bandwidth-gbps", args.bandwidth_gbps, 0 < args.bandwidth_gbps <= np.inf, "> 0"),
        ("--local-bandwidth-gbps", args.local_bandwidth_gbps, 0 < args.local_bandwidth_gbps <= np.inf, "> 0"),
        ("--local-size", args.local_size, args.local_size >= 1, ">= 1"),
    ]
    bounds += [(f"--{name.replace('_', '-')}", getattr(args, name), 0 <= getattr(args, name) < np.inf, ">= 0")
               for name in ("jitter", "straggler_delay_ms", "latency_us", "model_mb", "local_latency_us")]
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
            "strategy": f"{r.strategy}:{quorum}" if r.strategy.endswith("quorum") else r.strategy,
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
             f"relative speed), global batch {global_batch}, {cluster.algorithm} allreduce")
    cost = cluster.allreduce_cost()
    straggled = 1.0 - (1.0 - cluster.straggler_probability) ** cluster.size
    hop = f"{cluster.latency_s * 1e6:g} us"
    if cluster.algorithm == "hierarchical":
        hop = f"{cluster.local_latency_s * 1e6:g} us in a node of L = {cluster.local_size}, {hop} between nodes"
    return "\n".join([
        format_table(rows, title=title),
        (f"ideal allocation speedup {ideal_speedup(cluster):.2f} = sum of speeds / (N x slowest), compute alone. "
         "What allocation cannot win back, per step:"),
        f"  compute {global_batch / sum(cluster.speeds):.3g} s at a perfect allocation;",
        (f"  stragglers {cluster.straggler_delay_s:g} s in {100 * straggled:.0f}% of steps "
         f"(1 - (1 - {cluster.straggler_probability:g})^{cluster.size}: a synchronous step waits for its slowest);"
         if straggled > 0 else "  stragglers: none;"),
        (f"  allreduce {cost.total_s:.3g} s = latency {cost.latency_s:.3g} s ({HOPS[cluster.algorithm]} = "
         f"{cost.hops} hops x {hop}) + transfer {cost.transfer_s:.3g} s ({cluster.model_mb:g} MB at "
         f"{cluster.bandwidth_gbps:g} Gb/s, {cluster.algorithm})."),
    ])
