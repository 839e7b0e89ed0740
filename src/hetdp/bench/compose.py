"""Allocation x synchronization, composed: both kinds of heterogeneity at once, and the pairing that answers both.

Four emulated devices of unequal speed (``--speeds``, default 1,1,2,4) train the
digits ConvNet through the drop-in (``hetdp.DDP``), and at every step one random
rank is delayed ``--straggler-ms`` (default 200 ms, the same draw on every rank):
a permanent imbalance, which allocation answers, and a transient one, which a
partial allreduce answers. One launch runs each pairing from the same initial
model: equal + allreduce (plain DDP), adaptive + allreduce, equal + majority,
adaptive + majority and adaptive + quorum.

Figures: the time to accuracy, the training time until rank 0's model first
reaches the final accuracy of the synchronous run (equal + allreduce) less one
point, and the steps it took; samples per second, which flatters the stale
modes; and the final accuracies. The two synchronous pairings train with exact
gradients from one model on the same global batches, so whatever their shares
they end with the same parameters, to float rounding: each repeat reports how
far apart they end (``exact_pairs``: ``parameter_gap``) beside how far training
moved them (``parameter_moved``). ``speedup_vs_best_single_axis`` is how much
sooner adaptive + majority gets there than the better of adaptive + allreduce
and equal + majority: its pace up to the target (steps per second) over that
pairing's, divided by the ratio of their steps, since stale gradients buy pace
with steps. Snapshots of the model are taken every few steps and evaluated after
training, so evaluation costs no training time. Every pairing trains with the
same recipe, a user's loop as any: inputs standardized with the training set's
mean and deviation, SGD with momentum 0.9 (``--momentum``) from a learning rate of
0.05 decayed to 0 over the run (cosine).

One run's curve is noisy near its plateau: from one initial model to another, the
final accuracy of the same recipe varies by about a point, the very margin the
target is read at. So every pairing runs ``--repeats`` times (3), each repeat
from its own initial model, data order and straggler draws, the same for every
pairing, and the figures are read off the mean of their curves, as the eager-SGD
paper averages four runs (section 7.3); each repeat's own figures are reported
too. The repeats run at once, each on its own group of ranks in one launch: the
emulated devices spend their steps asleep, so three groups share two cores
without slowing each other, and ``--quick`` keeps within its two minutes.

From seed to seed (a seed draws the test split as well as the initial models)
the figures move more than from repeat to repeat, so one seed cannot be held to
a one-point margin either. ``--seeds 0,1,2,3,4`` trains every seed at once, each
on groups of its own (one repeat per seed unless ``--repeats`` says more), reads
the figures the targets are about off the mean curves over all the seeds, as the
repeats of one seed are read, and reports each seed's own figures and their
spread beside them (``summarize_seeds`` says why).

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hetdp.allocate.policy import Adaptive, allocation_policy
from hetdp.bench.datasets import Split, load_digits
from hetdp.bench.models import ConvNet, accuracy
from hetdp.bench.workers import launch_workers
from hetdp.cluster.emulate import Emulation, parse_speeds
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError
from hetdp.flags import positive_int
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed
from hetdp.sync.policy import Partial, sync_policy

DEFAULT_SPEEDS = "1,1,2,4"
PAIRINGS = (("equal", "allreduce"), ("adaptive", "allreduce"), ("equal", "majority"), ("adaptive", "majority"),
            ("adaptive", "quorum"))
"""(allocation, synchronization), the synchronous baseline first."""
LR = 0.05
"""Every pairing's recipe: SGD with momentum (``MOMENTUM``) from this learning rate, cosine-decayed to 0 over the
run."""
MOMENTUM = 0.9
"""The recipe's momentum. A gradient that arrives a round late adds momentum of its own (asynchrony acts as
momentum: Mitliagkas et al., 2016), on top of this: the stale pairings' steps to the target depend on it."""
SNAPSHOT_EVERY = 2
"""Steps between snapshots of rank 0's model."""
SMOOTHING = 5
"""Accuracy is the mean over this many consecutive snapshots (the test set's 360 images make one noisy), both
for the final accuracy and for the curve the time to accuracy is read off."""
WAIT_S = 1800.0
"""How long a group that finished waits for the others at the end."""
Curve = tuple[list[float], list[float], list[int]]
"""A run's snapshots, or their mean over repeats: training seconds, accuracies, and steps trained at each."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speeds", default=DEFAULT_SPEEDS, help=f"relative speed per rank (default {DEFAULT_SPEEDS})")
    parser.add_argument("--straggler-ms", type=float,
                        help="delay of the one random rank per step, in ms (default 200; --quick 100)")
    parser.add_argument("--epochs", type=positive_int, help="epochs per pairing (default 8; --quick 4)")
    parser.add_argument("--global-batch", type=positive_int, default=64, help="samples per step (default 64)")
    parser.add_argument("--sample-cost-ms", type=float,
                        help="emulated ms per sample at speed 1 (default 16: an equal share costs the slowest rank "
                        "256 ms, about the straggler's delay, so both kinds weigh alike; --quick 8)")
    parser.add_argument("--sync-every", type=int, default=0,
                        help="partial pairings: steps between meetings (parameter averaging; default 0: at each "
                        "epoch's end)")
    parser.add_argument("--quorum", type=positive_int, help="k of the quorum pairing (default: half the ranks)")
    parser.add_argument("--lr", type=float, default=LR, help=f"peak learning rate of every pairing (default {LR:g})")
    parser.add_argument("--momentum", type=float, default=MOMENTUM,
                        help=f"SGD momentum of every pairing (default {MOMENTUM:g}; plain SGD, 0, takes about "
                        "1 / (1 - momentum) times the learning rate to match it: --momentum 0 --lr 0.5)")
    parser.add_argument("--repeats", type=positive_int,
                        help="runs of every pairing, at once on groups of ranks of their own, the figures read off "
                        "their mean curves (default 3; with --seeds, 1 per seed)")
    parser.add_argument("--seeds", type=_seed_list, metavar="S1,S2,...",
                        help="seeds to run at once, each on groups of ranks of its own, in place of --seed: each "
                        "seed's figures, and their mean and spread over the seeds")


def _seed_list(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(seed) for seed in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must differ, got {text!r}")
    return seeds


def run(args: argparse.Namespace) -> dict[str, Any]:
    speeds = parse_speeds(args.speeds)
    nproc = len(speeds)
    if nproc < 2:
        raise ConfigError("--speeds needs at least 2 ranks")
    quorum = args.quorum or max(nproc // 2, 1)
    if quorum > nproc:
        raise ConfigError(f"--quorum {quorum} exceeds the {nproc} ranks")
    # --quick runs the same experiment at half the time scale, so that enough epochs fit in two minutes.
    straggler_ms = args.straggler_ms if args.straggler_ms is not None else (100.0 if args.quick else 200.0)
    sample_cost_ms = args.sample_cost_ms if args.sample_cost_ms is not None else (8.0 if args.quick else 16.0)
    if not (straggler_ms >= 0 and sample_cost_ms > 0):
        raise ConfigError(f"--straggler-ms must be >= 0 and --sample-cost-ms > 0, got {straggler_ms}, "
                          f"{sample_cost_ms}")
    if not args.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.sync_every < 0:
        raise ConfigError(f"--sync-every must be >= 0 steps, got {args.sync_every}")
    if args.global_batch < nproc:
        raise ConfigError(f"--global-batch {args.global_batch} is smaller than the {nproc} ranks")
    seeds = args.seeds
    if seeds and args.seed != 0:
        raise ConfigError(f"give either --seed or --seeds, got --seed {args.seed} and --seeds {_listed(seeds, '')}")
    seeds = seeds or (args.seed,)
    epochs = args.epochs or (4 if args.quick else 8)
    repeats = args.repeats or (3 if len(seeds) == 1 else 1)
    steps = -(-len(load_digits(seed=seeds[0]).train) // args.global_batch)
    worker_args = ["--speeds", ",".join(map(str, speeds)), "--straggler-ms", straggler_ms, "--epochs", epochs,
                   "--global-batch", args.global_batch, "--sample-cost-ms", sample_cost_ms,
                   "--sync-every", args.sync_every, "--quorum", quorum, "--lr", args.lr, "--momentum", args.momentum,
                   "--repeats", repeats, "--seeds", ",".join(map(str, seeds))]
    raw = launch_workers("hetdp.bench.compose", nproc * repeats * len(seeds), worker_args,
                         total=len(PAIRINGS) * epochs * steps, description="steps", unit="step")
    if len(seeds) == 1:
        return summarize(raw, speeds, quorum)
    return summarize_seeds(raw, seeds, speeds, quorum)


def _name(allocation: str, sync: str, quorum: int) -> str:
    return f"{allocation}+{f'quorum:{quorum}' if sync == 'quorum' else sync}"


def summarize(raw: dict[str, Any], speeds: tuple[float, ...], quorum: int) -> dict[str, Any]:
    """Time to accuracy of every pairing against the synchronous baseline's final accuracy, read off the mean
    curves of the repeats; each repeat's own speedup and accuracy drop beside them."""
    runs = {_name(a, s, quorum): raw["runs"][f"{a}+{s}"] for a, s in PAIRINGS}
    count = len(next(iter(runs.values())))
    exact = raw["exact_pairs"]
    mean = _figures({name: _mean_curve(repeats) for name, repeats in runs.items()})
    by_run = [_figures({name: (repeats[i]["time_s"], repeats[i]["accuracy"], repeats[i]["steps"])
                        for name, repeats in runs.items()}) for i in range(count)]
    return {
        "speeds": list(speeds),
        "pairings": list(runs),
        "repeats": count,
        **mean,
        "samples_per_s": {name: statistics.fmean(run_["samples_per_s"] for run_ in repeats)
                          for name, repeats in runs.items()},
        "train_s": {name: statistics.fmean(run_["time_s"][-1] for run_ in repeats) for name, repeats in runs.items()},
        "final_shares": {name: repeats[-1]["shares"] for name, repeats in runs.items()},
        "per_repeat": {key: [figures[key] for figures in by_run]
                       for key in ("speedup_vs_best_single_axis", "accuracy_drop_points")},
        "exact_pairs": exact,
        "parameter_gap": max(pair["parameter_gap"] for pair in exact),
        "parameter_moved": min(pair["parameter_moved"] for pair in exact),
        "targets": {"speedup_vs_best_single_axis": 1.2, "accuracy_drop_points": 1.0},
        "settings": raw["settings"],
        "runs": runs,
    }


