"""Adaptive allocation on emulated real devices: fixed step costs, knees, memory caps that force micro-batches.

Each device table (a cluster file without links) is emulated on local ranks, and
``hetdp.DDP`` runs the adaptive allocation twice on it, with the paper's
rule (task-allocation paper, eq. 10) and with the piecewise rule. The ideal is
the exact minimizer of the slowest rank's step time over integer shares
(``min_max_shares``). Two efficiencies stand side by side: ``efficiency_modelled``,
the ideal step over the device model's step at the shares the run reached (no
clock in it), and ``efficiency_measured``, the ideal step plus the exchange the run
measured over the steady steps' wall clock (rank 0's, step end to step end: on a
shared machine it also holds the processes' contention and the host's work between
steps). Each rule is also replayed without processes on the device model's exact
times (``noise_free``, modelled too): where a rule stalls, timing noise can hide or
cause it.

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from tqdm import tqdm

from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.minmax import min_max_shares, step_time_of
from hetdp.allocate.policy import Adaptive
from hetdp.bench.loop import tensor_loader, train_share
from hetdp.cluster.devices import device_model, device_table, per_sample_ms, read_device_table
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.spec import ClusterSpec
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError, HetDPError
from hetdp.launch import run_local
from hetdp.report import format_table
from hetdp.runtime import init_distributed

RULES = ("paper", "piecewise")
FEATURES = 16


def _card(name: str, sample_ms: float, memory_mb: float, fixed_mb: float, activation_mb: float,
          **model: float) -> dict[str, Any]:
    """A device entry: ``sample_ms`` per sample at full throughput (timed as a batch of 64) and the memory of a
    model that keeps ``fixed_mb`` whatever the batch and ``activation_mb`` per sample, whose cap is
    floor((memory - fixed) / activation) (C-ADP eq. 3)."""
    return {"name": name, "batch_size": 64, "batch_time_s": 64 * sample_ms / 1000, "memory_mb": memory_mb,
            "fixed_memory_mb": fixed_mb, "activation_mb_per_sample": activation_mb, **model}


TABLES: dict[str, dict[str, Any]] = {
    "a6000x2+2080tix2": {
        "global_batch": 1024,
        "note": "48 GB cards (cap 225) beside 11 GB ones (cap 40), throughput saturating at 64 samples, 4 ms per "
                "micro-batch: every card accumulates micro-batches at the optimum",
        "devices": [_card(f"a6000-{i}", 0.2, 48_000, 3_000, 200, step_overhead_ms=4, knee=64, micro_overhead_ms=4)
                    for i in range(2)]
                   + [_card(f"2080ti-{i}", 0.5, 11_000, 3_000, 200, step_overhead_ms=4, knee=64,
                            micro_overhead_ms=4) for i in range(2)],
    },
    "fixed-costs": {
        "global_batch": 128,
        "note": "issue 15's case: speeds 1, 1, 2, 4 with fixed per-step costs of 0, 0, 20 and 80 ms",
        "devices": [{"name": name, "batch_size": 64, "batch_time_s": 64 * ms / 1000, "step_overhead_ms": overhead}
                    for name, ms, overhead in (("slow-0", 6.0, 0), ("slow-1", 6.0, 0), ("mid", 3.0, 20),
                                               ("fast", 1.5, 80))],
    },
    "v100x2+gtx1080x2": {
        "global_batch": 512,
        "note": "32 GB cards (cap 256, knee 128) beside 8 GB ones (cap 57, knee 48), 12 ms per micro-batch",
        "devices": [_card(f"v100-{i}", 0.25, 32_000, 1_280, 120, step_overhead_ms=16, knee=128,
                          micro_overhead_ms=12) for i in range(2)]
                   + [_card(f"gtx1080-{i}", 1.0, 8_192, 1_280, 120, step_overhead_ms=16, knee=48,
                            micro_overhead_ms=12) for i in range(2)],
    },
}
"""The built-in device tables (``--table`` adds your own); quick runs the first three."""

SIZES = {"quick": {"steps": 48, "replan_every": 2}, "full": {"steps": 120, "replan_every": 2}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table", action="append", default=[], type=Path, metavar="PATH",
                        help="a device table (TOML cluster file; link fields optional) to run beside the built-in ones")
    parser.add_argument("--global-batch", type=int, default=512, help="samples per step of --table runs (default 512)")
    parser.add_argument("--steps", type=int, help="steps per rule and table (default 120; --quick 48)")
    parser.add_argument("--replan-every", type=int, help="steps between re-plans (default 2)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in ("steps", "replan_every"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    if size["steps"] < 8 or size["replan_every"] < 1:
        raise ConfigError(f"need --steps >= 8 and --replan-every >= 1, got {size['steps']}, {size['replan_every']}")
    tables = {name: (device_table({"devices": table["devices"]}, label=name), table["global_batch"], table["note"])
              for name, table in TABLES.items()}
    for path in args.table:
        if args.global_batch < 1:
            raise ConfigError(f"--global-batch must be >= 1, got {args.global_batch}")
        tables[path.stem] = (read_device_table(path), args.global_batch, str(path))
    results = {}
    for index, (name, (cluster, global_batch, note)) in enumerate(tables.items()):
        print(f"[{index + 1}/{len(tables)}] {name}: {len(cluster.devices)} ranks, global batch {global_batch}",
              file=sys.stderr)
        raw = _launch(cluster, global_batch, size, args.seed)
        results[name] = summarize_table(cluster, global_batch, raw, note)
    def smallest(rule: str, figure: str) -> float:
        return min(table["rules"][rule][figure] for table in results.values())

    return {
        "efficiency_modelled": smallest("piecewise", "efficiency_modelled"),
        "efficiency_measured": smallest("piecewise", "efficiency_measured"),
        "efficiency_paper_rule_modelled": smallest("paper", "efficiency_modelled"),
        "efficiency_paper_rule_measured": smallest("paper", "efficiency_measured"),
        "efficiency_noise_free": smallest("piecewise", "noise_free"),
        "efficiency_paper_rule_noise_free": smallest("paper", "noise_free"),
        "tables": results,
        "settings": {**size, "note": "efficiency_modelled: ideal step / the device model's step at the shares "
                                     "reached (no clock); efficiency_measured: (ideal step + the measured exchange) / "
                                     "the median steady step's wall clock (rank 0, shared machine); noise_free: the "
                                     "rule replayed on the device model's exact times (modelled)"},
    }


def _launch(cluster: ClusterSpec, global_batch: int, size: dict[str, int], seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        table_path, out = Path(folder) / "devices.json", Path(folder) / "result.json"
        table_path.write_text(json.dumps({"cluster": cluster.to_toml(), "global_batch": global_batch, **size,
                                          "seed": seed}))
        completed = run_local("hetdp.bench.devices", len(cluster.devices), ["--settings", table_path, "--out", out],
                              module=True)
        if completed.returncode != 0 or not out.is_file():
            raise HetDPError(f"device workers failed (exit code {completed.returncode}); see their output above")
        return json.loads(out.read_text())


def step_tables(cluster: ClusterSpec, global_batch: int) -> list[list[float]]:
    """Every rank's emulated step milliseconds at shares 0..global_batch, as the benchmark's loop runs them (as
    few near-equal micro-batches as its memory cap allows, ``bench.loop.train_share``)."""
    return [[device_model(device).step_ms(share, ms) for share in range(global_batch + 1)]
            for device, ms in zip(cluster.devices, per_sample_ms(cluster))]


def noise_free(rows: list[list[float]], chunks: list[int | None], global_batch: int, rule: str,
               updates: int = 24) -> float:
    """Efficiency of a rule re-planning on the device model's exact times (``hetdp.Adaptive``'s defaults, no processes):
    the ideal step over the mean step of the second half of ``updates`` re-plans."""
    policy = Adaptive(rule=rule)  # type: ignore[arg-type]
    allocator = AdaptiveAllocator(len(rows), global_batch, 1, tolerance=policy.tolerance, patience=policy.patience,
                                  drift=policy.drift, sustain=policy.sustain, rule=rule,  # type: ignore[arg-type]
                                  chunks=chunks)
    steps_ms = []
    for _ in range(updates):
        steps_ms.append(step_time_of(rows, allocator.shares))
        allocator.update([rows[rank][share] / 1000 for rank, share in enumerate(allocator.shares)])
    ideal_ms = step_time_of(rows, min_max_shares(rows, global_batch, minimum=1))
    return ideal_ms / statistics.fmean(steps_ms[updates // 2 :])


def summarize_table(cluster: ClusterSpec, global_batch: int, raw: dict[str, Any], note: str) -> dict[str, Any]:
    rows = step_tables(cluster, global_batch)
    caps = [device_model(device).max_batch for device in cluster.devices]
    ideal_shares = min_max_shares(rows, global_batch, minimum=1)
    ideal_ms = step_time_of(rows, ideal_shares)
    rules = {}
    for rule, steps in raw["runs"].items():
        steady = steps[len(steps) // 2 :]
        modelled_ms = statistics.fmean(step_time_of(rows, step["shares"]) for step in steady)
        measured_ms = statistics.median(1000 * step["wall_s"] for step in steady)
        exchange_ms = statistics.median(1000 * min(step["wait_s"]) for step in steady)
        rules[rule] = {
            "efficiency_modelled": ideal_ms / modelled_ms,
            "modelled_ms": modelled_ms,
            "efficiency_measured": (ideal_ms + exchange_ms) / measured_ms,
            "measured_ms": measured_ms,
            "exchange_ms": exchange_ms,
            "compute_ms": statistics.median(1000 * max(step["compute_s"]) for step in steady),
            "final_shares": steps[-1]["shares"],
            "replans": raw["replans"][rule],
            "noise_free": noise_free(rows, caps, global_batch, rule),
        }
    return {"devices": cluster.names, "caps": caps,
            "global_batch": global_batch, "ideal_ms": ideal_ms, "ideal_shares": ideal_shares, "note": note,
            "rules": rules}


def render(result: dict[str, Any]) -> str:
    rows = [{
        "table": name,
        "rule": rule,
        "ideal ms": table["ideal_ms"],
        "modelled ms": figures["modelled_ms"],
        "modelled eff.": figures["efficiency_modelled"],
        "noise-free (modelled)": figures["noise_free"],
        "measured ms": figures["measured_ms"],
        "exchange ms": figures["exchange_ms"],
        "measured eff.": figures["efficiency_measured"],
        "final shares": figures["final_shares"],
        "ideal shares": table["ideal_shares"],
    } for name, table in result["tables"].items() for rule, figures in table["rules"].items()]
    lines = [format_table(rows, title="adaptive allocation on emulated devices: paper's rule vs piecewise rule")]
    lines.append(f"efficiency, the smallest over the tables: modelled (the device model at the shares reached) "
                 f"piecewise {result['efficiency_modelled']:.3f}, paper's rule "
                 f"{result['efficiency_paper_rule_modelled']:.3f}; measured (ideal + measured exchange over the "
                 f"steady steps' wall clock) piecewise {result['efficiency_measured']:.3f}, paper's rule "
                 f"{result['efficiency_paper_rule_measured']:.3f}; noise-free replay (modelled): piecewise "
                 f"{result['efficiency_noise_free']:.3f}, paper's rule "
                 f"{result['efficiency_paper_rule_noise_free']:.3f}")
    return "\n".join(lines)


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.devices")
    parser.add_argument("--settings", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    settings = json.loads(args.settings.read_text())
    rank, _ = init_distributed()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cluster.toml"
        path.write_text(settings["cluster"])
        emulation = Emulation.from_device_table(read_device_table(path), seed=settings["seed"])
    global_batch, steps = settings["global_batch"], settings["steps"]
    generator = torch.Generator().manual_seed(settings["seed"])
    inputs = torch.randn(global_batch * steps, FEATURES, generator=generator)
    dataset = TensorDataset(inputs, (inputs.sum(1) > 0).long())
    progress = tqdm(total=len(RULES) * steps, desc="steps", unit="step", disable=None if rank == 0 else True,
                    file=sys.stderr)
    runs, replans = {}, {}
    for rule in RULES:
        torch.manual_seed(settings["seed"])
        model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 2))
        # The share runs as one forward, or as micro-batches where it passes this rank's emulated memory cap.
        policy = Adaptive(rule=rule, replan_every=settings["replan_every"])  # type: ignore[arg-type]
        ddp = DistributedDataParallel(model, policy, "allreduce", emulation=emulation)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = ddp.allocate(tensor_loader(dataset, global_batch), global_batch=global_batch, shuffle=True,
                              seed=settings["seed"], accumulates=True)
        dist.barrier()
        ended = [time.perf_counter()]
        with ddp:
            for inputs, targets in loader:
                optimizer.zero_grad()
                train_share(ddp, inputs, targets, largest=emulation.devices[rank].max_batch)
                optimizer.step()
                ended.append(time.perf_counter())
            report = ddp.last_epoch
            figures = list(ddp.step_figures)
        walls_s = [b - a for a, b in itertools.pairwise(ended)]
        runs[rule] = [{"shares": f.shares, "compute_s": f.compute_s, "wait_s": f.wait_s, "wall_s": walls_s[f.step]}
                      for f in sorted(figures, key=lambda f: f.step)]
        replans[rule] = len(report.replans)
        progress.update(steps)
    progress.close()
    if rank == 0:
        args.out.write_text(json.dumps({"runs": runs, "replans": replans}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
