"""Eager-SGD against synchronous SGD under one random straggler per step: the paper's hyperplane regression
(section 7.2.1, Fig. 10).

A one-layer model learns y = a . x + noise (8192 dimensions, 32,768 training
points, a global batch of 2,048 over 8 processes). At every step one process,
drawn at random (the same draw on every rank), sleeps 200, 300 or 400 ms before
computing; compute itself is padded to a fixed time per step so that ranks
sharing two cores still compute at equal speed. Every mode is the drop-in,
``hetdp.DDP(model, "equal", sync)``, over the same steps: synchronous SGD
(``"allreduce"``) against eager-SGD's solo and majority partial allreduce
(``"solo"``, ``"majority"``); the drop-in's emulation draws the stragglers and
pads the compute. One launch measures every mode and delay.

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector
from tqdm import tqdm

from hetdp.cluster.emulate import Emulation
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError, HetDPError
from hetdp.launch import run_local
from hetdp.report import format_table
from hetdp.runtime import init_distributed

MODES = ("sync", "solo", "majority")
SYNC = {"sync": "allreduce", "solo": "solo", "majority": "majority"}
"""The drop-in's synchronization of each mode."""
PAPER = {"speedup_solo": {"200": 1.50, "300": 1.75, "400": 2.01}, "steps_per_s_solo_200": 1.64,
         "steps_per_s_majority_200": 1.37}
"""Section 7.2.1 of the paper: 8 P100 nodes, eager-SGD (solo) over Deep500's synchronous SGD."""
SIZES = {
    "full": {"dim": 8192, "train": 32768, "batch": 2048, "epochs": 12, "lr": 0.05},
    "quick": {"dim": 512, "train": 6144, "batch": 512, "epochs": 2, "lr": 0.1},
}
"""The paper's problem (its 48 epochs cut to 12), and a small one for --quick."""


