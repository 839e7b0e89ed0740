"""Partial allreduce under skewed arrivals: the eager-SGD paper's Fig. 8 microbenchmark (section 7.1).

P processes; before each call rank r sleeps r * skew ms; then plain
torch.distributed.all_reduce, solo, majority and quorum (k = P/2) partial
allreduces of one element. Figures: the latency averaged over ranks and
iterations, its ratio to all_reduce's, and the number of active processes (NAP:
ranks whose fresh data the round holds). One launch per process count.

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetdp.bench.workers import launch_workers
from hetdp.collectives.partial import PartialAllreduce
from hetdp.errors import ConfigError
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed

MODES = ("allreduce", "solo", "majority", "quorum")
WARMUP = 3
PAPER = {"P": 32, "speedup_solo": 53.32, "speedup_majority": 2.46}
"""Fig. 9 of the paper: 32 processes skewed by 1 ms each, MPI_Allreduce vs fflib2 on Piz Daint."""


def parse_nproc(text: str) -> list[int]:
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"--nproc takes process counts like 16,32; got {text!r}") from None
    if not counts or any(n < 2 for n in counts):
        raise ConfigError(f"--nproc needs counts >= 2, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", metavar="P1,P2,...", help="process counts, one launch each (default 16,32; "
                        "--quick: 8, since starting 16-32 processes that import torch takes minutes on 2 cores)")
    parser.add_argument("--skew-ms", type=float, default=5.0, metavar="MS",
                        help="rank r sleeps r times MS milliseconds before each call (default 5)")
    parser.add_argument("--iterations", type=int, metavar="N", help="measured calls per mode (default 64, quick 24)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = parse_nproc(args.nproc or ("8" if args.quick else "16,32"))
    iterations = args.iterations if args.iterations is not None else (24 if args.quick else 64)
    if iterations < 1:
        raise ConfigError(f"--iterations must be >= 1, got {iterations}")
    if not args.skew_ms >= 0:
        raise ConfigError(f"--skew-ms must be >= 0, got {args.skew_ms}")
    runs = [summarize(launch(nproc, args.skew_ms, iterations, args.seed)) for nproc in counts]
    return {**runs[0], "runs": runs, "paper": PAPER}


def launch(nproc: int, skew_ms: float, iterations: int, seed: int) -> dict[str, Any]:
    """Run the worker on ``nproc`` local ranks; return what rank 0 gathered."""
    return launch_workers("hetdp.bench.collectives", nproc,
                          ["--skew-ms", skew_ms, "--iterations", iterations, "--seed", seed],
                          total=len(MODES) * (WARMUP + iterations), description=f"collectives P={nproc}", unit="call")


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Mean latency per mode over ranks and iterations, its speedups over all_reduce, and the NAP."""
    latency = {mode: 1000 * statistics.fmean(v for rank in raw["latency_s"][mode] for v in rank) for mode in MODES}
    nap = {mode: statistics.fmean(raw["contributors"][mode]) for mode in MODES[1:]}
    return {
        "P": raw["P"],
        "skew_ms": raw["skew_ms"],
        "iterations": raw["iterations"],
        "latency_ms": latency,
        "speedup_solo": latency["allreduce"] / latency["solo"],
        "speedup_majority": latency["allreduce"] / latency["majority"],
        "speedup_quorum": latency["allreduce"] / latency["quorum"],
        "nap_solo": nap["solo"],
        "nap_majority": nap["majority"],
        "nap_quorum": nap["quorum"],
        "quorum_k": raw["P"] // 2,
        "rounds_per_iteration": {mode: raw["rounds"][mode] / (raw["iterations"] + WARMUP) for mode in MODES[1:]},
    }


def render(result: dict[str, Any]) -> str:
    rows = []
    for run_ in result["runs"]:
        for mode in MODES:
            rows.append({
                "P": run_["P"],
                "mode": mode if mode != "quorum" else f"quorum k={run_['quorum_k']}",
                "latency ms": run_["latency_ms"][mode],
                "speedup": run_["latency_ms"]["allreduce"] / run_["latency_ms"][mode],
                "NAP": run_["P"] if mode == "allreduce" else run_[f"nap_{mode}"],
            })
    title = f"partial allreduce, rank r delayed r x {result['skew_ms']:g} ms, {result['iterations']} calls per mode"
    paper = result["paper"]
    return "\n".join([
        format_table(rows, title=title),
        ("latency: one call, mean over ranks and calls; speedup: all_reduce's latency / this mode's; NAP: number of "
         "active processes, the ranks whose fresh data a round holds (mean over rounds; all_reduce: every rank)"),
        f"paper (P={paper['P']}, 1 ms skew): solo {paper['speedup_solo']}x, majority {paper['speedup_majority']}x",
    ])


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.collectives")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skew-ms", type=float, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    progress = EventWriter(enabled=rank == 0)
    latency: dict[str, list[float]] = {}
    contributors: dict[str, list[int]] = {}
    rounds: dict[str, int] = {}
    for mode in MODES:
        partial = None
        if mode != "allreduce":
            quorum = world_size // 2 if mode == "quorum" else None
            partial = PartialAllreduce(1, mode=mode, quorum=quorum, seed=args.seed)
        latency[mode], contributors[mode] = [], []
        for iteration in range(WARMUP + args.iterations):
            dist.barrier()
            time.sleep(rank * args.skew_ms / 1000.0)
            data = torch.ones(1)
            started = time.perf_counter()
            if partial is None:
                dist.all_reduce(data)
            else:
                result = partial.allreduce(data)
            seconds = time.perf_counter() - started
            if iteration >= WARMUP:
                latency[mode].append(seconds)
                if partial is not None:
                    contributors[mode].append(result.contributors)
            progress.update()
        if partial is not None:
            rounds[mode] = partial.close()[-1].round  # the flushing round's index: rounds run before it
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, latency)
    if rank == 0:
        record = {
            "P": world_size,
            "skew_ms": args.skew_ms,
            "iterations": args.iterations,
            "latency_s": {mode: [per_rank[mode] for per_rank in gathered] for mode in MODES},
            "contributors": contributors,  # rank 0 arrives first, so its round is the iteration's round
            "rounds": rounds,
        }
        args.out.write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