def summarize_seeds(raw: dict[str, Any], seeds: Sequence[int], speeds: tuple[float, ...], quorum: int
                    ) -> dict[str, Any]:
    """The figures over the seeds, read off the mean of every seed's curves, and each seed's own beside them.

    One seed's target is its synchronous run's final accuracy less one point, on its own test split of 360
    images (one image is 0.28 points), and from run to run a final accuracy moves by about as much as that
    margin, so the drop of one seed's adaptive + majority scatters by a point or more. A seed whose adaptive +
    majority ends a little more than a point low never reaches its target and has no speedup at all, so asking
    every seed to reach its own turns the verdict into a draw: with a true drop of half a point and a scatter of
    a point, about one seed in three misses, and all five reach theirs in about one launch in six. The figures
    the targets are about are therefore read as the repeats of one seed are (``summarize``): off the mean curves
    over every seed's runs, each seed weighing alike, where one run's noise counts a fifth.
    ``mean_speedup_vs_best_single_axis`` is the time the better single axis's mean curve takes to reach the mean
    target (the synchronous mean curve's final accuracy less one point) over adaptive + majority's;
    ``mean_accuracy_drop_points`` is the mean of the seeds' drops (the mean curves' drop). ``per_seed`` holds
    each seed's figures read off its own repeats, ``speedup_spread`` their spread over the seeds that reach their
    target, and ``seeds_without_speedup`` the others; ``meets_targets`` holds when the two figures meet theirs.
    """
    repeats = len(next(iter(raw["runs"].values()))) // len(seeds)
    per_seed = []
    for index, seed in enumerate(seeds):
        own = {name: runs[index * repeats : (index + 1) * repeats] for name, runs in raw["runs"].items()}
        figures = summarize({"settings": raw["settings"], "runs": own,
                             "exact_pairs": raw["exact_pairs"][index * repeats : (index + 1) * repeats]},
                            speeds, quorum)
        per_seed.append({"seed": seed, **{key: figures[key] for key in SEED_FIGURES}})
    pooled = summarize(raw, speeds, quorum)
    speedup, drop = pooled["speedup_vs_best_single_axis"], pooled["accuracy_drop_points"]
    speedups = [figures["speedup_vs_best_single_axis"] for figures in per_seed]
    targets = {"mean_speedup_vs_best_single_axis": 1.15, "mean_accuracy_drop_points": 1.0}
    return {
        "speeds": list(speeds),
        "pairings": pooled["pairings"],
        "seeds": list(seeds),
        "repeats": repeats,
        "mean_speedup_vs_best_single_axis": speedup,
        "mean_accuracy_drop_points": drop,
        **{key: pooled[key] for key in ("best_single_axis", "target_accuracy", "time_to_accuracy_s",
                                         "steps_to_accuracy", "final_accuracy", "exact_pairs", "parameter_gap",
                                         "parameter_moved")},
        "speedup_spread": _spread([value for value in speedups if value is not None]),
        "seeds_without_speedup": [figures["seed"] for figures in per_seed if figures["speedup_vs_best_single_axis"]
                                  is None],
        "accuracy_drop_spread": _spread([figures["accuracy_drop_points"] for figures in per_seed]),
        "meets_targets": (speedup is not None and speedup >= targets["mean_speedup_vs_best_single_axis"]
                          and drop <= targets["mean_accuracy_drop_points"]),
        "targets": targets,
        "per_seed": per_seed,
        "settings": raw["settings"],
    }


