"""``hetdp bench cadp``: C-ADP against equal-split DDP and local SGD on emulated geo-distributed devices.

GPU-like and CPU-like devices (batch times 10x apart) sit behind links from
1 Gb/s to 50 Mb/s; each digits image is priced as a 150 KB ImageNet image on
the wire, so delivering the data weighs as in the C-ADP paper's experiments.
All three methods run in one torchrun launch, one after the other, from the
same initial model, each as C-ADP runs: rank 0, the data owner, plans each
device's share (``hetdp.plan``, or an equal split) and sends it once
(``hetdp.distribute``), and every device trains its own samples through the
drop-in (``hetdp.DDP`` with ``"local"`` or ``"allreduce"`` and
``model.allocate(loader, own_data=True)``). Every compute and transfer is paced
by the emulation, the model's trips over the links included, so the measured
T_send and T_train can be set against the cost model's predictions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import hetdp
from hetdp import ClusterSpec, DeviceSpec, Plan
from hetdp.allocate.planner import evaluate
from hetdp.bench.datasets import load_digits
from hetdp.bench.models import ConvNet, accuracy
from hetdp.cluster.devices import per_sample_ms
from hetdp.errors import ConfigError, HetDPError
from hetdp.launch import run_local
from hetdp.report import format_table

METHODS = ("ddp", "local_sgd", "cadp")
"""The compared runs, in table order."""

SETTINGS = {"ddp": ("equal", "allreduce"), "local_sgd": ("equal", "local"), "cadp": ("planned", "local")}
"""Each run's allocation (of the data: planned by C-ADP, or split equally) and its drop-in synchronization: DDP
combines gradients every step, the others merge the models every epoch."""

TIMEOUT_S = 60.0
"""Seconds a delivery or a step may wait beyond twice its planned time; past them, PeerTimeoutError names the rank."""

PROFILES = (
    # name, batch_time_s at batch 32, bandwidth_mbps from the owner, latency_ms
    ("owner-gpu", 0.020, math.inf, 0.0),
    ("gpu-1g", 0.020, 1000.0, 5.0),
    ("cpu-200m", 0.200, 200.0, 20.0),
    ("cpu-50m", 0.250, 50.0, 40.0),
    ("gpu-500m", 0.025, 500.0, 10.0),
    ("cpu-100m", 0.200, 100.0, 30.0),
    ("gpu-100m", 0.020, 100.0, 25.0),
    ("cpu-50m-b", 0.300, 50.0, 50.0),
)
"""Device i of an N-device run is PROFILES[i]. GPU-like batches take 20-25 ms, CPU-like 200-300 ms: both well
above the real cost of a ConvNet batch on digits (~3 ms on one core), so the pacing, not the 2 shared cores,
sets every device's speed."""

