"""``hetdp bench fsdp``: the sharded drop-in (``hetdp.fully_shard``) on emulated unequal devices.

One launch of 4 ranks over gloo trains the reference FSDP2 script's model
(``bench.models.TinyLM``, sharded block by block, then the root) at speeds
1,1,2,4, with SGD + momentum (its state sharded too) and clipping, an epoch of
each run in turn (a loaded machine's slow spells fall on all of them alike):

* equal and adaptive shares of the sharded drop-in: ``speedup_vs_equal``;
* hetdp.DDP (adaptive) on the same model and emulation: ``vs_ddp``, the sharded
  epoch time over the replicated one;
* the adaptive run's parameters against one process on the same global batches
  (``param_gap``), and the bytes each rank holds of the parameters, gradients and
  optimizer state against a replica's (``state_bytes_per_rank``);
* an adaptive run whose fastest rank's emulated device has memory for ``CAP``
  samples beside its shard (``caps``, ``capped_shares``).

The sample cost is calibrated so that the emulated devices, not the host, set
the pace: the fastest device's block is ``HEADROOM`` times the host's real
compute of it, and the slowest device's adaptive block ``EXCHANGE_MULTIPLE`` times
what a step measured beyond its block (FSDP2 runs two to three collectives a unit
a step, and on a shared 2-core host each costs a few scheduler quanta, beside the
optimizer's and the loop's own work). Run as a module
under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from hetdp.bench.models import TinyLM, next_token_loss, token_sequences
from hetdp.bench.workers import launch_workers
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import saved_tensor_bytes, storage_bytes
from hetdp.cluster.probe import median_batch_s
from hetdp.data.steps import StepSampler
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError
from hetdp.fsdp.dropin import unit_options
from hetdp.fsdp.memory import footprint, unit_shapes
from hetdp.fsdp.shard import fully_shard
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed

SPEEDS = (1.0, 1.0, 2.0, 4.0)
BATCH = 16
"""Samples per rank per step under equal shares: a global batch of 64."""
SIZES = {"quick": {"samples": 384, "epochs": 2}, "full": {"samples": 1280, "epochs": 3}}
"""Samples (6 and 20 steps an epoch) and epochs per run."""
HEADROOM = 2.0
"""The fastest device's emulated block over the host's real compute of it."""
EXCHANGE_MULTIPLE = 4.0
"""The slowest device's adaptive block over what a step measured beyond its block (X: collectives and host work): at
4, the ideal 2.0x speedup over equal shares reads as (16 c + X) / (8 c + X) = 1.8x with X in both."""
CAP = 20
"""Samples the fastest rank's emulated memory holds beside its shard in the capped run (its speed would take 32)."""
LR = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="epochs per run (default 3, quick 2); the last one is timed")
    parser.add_argument("--sample-cost-ms", type=float,
                        help="emulated ms per sample at speed 1 (default: calibrated on this machine)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = SIZES["quick" if args.quick else "full"]
    epochs = args.epochs or size["epochs"]
    if epochs < 2:
        raise ConfigError(f"--epochs must be >= 2 (the first settles the shares), got {epochs}")
    if args.sample_cost_ms is not None and not args.sample_cost_ms > 0:
        raise ConfigError(f"--sample-cost-ms must be > 0, got {args.sample_cost_ms}")
    cost = ["--sample-cost-ms", args.sample_cost_ms] if args.sample_cost_ms else []
    raw = launch_workers("hetdp.bench.fsdp", len(SPEEDS), ["--epochs", epochs, "--samples", size["samples"],
                                                           "--seed", args.seed, *cost],
                         total=3 * epochs + 2, description="epochs", unit="epoch")
    return summarize(raw)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from rank 0's rows (each run's last epoch is its steady one)."""
    runs = raw["runs"]
    equal_s, adaptive_s, ddp_s = (runs[name][-1]["epoch_s"] for name in ("equal", "adaptive", "ddp"))
    replica = raw["replica_state_bytes"]
    return {
        "speedup_vs_equal": equal_s / adaptive_s,
        "param_gap": raw["param_gap"],
        "final_shares": runs["adaptive"][-1]["shares"],
        "vs_ddp": adaptive_s / ddp_s,
        "state_bytes_per_rank": raw["state_bytes_per_rank"],
        "replica_state_bytes": replica,
        "state_fraction": max(raw["state_bytes_per_rank"]) / replica,
        "caps": raw["capped"]["caps"],
        "capped_shares": raw["capped"]["shares"],
        "capped_diagnosis": raw["capped"]["diagnosis"],
        "epoch_s": {"equal": equal_s, "adaptive": adaptive_s, "ddp": ddp_s},
        "speeds": list(SPEEDS),
        "sample_cost_ms": raw["sample_cost_ms"],
        "calibration": raw["calibration"],
        "global_batch": BATCH * len(SPEEDS),
        "parameters": raw["parameters"],
        "optimizer": "SGD(lr=0.05, momentum=0.9), clip_grad_norm_ 1.0",
        "runs": runs,
    }


def render(result: dict[str, Any]) -> str:
    epoch_s = result["epoch_s"]
    rows = [
        {"run": "sharded, equal", "steady epoch s": epoch_s["equal"], "shares": result["runs"]["equal"][-1]["shares"]},
        {"run": "sharded, adaptive", "steady epoch s": epoch_s["adaptive"], "shares": result["final_shares"]},
        {"run": "hetdp.DDP, adaptive", "steady epoch s": epoch_s["ddp"], "shares": result["runs"]["ddp"][-1]["shares"]},
        {"run": f"sharded, adaptive, rank 3 capped at {CAP}", "steady epoch s": "", "shares": result["capped_shares"]},
    ]
    replica = result["replica_state_bytes"]
    title = (f"hetdp.fully_shard on speeds {','.join(f'{s:g}' for s in SPEEDS)} ({result['parameters']:,} parameters, "
             f"global batch {result['global_batch']}, {result['sample_cost_ms']:.3g} ms per sample at speed 1)")
    figures = (f"speedup_vs_equal {result['speedup_vs_equal']:.2f} (target >= 1.6, ideal 2.0); param_gap "
               f"{result['param_gap']:.1e} (target <= 1e-5); vs_ddp {result['vs_ddp']:.2f}; state per rank "
               f"{[round(b / replica, 3) for b in result['state_bytes_per_rank']]} of a replica's {replica:,} B; caps "
               f"{result['caps']}\ncapped run: {result['capped_diagnosis']}")
    return "\n".join([format_table(rows, title=title), figures])


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _sharded(seed: int, **settings: Any) -> nn.Module:
    model = _model(seed)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model, **settings)


def _loader(samples: int, seed: int) -> DataLoader:
    dataset = token_sequences(samples, seed=seed)
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, seed=seed), drop_last=True)


class _Run:
    """The reference script's loop on one drop-in, an epoch at a time; a row per epoch."""

    def __init__(self, name: str, model: Any, samples: int, seed: int) -> None:
        self.name = name
        self.model = model
        self.loader = model.allocate(_loader(samples, seed))
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def epoch(self, epoch: int) -> dict[str, Any]:
        self.loader.sampler.set_epoch(epoch)
        began = [time.perf_counter()]
        for (tokens,) in self.loader:
            self.optimizer.zero_grad()
            next_token_loss(self.model, tokens).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            began.append(time.perf_counter())
        report = self.model.last_epoch
        return {"run": self.name, "epoch": epoch, "epoch_s": report.epoch_s, "shares": report.shares,
                "caps": report.caps, "diagnosis": report.diagnosis(),
                "step_s": [end - start for start, end in itertools.pairwise(began)]}

    def close(self) -> None:
        self.model.close()