SEED_FIGURES = ("speedup_vs_best_single_axis", "accuracy_drop_points", "best_single_axis", "target_accuracy",
                "time_to_accuracy_s", "steps_to_accuracy", "final_accuracy", "samples_per_s", "per_repeat",
                "parameter_gap")
"""The figures of each seed that ``--seeds`` reports."""


def _spread(values: Sequence[float]) -> dict[str, float | None]:
    """Smallest, largest and sample standard deviation (None below two values) of ``values``."""
    return {"min": min(values, default=None), "max": max(values, default=None),
            "stdev": statistics.stdev(values) if len(values) > 1 else None}


def _mean_curve(repeats: list[dict[str, Any]]) -> Curve:
    """Snapshot times and accuracies averaged over the repeats, and the steps, at which they all snapshot alike."""
    return ([statistics.fmean(times) for times in zip(*(run_["time_s"] for run_ in repeats))],
            [statistics.fmean(accuracies) for accuracies in zip(*(run_["accuracy"] for run_ in repeats))],
            repeats[0]["steps"])


def _figures(curves: dict[str, Curve]) -> dict[str, Any]:
    """Target, time and steps to accuracy, final accuracy and the two headline figures of one set of curves, the
    synchronous baseline first and the pairings in ``PAIRINGS`` order."""
    names = list(curves)
    smoothed = {name: [statistics.fmean(accuracy[max(i + 1 - SMOOTHING, 0) : i + 1]) for i in range(len(accuracy))]
                for name, (_, accuracy, _) in curves.items()}
    final = {name: curve[-1] for name, curve in smoothed.items()}
    target = final[names[0]] - 0.01
    reached = {name: next((i for i, acc in enumerate(curve) if acc >= target), None)
               for name, curve in smoothed.items()}
    tta = {name: None if i is None else curves[name][0][i] for name, i in reached.items()}
    steps = {name: None if i is None else curves[name][2][i] for name, i in reached.items()}
    both = names[3]
    best_single = min((name for name in (names[1], names[2]) if tta[name] is not None), key=tta.get, default=None)
    speedup = tta[best_single] / tta[both] if best_single is not None and tta[both] is not None else None
    return {"target_accuracy": target, "time_to_accuracy_s": tta, "steps_to_accuracy": steps, "final_accuracy": final,
            "best_single_axis": best_single, "speedup_vs_best_single_axis": speedup,
            "accuracy_drop_points": 100 * (final[names[0]] - final[both])}