TARGETS = {"cadp_vs_ddp": 0.5, "prediction_error": 0.15, "accuracy_drop_points": 2.0}
"""Upper limits: C-ADP's T_total over DDP's; |measured - predicted| / predicted for C-ADP; DDP's accuracy minus
C-ADP's, in points (negative when C-ADP is more accurate)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=None, help="emulated devices, 2-8 (default 6; 4 with --quick)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every method (default 10; 5 with --quick)")
    parser.add_argument("--sample-kb", type=float, default=150.0, help="emulated kilobytes per sample b (default 150)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size of every device (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate of every method (default 0.05)")
    parser.add_argument("--method", choices=("exact", "alm"), default="exact", help="C-ADP solver (default exact)")


def bench_cluster(nproc: int, *, sample_bytes: float, batch_size: int, model_bytes: float) -> ClusterSpec:
    """The first ``nproc`` device profiles, with batch times scaled from batch 32 to ``batch_size``."""
    if not 2 <= nproc <= len(PROFILES):
        raise ConfigError(f"--nproc must be between 2 and {len(PROFILES)}, got {nproc}")
    devices = tuple(
        DeviceSpec(
            name=name,
            batch_size=batch_size,
            batch_time_s=time_s * batch_size / 32,
            bandwidth_mbps=bandwidth,
            latency_ms=latency,
        )
        for name, time_s, bandwidth, latency in PROFILES[:nproc]
    )
    return ClusterSpec(devices=devices, sample_bytes=sample_bytes, model_bytes=model_bytes)


def ddp_predicted_total_s(cluster: ClusterSpec, send_s: float, batches: list[int], epochs: int) -> float:
    """Synchronous DDP under the C-ADP cost model: every step waits for the slowest batch and the slowest link.

    T_send + epochs * max_i batches_i * (max_i T_i^batch + max_i 2 (alpha_0i + M_m / B_0i)).
    """
    step_s = max(d.feasible_batch_time_s for d in cluster.devices) + max(cluster.comm_s(d) for d in cluster.devices)
    return send_s + epochs * max(batches) * step_s


def run(args: argparse.Namespace) -> dict[str, Any]:
    nproc = args.nproc or (4 if args.quick else 6)
    epochs = args.epochs or (5 if args.quick else 10)
    if epochs < 1 or args.batch_size < 1 or not args.sample_kb >= 0 or not args.lr > 0:
        raise ConfigError("--epochs, --batch-size and --lr must be positive and --sample-kb >= 0")
    model_bytes = float(sum(p.numel() * p.element_size() for p in ConvNet().parameters()))
    sample_bytes = args.sample_kb * 1000
    cluster = bench_cluster(nproc, sample_bytes=sample_bytes, batch_size=args.batch_size, model_bytes=model_bytes)
    settings = {"epochs": epochs, "lr": args.lr, "seed": args.seed, "method": args.method}
    with tempfile.TemporaryDirectory(prefix="hetdp-bench-cadp-") as folder:
        work = Path(folder)
        (work / "cluster.toml").write_text(cluster.to_toml())
        (work / "settings.json").write_text(json.dumps(settings))
        done = run_local("hetdp.bench.cadp", nproc, ["--worker", str(work)], module=True, timeout_s=1800)
        if done.returncode != 0:
            raise HetDPError(f"the benchmark workers exited with code {done.returncode} (their output is above)")
        runs = json.loads((work / "results.json").read_text())
    return figures(cluster, runs, epochs=epochs, nproc=nproc, sample_kb=args.sample_kb)


def figures(
    cluster: ClusterSpec, runs: dict[str, dict[str, Any]], *, epochs: int, nproc: int, sample_kb: float
) -> dict[str, Any]:
    """The JSON figures from each method's run, with the comparisons the targets are about."""

    def per_method(key: str) -> dict[str, Any]:
        return {method: runs[method][key] for method in METHODS}

    predicted = per_method("predicted_total_s")
    predicted["ddp"] = ddp_predicted_total_s(cluster, runs["ddp"]["predicted_send_s"], runs["ddp"]["batches"], epochs)
    total, accuracy = per_method("total_s"), per_method("accuracy")
    errors = {method: abs(total[method] - predicted[method]) / predicted[method] for method in METHODS}
    drop_points = 100 * (accuracy["ddp"] - accuracy["cadp"])
    result = {
        "nproc": nproc,
        "epochs": epochs,
        "sample_kb": sample_kb,
        "model_bytes": cluster.model_bytes,
        "devices": [
            {"name": d.name, "batch_size": d.batch_size, "batch_time_s": d.batch_time_s,
             "bandwidth_mbps": None if math.isinf(d.bandwidth_mbps) else d.bandwidth_mbps, "latency_ms": d.latency_ms}
            for d in cluster.devices
        ],
        "samples": per_method("samples"),
        "send_s": per_method("send_s"),
        "train_s": per_method("train_s"),
        "total_s": total,
        "accuracy": accuracy,
        "predicted_s": predicted,
        "prediction_errors": errors,
        "predicted_total_s": predicted["cadp"],
        "prediction_error": errors["cadp"],
        "speedup_vs_ddp": total["ddp"] / total["cadp"],
        "cadp_vs_ddp": total["cadp"] / total["ddp"],
        "speedup_vs_local_sgd": total["local_sgd"] / total["cadp"],
        "accuracy_drop_points": drop_points,
    }
    result["targets"] = {key: {"limit": limit, "met": result[key] <= limit} for key, limit in TARGETS.items()}
    return result


