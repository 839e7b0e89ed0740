"""Never slower than the best subset of the devices: ranks whose compute is worth less than their exchange sit out.

One launch of 4 local ranks runs two settings with the drop-in (``hetdp.DDP``,
adaptive allocation, allreduce) in a user's loop, each side's epochs timed whole
on one clock, the sides in turn (``bench.compare``):

* communication-heavy: speeds 100,1,1,1 and a 1.1M-parameter MLP, whose exchange
  costs more than the three slow ranks' samples save. The fastest rank also trains
  the same global batches alone (a plain loop, paced as its emulated device):
  ``vs_fastest_alone`` is that epoch time over the group's, beside its ideal, the
  fastest alone's over the best subset's (``best_subset_s``). The sample cost is
  a device model taken from the host (``calibrated_cost_ms``: twice the host's
  real compute of the fastest device's block), never from the ratio: pacing can
  only slow a rank down, so a fastest device whose block the host's real compute
  overran would run at the host's speed, sharing its cores with the ranks that
  sat out, which is a measure of the host and not of the emulated device.
  A third side measures the floor of keeping every rank current: the fastest
  alone again, then at each epoch's end the least any tool must do so that the
  loop may read the model on any rank, one gather of figures and one broadcast
  of the parameters (``floor_vs_fastest_alone``; ``efficiency_vs_floor``, the
  group's epoch against it).
* balanced: speeds 1,1,2,4 and the demo's ConvNet, where every rank pays; adaptive
  against equal allocation, beside the ideal ``bench allocation`` works out from
  the equal run's own compute and exchange: ``balanced_efficiency``.

Who sits out is decided from measured figures only; ``sat_out`` lists the ranks
out at each setting's end. Run as a module under torchrun it is the worker;
imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from hetdp.bench.compare import alternate, ideal, per_sample_s, plain_row, report_row, sat_out, steady_s
from hetdp.bench.datasets import Split, load_dataset
from hetdp.bench.models import ConvNet
from hetdp.bench.workers import launch_workers
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.probe import median_batch_s
from hetdp.collectives.flat import broadcast_in_place
from hetdp.ddp import model as hetdp_ddp
from hetdp.errors import ConfigError
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed

COMM_HEAVY_SPEEDS = (100.0, 1.0, 1.0, 1.0)
BALANCED_SPEEDS = (1.0, 1.0, 2.0, 4.0)
SAMPLE_COST_MS = 8.0
"""Emulated milliseconds per sample at speed 1 (the demo's)."""
GLOBAL_BATCH = 128
"""Samples per step over all ranks (the demo's)."""
HEADROOM = 2.0
"""The fastest device's emulated step over the host's real compute of it (``calibrated_cost_ms``)."""
HIDDEN = 1024
"""Width of the communication-heavy MLP's two hidden layers: 1.1M parameters, 4.4 MB exchanged per step."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int,
                        help="epochs per balanced run (default 8, quick 4); the communication-heavy runs, of epochs "
                             "a few times shorter, take twice as many")


def run(args: argparse.Namespace) -> dict[str, Any]:
    epochs = args.epochs or (4 if args.quick else 8)
    if epochs < 2:
        raise ConfigError(f"--epochs must be >= 2 to measure a steady state, got {epochs}")
    load_dataset("digits")
    raw = launch_workers("hetdp.bench.subset", len(COMM_HEAVY_SPEEDS), ["--epochs", epochs, "--seed", args.seed],
                         total=8 * epochs, description="epochs", unit="epoch")
    return summarize(raw)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from rank 0's per-epoch rows, each beside its ideal."""
    runs = raw["runs"]
    alone_s, group_s = steady_s(runs["fastest_alone"]), steady_s(runs["comm_heavy"])
    floor_s = steady_s(runs["alone_kept_current"])
    best_subset = best_subset_s(alone_s, runs["comm_heavy"])
    equal, adaptive = runs["balanced_equal"], runs["balanced_adaptive"]
    equal_s, adaptive_s = steady_s(equal), steady_s(adaptive)
    balanced_ideal = ideal(equal_s, baseline_samples=equal[-1]["samples"], per_sample=per_sample_s(equal))
    vs_alone = alone_s / group_s
    steady = [row for row in runs["comm_heavy"] if not row["warmup"]]
    end_work_s = statistics.median(row["epoch_s"] - row["report_epoch_s"] for row in steady)
    from_speeds = sum(BALANCED_SPEEDS) / (len(BALANCED_SPEEDS) * min(BALANCED_SPEEDS))
    return {
        "vs_fastest_alone": vs_alone,
        "ideal_vs_fastest_alone": alone_s / best_subset["epoch_s"],
        "efficiency_vs_best_subset": best_subset["epoch_s"] / group_s,
        "floor_vs_fastest_alone": alone_s / floor_s,
        "efficiency_vs_floor": floor_s / group_s,
        "balanced_speedup": equal_s / adaptive_s,
        "balanced_ideal_speedup": balanced_ideal.speedup,
        "balanced_efficiency": balanced_ideal.efficiency(adaptive_s),
        "settings": {
            "comm_heavy": {"speeds": list(COMM_HEAVY_SPEEDS), "parameters": raw["parameters"]["mlp"],
                           "fastest_alone_epoch_s": alone_s, "group_epoch_s": group_s, "vs_fastest_alone": vs_alone,
                           "kept_current_epoch_s": floor_s,
                           "best_subset": best_subset, "sat_out": sat_out(runs["comm_heavy"]),
                           "steps_per_epoch": statistics.median(row["steps"] for row in steady),
                           "end_work_s": end_work_s, "vs_fastest_alone_before_end_work": alone_s / (group_s - end_work_s),
                           "final_shares": runs["comm_heavy"][-1]["shares"]},
            "balanced": {"speeds": list(BALANCED_SPEEDS), "parameters": raw["parameters"]["convnet"],
                         "equal_epoch_s": equal_s, "adaptive_epoch_s": adaptive_s,
                         "ideal_epoch_s": balanced_ideal.epoch_s, "ideal_speedup": balanced_ideal.speedup,
                         "ideal_speedup_from_speeds": from_speeds,
                         "balanced_efficiency": balanced_ideal.efficiency(adaptive_s),
                         "sat_out": sat_out(adaptive), "final_shares": adaptive[-1]["shares"]},
        },
        "sample_cost_ms": SAMPLE_COST_MS,
        "comm_heavy_sample_cost_ms": raw["comm_heavy_sample_cost_ms"],
        "global_batch": GLOBAL_BATCH,
        "runs": runs,
    }


def best_subset_s(alone_s: float, group: list[dict[str, Any]]) -> dict[str, Any]:
    """The best subset's epoch, from the group run's own measurements: the fastest rank alone (``alone_s``, as
    measured), or every rank in, at shares proportional to the speeds each rank's compute per sample measured and
    the exchange measured in the steps everyone was in (the subsets between pay that exchange for less compute).

    Every rank in: the fastest alone's epoch, less the compute the others would take off it each step, plus the
    exchange each step would add; unknown where no step ran with everyone in."""
    per_sample = [sum(row["compute_s"][rank] for row in group) / max(sum(row["samples"][rank] for row in group), 1)
                  for rank in range(len(group[0]["shares"]))]
    exchanges = [row["all_in_exchange_s"] for row in group if row["all_in_exchange_s"] is not None]
    steps = statistics.median(row["steps"] for row in group)
    result: dict[str, Any] = {"subset": [0], "epoch_s": alone_s, "per_sample_ms": [1000 * s for s in per_sample],
                              "all_in_exchange_ms": 1000 * statistics.median(exchanges) if exchanges else None}
    if exchanges and all(per_sample):
        saved_s = sum(group[-1]["samples"]) * (per_sample[0] - 1.0 / sum(1.0 / s for s in per_sample))
        all_in_s = alone_s - saved_s + steps * statistics.median(exchanges)
        result["all_in_epoch_s"] = all_in_s
        if all_in_s < alone_s:
            result.update(subset=list(range(len(per_sample))), epoch_s=all_in_s)
    return result


def render(result: dict[str, Any]) -> str:
    heavy, balanced = result["settings"]["comm_heavy"], result["settings"]["balanced"]
    rows = [
        {"setting": "comm-heavy", "speeds": heavy["speeds"], "parameters": heavy["parameters"],
         "steady epoch s": heavy["group_epoch_s"], "baseline s": heavy["fastest_alone_epoch_s"],
         "figure": f"vs_fastest_alone {heavy['vs_fastest_alone']:.3f} (ideal {result['ideal_vs_fastest_alone']:.3f})",
         "sat out": heavy["sat_out"], "shares": heavy["final_shares"]},
        {"setting": "balanced", "speeds": balanced["speeds"], "parameters": balanced["parameters"],
         "steady epoch s": balanced["adaptive_epoch_s"], "baseline s": balanced["equal_epoch_s"],
         "figure": f"speedup {result['balanced_speedup']:.3f}x (ideal {balanced['ideal_speedup']:.3f}x)",
         "sat out": balanced["sat_out"], "shares": balanced["final_shares"]},
    ]
    title = (f"ranks that do not pay sit out (adaptive + allreduce, global batch {result['global_batch']}; ms per "
             f"sample at speed 1: comm-heavy {result['comm_heavy_sample_cost_ms']:.3g}, from the host's compute; "
             f"balanced {result['sample_cost_ms']:g}); the wall clock of whole epochs, runs in turn")
    subset = heavy["best_subset"]
    all_in = subset.get("all_in_epoch_s")
    legend = (
        "baseline s: comm-heavy, the fastest rank alone on the same global batches; balanced, equal shares.\n"
        f"vs_fastest_alone: its epoch over the group's (target >= 0.95); ideal: over the best subset's, ranks "
        f"{subset['subset']} (everyone in: "
        + ("unknown, no step ran with everyone in" if all_in is None else
           f"{all_in:.3f} s at {subset['all_in_exchange_ms']:.1f} ms of exchange a step")
        + f"): efficiency {result['efficiency_vs_best_subset']:.3f}; the group's end work (figures gathered, ranks "
        f"out brought current) {1000 * heavy['end_work_s']:.0f} ms an epoch of {heavy['steps_per_epoch']:g} steps, "
        f"without which {heavy['vs_fastest_alone_before_end_work']:.3f}\n"
        f"floor: the fastest alone, then each epoch one gather and one broadcast of its parameters to every rank, "
        f"{result['floor_vs_fastest_alone']:.3f} of the fastest alone; the group {result['efficiency_vs_floor']:.3f} "
        f"of the floor\n"
        f"balanced: ideal from the equal run's own compute and exchange; balanced_efficiency "
        f"{result['balanced_efficiency']:.3f} (target >= 0.95)")
    return "\n".join([format_table(rows, title=title), legend])


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 10))