def render(result: dict[str, Any]) -> str:
    if "per_seed" in result:
        return _render_seeds(result)
    tta = result["time_to_accuracy_s"]
    base = tta[result["pairings"][0]]
    rows = [{
        "pairing": name,
        "time to accuracy s": "never" if tta[name] is None else tta[name],
        "steps": "" if tta[name] is None else result["steps_to_accuracy"][name],
        "speedup": "" if tta[name] is None or base is None else base / tta[name],
        "samples/s": result["samples_per_s"][name],
        "train s": result["train_s"][name],
        "final accuracy": result["final_accuracy"][name],
        "final shares": result["final_shares"][name],
    } for name in result["pairings"]]
    s = result["settings"]
    repeats = result["repeats"]
    title = (f"digits ConvNet on speeds {result['speeds']}, one random rank delayed {s['straggler_ms']:g} ms per "
             f"step, global batch {s['global_batch']}, {s['epochs']} epochs per pairing, SGD from learning rate "
             f"{s['lr']:g} with momentum {s['momentum']:g}" + (f", mean of {repeats} runs" if repeats > 1 else ""))
    lines = [format_table(rows, title=title)]
    speedup = result["speedup_vs_best_single_axis"]
    lines.append(
        f"time to accuracy: training seconds until rank 0's model reaches {result['target_accuracy']:.3f} (the "
        f"synchronous run's final accuracy less one point); speedup over equal+allreduce; samples/s counts stale "
        f"gradients too; accuracy: of rank 0's model, the mean of {SMOOTHING} snapshots {SNAPSHOT_EVERY} steps apart"
        + (", averaged over the runs." if repeats > 1 else ".")
    )
    lines.append(
        f"adaptive+majority reaches it {'-' if speedup is None else f'{speedup:.2f}x'} sooner than the better single "
        f"axis (target 1.2x), {result['accuracy_drop_points']:+.1f} points from synchronous (target within 1)"
        + (f"; run by run: {_listed(result['per_repeat']['speedup_vs_best_single_axis'], 'x')} and "
           f"{_listed(result['per_repeat']['accuracy_drop_points'], ' points')}" if repeats > 1 else "")
    )
    anatomy = _anatomy(result)
    if anatomy:
        lines.append(anatomy)
    lines.append(_exactness(result))
    return "\n".join(lines)


