"""Equal vs static vs adaptive task allocation on emulated unequal workers (task-allocation paper).

One launch of N local ranks trains the digits ConvNet once per policy (same
initial model, same data, same global batch), so every ratio below is measured
in one run. It also compares adaptive allocation against plain DDP on equal
speeds, epoch by epoch alternately, to measure hetdp's own overhead.

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from hetdp.allocate.policy import Adaptive, Equal, Static
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
    """Launch the worker on ``len(speeds)`` local ranks and return what rank 0 recorded.

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
    return launch_workers("hetdp.bench.allocation", len(speeds), args, total=len(policies) * epochs + 2 *
                          homogeneous_epochs, description="epochs", unit="epoch", on_row=on_row)


def steady_epoch_s(rows: list[dict[str, Any]]) -> float:
    """Mean epoch time over the second half of the epochs, once adaptive shares have settled."""
    tail = rows[len(rows) // 2 :]
    return statistics.fmean(row["epoch_s"] for row in tail)


def allreduce_s_per_step(rows: list[dict[str, Any]]) -> float:
    """Seconds per step that even the last rank to finish computing waits: the allreduce itself (steady state)."""
    tail = rows[len(rows) // 2 :]
    return statistics.fmean(min(row["wait_s"]) / row["steps"] for row in tail)


def epochs_to_stable(rows: list[dict[str, Any]]) -> float:
    """Fractional epoch at which the shares last changed (0 if they never did)."""
    last = 0.0
    for row in rows:
        for step, _ in row["replans"]:
            last = row["epoch"] + step / row["steps"]
    return last


def summarize(speeds: tuple[float, ...], raw: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from the workers' per-epoch rows."""
    runs = raw["runs"]
    ideal = sum(speeds) / (len(speeds) * min(speeds))
    equal_s = steady_epoch_s(runs["equal"])
    speedup = equal_s / steady_epoch_s(runs["adaptive"])
    comm_s = allreduce_s_per_step(runs["adaptive"])
    steps = statistics.fmean(row["steps"] for row in runs["equal"])
    perfect_s = (equal_s - steps * comm_s) / ideal + steps * comm_s
    result: dict[str, Any] = {
        "speeds": list(speeds),
        "nproc": len(speeds),
        "epochs": len(runs["equal"]),
        "ideal_speedup": ideal,
        "speedup_vs_equal": speedup,
        "efficiency": speedup / ideal,
        "allreduce_ms_per_step": 1000 * comm_s,
        "efficiency_bound": equal_s / perfect_s / ideal,
        "speedup_static_vs_equal": equal_s / steady_epoch_s(runs["static"]),
        "epochs_to_stable": epochs_to_stable(runs["adaptive"]),
        "final_shares": runs["adaptive"][-1]["shares"],
        "accuracy_equal": runs["equal"][-1]["accuracy"],
        "accuracy_static": runs["static"][-1]["accuracy"],
        "accuracy_adaptive": runs["adaptive"][-1]["accuracy"],
        "steady_epoch_s": {policy: steady_epoch_s(rows) for policy, rows in runs.items()},
        "settings": raw["settings"],
        "runs": runs,
    }
    if raw.get("homogeneous"):
        plain = statistics.median(raw["homogeneous"]["plain_ddp_epoch_s"])
        ours = statistics.median(raw["homogeneous"]["adaptive_epoch_s"])
        result["overhead_homogeneous"] = ours / plain - 1.0
        result["homogeneous"] = raw["homogeneous"]
    return result


def render(result: dict[str, Any]) -> str:
    rows = [
        {
            "policy": policy,
            "steady epoch s": seconds,
            "speedup": result["steady_epoch_s"]["equal"] / seconds,
            "accuracy": result["runs"][policy][-1]["accuracy"],
            "final shares": result["runs"][policy][-1]["shares"],
        }
        for policy, seconds in result["steady_epoch_s"].items()
    ]
    lines = [format_table(rows, title=f"task allocation at speeds {result['speeds']}")]
    lines.append(
        f"ideal speedup {result['ideal_speedup']:.3f}, adaptive {result['speedup_vs_equal']:.3f} "
        f"(efficiency {result['efficiency']:.3f}); shares stable after {result['epochs_to_stable']:.2f} epochs"
    )
    lines.append(
        f"allreduce {result['allreduce_ms_per_step']:.1f} ms per step: a perfect allocation would reach "
        f"efficiency {result['efficiency_bound']:.3f} on this machine"
    )
    if "overhead_homogeneous" in result:
        lines.append(f"overhead vs plain DDP on equal speeds: {100 * result['overhead_homogeneous']:+.1f}%")
    return "\n".join(lines)


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
    policies = args.policies.split(",")
    progress = EventWriter(enabled=rank == 0)

    runs = {policy: _train_policy(policy, args, split, emulation, progress) for policy in policies}
    homogeneous = _compare_with_plain_ddp(args, split, progress) if args.homogeneous_epochs else None
    if rank == 0:
        settings = {key: value for key, value in vars(args).items() if key != "out"}
        args.out.write_text(json.dumps({"settings": settings, "runs": runs, "homogeneous": homogeneous}))
    dist.destroy_process_group()


def _new_model(seed: int, split: Split) -> ConvNet:
    torch.manual_seed(seed)
    channels, size, _ = split.image_shape
    return ConvNet(in_channels=channels, image_size=size, num_classes=split.num_classes)


def _train_policy(
    policy: str, args: argparse.Namespace, split: Split, emulation: Emulation, progress: EventWriter
) -> list[dict]:
    allocation = {"equal": Equal(), "static": Static(emulation.speeds or ()),
                  "adaptive": Adaptive(replan_every=args.replan_every)}[policy]
    model = _new_model(args.seed, split)
    ddp = hetdp_ddp.DistributedDataParallel(model, allocation, "allreduce", emulation=emulation)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = ddp.allocate(tensor_loader(split.train, args.global_batch), global_batch=args.global_batch,
                          shuffle=True, seed=args.seed, accumulates=True)
    rows, wall_s = [], 0.0
    for epoch in range(args.epochs):
        start_shares = ddp.shares
        dist.barrier()  # the previous epoch's evaluation ends at different times on different ranks: not training
        loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            train_share(ddp, inputs, targets, largest=args.micro_batch)
            optimizer.step()
        report = ddp.last_epoch
        wall_s += report.epoch_s
        rows.append({**vars(report), "policy": policy, "start_shares": start_shares, "wall_s": wall_s,
                     "accuracy": accuracy(model, split.test)})
        progress.update(row=rows[-1])
    dist.barrier()
    ddp.close()
    return rows


def _compare_with_plain_ddp(args: argparse.Namespace, split: Split, progress: EventWriter) -> dict[str, list[float]]:
    """Alternate epochs of plain DDP and of the drop-in (adaptive allocation) on equal, unemulated speeds.

    Both iterate the same DataLoader settings (per-rank batches of global_batch / N, one item at a time through
    the default collate) with the same loop body, so the difference is hetdp's own: its comm hook, its step
    bookkeeping and its re-plans.
    """
    world_size = dist.get_world_size()
    batch_size = args.global_batch // world_size

    def loader() -> DataLoader:
        return DataLoader(split.train, batch_size=batch_size, sampler=DistributedSampler(split.train, seed=args.seed))

    plain = DistributedDataParallel(_new_model(args.seed, split))
    ours = hetdp_ddp.DistributedDataParallel(_new_model(args.seed, split), "adaptive", emulation=Emulation())
    runs = [(plain, loader()), (ours, ours.allocate(loader()))]
    optimizers = [torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9) for model, _ in runs]
    seconds: list[list[float]] = [[], []]
    for epoch in range(args.homogeneous_epochs):
        for (model, data), optimizer, times in zip(runs, optimizers, seconds):
            dist.barrier()
            started = time.perf_counter()
            data.sampler.set_epoch(epoch)
            for inputs, targets in data:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(inputs), targets).backward()
                optimizer.step()
            dist.barrier()
            times.append(time.perf_counter() - started)
            progress.update()
    ours.close()
    return {"plain_ddp_epoch_s": seconds[0], "adaptive_epoch_s": seconds[1]}


if __name__ == "__main__":
    _worker(sys.argv[1:])