def _convnet(seed: int, split: Split) -> nn.Module:
    torch.manual_seed(seed)
    channels, size, _ = split.image_shape
    return ConvNet(in_channels=channels, image_size=size, num_classes=split.num_classes)


class _Group:
    """The user's loop with the drop-in on every rank, an epoch at a time."""

    def __init__(self, name: str, module: nn.Module, allocation: str, speeds: tuple[float, ...], split: Split,
                 seed: int, sample_cost_ms: float = SAMPLE_COST_MS) -> None:
        emulation = Emulation(speeds=speeds, sample_cost_ms=sample_cost_ms, seed=seed)
        self.name = name
        self.model = hetdp_ddp.DistributedDataParallel(module, allocation, "allreduce", emulation=emulation)
        sampler = DistributedSampler(split.train, seed=seed)
        self.loader = self.model.allocate(DataLoader(split.train, batch_size=GLOBAL_BATCH // dist.get_world_size(),
                                                     sampler=sampler))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.epoch = 0

    def train_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self.model(inputs), targets).backward()
            self.optimizer.step()

    def describe(self) -> dict[str, Any]:
        """The epoch's report, and the exchange of its steps with every rank in (the least wait of the step's ranks,
        the median over those steps; None: no such step)."""
        report = self.model.last_epoch
        all_in = [min(step.wait_s) for step in self.model.step_figures
                  if step.epoch == self.epoch and all(step.shares)]
        return {**report_row(report), "diagnosis": report.diagnosis(),
                "all_in_exchange_s": statistics.median(all_in) if all_in else None}

    def close(self) -> None:
        self.model.close()