def _render_seeds(result: dict[str, Any]) -> str:
    """One row per seed, then the means and spreads against the targets."""
    both = result["pairings"][3]
    rows = []
    for figures in result["per_seed"]:
        tta, best = figures["time_to_accuracy_s"], figures["best_single_axis"]
        speedup = figures["speedup_vs_best_single_axis"]
        rows.append({
            "seed": figures["seed"],
            "target accuracy": figures["target_accuracy"],
            f"{both} s": "never" if tta[both] is None else tta[both],
            "better single axis": best or "neither",
            "its s": "" if best is None else tta[best],
            "speedup": "never" if speedup is None else speedup,
            "accuracy drop points": figures["accuracy_drop_points"],
            f"{both} samples/s": figures["samples_per_s"][both],
        })
    s = result["settings"]
    title = (f"digits ConvNet on speeds {result['speeds']}, one random rank delayed {s['straggler_ms']:g} ms per "
             f"step, global batch {s['global_batch']}, {s['epochs']} epochs per pairing, SGD from learning rate "
             f"{s['lr']:g} with momentum {s['momentum']:g}; seeds {_listed(result['seeds'], '')}, "
             f"{result['repeats']} run{'s' if result['repeats'] > 1 else ''} each, all at once")
    speedup, spread = result["mean_speedup_vs_best_single_axis"], result["speedup_spread"]
    drop, drop_spread = result["mean_accuracy_drop_points"], result["accuracy_drop_spread"]
    without, best = result["seeds_without_speedup"], result["best_single_axis"]
    targets = result["targets"]
    lines = [format_table(rows, title=title)]
    lines.append(
        "time in training seconds until rank 0's model reaches the seed's target accuracy (its synchronous run's "
        "final accuracy less one point); speedup: the better single axis's time over adaptive+majority's")
    lines.append(
        f"over the seeds' mean curves, adaptive+majority reaches {result['target_accuracy']:.3f} (synchronous less "
        f"one point) {'-' if speedup is None else f'{speedup:.2f}x'} sooner than {best or 'either single axis'} "
        f"(target {targets['mean_speedup_vs_best_single_axis']:g}x; seed by seed {_range(spread, 'x')}"
        + (f", never on seed{'s' if len(without) > 1 else ''} {_listed(without, '')}" if without else "")
        + f"), mean accuracy drop {drop:+.2f} points (target within {targets['mean_accuracy_drop_points']:g}; "
        f"{_range(drop_spread, ' points')}): targets {'met' if result['meets_targets'] else 'not met'}")
    lines.append(_exactness(result))
    return "\n".join(lines)