def _alternate(runs: list[_Run], epochs: int, progress: EventWriter) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {run.name: [] for run in runs}
    for epoch in range(epochs):
        for run in runs:
            dist.barrier()
            rows[run.name].append(run.epoch(epoch))
            progress.update(row=rows[run.name][-1])
    return rows


def _calibrate(samples: int, seed: int) -> tuple[float, dict[str, float]]:
    """The sample cost (ms at speed 1) that makes the emulated devices set the pace: rank 0 times the host's real
    compute of the fastest device's adaptive share; then an epoch at the adaptive shares times what a step costs
    beyond its emulated block (its collectives' waits and the host's work between steps: on a shared 2-core host
    these, not the devices, would set the pace of a fast step)."""
    ideal = [round(BATCH * len(SPEEDS) * speed / sum(SPEEDS)) for speed in SPEEDS]
    seconds = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        (tokens,) = token_sequences(ideal[-1], seed=seed).tensors
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        seconds[0] = median_batch_s(_model(seed), inputs, targets, _flat_cross_entropy, repeats=3, warmup=1)
    dist.broadcast(seconds, 0)
    compute_ms = 1000.0 * HEADROOM * float(seconds) * SPEEDS[-1] / ideal[-1]
    model = _sharded(seed, allocation="equal", emulation=Emulation(speeds=SPEEDS, sample_cost_ms=compute_ms))
    probe = _Run("calibration", model, samples, seed)
    model.set_shares(ideal)
    steps_s = probe.epoch(0)["step_s"][1:]  # past the first, which sets FSDP2 up
    probe.close()
    beyond_s = max(statistics.median(steps_s) - ideal[0] * compute_ms / 1000.0, 0.0)
    cost_ms = max(compute_ms, 1000.0 * EXCHANGE_MULTIPLE * beyond_s / ideal[0])
    return cost_ms, {"host_compute_ms_per_sample": compute_ms, "step_beyond_block_s": beyond_s}