class _Alone:
    """The fastest rank on the same global batches, alone (the others wait): a plain loop, each step paced as its
    emulated device."""

    name = "fastest_alone"

    def __init__(self, module: nn.Module, speed: float, split: Split, seed: int, sample_cost_ms: float) -> None:
        self.module = module
        self.emulation = Emulation(speeds=(speed,), sample_cost_ms=sample_cost_ms, seed=seed)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        self.loader = DataLoader(split.train, batch_size=GLOBAL_BATCH, shuffle=True,
                                 generator=torch.Generator().manual_seed(seed))
        self.step = 0

    def train_epoch(self, epoch: int) -> None:
        if dist.get_rank() != 0:
            return
        for inputs, targets in self.loader:
            with self.emulation.compute(0, len(inputs), self.step):
                self.optimizer.zero_grad()
                nn.functional.cross_entropy(self.module(inputs), targets).backward()
            self.optimizer.step()
            self.step += 1

    def describe(self) -> dict[str, Any]:
        return plain_row([GLOBAL_BATCH] + [0] * (dist.get_world_size() - 1))

    def close(self) -> None:
        pass


class _AloneKeptCurrent(_Alone):
    """The fastest rank alone, then the least an epoch's end costs where the loop may read the model on any rank:
    one gather of a row of figures and one broadcast of its parameters, flat, to every rank. What no tool that keeps
    the ranks out current can undercut."""

    name = "alone_kept_current"
    FIGURES = 8
    """Values a rank's row of figures holds (an adaptive rule gathers each rank's compute, waits and samples)."""

    def train_epoch(self, epoch: int) -> None:
        super().train_epoch(epoch)
        row = torch.zeros(self.FIGURES, dtype=torch.float64)
        dist.all_gather([torch.empty_like(row) for _ in range(dist.get_world_size())], row)
        broadcast_in_place([parameter.data for parameter in self.module.parameters()], 0, dist.group.WORLD)