def _range(spread: dict[str, float | None], unit: str) -> str:
    if spread["min"] is None:
        return "no seed"
    deviation = "" if spread["stdev"] is None else f", standard deviation {spread['stdev']:.2f}"
    return f"{spread['min']:.2f} to {spread['max']:.2f}{unit}{deviation}"


def _anatomy(result: dict[str, Any]) -> str:
    """The speedup over the better single axis, taken apart: pace up to the target over steps to it."""
    tta, steps = result["time_to_accuracy_s"], result["steps_to_accuracy"]
    both, best = result["pairings"][3], result["best_single_axis"]
    if tta[both] is None or best is None:
        return ""
    pace = (steps[both] / tta[both]) / (steps[best] / tta[best])
    return (f"{both} takes {pace:.2f}x the steps per second of {best} up to the target and needs "
            f"{steps[both] / steps[best]:.2f}x its steps: stale gradients buy pace with steps")


def _exactness(result: dict[str, Any]) -> str:
    """How far apart the two synchronous pairings end, against how far training moved them."""
    equal, adaptive = result["pairings"][:2]
    return (f"{equal} and {adaptive} (exact gradients, their own shares) end at most {result['parameter_gap']:.1e} "
            f"apart in any parameter, which training moved by at least {result['parameter_moved']:.2f}")


