"""Equal vs static vs adaptive task allocation on emulated unequal workers (task-allocation paper).

One launch of N local ranks trains the digits ConvNet once per policy (same
initial model, same data, same global batch), an epoch of each in turn, every
epoch timed whole on one clock (``bench.compare``), so every ratio below is
measured in one run. Adaptive's speed-up over equal shares is read against its
ideal, worked out from the equal run's own compute and exchange. On equal,
unemulated speeds the drop-in then runs beside torch DDP, every rank in and
membership off, for its overhead.

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from hetdp.allocate.policy import Adaptive, Equal, Static
from hetdp.bench.compare import (alternate, exchange_s, ideal, per_sample_s, plain_row, report_row, sat_out,
                                 steady_s)
from hetdp.bench.datasets import DATASETS, Split, load_dataset
from hetdp.bench.loop import tensor_loader, train_share
from hetdp.bench.models import ConvNet, accuracy
from hetdp.bench.workers import launch_workers
from hetdp.cluster.emulate import Emulation, parse_speeds
from hetdp.ddp import model as hetdp_ddp
from hetdp.errors import ConfigError
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed

DEFAULT_SPEEDS = "1,1,2,4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speeds", default=DEFAULT_SPEEDS, help=f"relative speed per rank (default {DEFAULT_SPEEDS})")
    parser.add_argument("--epochs", type=int, help="epochs per policy (default 12, quick 6)")
    parser.add_argument("--sample-cost-ms", type=float, default=8.0, help="emulated ms per sample at speed 1")
    parser.add_argument("--global-batch", type=int, default=256,
                        help="samples per step over all ranks (default 256; the learning rate scales with it)")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per forward/backward")
    parser.add_argument("--replan-every", type=int, default=2, help="steps between adaptive re-plans (0: per epoch)")
    add_dataset_arguments(parser)


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """--dataset and --data-root, shared with `hetdp demo`."""
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="digits", help="training data (default digits)")
    parser.add_argument("--data-root", type=Path, help="folder of the MNIST / CIFAR-10 files in their standard format")


def run(args: argparse.Namespace) -> dict[str, Any]:
    speeds = parse_speeds(args.speeds)
    epochs = args.epochs or (6 if args.quick else 12)
    if epochs < 2:
        raise ConfigError(f"--epochs must be >= 2 to measure a steady state, got {epochs}")
    raw = run_experiment(
        speeds,
        policies=("equal", "static", "adaptive"),
        epochs=epochs,
        sample_cost_ms=args.sample_cost_ms,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        replan_every=args.replan_every,
        homogeneous_epochs=12 if args.quick else 24,
        seed=args.seed,
        lr=0.05 * args.global_batch / 128,  # the linear scaling rule
        dataset=args.dataset,
        data_root=args.data_root,
    )
    return summarize(speeds, raw)


def run_experiment(speeds: tuple[float, ...], *, policies: tuple[str, ...], epochs: int, sample_cost_ms: float,
                   global_batch: int, micro_batch: int, replan_every: int, homogeneous_epochs: int = 0,
                   seed: int = 0, lr: float = 0.05, dataset: str = "digits", data_root: Path | None = None,
                   on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Launch the worker on ``len(speeds)`` local ranks and return what rank 0 recorded: each policy's rows (the
    policies an epoch each in turn), with ``wall_s``, its wall clock so far.

    ``on_row`` receives each epoch's row as soon as rank 0 measured it, while a progress bar runs.
    """
    load_dataset(dataset, data_root)  # a bad name, folder or setting fails here, once, not on every rank
    Emulation(speeds=speeds, sample_cost_ms=sample_cost_ms)
    args = [
        "--speeds", ",".join(map(str, speeds)), "--policies", ",".join(policies),
        "--epochs", epochs, "--sample-cost-ms", sample_cost_ms, "--global-batch", global_batch,
        "--micro-batch", micro_batch, "--replan-every", replan_every, "--homogeneous-epochs", homogeneous_epochs,
        "--seed", seed, "--lr", lr, "--dataset", dataset,
    ]
    args += ["--data-root", data_root] if data_root else []
    total = len(policies) * epochs + len(HOMOGENEOUS_SIDES) * homogeneous_epochs
    raw = launch_workers("hetdp.bench.allocation", len(speeds), args, total=total, description="epochs", unit="epoch",
                         on_row=on_row)
    for rows in raw["runs"].values():
        for row, wall_s in zip(rows, itertools.accumulate(row["epoch_s"] for row in rows)):
            row["wall_s"] = wall_s
    return raw


def steady_epoch_s(rows: list[dict[str, Any]]) -> float:
    """A policy's steady epoch: the median wall clock of its epochs past the warm-up (``compare.steady_s``)."""
    return steady_s(rows)


def epochs_to_stable(rows: list[dict[str, Any]]) -> float:
    """Fractional epoch at which the shares last changed (0 if they never did)."""
    last = 0.0
    for row in rows:
        for step, _ in row["replans"]:
            last = row["epoch"] + step / row["steps"]
    return last