def calibrated_cost_ms(module: nn.Module, split: Split, speed: float, samples: int = GLOBAL_BATCH,
                       trials: int = 5) -> float:
    """Milliseconds per sample at speed 1 that make ``speed``'s block of ``samples`` last ``HEADROOM`` times the
    host's real compute of it (forward and backward of ``module``, the median of ``trials``), on every rank: rank 0
    measures, the others take its figure."""
    seconds = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        inputs, targets = split.train[:samples]
        seconds[0] = median_batch_s(module, inputs, targets, nn.functional.cross_entropy, repeats=trials, warmup=0)
    dist.broadcast(seconds, 0)
    return 1000.0 * HEADROOM * float(seconds) * speed / samples


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.subset")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rank, _ = init_distributed()
    torch.set_num_threads(1)
    split = load_dataset("digits", seed=args.seed)
    progress = EventWriter(enabled=rank == 0)
    runs: dict[str, list[dict[str, Any]]] = {}
    cost_ms = calibrated_cost_ms(_mlp(args.seed), split, COMM_HEAVY_SPEEDS[0])
    heavy = [_Alone(_mlp(args.seed), COMM_HEAVY_SPEEDS[0], split, args.seed, cost_ms),
             _AloneKeptCurrent(_mlp(args.seed), COMM_HEAVY_SPEEDS[0], split, args.seed, cost_ms),
             _Group("comm_heavy", _mlp(args.seed), "adaptive", COMM_HEAVY_SPEEDS, split, args.seed, cost_ms)]
    runs.update(alternate(heavy, 2 * args.epochs, warmup=args.epochs, progress=progress))
    balanced = [_Group(f"balanced_{allocation}", _convnet(args.seed, split), allocation, BALANCED_SPEEDS, split,
                       args.seed) for allocation in ("equal", "adaptive")]
    runs.update(alternate(balanced, args.epochs, warmup=args.epochs // 2, progress=progress))
    for run in [*heavy, *balanced]:
        run.close()
    if rank == 0:
        parameters = {"mlp": sum(p.numel() for p in _mlp(0).parameters()),
                      "convnet": sum(p.numel() for p in _convnet(0, split).parameters())}
        args.out.write_text(json.dumps({"runs": runs, "parameters": parameters, "comm_heavy_sample_cost_ms": cost_ms}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