def _flat_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of the parameters, their gradients and the optimizer's state (its shards of each)."""
    parameters = list(model.parameters())
    state = [value for entry in optimizer.state.values() for value in entry.values() if isinstance(value, torch.Tensor)]
    return (storage_bytes(parameters) + storage_bytes(p.grad for p in parameters if p.grad is not None)
            + storage_bytes(state))


def _replica_state_bytes(seed: int) -> int:
    """A replica's parameters, gradients and momentum (SGD's one copy), in bytes."""
    return 3 * sum(p.numel() * p.element_size() for p in _model(seed).parameters())


def _reference_gap(model: nn.Module, samples: int, epochs: int, seed: int) -> float:
    """The sharded run's parameters against one process on the same global batches (collective; rank 0's figure)."""
    whole = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for name, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return 0.0
    reference = _model(seed)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    (data,) = token_sequences(samples, seed=seed).tensors
    global_batch = BATCH * len(SPEEDS)
    sampler = StepSampler(samples, global_batch, 0, shares_at=lambda _: [global_batch], shuffle=True, seed=seed,
                          drop_last=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = sampler.permutation()
        for first in range(0, samples - global_batch + 1, global_batch):
            optimizer.zero_grad()
            next_token_loss(reference, data[torch.tensor(order[first : first + global_batch])]).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            optimizer.step()
    return max((whole[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters())


def _capped_devices(seed: int, samples: int) -> tuple[DeviceModel, ...]:
    """Device models whose fastest has memory for ``CAP`` samples beside its shard: its footprint once sharded, and
    the activation bytes a sample holds in the whole model (``saved_tensor_bytes`` at 2 and 4 samples)."""
    probe = _sharded(seed)
    units = [unit for unit in probe.modules() if isinstance(unit, FSDPModule)]
    held = footprint(unit_shapes(units, unit_options),
                     storage_bytes(probe.parameters())).held
    plain = _model(seed)
    (tokens,) = token_sequences(4, seed=seed).tensors
    counts = []
    for count in (2, 4):
        saved, output = saved_tensor_bytes(functools.partial(plain, tokens[:count, :-1]), plain.parameters)
        output.sum().backward()
        counts.append(saved)
    per_sample = (counts[1] - counts[0]) / 2
    memory_mb = (held + (CAP + 0.5) * per_sample) / 1e6
    return (DeviceModel(),) * (len(SPEEDS) - 1) + (
        DeviceModel(memory_mb=memory_mb, activation_mb_per_sample=per_sample / 1e6),)


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.fsdp")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-cost-ms", type=float)
    args = parser.parse_args(argv)
    rank, _ = init_distributed("gloo")
    torch.set_num_threads(1)
    progress = EventWriter(enabled=rank == 0)
    if args.sample_cost_ms:
        cost_ms, calibration = args.sample_cost_ms, {}
    else:
        cost_ms, calibration = _calibrate(args.samples, args.seed)
    progress.update(row={"run": "calibration", "sample_cost_ms": round(cost_ms, 2), **calibration})
    emulation = Emulation(speeds=SPEEDS, sample_cost_ms=cost_ms, seed=args.seed)
    runs = [_Run("equal", _sharded(args.seed, allocation="equal", emulation=emulation), args.samples, args.seed),
            _Run("adaptive", _sharded(args.seed, allocation="adaptive", emulation=emulation), args.samples, args.seed),
            _Run("ddp", DistributedDataParallel(_model(args.seed), "adaptive", emulation=emulation), args.samples,
                 args.seed)]
    rows = _alternate(runs, args.epochs, progress)
    adaptive = runs[1]
    state_bytes = [None] * dist.get_world_size()
    dist.all_gather_object(state_bytes, _state_bytes(adaptive.model, adaptive.optimizer))
    gap = _reference_gap(adaptive.model, args.samples, args.epochs, args.seed)
    for each in runs:
        each.close()
    capped_emulation = Emulation(speeds=SPEEDS, sample_cost_ms=cost_ms, seed=args.seed,
                                 devices=_capped_devices(args.seed, args.samples))
    capped = _Run("capped", _sharded(args.seed, allocation="adaptive", emulation=capped_emulation), args.samples,
                  args.seed)
    capped_rows = [capped.epoch(0)]  # its shares settle within the epoch
    progress.update(row=capped_rows[-1])
    capped.close()
    if rank == 0:
        args.out.write_text(json.dumps({
            "runs": {**rows, "capped": capped_rows}, "param_gap": gap, "state_bytes_per_rank": state_bytes,
            "replica_state_bytes": _replica_state_bytes(args.seed), "sample_cost_ms": cost_ms,
            "calibration": calibration, "parameters": sum(p.numel() for p in _model(args.seed).parameters()),
            "capped": {"caps": capped_rows[-1]["caps"], "shares": capped_rows[-1]["shares"],
                       "diagnosis": capped_rows[-1]["diagnosis"]}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
