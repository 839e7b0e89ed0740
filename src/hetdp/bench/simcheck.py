"""The simulator against real runs: emulated ranks of the drop-in, and ``sim/engine.py`` on the same settings.

For 4, 8 and 16 local ranks (``--nproc``; one launch of the largest count, the
first n ranks in a group of their own), a tiny model trains through the drop-in
(``hetdp.DDP``) under each setting: unequal speeds (the pattern
``--speeds`` repeated over the ranks), one random straggler per step, a device
curve (a fixed cost per step and a knee on half of the ranks), each with the
pairings that answer it: equal, static and adaptive allocation, allreduce,
solo, majority and local averaging every K steps. Compute is emulated (sleeps
to ``samples x --sample-cost-ms / speed``), so 16 ranks on 2 cores measure the
schedule rather than the cores' contention.

The simulator predicts, it is not fitted per row. What it takes from this
machine is measured once per rank count, before the rows, on equal speeds and no
straggler: the loop's own cost per step (the drop-in with local averaging, no
communication), and on top of it a synchronous allreduce, a partial round
(``full`` partial allreduce) and the gather of step figures an adaptive
allocation re-plans from (metrics gathered every step). Every row's compute times come from
the row's emulation settings, as the ranks pace themselves. Figures per row:
measured and predicted samples per second and their ratio; ``max_abs_error``
is the largest |predicted / measured - 1| (target 0.10).

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hetdp.allocate.policy import AllocationPolicy, Static, allocation_policy
from hetdp.bench.workers import launch_workers
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation, parse_speeds
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError
from hetdp.figures.metrics import MetricsConfig
from hetdp.flags import positive_int
from hetdp.launch import EventWriter
from hetdp.report import StreamingTable, format_table, print_above_progress
from hetdp.runtime import init_distributed
from hetdp.sim.engine import LoopCosts, Strategy, simulate_strategy

DEFAULT_NPROC = "4,8,16"
DEFAULT_SPEEDS = "1,1,2,4"
PER_RANK_BATCH = 16
"""Samples per rank of an equal share: the global batch is this times the ranks."""
FEATURES = 8
TARGET = 0.10
"""The largest |predicted / measured - 1| the simulator may show on any row."""
WAIT_S = 1800.0
"""Seconds the ranks outside a run's group may wait for it, at a barrier."""
DEVICE_CURVE = DeviceModel(step_overhead_ms=20.0, knee=12)
"""The device of half of the ranks in the device-curve setting: a fixed cost per step, a throughput knee."""


@dataclass(frozen=True)
class Setting:
    """One row: a heterogeneity and a pairing."""

    name: str
    """What is unequal: speeds, straggler, speeds+straggler or device curve."""
    strategy: str
    """allocation+synchronization, as ``Strategy.parse`` reads it."""


SETTINGS = (
    Setting("speeds", "equal"),
    Setting("speeds", "static"),
    Setting("speeds", "adaptive"),
    Setting("straggler", "equal"),
    Setting("straggler", "equal+solo"),
    Setting("speeds+straggler", "adaptive+majority"),
    Setting("speeds", "adaptive+local:5"),
    Setting("device curve", "adaptive"),
)
QUICK_SETTINGS = tuple(SETTINGS[i] for i in (0, 2, 4, 5, 6, 7))
COLUMNS = {"ranks": "ranks", "setting": "setting", "strategy": "strategy", "measured/s": "measured_samples_per_s",
           "predicted/s": "predicted_samples_per_s", "error": "error"}
