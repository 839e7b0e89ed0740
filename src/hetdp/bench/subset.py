"""Never slower than the best subset of the devices: ranks whose compute is worth less than their exchange sit out.

One launch of 4 local ranks runs two settings with the drop-in (``hetdp.DDP``,
adaptive allocation, allreduce) in a user's loop:

* communication-heavy: speeds 100,1,1,1 and a 1.1M-parameter MLP, whose exchange
  costs more than the three slow ranks' samples save. The fastest rank also trains
  the same global batches alone (a plain loop, paced as its emulated device):
  ``vs_fastest_alone`` is that epoch time over the group's. Its sample cost is
  calibrated on the machine (``calibrated_cost_ms``): pacing can only slow a rank
  down, so a fastest device whose block the host's real compute overran would run
  at the host's speed, sharing its cores with the ranks that sat out, which is a
  measure of the host and not of the emulated device.
* balanced: speeds 1,1,2,4 and the demo's ConvNet, where every rank pays; equal
  against adaptive allocation gives ``balanced_efficiency`` as ``bench allocation``
  defines efficiency (speedup over equal shares / the ideal speedup).

Who sits out is decided from measured figures only; ``sat_out`` lists the ranks
out at each setting's end. Run as a module under torchrun it is the worker;
imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from hetdp.bench.allocation import steady_epoch_s
from hetdp.bench.datasets import Split, load_dataset
from hetdp.bench.models import ConvNet
from hetdp.bench.workers import launch_workers
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.probe import median_batch_s
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
                         total=6 * epochs, description="epochs", unit="epoch")
    return summarize(raw)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from rank 0's per-epoch rows."""
    runs = raw["runs"]
    alone_s, group_s = steady_epoch_s(runs["fastest_alone"]), steady_epoch_s(runs["comm_heavy"])
    equal_s, adaptive_s = steady_epoch_s(runs["balanced_equal"]), steady_epoch_s(runs["balanced_adaptive"])
    ideal = sum(BALANCED_SPEEDS) / (len(BALANCED_SPEEDS) * min(BALANCED_SPEEDS))
    return {
        "vs_fastest_alone": alone_s / group_s,
        "balanced_efficiency": equal_s / adaptive_s / ideal,
        "settings": {
            "comm_heavy": {"speeds": list(COMM_HEAVY_SPEEDS), "parameters": raw["parameters"]["mlp"],
                           "fastest_alone_epoch_s": alone_s, "group_epoch_s": group_s,
                           "vs_fastest_alone": alone_s / group_s, "sat_out": _sat_out(runs["comm_heavy"]),
                           "final_shares": runs["comm_heavy"][-1]["shares"]},
            "balanced": {"speeds": list(BALANCED_SPEEDS), "parameters": raw["parameters"]["convnet"],
                         "ideal_speedup": ideal, "equal_epoch_s": equal_s, "adaptive_epoch_s": adaptive_s,
                         "balanced_efficiency": equal_s / adaptive_s / ideal,
                         "sat_out": _sat_out(runs["balanced_adaptive"]),
                         "final_shares": runs["balanced_adaptive"][-1]["shares"]},
        },
        "sample_cost_ms": SAMPLE_COST_MS,
        "comm_heavy_sample_cost_ms": raw["comm_heavy_sample_cost_ms"],
        "global_batch": GLOBAL_BATCH,
        "runs": runs,
    }


def _sat_out(rows: list[dict[str, Any]]) -> list[int]:
    """The ranks out of the exchange at the run's end."""
    return sorted(int(rank) for rank in rows[-1]["sat_out"])


