"""Allocation that follows drift: a device slows down (or speeds up) after the adaptive shares have settled.

One launch trains a small model three times with the drop-in (``hetdp.DDP``,
adaptive allocation, allreduce) in a user-style loop, on emulated devices:

1. at constant ``--speeds``: how many re-plans come after the shares first
   settle (none, if the noise guard holds);
2. with the ``--speed-change``s (default: during the second epoch the fastest
   rank drops to the slowest rank's speed): the step time, step by step;
3. a reference with static shares that are the best integer split for the
   speeds after the last change: the ideal step time on this machine.

Figures: ``steps_to_recover`` (steps from the change to the end of the first
5-step window whose mean step time is within 10% of the ideal),
``recovered_step_ratio`` (mean step time from then on over the ideal),
``replans_at_constant_speeds``.

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
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hetdp.allocate.apportion import apportion_min_max
from hetdp.allocate.policy import Adaptive, Static
from hetdp.bench.workers import launch_workers
from hetdp.cluster.emulate import Emulation, parse_speed_change, parse_speeds
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError
from hetdp.flags import positive_int
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed

DEFAULT_SPEEDS = "1,1,2,4"
WINDOW = 5
"""Steps averaged when judging whether the step time has recovered."""
WITHIN = 0.10
"""Recovered: the window's mean step time is within this fraction of the ideal."""
STEPS_TO_RECOVER = 16
"""The target: steps from the change to the first recovered window (14 measured at 50857b3)."""
FEATURES = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speeds", default=DEFAULT_SPEEDS, help=f"relative speed per rank (default {DEFAULT_SPEEDS})")
    parser.add_argument("--speed-change", action="append", default=[], metavar="STEP:V1,V2,...",
                        help="from global step STEP on, the ranks run at speeds V1,V2,... (repeatable; default: "
                        "the fastest rank drops to the slowest rank's speed halfway through the second epoch)")
    parser.add_argument("--epochs", type=positive_int, help="epochs per run (default 4; --quick 3)")
    parser.add_argument("--steps-per-epoch", type=positive_int, help="steps per epoch (default 40; --quick 30)")
    parser.add_argument("--global-batch", type=positive_int, default=128, help="samples per step (default 128)")
    parser.add_argument("--sample-cost-ms", type=float, default=4.0,
                        help="emulated ms per sample at speed 1 (default 4)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    speeds = parse_speeds(args.speeds)
    epochs = args.epochs or (3 if args.quick else 4)
    steps_per_epoch = args.steps_per_epoch or (30 if args.quick else 40)
    changes = sorted(parse_speed_change(text, len(speeds)) for text in args.speed_change)
    if not changes:
        fastest = max(range(len(speeds)), key=speeds.__getitem__)
        new = list(speeds)
        new[fastest] = min(speeds)
        changes = [(steps_per_epoch * 3 // 2, tuple(new))]
    last_step, last_speeds = changes[-1]
    if last_step >= epochs * steps_per_epoch - WINDOW:
        raise ConfigError(f"the last speed change, at step {last_step}, leaves fewer than {WINDOW} of the "
                          f"{epochs * steps_per_epoch} steps to recover in")
    if not args.sample_cost_ms > 0:
        raise ConfigError(f"--sample-cost-ms must be > 0, got {args.sample_cost_ms}")
    Emulation(speeds=speeds, sample_cost_ms=args.sample_cost_ms, speed_changes=tuple(changes))  # validates
    if args.global_batch < len(speeds):
        raise ConfigError(f"--global-batch {args.global_batch} is smaller than the {len(speeds)} ranks")
    worker_args = ["--speeds", ",".join(map(str, speeds)), "--changes",
                   ";".join(f"{step}:{','.join(map(str, v))}" for step, v in changes), "--epochs", epochs,
                   "--steps-per-epoch", steps_per_epoch, "--global-batch", args.global_batch,
                   "--sample-cost-ms", args.sample_cost_ms, "--seed", args.seed]
    raw = launch_workers("hetdp.bench.drift", len(speeds), worker_args, total=3 * epochs * steps_per_epoch,
                         description="steps", unit="step")
    return summarize(raw, speeds, changes, last_speeds)


def summarize(raw: dict[str, Any], speeds: tuple[float, ...], changes: list[tuple[int, tuple[float, ...]]],
              last_speeds: tuple[float, ...]) -> dict[str, Any]:
    """The recovery figures from the three runs' per-step times."""
    change = changes[-1][0]
    steps = raw["drift"]["step_s"]
    ideal_s = statistics.median(raw["reference"]["step_s"][WINDOW:])
    windows = [statistics.fmean(steps[k : k + WINDOW]) for k in range(change, len(steps) - WINDOW + 1)]
    recovered_at = next((change + i for i, mean_s in enumerate(windows) if mean_s <= (1 + WITHIN) * ideal_s), None)
    steps_to_recover = None if recovered_at is None else recovered_at + WINDOW - change
    after = steps[recovered_at:] if recovered_at is not None else steps[change:]
    before = steps[max(change - 2 * WINDOW, 0) : change]
    return {
        "speeds": list(speeds),
        "speed_changes": [[step, list(v)] for step, v in changes],
        "steps_to_recover": steps_to_recover,
        "recovered_step_ratio": statistics.fmean(after) / ideal_s,
        "replans_at_constant_speeds": raw["constant"]["replans_after_stable"],
        "stable_after_steps_at_constant_speeds": raw["constant"]["stable_at"],
        "ideal_step_ms": 1000 * ideal_s,
        "ideal_shares": raw["reference"]["shares"][-1],
        "step_ms_before_change": 1000 * statistics.fmean(before),
        "step_ms_after_change": 1000 * statistics.fmean(steps[change : change + WINDOW]),
        "final_shares": raw["drift"]["shares"][-1],
        "restarts": raw["drift"]["restarts"],
        "targets": {"steps_to_recover": STEPS_TO_RECOVER, "recovered_step_ratio": 1 + WITHIN, "replans_at_constant_speeds": 0},
        "settings": raw["settings"],
        "runs": raw,
    }


def render(result: dict[str, Any]) -> str:
    recovered = result["steps_to_recover"]
    rows = [{
        "speeds": ",".join(f"{v:g}" for v in result["speeds"]),
        "change": "; ".join(f"step {step}: {','.join(f'{x:g}' for x in v)}" for step, v in result["speed_changes"]),
        "ms/step before": result["step_ms_before_change"],
        "ms/step just after": result["step_ms_after_change"],
        "ideal ms/step after": result["ideal_step_ms"],
        "steps to recover": "never" if recovered is None else recovered,
        "after / ideal": result["recovered_step_ratio"],
        "final shares": result["final_shares"],
    }]
    lines = [format_table(rows, title="adaptive allocation when a device's speed changes mid-run")]
    lines.append(
        f"ms/step: step time on rank 0 (compute + allreduce + loop); ideal: static shares "
        f"{result['ideal_shares']}, the best integer split for the new speeds, measured in the same launch; "
        f"recovered: the first {WINDOW}-step window within {100 * WITHIN:.0f}% of it (target: within {STEPS_TO_RECOVER} steps)."
    )
    lines.append(
        f"at constant speeds the shares settled after {result['stable_after_steps_at_constant_speeds']} steps, "
        f"then re-planned {result['replans_at_constant_speeds']} times (target 0)"
    )
    return "\n".join(lines)


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.drift")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--speeds", required=True)
    parser.add_argument("--changes", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--steps-per-epoch", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--sample-cost-ms", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    speeds = parse_speeds(args.speeds, world_size)
    changes = tuple(parse_speed_change(text, world_size) for text in args.changes.split(";"))
    progress = EventWriter(enabled=rank == 0)
    emulation = Emulation(speeds=speeds, sample_cost_ms=args.sample_cost_ms, seed=args.seed)
    last_speeds = changes[-1][1]
    ideal = apportion_min_max(last_speeds, args.global_batch)
    runs = {
        "constant": _train(args, Adaptive(), emulation, progress),
        "drift": _train(args, Adaptive(), Emulation(speeds=speeds, sample_cost_ms=args.sample_cost_ms,
                                                      seed=args.seed, speed_changes=changes), progress),
        "reference": _train(args, Static(tuple(float(s) for s in ideal)),
                            Emulation(speeds=last_speeds, sample_cost_ms=args.sample_cost_ms, seed=args.seed),
                            progress),
    }
    if rank == 0:
        runs["settings"] = {key: value for key, value in vars(args).items() if key != "out"}
        args.out.write_text(json.dumps(runs))
    dist.destroy_process_group()


def _train(args: argparse.Namespace, allocation: Adaptive | Static, emulation: Emulation,
           progress: EventWriter) -> dict[str, Any]:
    """A user's loop on a regression task; rank 0 records each step's time and the shares."""
    generator = torch.Generator().manual_seed(args.seed)
    size = args.global_batch * args.steps_per_epoch
    inputs = torch.randn(size, FEATURES, generator=generator)
    data = TensorDataset(inputs, inputs @ torch.randn(FEATURES, 1, generator=generator))
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    model = DistributedDataParallel(net, allocation, "allreduce", emulation=emulation)
    world_size = model.world_size
    loader = model.allocate(DataLoader(data, batch_size=args.global_batch // world_size,
                                       sampler=DistributedSampler(data, seed=args.seed)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step_s, shares, stable_at, replans_after_stable = [], [], None, 0
    dist.barrier()
    last = time.perf_counter()
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for features, targets in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(features), targets).backward()
            optimizer.step()
            now = time.perf_counter()
            step_s.append(now - last)
            last = now
            allocator = model.allocator
            if stable_at is None and allocator.stable:
                stable_at, replans_at_stable = len(step_s), allocator.replans
            shares.append(model.shares)
            progress.update()
    if stable_at is not None:
        replans_after_stable = model.allocator.replans - replans_at_stable
    restarts = model.allocator.adaptive.restarts if model.allocator.adaptive is not None else 0
    model.close()
    return {"step_s": step_s, "shares": shares, "stable_at": stable_at, "replans_after_stable": replans_after_stable,
            "restarts": restarts}


if __name__ == "__main__":
    _worker(sys.argv[1:])