"""Table column -> JSON key of a row."""
CALIBRATION = {"loop": "local", "allreduce": "allreduce", "round": "full", "gather": "allreduce"}
"""Homogeneous runs (equal allocation) that measure this machine's costs: the loop alone (local averaging, once
at the end), with an allreduce per step, with a partial round per step (``full``: every rank arrives), with an
allreduce and a gather of the step's figures per step (metrics every step, as an adaptive allocation gathers)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", default=DEFAULT_NPROC, help=f"rank counts, comma-separated (default {DEFAULT_NPROC})")
    parser.add_argument("--speeds", default=DEFAULT_SPEEDS,
                        help=f"relative speeds, repeated over the ranks (default {DEFAULT_SPEEDS})")
    parser.add_argument("--steps", type=positive_int, help="steps per row (default 40; --quick 10)")
    parser.add_argument("--sample-cost-ms", type=float, default=8.0,
                        help="emulated ms per sample at speed 1 (default 8: an equal share of 16 costs the slowest "
                        "rank 128 ms, several times the loop and allreduce of 16 ranks on 2 cores)")
    parser.add_argument("--straggler-ms", type=float, default=150.0,
                        help="delay of the one random rank per step in the straggler settings, ms (default 150)")


def _counts(text: str) -> list[int]:
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise ConfigError(f"--nproc needs counts >= 2, got {text!r}")
    return counts


def emulation(setting: str, nproc: int, speeds: tuple[float, ...], sample_cost_ms: float, straggler_ms: float,
              seed: int) -> Emulation:
    """The emulated devices of ``setting`` on ``nproc`` ranks (also what the simulator prices)."""
    pattern = tuple(speeds[rank % len(speeds)] for rank in range(nproc))
    unequal = pattern if "speeds" in setting else None
    straggler = "straggler" in setting
    devices = (tuple(DEVICE_CURVE if rank % 2 else DeviceModel() for rank in range(nproc))
               if setting == "device curve" else None)
    return Emulation(speeds=unequal, sample_cost_ms=sample_cost_ms, straggler_count=1 if straggler else 0,
                     straggler_delay_ms=straggler_ms if straggler else 0.0, seed=seed, devices=devices)


def run(args: argparse.Namespace) -> dict[str, Any]:
    counts = _counts(args.nproc)
    speeds = parse_speeds(args.speeds)
    if not (args.sample_cost_ms > 0 and args.straggler_ms >= 0):
        raise ConfigError(f"--sample-cost-ms must be > 0 and --straggler-ms >= 0, got {args.sample_cost_ms}, "
                          f"{args.straggler_ms}")
    steps = args.steps or (10 if args.quick else 40)
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    table = StreamingTable(list(COLUMNS), widths={"setting": 16, "strategy": 17})
    rows: list[dict[str, Any]] = []
    calibrations: dict[int, dict[str, float]] = {}

    def on_row(event: dict[str, Any]) -> None:
        if "calibration" in event:
            calibrations[event["ranks"]] = event["calibration"]
            return
        row = predict(event, speeds, args, steps, calibrations[event["ranks"]])
        rows.append(row)
        print_above_progress(table.format(_display(row)))

    worker_args = ["--counts", ",".join(map(str, counts)), "--speeds", args.speeds, "--steps", steps,
                   "--sample-cost-ms", args.sample_cost_ms, "--straggler-ms", args.straggler_ms, "--seed", args.seed,
                   "--settings", json.dumps([[s.name, s.strategy] for s in settings])]
    launch_workers("hetdp.bench.simcheck", max(counts), worker_args,
                   total=len(counts) * (len(CALIBRATION) + len(settings)), description="runs", unit="run",
                   on_row=on_row)
    errors = [abs(row["error"]) for row in rows]
    return {"nproc": counts, "speeds": list(speeds), "steps": steps, "sample_cost_ms": args.sample_cost_ms,
            "straggler_ms": args.straggler_ms, "calibration": {str(n): c for n, c in calibrations.items()},
            "rows": rows, "max_abs_error": max(errors), "mean_abs_error": float(np.mean(errors)),
            "targets": {"max_abs_error": TARGET}}


def loop_costs(calibration: dict[str, float], emulated: Emulation, nproc: int) -> LoopCosts:
    """The simulator's costs for a row: the emulation's compute, this machine's measured loop and collectives."""
    def compute_s(step: int, shares: np.ndarray) -> np.ndarray:
        return np.array([emulated.straggler_delay_s(step, rank, nproc) + emulated.block_s(rank, share, step)
                         for rank, share in enumerate(shares)])

    # A meeting's parameter averaging is one collective of gloo's own, as the gather is (the drop-in's gradient
    # allreduce sends a small last bucket by recursive doubling instead): priced as the gather.
    return LoopCosts(compute_s=compute_s, loop_s=calibration["loop_s"], allreduce_s=calibration["allreduce_s"],
                     round_s=calibration["round_s"], average_s=calibration["gather_s"],
                     gather_s=calibration["gather_s"], static_weights=emulated.speeds_at(0))


