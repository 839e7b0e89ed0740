"""The C-ADP planners on random heterogeneous clusters: exact vs the paper's Algorithm 1 (ALM), objective and time.

Each instance is a random geo cluster (half GPU-like, half CPU-like devices, links
from 50 Mb/s to 1 Gb/s, 150 KB samples); both solvers plan the same dataset, and
their eq. (7) objectives are priced by the same cost model, so ``alm_gap`` is the
ALM's relative excess over the proved optimum.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm import tqdm

from hetdp.allocate.alm import AlmConfig, solve_alm
from hetdp.allocate.apportion import apportion
from hetdp.allocate.cost import CostModel
from hetdp.allocate.exact import solve_exact
from hetdp.allocate.planner import plan
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.errors import ConfigError
from hetdp.report import format_table

DEFAULT_DEVICES = "8,100,1000,10000"
SAMPLE_BYTES = 150_000
"""An ImageNet image, as in the C-ADP paper's setting."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default=DEFAULT_DEVICES, help=f"cluster sizes (default {DEFAULT_DEVICES})")
    parser.add_argument("--instances", type=int, help="random clusters per size (default 5, quick 2)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs planned for (default 10)")
    parser.add_argument(
        "--samples-per-device", type=int, default=1000,
        help="dataset size per device (default 1000; at least 100,000 samples in all)",
    )


def random_cluster(devices: int, rng: np.random.Generator) -> ClusterSpec:
    """A random geo cluster: half GPU-like (batch 32-128, 2-10 ms per sample), half CPU-like (batch 4-16,
    50-400 ms per sample), links log-uniform in 50 Mb/s - 1 Gb/s with 1-100 ms latency, a 25-100 MB model."""
    specs = []
    for index in range(devices):
        gpu = rng.random() < 0.5
        batch = int(rng.choice([32, 64, 128] if gpu else [4, 8, 16]))
        per_sample_s = rng.uniform(0.002, 0.01) if gpu else rng.uniform(0.05, 0.4)
        specs.append(
            DeviceSpec(
                name=f"{'gpu' if gpu else 'cpu'}-{index}",
                batch_size=batch,
                batch_time_s=float(batch * per_sample_s),
                bandwidth_mbps=float(math.exp(rng.uniform(math.log(50), math.log(1000)))),
                latency_ms=float(rng.uniform(1, 100)),
            )
        )
    model_bytes = float(rng.choice([25e6, 50e6, 100e6]))
    return ClusterSpec(devices=tuple(specs), sample_bytes=SAMPLE_BYTES, model_bytes=model_bytes)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = _parse_sizes(args.devices)
    count = args.instances or (2 if args.quick else 5)
    if count < 1 or args.epochs < 1 or args.samples_per_device < 1:
        raise ConfigError("--instances, --epochs and --samples-per-device must be >= 1")
    jobs = [(size, index) for size in sizes for index in range(count)]
    instances = []
    for size, index in tqdm(jobs, desc="planner", unit="cluster", leave=False):
        rng = np.random.default_rng([args.seed, size, index])
        instances.append(run_instance(random_cluster(size, rng), args.samples_per_device, args.epochs, index))
    gaps = [item["alm_gap"] for item in instances]
    return {
        "epochs": args.epochs,
        "samples_per_device": args.samples_per_device,
        "instances": instances,
        "exact_s_max": max(item["exact_s"] for item in instances),
        "exact_cpu_s_max": max(item["exact_cpu_s"] for item in instances),
        "exact_plan_s_max": max(item["exact_plan_s"] for item in instances),
        "exact_optimal_all": all(item["exact_gap"] == 0 for item in instances),
        "alm_gap_mean": float(np.mean(gaps)),
        "alm_gap_max": max(gaps),
        "alm_s_max": max(item["alm_s"] for item in instances),
        "by_devices": _by_size(instances),
    }


def run_instance(cluster: ClusterSpec, samples_per_device: int, epochs: int, index: int) -> dict[str, Any]:
    """Plan one cluster with both solvers; times are solve times on a prepared cost model."""
    devices = len(cluster.devices)
    dataset_size = max(100_000, samples_per_device * devices)
    model = CostModel.from_cluster(cluster)
    exact, exact_s, exact_cpu_s = _timed(lambda: solve_exact(model, dataset_size, epochs))
    alm, alm_s, alm_cpu_s = _timed(lambda: solve_alm(model, dataset_size, epochs, config=AlmConfig()))
    start = time.perf_counter()
    plan(cluster, dataset_size, epochs, method="exact")  # the public call, cost model included
    exact_plan_s = time.perf_counter() - start
    exact_objective = model.total_s(exact.samples, epochs)
    alm_objective = model.total_s(alm, epochs)
    equal_objective = model.total_s(apportion([1.0] * devices, dataset_size, minimum=0), epochs)
    return {
        "devices": devices,
        "instance": index,
        "dataset_size": dataset_size,
        "exact_objective": exact_objective,
        "exact_s": exact_s,
        "exact_cpu_s": exact_cpu_s,
        "exact_plan_s": exact_plan_s,
        "exact_gap": 0.0 if exact.optimal else (exact_objective - exact.lower_bound_s) / exact_objective,
        "exact_evaluations": exact.evaluations,
        "alm_objective": alm_objective,
        "alm_s": alm_s,
        "alm_cpu_s": alm_cpu_s,
        "alm_gap": alm_objective / exact_objective - 1.0,
        "equal_objective": equal_objective,
    }


def _timed(solve: Callable[[], Any]) -> tuple[Any, float, float]:
    """Run ``solve``; return its result, wall seconds and CPU seconds of this process (the solvers are
    single-threaded, so CPU time is the figure that other load on the machine does not inflate)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = solve()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def render(result: dict[str, Any]) -> str:
    rows = [
        {
            "devices": item["devices"],
            "#": item["instance"],
            "D": item["dataset_size"],
            "exact_total_s": item["exact_objective"],
            "exact_s": item["exact_s"],
            "evals": item["exact_evaluations"],
            "exact_gap": item["exact_gap"],
            "alm_total_s": item["alm_objective"],
            "alm_s": item["alm_s"],
            "alm_gap_%": round(100 * item["alm_gap"], 3),
            "equal/exact": item["equal_objective"] / item["exact_objective"],
        }
        for item in result["instances"]
    ]
    title = f"C-ADP planners on random geo clusters ({result['epochs']} epochs, 150 KB samples)"
    summary = [
        f"exact: proved optimal on every instance: {result['exact_optimal_all']}; "
        f"slowest solve {result['exact_s_max']:.3f} s wall, {result['exact_cpu_s_max']:.3f} s CPU "
        f"(public plan() call {result['exact_plan_s_max']:.3f} s)",
        f"alm:   gap to optimal mean {100 * result['alm_gap_mean']:.2f}%, max {100 * result['alm_gap_max']:.2f}%; "
        f"slowest solve {result['alm_s_max']:.2f} s",
    ]
    return "\n".join([format_table(rows, title=title), "", *summary])


def _by_size(instances: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    result = {}
    for size in sorted({item["devices"] for item in instances}):
        group = [item for item in instances if item["devices"] == size]
        result[str(size)] = {
            "exact_s_max": max(item["exact_s"] for item in group),
            "alm_s_max": max(item["alm_s"] for item in group),
            "alm_gap_mean": float(np.mean([item["alm_gap"] for item in group])),
            "alm_gap_max": max(item["alm_gap"] for item in group),
        }
    return result


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"--devices must be comma-separated positive integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--devices must be comma-separated positive integers, got {text!r}")
    return sizes