def render(result: dict[str, Any]) -> str:
    names = {"ddp": "DDP (equal, allreduce/step)", "local_sgd": "local SGD (equal)", "cadp": "C-ADP (planned)"}
    rows = [
        {
            "method": names[method],
            "samples": result["samples"][method],
            "T_send s": result["send_s"][method],
            "T_train s": result["train_s"][method],
            "T_total s": result["total_s"][method],
            "predicted s": result["predicted_s"][method],
            "error": f"{100 * result['prediction_errors'][method]:.1f}%",
            "accuracy": f"{100 * result['accuracy'][method]:.1f}%",
        }
        for method in METHODS
    ]
    title = (
        f"C-ADP on {result['nproc']} emulated devices, digits priced at {result['sample_kb']:g} KB/sample, "
        f"{result['epochs']} epochs"
    )
    lines = [format_table(rows, title=title), ""]
    lines.append(
        f"C-ADP T_total = {result['cadp_vs_ddp']:.3f} x DDP ({result['speedup_vs_ddp']:.2f}x faster), "
        f"{result['speedup_vs_local_sgd']:.2f}x faster than local SGD"
    )
    for key, target in result["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        lines.append(f"  {key:<22} {result[key]:8.3f}   target <= {target['limit']:<5g} {verdict}")
    return "\n".join(lines)


def _worker(folder: Path) -> None:
    """One rank of the benchmark: train every method in turn; rank 0 writes ``results.json``."""
    rank, _ = hetdp.init_distributed()
    torch.set_num_threads(1)
    settings = json.loads((folder / "settings.json").read_text())
    cluster = ClusterSpec.from_toml(folder / "cluster.toml")
    split = load_digits(seed=settings["seed"]) if rank == 0 else None  # only the data owner holds the data
    progress = tqdm(total=len(METHODS) * settings["epochs"], desc="bench cadp", unit="epoch", file=sys.stderr,
                    disable=None if rank == 0 else True)
    results = {}
    for method in METHODS:
        progress.set_postfix_str(method)
        torch.manual_seed(settings["seed"])
        net = ConvNet()
        figures = _run(method, net, split.train if split is not None else None, cluster, settings, progress.update)
        if split is not None:
            results[method] = {**figures, "accuracy": accuracy(net, split.test)}
    progress.close()
    if rank == 0:
        (folder / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _run(method: str, net: nn.Module, dataset: TensorDataset | None, cluster: ClusterSpec, settings: dict[str, Any],
         on_epoch: Callable[[], object]) -> dict[str, Any]:
    """One method as C-ADP runs: the owner plans and delivers once, each device trains its own samples; the paper's
    T_send and T_train (Table 3) measured around each part, from and to the moment every rank is there."""
    allocation, sync = SETTINGS[method]
    plan = _owner_plan(allocation, dataset, cluster, settings)
    delivery_s = [_link_s(device, n * cluster.sample_bytes) for device, n in zip(cluster.devices, plan.samples)]
    dist.barrier()
    started = time.perf_counter()
    # Deadlines grow with the planned work, so that a long but healthy delivery or epoch is never cut short.
    local = hetdp.distribute(dataset, plan.samples, transfer_s=delivery_s, seed=settings["seed"],
                             timeout_s=TIMEOUT_S + 2 * max(delivery_s))
    dist.barrier()
    delivered = time.perf_counter()
    # A device the plan gives no samples sits the training out (C-ADP: D_i = 0), outside the drop-in's group.
    trains = [rank for rank, samples in enumerate(plan.samples) if samples > 0]
    group = None if len(trains) == len(plan.samples) else dist.new_group(trains)
    if dist.get_rank() in trains:
        members = replace(cluster, devices=tuple(cluster.devices[rank] for rank in trains))
        policy = hetdp.Planned(members) if allocation == "planned" else "equal"
        with hetdp.DDP(net.to(local.data.tensors[0].device), policy, sync, emulation=_emulation(members),
                       step_timeout_s=TIMEOUT_S + 2 * plan.epoch_s, process_group=group) as model:
            _train(model, local.data, members, sync, settings, on_epoch)
        if group is not None:
            dist.destroy_process_group(group)
    dist.barrier()
    send_s, train_s = delivered - started, time.perf_counter() - delivered
    return {"samples": plan.samples, "batches": [device.batches for device in plan.devices], "send_s": send_s,
            "train_s": train_s, "total_s": send_s + train_s, "predicted_send_s": plan.send_s,
            "predicted_total_s": plan.total_s}


def _owner_plan(allocation: str, dataset: TensorDataset | None, cluster: ClusterSpec, settings: dict[str, Any]
                ) -> Plan:
    """Rank 0, the data owner, chooses D_1..D_N (C-ADP eq. 7, or an equal split priced by the same cost model);
    every rank receives its plan."""
    planned: list[Plan | None] = [None]
    if dist.get_rank() == 0:
        size, epochs = len(dataset), settings["epochs"]
        planned[0] = (hetdp.plan(cluster, size, epochs, method=settings["method"]) if allocation == "planned" else
                      evaluate(cluster, hetdp.apportion([1.0] * len(cluster.devices), size, minimum=0), epochs))
    dist.broadcast_object_list(planned, src=0)
    return planned[0]


def _train(model: hetdp.DDP, data: TensorDataset, cluster: ClusterSpec, sync: str, settings: dict[str, Any],
           on_epoch: Callable[[], object]) -> None:
    """The drop-in's loop over this device's own samples, each epoch in batches of its own size.

    The drop-in emulates compute, not links: the model's trips to and from the
    owner are slept here, before the epoch under local training (the merge ends
    it), after every step under per-step allreduce (every step waits for the
    slowest link).
    """
    loader = model.allocate(DataLoader(data, batch_size=cluster.devices[model.rank].feasible_batch_size),
                            shuffle=True, seed=settings["seed"], own_data=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings["lr"], momentum=0.9)
    trip_s = [2 * _link_s(device, cluster.model_bytes) for device in cluster.devices]
    epoch_trip_s, step_trip_s = (trip_s[model.rank], 0.0) if sync == "local" else (0.0, max(trip_s))
    for epoch in range(settings["epochs"]):
        loader.sampler.set_epoch(epoch)
        time.sleep(epoch_trip_s)
        for inputs, targets in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            time.sleep(step_trip_s)
        on_epoch()


def _emulation(cluster: ClusterSpec) -> hetdp.Emulation:
    """Each device's time per sample (``batch_time_s / batch_size``) as the drop-in's emulation."""
    sample_ms = per_sample_ms(cluster)
    return hetdp.Emulation(speeds=tuple(max(sample_ms) / ms for ms in sample_ms), sample_cost_ms=max(sample_ms))


def _link_s(device: DeviceSpec, nbytes: float) -> float:
    """Seconds to move ``nbytes`` from the data owner to ``device`` (alpha + size / B; 0 behind an infinite link)."""
    return hetdp.Link(bandwidth_mbps=device.bandwidth_mbps, latency_ms=device.latency_ms).transfer_s(nbytes)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m hetdp.bench.cadp --worker FOLDER (started by `hetdp bench cadp`)")
    _worker(Path(sys.argv[2]))