def summarize(speeds: tuple[float, ...], raw: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from the workers' per-epoch rows: each policy against equal shares and the ideal
    worked out from the equal run's own compute, and the drop-in against torch DDP."""
    runs = raw["runs"]
    equal = runs["equal"]
    equal_s = steady_s(equal)
    per_sample = per_sample_s(equal)
    best = ideal(equal_s, baseline_samples=equal[-1]["samples"], per_sample=per_sample)
    speedup = equal_s / steady_s(runs["adaptive"])
    result: dict[str, Any] = {
        "speeds": list(speeds),
        "nproc": len(speeds),
        "epochs": len(equal),
        "warmup_epochs": sum(row["warmup"] for row in equal),
        "speedup_vs_equal": speedup,
        "ideal_speedup": best.speedup,
        "efficiency": speedup / best.speedup,
        "speedup_static_vs_equal": equal_s / steady_s(runs["static"]),
        "efficiency_static": equal_s / steady_s(runs["static"]) / best.speedup,
        "ideal_speedup_from_speeds": sum(speeds) / (len(speeds) * min(speeds)),
        "per_sample_ms": [None if s is None else 1000 * s for s in per_sample],
        "exchange_ms_per_step": 1000 * exchange_s(equal),
        "ideal_epoch_s": best.epoch_s,
        "epochs_to_stable": epochs_to_stable(runs["adaptive"]),
        "final_shares": runs["adaptive"][-1]["shares"],
        "sat_out": {policy: sat_out(rows) for policy, rows in runs.items()},
        "accuracy_equal": equal[-1]["accuracy"],
        "accuracy_static": runs["static"][-1]["accuracy"],
        "accuracy_adaptive": runs["adaptive"][-1]["accuracy"],
        "steady_epoch_s": {policy: steady_s(rows) for policy, rows in runs.items()},
        "settings": raw["settings"],
        "runs": runs,
    }
    if raw.get("homogeneous"):
        result.update(overhead(raw["homogeneous"]))
    return result


def overhead(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The drop-in against torch DDP on equal, unemulated ranks, every rank in: its steady epoch over torch's, less
    one (ideal 0), with adaptive allocation and membership off, and with equal shares."""
    torch_s = steady_s(rows["torch_ddp"])
    return {
        "overhead_vs_ddp": steady_s(rows["hetdp_adaptive"]) / torch_s - 1.0,
        "overhead_vs_ddp_equal": steady_s(rows["hetdp_equal"]) / torch_s - 1.0,
        "homogeneous": {"sides": HOMOGENEOUS_SIDES, "steady_epoch_s": {name: steady_s(side) for name, side in
                                                                         rows.items()},
                        "sat_out": {name: sorted({int(rank) for row in side for rank in row["sat_out"]})
                                    for name, side in rows.items()},
                        "shares": {name: [row["shares"] for row in side] for name, side in rows.items()},
                        "runs": rows},
    }


def render(result: dict[str, Any]) -> str:
    rows = [
        {
            "policy": policy,
            "steady epoch s": seconds,
            "speedup": result["steady_epoch_s"]["equal"] / seconds,
            "efficiency": result["steady_epoch_s"]["equal"] / seconds / result["ideal_speedup"],
            "accuracy": result["runs"][policy][-1]["accuracy"],
            "final shares": result["runs"][policy][-1]["shares"],
            "sat out": result["sat_out"][policy],
        }
        for policy, seconds in result["steady_epoch_s"].items()
    ]
    lines = [format_table(rows, title=f"task allocation at speeds {result['speeds']}: the wall clock of whole epochs, "
                                      f"median of {result['epochs'] - result['warmup_epochs']} after "
                                      f"{result['warmup_epochs']} of warm-up, policies in turn")]
    lines.append(
        f"adaptive over equal {result['speedup_vs_equal']:.3f}x; ideal {result['ideal_speedup']:.3f}x (the equal run "
        f"less the compute balanced shares save, at {_ms(result['per_sample_ms'])} ms per sample measured; exchange "
        f"{result['exchange_ms_per_step']:.1f} ms per step kept): efficiency {result['efficiency']:.3f}; speeds alone "
        f"would give {result['ideal_speedup_from_speeds']:.2f}x; shares stable after {result['epochs_to_stable']:.2f} "
        "epochs"
    )
    if "overhead_vs_ddp" in result:
        seconds = result["homogeneous"]["steady_epoch_s"]
        lines.append(
            f"overhead_vs_ddp {100 * result['overhead_vs_ddp']:+.1f}% (ideal 0): hetdp.DDP, adaptive with membership "
            f"off ({seconds['hetdp_adaptive']:.3f} s), against torch DDP ({seconds['torch_ddp']:.3f} s) on equal, "
            f"unemulated ranks, every rank in (sat out: {result['homogeneous']['sat_out']['hetdp_adaptive'] or 'none'})"
            f"; at equal shares {100 * result['overhead_vs_ddp_equal']:+.1f}%"
        )
    return "\n".join(lines)


def _ms(values: list[float | None]) -> str:
    return ",".join("-" if value is None else f"{value:.2f}" for value in values)


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.allocation")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--speeds", required=True)
    parser.add_argument("--policies", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--sample-cost-ms", type=float, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--replan-every", type=int, required=True)
    parser.add_argument("--homogeneous-epochs", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-root", type=Path)
    args = parser.parse_args(argv)

    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    speeds = parse_speeds(args.speeds, world_size)
    split = load_dataset(args.dataset, args.data_root, seed=args.seed)
    emulation = Emulation(speeds=speeds, sample_cost_ms=args.sample_cost_ms, seed=args.seed)
    progress = EventWriter(enabled=rank == 0)

    policies = [_Policy(policy, args, split, emulation) for policy in args.policies.split(",")]
    runs = alternate(policies, args.epochs, warmup=args.epochs // 2, progress=progress)
    for policy in policies:
        policy.close()
    homogeneous = None
    if args.homogeneous_epochs:
        sides = _homogeneous_sides(args, split)
        homogeneous = alternate(sides, args.homogeneous_epochs, warmup=args.homogeneous_epochs // 2,
                                progress=progress)
        for side in sides:
            side.close()
    if rank == 0:
        settings = {key: value for key, value in vars(args).items() if key != "out"}
        args.out.write_text(json.dumps({"settings": settings, "runs": runs, "homogeneous": homogeneous}))
    dist.destroy_process_group()


def _new_model(seed: int, split: Split) -> ConvNet:
    torch.manual_seed(seed)
    channels, size, _ = split.image_shape
    return ConvNet(in_channels=channels, image_size=size, num_classes=split.num_classes)


class _Policy:
    """One allocation policy through the drop-in, the loop body ``bench.loop.train_share`` runs, an epoch at a time;
    its rows carry the accuracy after the epoch (not timed)."""

    def __init__(self, policy: str, args: argparse.Namespace, split: Split, emulation: Emulation) -> None:
        self.name = policy
        allocation = {"equal": Equal(), "static": Static(emulation.speeds or ()),
                      "adaptive": Adaptive(replan_every=args.replan_every)}[policy]
        self.module = _new_model(args.seed, split)
        self.model = hetdp_ddp.DistributedDataParallel(self.module, allocation, "allreduce", emulation=emulation)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=args.lr, momentum=0.9)
        self.loader = self.model.allocate(tensor_loader(split.train, args.global_batch),
                                          global_batch=args.global_batch, shuffle=True, seed=args.seed,
                                          accumulates=True)
        self.micro_batch = args.micro_batch
        self.test = split.test
        self.start_shares = self.model.shares

    def train_epoch(self, epoch: int) -> None:
        self.start_shares = self.model.shares
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self.optimizer.zero_grad()
            train_share(self.model, inputs, targets, largest=self.micro_batch)
            self.optimizer.step()

    def describe(self) -> dict[str, Any]:
        report = self.model.last_epoch
        return {**report_row(report), "policy": self.name, "start_shares": self.start_shares,
                "accuracy": accuracy(self.module, self.test)}

    def close(self) -> None:
        self.model.close()


class _Plain:
    """Torch's DDP, or the drop-in, on equal unemulated ranks: per-rank batches of ``global_batch / N`` from one
    DataLoader setting, one item at a time through the default collate, the same loop body; the difference is the
    drop-in's own (its comm hook, its step bookkeeping, its re-plans)."""

    def __init__(self, name: str, model: nn.Module, loader: DataLoader, lr: float) -> None:
        self.name = name
        self.model = model
        self.loader = loader
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def train_epoch(self, epoch: int) -> None:
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self.model(inputs), targets).backward()
            self.optimizer.step()

    def describe(self) -> dict[str, Any]:
        if isinstance(self.model, hetdp_ddp.DistributedDataParallel):
            return report_row(self.model.last_epoch)
        return plain_row([self.loader.batch_size] * dist.get_world_size())

    def close(self) -> None:
        if isinstance(self.model, hetdp_ddp.DistributedDataParallel):
            self.model.close()


HOMOGENEOUS_SIDES = {"torch_ddp": "torch.nn.parallel.DistributedDataParallel",
                     "hetdp_adaptive": "hetdp.DDP(model, Adaptive(sit_out=False)): adaptive, membership off",
                     "hetdp_equal": "hetdp.DDP(model, 'equal')"}
"""The overhead's sides, on equal unemulated ranks, every rank in."""


def _homogeneous_sides(args: argparse.Namespace, split: Split) -> list[_Plain]:
    batch_size = args.global_batch // dist.get_world_size()

    def loader() -> DataLoader:
        return DataLoader(split.train, batch_size=batch_size, sampler=DistributedSampler(split.train, seed=args.seed))

    sides = [_Plain("torch_ddp", DistributedDataParallel(_new_model(args.seed, split)), loader(), args.lr)]
    for name, allocation in (("hetdp_adaptive", Adaptive(sit_out=False)), ("hetdp_equal", Equal())):
        model = hetdp_ddp.DistributedDataParallel(_new_model(args.seed, split), allocation, emulation=Emulation())
        sides.append(_Plain(name, model, model.allocate(loader()), args.lr))
    return sides


if __name__ == "__main__":
    _worker(sys.argv[1:])