def predict(measured: dict[str, Any], speeds: tuple[float, ...], args: argparse.Namespace, steps: int,
            calibration: dict[str, float]) -> dict[str, Any]:
    """The simulator's samples per second for a measured row, and the ratio."""
    nproc = measured["ranks"]
    emulated = emulation(measured["setting"], nproc, speeds, args.sample_cost_ms, args.straggler_ms, args.seed)
    result = simulate_strategy(Strategy.parse(measured["strategy"]), loop_costs(calibration, emulated, nproc),
                               world_size=nproc, global_batch=PER_RANK_BATCH * nproc, steps=steps)
    return {"ranks": nproc, "setting": measured["setting"], "strategy": measured["strategy"],
            "measured_samples_per_s": measured["samples_per_s"], "predicted_samples_per_s": result.samples_per_s,
            "error": result.samples_per_s / measured["samples_per_s"] - 1.0,
            "measured_shares": measured["shares"], "predicted_shares": result.final_shares}


def _display(row: dict[str, Any]) -> dict[str, Any]:
    return {column: row[key] for column, key in COLUMNS.items()}


def render(result: dict[str, Any]) -> str:
    title = (f"simulator vs emulated ranks of the drop-in: speeds {result['speeds']} repeated, {result['steps']} "
             f"steps per row, {result['sample_cost_ms']:g} ms per sample at speed 1, straggler "
             f"{result['straggler_ms']:g} ms")
    costs = "; ".join(f"{n} ranks: loop {1e3 * c['loop_s']:.1f} ms, allreduce {1e3 * c['allreduce_s']:.1f} ms, "
                      f"partial round {1e3 * c['round_s']:.1f} ms, gather {1e3 * c['gather_s']:.1f} ms"
                      for n, c in result["calibration"].items())
    return "\n".join([
        format_table([_display(row) for row in result["rows"]], title=title),
        f"measured on this machine once per rank count, equal speeds: {costs}",
        (f"error = predicted / measured - 1; max_abs_error {result['max_abs_error']:.3f} (target "
         f"{TARGET:.2f}), mean {result['mean_abs_error']:.3f}"),
    ])


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.simcheck")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--counts", required=True)
    parser.add_argument("--speeds", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--sample-cost-ms", type=float, required=True)
    parser.add_argument("--straggler-ms", type=float, required=True)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rank, _ = init_distributed()
    torch.set_num_threads(1)
    progress = EventWriter(enabled=rank == 0)
    # One launch for every rank count (starting 16 processes on 2 cores takes half a minute): the first n ranks
    # train in a group of their own while the others wait, blocked, at a barrier with room for the longest run.
    everyone = dist.new_group(timeout=datetime.timedelta(seconds=WAIT_S))
    rows = []
    for nproc in _counts(args.counts):
        group = dist.new_group(list(range(nproc)))
        if rank < nproc:
            rows += _rows(args, group, nproc, progress)
        dist.barrier(group=everyone)
    if rank == 0:
        args.out.write_text(json.dumps({"rows": rows}))
    dist.destroy_process_group()


def _rows(args: argparse.Namespace, group: dist.ProcessGroup, nproc: int, progress: EventWriter) -> list[dict]:
    """Calibrate on ``group``, then measure every setting on it."""
    speeds = parse_speeds(args.speeds)
    block_s = PER_RANK_BATCH * args.sample_cost_ms / 1000.0
    homogeneous = Emulation(sample_cost_ms=args.sample_cost_ms, seed=args.seed)
    seconds = {}
    with tempfile.TemporaryDirectory() as folder:
        for part, sync in CALIBRATION.items():
            metrics = MetricsConfig(csv=Path(folder) / "steps.csv", every=1) if part == "gather" else None
            measured = _measure(args, "equal", sync, homogeneous, group, metrics)
            seconds[part] = measured["seconds"] / args.steps - block_s
            progress.update()
    loop_s = max(seconds["loop"], 0.0)
    calibration = {"loop_s": loop_s, "allreduce_s": max(seconds["allreduce"] - loop_s, 0.0),
                   "round_s": max(seconds["round"] - loop_s, 0.0),
                   "gather_s": max(seconds["gather"] - seconds["allreduce"], 0.0)}
    progress.update(0, row={"ranks": nproc, "calibration": calibration})
    rows = []
    for setting, strategy in json.loads(args.settings):
        emulated = emulation(setting, nproc, speeds, args.sample_cost_ms, args.straggler_ms, args.seed)
        measured = _measure(args, *drop_in_pairing(Strategy.parse(strategy), emulated, nproc), emulated, group)
        row = {"ranks": nproc, "setting": setting, "strategy": strategy,
               "samples_per_s": measured["samples_per_s"], "shares": measured["shares"]}
        rows.append(row)
        progress.update(row=row)
    return rows


def drop_in_pairing(strategy: Strategy, emulated: Emulation, world_size: int) -> tuple[AllocationPolicy, str]:
    """The drop-in's allocation and synchronization for ``strategy``, as the simulator reads it: static weights
    are the emulated speeds, a quorum without K is half the ranks rounded up."""
    if strategy.allocation == "static" and emulated.speeds is not None:
        allocation: AllocationPolicy = Static(emulated.speeds)
    else:
        allocation = allocation_policy("equal" if strategy.allocation == "static" else strategy.allocation)
    k = strategy.k or ((world_size + 1) // 2 if strategy.sync == "quorum" else 0)
    return allocation, f"{strategy.sync}:{k}" if k else strategy.sync


def _measure(args: argparse.Namespace, allocation: str | AllocationPolicy, sync: str, emulated: Emulation,
             group: dist.ProcessGroup, metrics: MetricsConfig | None = None) -> dict[str, Any]:
    """Train ``args.steps`` steps of one pairing on ``group``, in a user's loop; the seconds from a barrier to the
    epoch's end."""
    global_batch = PER_RANK_BATCH * dist.get_world_size(group)
    generator = torch.Generator().manual_seed(args.seed)
    data = TensorDataset(torch.randn(args.steps * global_batch, FEATURES, generator=generator),
                         torch.randint(0, 4, (args.steps * global_batch,), generator=generator))
    torch.manual_seed(args.seed)
    net = nn.Linear(FEATURES, 4)
    with DistributedDataParallel(net, allocation, sync, emulation=emulated, process_group=group,
                                 metrics=metrics) as model:
        sampler = DistributedSampler(data, num_replicas=model.world_size, rank=model.rank)
        loader = model.allocate(DataLoader(data, batch_size=PER_RANK_BATCH, sampler=sampler))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        dist.barrier(group=group)
        started = time.perf_counter()
        for inputs, labels in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
        seconds = time.perf_counter() - started
        shares = model.shares
    return {"seconds": seconds, "samples_per_s": args.steps * global_batch / seconds, "shares": shares}


if __name__ == "__main__":
    _worker(sys.argv[1:])