def parse_delays(text: str) -> list[float]:
    try:
        delays = [float(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"--delays-ms takes milliseconds like 200,300,400; got {text!r}") from None
    if not delays or any(not d >= 0 for d in delays):
        raise ConfigError(f"--delays-ms needs values >= 0, got {text!r}")
    return delays


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=8, help="processes (default 8, as in the paper)")
    parser.add_argument("--delays-ms", default="200,300,400",
                        help="straggler delays, one run each (default 200,300,400)")
    parser.add_argument("--epochs", type=int, help="epochs per run (default 12; --quick 2)")
    parser.add_argument("--compute-ms", type=float, default=100.0,
                        help="emulated compute time of one step on every rank (default 100)")
    parser.add_argument("--dim", type=int, help="hyperplane dimensions (default 8192; --quick 512)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = dict(SIZES["quick" if args.quick else "full"])
    size["epochs"] = args.epochs or size["epochs"]
    size["dim"] = args.dim or size["dim"]
    delays = parse_delays(args.delays_ms)
    if args.nproc < 2 or size["batch"] % args.nproc or size["train"] % size["batch"]:
        raise ConfigError(f"--nproc must be >= 2 and divide the batch of {size['batch']}, got {args.nproc}")
    if size["epochs"] < 1 or not args.compute_ms >= 0:
        raise ConfigError(f"--epochs must be >= 1 and --compute-ms >= 0, got {size['epochs']}, {args.compute_ms}")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "eager.json"
        worker_args = ["--out", out, "--delays-ms", ",".join(map(str, delays)), "--compute-ms", args.compute_ms,
                       "--seed", args.seed] + [item for key, value in size.items() for item in (f"--{key}", value)]
        completed = run_local("hetdp.bench.eager", args.nproc, worker_args, module=True)
        if completed.returncode != 0 or not out.is_file():
            raise HetDPError(f"eager workers failed (exit code {completed.returncode}); see their output above")
        raw = json.loads(out.read_text())
    return summarize(raw, size, args.nproc, args.compute_ms)


def _key(delay: float) -> str:
    return f"{delay:g}"


def summarize(raw: dict[str, Any], size: dict[str, Any], nproc: int, compute_ms: float) -> dict[str, Any]:
    runs = raw["runs"]
    delays = sorted({run_["delay_ms"] for run_ in runs})
    table = {(run_["mode"], run_["delay_ms"]): run_ for run_ in runs}
    steps_per_s = {mode: {_key(d): table[mode, d]["steps_per_s"] for d in delays} for mode in MODES}
    val_mse = {mode: {_key(d): table[mode, d]["val_mse"] for d in delays} for mode in MODES}
    eager_runs = [run_ for run_ in runs if run_["mode"] != "sync"]
    return {
        "nproc": nproc,
        "delays_ms": delays,
        "steps_per_s": steps_per_s,
        "speedup_solo": {k: steps_per_s["solo"][k] / steps_per_s["sync"][k] for k in steps_per_s["sync"]},
        "speedup_majority": {k: steps_per_s["majority"][k] / steps_per_s["sync"][k] for k in steps_per_s["sync"]},
        "val_mse": val_mse,
        "val_mse_vs_sync": {mode: {k: val_mse[mode][k] / val_mse["sync"][k] for k in val_mse["sync"]}
                            for mode in MODES[1:]},
        "max_param_divergence": max(run_["divergence"] for run_ in eager_runs),
        "rounds": {mode: {_key(d): table[mode, d]["rounds"] for d in delays} for mode in MODES},
        "settings": {**size, "compute_ms": compute_ms, "noise_sd": raw["noise_sd"],
                     "note": "quick: a smaller problem than the paper's" if size["dim"] < 8192 else "paper size"},
        "paper": PAPER,
        "runs": runs,
    }


def render(result: dict[str, Any]) -> str:
    rows = []
    for delay in result["delays_ms"]:
        key = _key(delay)
        for mode in MODES:
            rows.append({
                "delay ms": delay,
                "mode": mode,
                "steps/s": result["steps_per_s"][mode][key],
                "speedup": result["steps_per_s"][mode][key] / result["steps_per_s"]["sync"][key],
                "rounds": result["rounds"][mode][key],
                "val MSE": result["val_mse"][mode][key],
            })
    s = result["settings"]
    title = (f"hyperplane regression, {s['dim']} dims, {s['train']} points, batch {s['batch']} over "
             f"{result['nproc']} processes, {s['epochs']} epochs, compute {s['compute_ms']:g} ms/step")
    lines = [format_table(rows, title=title)]
    lines.append(f"largest parameter gap between replicas at the end: {result['max_param_divergence']:.3g} (solo and "
                 "majority: every rank applies every round, and the ranks meet at the end)")
    lines.append("paper speedup of solo over synch-SGD: "
                 + ", ".join(f"{v}x at {k} ms" for k, v in result["paper"]["speedup_solo"].items()))
    return "\n".join(lines)


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------

NOISE_SD = 1.0


def _shard(seed: int, tag: int, rows: int, coefficients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` points of y = a . x + noise, x ~ N(0, I), drawn from (seed, tag)."""
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, tag]).generate_state(1)[0]))
    inputs = torch.randn(rows, coefficients.numel(), generator=generator)
    targets = inputs @ coefficients + NOISE_SD * torch.randn(rows, generator=generator)
    return inputs, targets.unsqueeze(1)


def _batches(size: int, local_batch: int, seed: int, rank: int) -> Iterator[torch.Tensor]:
    """This rank's batches, epoch after epoch, each epoch in a fresh seeded order (the last partial batch dropped)."""
    for epoch in itertools.count():
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch + 1000 * rank))
        yield from order[: size // local_batch * local_batch].split(local_batch)


def _train(args: argparse.Namespace, mode: str, delay_ms: float, data: tuple[torch.Tensor, torch.Tensor],
           progress: tqdm) -> dict[str, Any]:
    """One run of ``mode`` through the drop-in: every rank runs the same steps on its own shard's batches."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_batch = args.batch // world_size
    emulation = Emulation(sample_cost_ms=args.compute_ms / local_batch, straggler_count=1,
                          straggler_delay_ms=delay_ms, seed=args.seed)
    net = nn.Linear(args.dim, 1)
    nn.init.zeros_(net.weight)
    nn.init.zeros_(net.bias)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
    rounds = [0]
    optimizer.register_step_post_hook(lambda *_: rounds.__setitem__(0, rounds[0] + 1))  # once per round applied
    model = DistributedDataParallel(net, "equal", SYNC[mode], emulation=emulation)
    inputs, targets = data
    steps = args.epochs * (inputs.shape[0] // local_batch)
    dist.barrier()
    started = time.perf_counter()
    for batch in itertools.islice(_batches(inputs.shape[0], local_batch, args.seed, rank), steps):
        model.begin_step(local_batch, local_batch * world_size)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs[batch]), targets[batch]).backward()
        optimizer.step()
        model.end_step()
        progress.update()
    model.end_epoch()  # the ranks meet: partial synchronization flushes the rounds in flight and averages
    wall_s = time.perf_counter() - started
    divergence = _divergence(net)
    model.close()
    return {"mode": mode, "delay_ms": delay_ms, "steps": steps, "wall_s": wall_s, "steps_per_s": steps / wall_s,
            "rounds": rounds[0], "divergence": divergence, "model": net}


def _divergence(model: nn.Module) -> float:
    """The largest absolute difference between a parameter here and on rank 0, over all ranks (collective)."""
    flat = parameters_to_vector(model.parameters()).detach().double()
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    gap = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap.item())


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.eager")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--delays-ms", required=True)
    parser.add_argument("--compute-ms", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    for key in ("dim", "train", "batch", "epochs"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    coefficients = torch.randn(args.dim, generator=torch.Generator().manual_seed(args.seed)) / args.dim**0.5
    data = _shard(args.seed, 1 + rank, args.train // world_size, coefficients)
    validation = _shard(args.seed, 0, 4096, coefficients) if rank == 0 else None
    delays = parse_delays(args.delays_ms)
    plan = [(mode, delay) for delay in delays for mode in MODES]
    steps = args.epochs * (args.train // args.batch)
    progress = tqdm(total=len(plan) * steps, desc="eager runs", unit="step", disable=None if rank == 0 else True,
                    file=sys.stderr)
    runs = []
    for mode, delay in plan:
        progress.set_postfix(mode=mode, delay_ms=f"{delay:g}")
        record = _train(args, mode, delay, data, progress)
        model = record.pop("model")
        if validation is not None:
            with torch.no_grad():
                record["val_mse"] = nn.functional.mse_loss(model(validation[0]), validation[1]).item()
        walls = [None] * world_size
        dist.all_gather_object(walls, record["wall_s"])
        record["wall_s"] = max(walls)  # the run ends when the last rank is done
        record["steps_per_s"] = record["steps"] / record["wall_s"]
        runs.append(record)
    progress.close()
    if rank == 0:
        args.out.write_text(json.dumps({"runs": runs, "noise_sd": NOISE_SD}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