def render(result: dict[str, Any]) -> str:
    heavy, balanced = result["settings"]["comm_heavy"], result["settings"]["balanced"]
    rows = [
        {"setting": "comm-heavy", "speeds": heavy["speeds"], "parameters": heavy["parameters"],
         "steady epoch s": heavy["group_epoch_s"], "baseline s": heavy["fastest_alone_epoch_s"],
         "figure": f"vs_fastest_alone {heavy['vs_fastest_alone']:.3f}", "sat out": heavy["sat_out"],
         "shares": heavy["final_shares"]},
        {"setting": "balanced", "speeds": balanced["speeds"], "parameters": balanced["parameters"],
         "steady epoch s": balanced["adaptive_epoch_s"], "baseline s": balanced["equal_epoch_s"],
         "figure": f"balanced_efficiency {balanced['balanced_efficiency']:.3f}", "sat out": balanced["sat_out"],
         "shares": balanced["final_shares"]},
    ]
    title = (f"ranks that do not pay sit out (adaptive + allreduce, global batch {result['global_batch']}; ms per "
             f"sample at speed 1: comm-heavy {result['comm_heavy_sample_cost_ms']:.3g}, calibrated; balanced "
             f"{result['sample_cost_ms']:g})")
    legend = ("baseline s: comm-heavy, the fastest rank alone on the same global batches; balanced, equal shares. "
              "vs_fastest_alone: its epoch time over the group's (target >= 0.95); balanced_efficiency: speedup "
              "over equal shares / ideal speedup, as `bench allocation` (target >= 0.95)")
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
    """The user's loop with the drop-in on every rank, an epoch at a time; a row per epoch (every rank's view)."""

    def __init__(self, module: nn.Module, allocation: str, speeds: tuple[float, ...], split: Split, seed: int,
                 sample_cost_ms: float = SAMPLE_COST_MS) -> None:
        emulation = Emulation(speeds=speeds, sample_cost_ms=sample_cost_ms, seed=seed)
        self.name = allocation
        self.model = hetdp_ddp.DistributedDataParallel(module, allocation, "allreduce", emulation=emulation)
        sampler = DistributedSampler(split.train, seed=seed)
        self.loader = self.model.allocate(DataLoader(split.train, batch_size=GLOBAL_BATCH // dist.get_world_size(),
                                                     sampler=sampler))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def epoch(self, epoch: int) -> dict[str, Any]:
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self.model(inputs), targets).backward()
            self.optimizer.step()
        report = self.model.last_epoch
        return {"epoch": epoch, "epoch_s": report.epoch_s, "shares": report.shares,
                "sat_out": {str(rank): why for rank, why in report.sat_out.items()}, "diagnosis": report.diagnosis()}

    def close(self) -> None:
        self.model.close()


class _Alone:
    """The fastest rank on the same global batches, alone (the others wait): a plain loop, each step paced as its
    emulated device."""

    def __init__(self, module: nn.Module, speed: float, split: Split, seed: int, sample_cost_ms: float) -> None:
        self.name = "fastest alone"
        self.module = module
        self.emulation = Emulation(speeds=(speed,), sample_cost_ms=sample_cost_ms, seed=seed)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        self.loader = DataLoader(split.train, batch_size=GLOBAL_BATCH, shuffle=True,
                                 generator=torch.Generator().manual_seed(seed))
        self.step = 0

    def epoch(self, epoch: int) -> dict[str, Any]:
        if dist.get_rank() != 0:
            return {}
        started = time.perf_counter()
        for inputs, targets in self.loader:
            with self.emulation.compute(0, len(inputs), self.step):
                self.optimizer.zero_grad()
                nn.functional.cross_entropy(self.module(inputs), targets).backward()
            self.optimizer.step()
            self.step += 1
        return {"epoch": epoch, "epoch_s": time.perf_counter() - started, "shares": [GLOBAL_BATCH], "sat_out": {}}

    def close(self) -> None:
        pass


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


def _alternate(runs: list[_Group | _Alone], epochs: int, progress: EventWriter) -> list[list[dict[str, Any]]]:
    """An epoch of each run in turn, so that a loaded machine's slow spells fall on all of them alike."""
    rows: list[list[dict[str, Any]]] = [[] for _ in runs]
    for epoch in range(epochs):
        for run, done in zip(runs, rows):
            dist.barrier()
            done.append(run.epoch(epoch))
            progress.update(row={"run": run.name, **done[-1]})
    dist.barrier()
    for run in runs:
        run.close()
    return rows


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
    runs["fastest_alone"], runs["comm_heavy"] = _alternate(
        [_Alone(_mlp(args.seed), COMM_HEAVY_SPEEDS[0], split, args.seed, cost_ms),
         _Group(_mlp(args.seed), "adaptive", COMM_HEAVY_SPEEDS, split, args.seed, cost_ms)], 2 * args.epochs,
        progress)
    runs["balanced_equal"], runs["balanced_adaptive"] = _alternate(
        [_Group(_convnet(args.seed, split), allocation, BALANCED_SPEEDS, split, args.seed)
         for allocation in ("equal", "adaptive")], args.epochs, progress)
    if rank == 0:
        parameters = {"mlp": sum(p.numel() for p in _mlp(0).parameters()),
                      "convnet": sum(p.numel() for p in _convnet(0, split).parameters())}
        args.out.write_text(json.dumps({"runs": runs, "parameters": parameters, "comm_heavy_sample_cost_ms": cost_ms}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