def _listed(values: Sequence[float | None], unit: str) -> str:
    return ", ".join("-" if value is None else f"{value}{unit}" if isinstance(value, int) else f"{value:.2f}{unit}"
                     for value in values)


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.compose")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--speeds", required=True)
    parser.add_argument("--straggler-ms", type=float, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--sample-cost-ms", type=float, required=True)
    parser.add_argument("--sync-every", type=int, required=True)
    parser.add_argument("--quorum", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--momentum", type=float, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--seeds", type=_seed_list, required=True)
    args = parser.parse_args(argv)

    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    speeds = parse_speeds(args.speeds)
    nproc = len(speeds)
    # Group g trains on ranks g * nproc ... (g + 1) * nproc - 1; the groups wait for each other only at the end.
    everyone = dist.new_group(timeout=datetime.timedelta(seconds=WAIT_S))
    groups = [dist.new_group(list(range(first, first + nproc))) for first in range(0, world_size, nproc)]
    group = rank // nproc
    of_seed, seed = group_seeds(group, args.seeds, args.repeats)
    progress = EventWriter(enabled=rank == 0)
    split = _standardized(load_digits(seed=of_seed))  # one split for every run of a seed: its repeats vary the rest
    emulation = Emulation(speeds=speeds, sample_cost_ms=args.sample_cost_ms, seed=seed,  # the repeat's own draws
                          straggler_count=1 if args.straggler_ms else 0, straggler_delay_ms=args.straggler_ms)
    runs, finals = {}, {}
    for allocation, sync in PAIRINGS:
        name = f"{allocation}+{sync}"
        runs[name], finals[name] = _train(args, split, allocation, sync, emulation, groups[group], progress, seed)
    # The synchronous pairings (the first two) train from one model on the same global batches with exact gradients.
    first, second = (finals[f"{allocation}+{sync}"] for allocation, sync in PAIRINGS[:2])
    exact = {"parameter_gap": _largest_difference(first, second),
             "parameter_moved": _largest_difference(first, _copy(_initial_model(seed)))}
    gathered: list[dict[str, Any] | None] = [None] * world_size
    mine = {"runs": runs, "exact": exact} if rank % nproc == 0 else None
    dist.gather_object(mine, gathered if rank == 0 else None, group=everyone)
    if rank == 0:
        settings = {key: value for key, value in vars(args).items() if key != "out"}
        repeats = [repeat for repeat in gathered if repeat is not None]
        args.out.write_text(json.dumps({"settings": settings,
                                        "runs": {name: [repeat["runs"][name] for repeat in repeats] for name in runs},
                                        "exact_pairs": [repeat["exact"] for repeat in repeats]}))
    dist.destroy_process_group()


def group_seeds(group: int, seeds: Sequence[int], repeats: int) -> tuple[int, int]:
    """The seed group ``group`` runs a repeat of, and the seed of that repeat's initial model, data order and
    straggler draws: the groups run each seed's repeats in turn, and seeds S and S + 1 run disjoint repeats."""
    of_seed = seeds[group // repeats]
    return of_seed, of_seed * repeats + group % repeats


def _initial_model(seed: int) -> ConvNet:
    """The model every pairing of a repeat starts from."""
    torch.manual_seed(seed)
    return ConvNet()


def _largest_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two models' parameters."""
    return max((first[name] - tensor).abs().max().item() for name, tensor in second.items())


def _train(args: argparse.Namespace, split: Split, allocation: str, sync: str, emulation: Emulation,
           group: dist.ProcessGroup, progress: EventWriter, seed: int
           ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One pairing on ``group`` in a user's loop from ``seed``'s initial model and data order; the group's first
    rank keeps timed snapshots, evaluated once training is over. Returns the figures and the final parameters."""
    net = _initial_model(seed)
    spec = (Partial(mode="quorum", quorum=args.quorum, every=args.sync_every) if sync == "quorum" else
            Partial(mode=sync, every=args.sync_every) if sync != "allreduce" else sync_policy(sync))
    policy = allocation_policy(allocation)
    if isinstance(policy, Adaptive):  # the figure compares the two axes on every rank, as it was first measured
        policy = dataclasses.replace(policy, sit_out=False)
    model = DistributedDataParallel(net, policy, spec, emulation=emulation, process_group=group)
    sampler = DistributedSampler(split.train, num_replicas=model.world_size, rank=model.rank, seed=seed)
    loader = model.allocate(DataLoader(split.train, batch_size=args.global_batch // model.world_size, sampler=sampler))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    snapshots: list[tuple[float, int, dict[str, torch.Tensor]]] = []
    trained_s, steps = 0.0, 0
    dist.barrier(group=group)
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        started = time.perf_counter()
        for images, labels in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            schedule.step()
            steps += 1
            if steps % SNAPSHOT_EVERY == 0:
                now = time.perf_counter()
                snapshots.append((trained_s + now - started, steps, _copy(net)))
                started += time.perf_counter() - now  # the copy is not training time
            progress.update()
        trained_s += time.perf_counter() - started  # the epoch's end, a meeting in partial pairings, included
        snapshots.append((trained_s, steps, _copy(net)))
    shares, evaluates = model.shares, model.rank == 0  # every rank copies alike, to be timed alike
    model.close()
    times, accuracies, trained_steps = [], [], []
    for seconds, step, state in snapshots if evaluates else ():
        net.load_state_dict(state)
        times.append(seconds)
        trained_steps.append(step)
        accuracies.append(accuracy(net, split.test))
    return ({"time_s": times, "accuracy": accuracies, "steps": trained_steps, "shares": shares,
             "samples_per_s": steps * args.global_batch / trained_s}, snapshots[-1][2])


def _standardized(split: Split) -> Split:
    """Inputs shifted and scaled by the training set's mean and deviation, as a user's normalizing transform does: on
    raw pixels the recipe trains so close to its stability limit that one run's final accuracy varies by points."""
    images = split.train.tensors[0]
    mean, std = images.mean(), images.std()
    return Split(TensorDataset((images - mean) / std, split.train.tensors[1]),
                 TensorDataset((split.test.tensors[0] - mean) / std, split.test.tensors[1]), split.num_classes)


def _copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


if __name__ == "__main__":
    _worker(sys.argv[1:])
