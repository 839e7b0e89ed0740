"""``hetdp bench fsdp``: the sharded drop-in (``hetdp.fully_shard``) on emulated unequal devices, and against torch.

One launch of 4 ranks over gloo trains the reference FSDP2 script's model
(``bench.models.TinyLM``, sharded block by block, then the root) with SGD +
momentum (its state sharded too) and clipping. Every ratio is of whole epochs on
one clock, the sides an epoch each in turn (``bench.compare``):

* at emulated speeds 1,1,2,4 and a fixed ``--sample-cost-ms`` (a device model given,
  never chosen from the ratio it gives): adaptive against equal shares of the
  sharded drop-in, ``speedup_vs_equal``, beside its ``ideal_speedup`` (the equal
  run less the compute balanced shares would save, at the compute per sample each
  rank measured: the exchange stays as measured) and their ratio, ``efficiency``;
  and ``vs_ddp``, the sharded epoch over ``hetdp.DDP``'s on the same emulation;
* unemulated, every rank alike: the drop-in at equal shares against torch's own
  ``fully_shard`` on the same model, data and loop, ``vs_fully_shard`` (its epoch
  over torch's; ideal 1);
* the adaptive run's parameters against one process on the same global batches
  (``param_gap``), and the bytes each rank holds of the parameters, gradients and
  optimizer state against a replica's (``state_bytes_per_rank``);
* an adaptive run whose fastest rank's emulated device has ``CAPPED_MEMORY_MB`` of
  memory: the cap the drop-in finds (``caps``, ``capped_shares``), checked against
  the memory that rank actually holds in each step (``held``: its state's tensors at
  the step's start and the peak of those the step allocates, counted as torch
  allocates them, ``bench.held``), not against the drop-in's own arithmetic.

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from hetdp.bench.compare import alternate, exchange_s, ideal, per_sample_s, plain_row, report_row, steady_s
from hetdp.bench.held import HeldBytes, state_bytes
from hetdp.bench.models import TinyLM, next_token_loss, token_sequences
from hetdp.bench.workers import launch_workers
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import saved_tensor_bytes
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError
from hetdp.fsdp.shard import fully_shard
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed

SPEEDS = (1.0, 1.0, 2.0, 4.0)
BATCH = 16
"""Samples per rank per step under equal shares: a global batch of 64."""
SIZES = {"quick": {"samples": 384, "epochs": 3, "plain_epochs": 8},
         "full": {"samples": 1280, "epochs": 5, "plain_epochs": 16}}
"""Samples (6 and 20 steps an epoch), epochs of each emulated run and of each run against torch's ``fully_shard``."""
WARMUP = 1
"""Epochs of every run dropped before its steady figure: the first settles the shares (and sets FSDP2 up)."""
SAMPLE_COST_MS = 10.0
"""Emulated milliseconds a sample costs at speed 1: the fastest device's block of 32 samples (80 ms) stays above the
host's real compute of it (about 1.4 ms a sample on one core here), so the emulated devices set the pace."""
CAPPED_MEMORY_MB = 12.0
"""The capped run's fastest device: its memory, in MB (TinyLM's activations take about half a MB a sample)."""
CAPPED_EPOCHS = 2
"""Epochs of the capped run: its shares settle within the first, the second runs at them."""
LR = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int,
                        help="epochs per emulated run (default 5, quick 3); the first is warm-up")
    parser.add_argument("--sample-cost-ms", type=float, default=SAMPLE_COST_MS,
                        help=f"emulated ms per sample at speed 1 (default {SAMPLE_COST_MS:g})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = SIZES["quick" if args.quick else "full"]
    epochs = args.epochs or size["epochs"]
    if epochs <= WARMUP:
        raise ConfigError(f"--epochs must be >= {WARMUP + 1} (the first settles the shares), got {epochs}")
    if not args.sample_cost_ms > 0:
        raise ConfigError(f"--sample-cost-ms must be > 0, got {args.sample_cost_ms}")
    raw = launch_workers("hetdp.bench.fsdp", len(SPEEDS), [
        "--epochs", epochs, "--plain-epochs", size["plain_epochs"], "--samples", size["samples"],
        "--seed", args.seed, "--sample-cost-ms", args.sample_cost_ms],
        total=3 * epochs + 2 * size["plain_epochs"] + CAPPED_EPOCHS, description="epochs", unit="epoch")
    return summarize(raw)


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's figures from rank 0's rows."""
    runs, plain = raw["runs"], raw["plain"]
    equal = runs["equal"]
    equal_s, adaptive_s, ddp_s = (steady_s(runs[name]) for name in ("equal", "adaptive", "ddp"))
    per_sample = per_sample_s(equal)
    best = ideal(equal_s, baseline_samples=equal[-1]["samples"], per_sample=per_sample)
    speedup = equal_s / adaptive_s
    torch_s, ours_s = steady_s(plain["torch_fully_shard"]), steady_s(plain["hetdp_equal"])
    replica = raw["replica_state_bytes"]
    return {
        "speedup_vs_equal": speedup,
        "ideal_speedup": best.speedup,
        "efficiency": speedup / best.speedup,
        "vs_fully_shard": ours_s / torch_s,
        "param_gap": raw["param_gap"],
        "final_shares": runs["adaptive"][-1]["shares"],
        "vs_ddp": adaptive_s / ddp_s,
        "per_sample_ms": [None if s is None else 1000 * s for s in per_sample],
        "exchange_ms_per_step": 1000 * exchange_s(equal),
        "exchange_fraction": exchange_s(equal) * equal[-1]["steps"] / equal_s,
        "state_bytes_per_rank": raw["state_bytes_per_rank"],
        "replica_state_bytes": replica,
        "state_fraction": max(raw["state_bytes_per_rank"]) / replica,
        "caps": raw["capped"]["caps"],
        "capped_shares": raw["capped"]["shares"],
        "capped_diagnosis": raw["capped"]["diagnosis"],
        "held": held_figures(raw["capped"]),
        "epoch_s": {"equal": equal_s, "adaptive": adaptive_s, "ddp": ddp_s, "ideal": best.epoch_s,
                    "torch_fully_shard": torch_s, "hetdp_equal_unemulated": ours_s},
        "speeds": list(SPEEDS),
        "sample_cost_ms": raw["sample_cost_ms"],
        "global_batch": BATCH * len(SPEEDS),
        "parameters": raw["parameters"],
        "optimizer": "SGD(lr=0.05, momentum=0.9), clip_grad_norm_ 1.0",
        "runs": runs,
        "plain": plain,
    }


def held_figures(capped: dict[str, Any]) -> dict[str, Any]:
    """The capped rank's memory against its device's: the most it held at each share it ran (its state's tensors at
    the step's start plus the peak of those the step allocated), the bytes one more sample took between the two
    largest shares, and the samples still free at its largest share (negative: the cap let it overrun)."""
    memory = capped["memory_mb"] * 1e6
    by_share = {int(share): held for share, held in capped["held_bytes"].items()}
    largest = max(by_share)
    smaller = [share for share in by_share if share < largest]
    per_sample = ((by_share[largest] - by_share[max(smaller)]) / (largest - max(smaller))) if smaller else None
    return {"rank": capped["rank"], "memory_mb": capped["memory_mb"],
            "activation_mb_per_sample": capped["activation_mb_per_sample"], "held_mb_by_share": {
                share: held / 1e6 for share, held in sorted(by_share.items())},
            "largest_share": largest, "held_mb": by_share[largest] / 1e6, "cap_holds": by_share[largest] <= memory,
            "mb_per_sample": None if per_sample is None else per_sample / 1e6,
            "spare_samples": None if not per_sample else (memory - by_share[largest]) / per_sample}


def render(result: dict[str, Any]) -> str:
    epoch_s = result["epoch_s"]
    runs = result["runs"]
    rows = [
        {"run": "sharded, equal", "steady epoch s": epoch_s["equal"], "shares": runs["equal"][-1]["shares"]},
        {"run": "sharded, adaptive", "steady epoch s": epoch_s["adaptive"], "shares": result["final_shares"]},
        {"run": "  ideal (equal less balanced compute)", "steady epoch s": epoch_s["ideal"], "shares": ""},
        {"run": "hetdp.DDP, adaptive", "steady epoch s": epoch_s["ddp"], "shares": runs["ddp"][-1]["shares"]},
        {"run": "unemulated: torch fully_shard", "steady epoch s": epoch_s["torch_fully_shard"],
         "shares": [BATCH] * len(SPEEDS)},
        {"run": "unemulated: hetdp.fully_shard, equal", "steady epoch s": epoch_s["hetdp_equal_unemulated"],
         "shares": result["plain"]["hetdp_equal"][-1]["shares"]},
        {"run": f"sharded, adaptive, rank 3 of {result['held']['memory_mb']:g} MB", "steady epoch s": "",
         "shares": result["capped_shares"]},
    ]
    replica, held = result["replica_state_bytes"], result["held"]
    title = (f"hetdp.fully_shard on speeds {','.join(f'{s:g}' for s in SPEEDS)} ({result['parameters']:,} parameters, "
             f"global batch {result['global_batch']}, {result['sample_cost_ms']:.3g} ms per sample at speed 1); the "
             "wall clock of whole epochs, runs in turn")
    per_sample = ",".join("-" if ms is None else f"{ms:.2f}" for ms in result["per_sample_ms"])
    figures = [
        f"speedup_vs_equal {result['speedup_vs_equal']:.2f}x, ideal_speedup {result['ideal_speedup']:.2f}x (compute "
        f"{per_sample} ms per sample measured; exchange {result['exchange_ms_per_step']:.0f} ms per step, "
        f"{result['exchange_fraction']:.0%} of the equal epoch): efficiency {result['efficiency']:.3f} (target >= 0.9)",
        f"vs_fully_shard {result['vs_fully_shard']:.3f} (hetdp at equal shares over torch's fully_shard, ideal 1, "
        f"target <= 1.03); vs_ddp {result['vs_ddp']:.2f}; param_gap {result['param_gap']:.1e} (target <= 1e-5)",
        f"state per rank {[round(b / replica, 3) for b in result['state_bytes_per_rank']]} of a replica's "
        f"{replica:,} B",
        f"rank {held['rank']}'s cap {result['caps'][held['rank']]}: at share {held['largest_share']} it held "
        f"{held['held_mb']:.2f} MB of its {held['memory_mb']:g} MB ({'holds' if held['cap_holds'] else 'OVERRUN'}; "
        + ("spare samples " + f"{held['spare_samples']:.1f}" if held["spare_samples"] is not None else "one share run")
        + f")\ncapped run: {result['capped_diagnosis']}",
    ]
    return "\n".join([format_table(rows, title=title), *figures])


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _model(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _sharded(seed: int, shard: Any = fully_shard, **settings: Any) -> nn.Module:
    """The model sharded block by block, then the root, by ``shard`` (hetdp's ``fully_shard`` or torch's)."""
    model = _model(seed)
    for block in model.blocks:
        shard(block)
    return shard(model, **settings)


def _loader(samples: int, seed: int) -> DataLoader:
    dataset = token_sequences(samples, seed=seed)
    return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, seed=seed), drop_last=True)


class _Run:
    """The reference script's loop on one model (a drop-in, or torch's own with ``plain``), an epoch at a time."""

    def __init__(self, name: str, model: Any, samples: int, seed: int, *, plain: bool = False) -> None:
        self.name = name
        self.model = model
        self.plain = plain
        self.loader = _loader(samples, seed) if plain else model.allocate(_loader(samples, seed))
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        self.held: HeldBytes | None = None
        """While set, each step runs under it: ``held_bytes`` keeps the most each share held."""
        self.held_bytes: dict[int, int] = {}

    def train_epoch(self, epoch: int) -> None:
        self.loader.sampler.set_epoch(epoch)
        for (tokens,) in self.loader:
            self.optimizer.zero_grad()
            if self.held is None:
                self._step(tokens)
                continue
            before = state_bytes(self.model.parameters(), self.optimizer)
            with HeldBytes() as held:
                self._step(tokens)
            share = len(tokens)
            self.held_bytes[share] = max(self.held_bytes.get(share, 0), before + held.peak)

    def _step(self, tokens: torch.Tensor) -> None:
        next_token_loss(self.model, tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()

    def describe(self) -> dict[str, Any]:
        if self.plain:
            return plain_row([BATCH] * dist.get_world_size())
        report = self.model.last_epoch
        return {**report_row(report), "caps": report.caps, "diagnosis": report.diagnosis()}

    def close(self) -> None:
        if not self.plain:
            self.model.close()


def _replica_state_bytes(seed: int) -> int:
    """A replica's parameters, gradients and momentum (SGD's one copy), in bytes."""
    return 3 * sum(p.numel() * p.element_size() for p in _model(seed).parameters())


def _reference_gap(model: nn.Module, samples: int, epochs: int, seed: int) -> float:
    """The sharded run's parameters against one process on the same global batches (collective; rank 0's figure):
    each epoch's order is ``DistributedSampler``'s, ``torch.randperm`` seeded with seed + epoch, taken a global
    batch at a time."""
    whole = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for name, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return 0.0
    reference = _model(seed)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    (data,) = token_sequences(samples, seed=seed).tensors
    global_batch = BATCH * len(SPEEDS)
    for epoch in range(epochs):
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch))
        for first in range(0, samples - global_batch + 1, global_batch):
            optimizer.zero_grad()
            next_token_loss(reference, data[order[first : first + global_batch]]).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            optimizer.step()
    return max((whole[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters())


def activation_mb_per_sample(seed: int) -> float:
    """The device table's ``activation_mb_per_sample`` for TinyLM, measured on the host: what autograd saves in a
    forward of 4 samples over one of 2 (``saved_tensor_bytes``), per sample. (The drop-in cannot probe it itself: the
    loader's batches hold one token more than the model's input.)"""
    model = _model(seed)
    (tokens,) = token_sequences(4, seed=seed).tensors
    saved = []
    for count in (2, 4):
        count_saved, output = saved_tensor_bytes(functools.partial(model, tokens[:count, :-1]), model.parameters)
        output.sum().backward()
        saved.append(count_saved)
    return (saved[1] - saved[0]) / 2 / 1e6


def _capped(args: argparse.Namespace, progress: EventWriter) -> dict[str, Any]:
    """An adaptive run whose fastest rank's device has ``CAPPED_MEMORY_MB``; that rank counts what each step holds."""
    rank = len(SPEEDS) - 1
    per_sample_mb = activation_mb_per_sample(args.seed)
    devices = (DeviceModel(),) * rank + (
        DeviceModel(memory_mb=CAPPED_MEMORY_MB, activation_mb_per_sample=per_sample_mb),)
    emulation = Emulation(speeds=SPEEDS, sample_cost_ms=args.sample_cost_ms, seed=args.seed, devices=devices)
    run = _Run("capped", _sharded(args.seed, allocation="adaptive", emulation=emulation), args.samples, args.seed)
    if dist.get_rank() == rank:
        run.held = HeldBytes()
    for epoch in range(CAPPED_EPOCHS):
        run.train_epoch(epoch)
        row = run.describe()
        progress.update(row={"run": "capped", **row})
    held: list[dict[int, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(held, run.held_bytes)
    run.close()
    return {"caps": row["caps"], "shares": row["shares"], "diagnosis": row["diagnosis"], "rank": rank,
            "memory_mb": CAPPED_MEMORY_MB, "activation_mb_per_sample": per_sample_mb, "held_bytes": held[rank]}


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.fsdp")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--plain-epochs", type=int, required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-cost-ms", type=float, required=True)
    args = parser.parse_args(argv)
    rank, _ = init_distributed("gloo")
    torch.set_num_threads(1)
    progress = EventWriter(enabled=rank == 0)
    emulation = Emulation(speeds=SPEEDS, sample_cost_ms=args.sample_cost_ms, seed=args.seed)
    runs = [_Run("equal", _sharded(args.seed, allocation="equal", emulation=emulation), args.samples, args.seed),
            _Run("adaptive", _sharded(args.seed, allocation="adaptive", emulation=emulation), args.samples, args.seed),
            _Run("ddp", DistributedDataParallel(_model(args.seed), "adaptive", emulation=emulation), args.samples,
                 args.seed)]
    rows = alternate(runs, args.epochs, warmup=WARMUP, progress=progress)
    adaptive = runs[1]
    state = [None] * dist.get_world_size()
    dist.all_gather_object(state, state_bytes(adaptive.model.parameters(), adaptive.optimizer))
    gap = _reference_gap(adaptive.model, args.samples, args.epochs, args.seed)
    for each in runs:
        each.close()
    plain = [_Run("torch_fully_shard", _sharded(args.seed, torch_fully_shard), args.samples, args.seed, plain=True),
             _Run("hetdp_equal", _sharded(args.seed, allocation="equal", emulation=Emulation()), args.samples,
                  args.seed)]
    plain_rows = alternate(plain, args.plain_epochs, warmup=WARMUP, progress=progress)
    for each in plain:
        each.close()
    capped = _capped(args, progress)
    if rank == 0:
        args.out.write_text(json.dumps({
            "runs": rows, "plain": plain_rows, "capped": capped, "param_gap": gap, "state_bytes_per_rank": state,
            "replica_state_bytes": _replica_state_bytes(args.seed), "sample_cost_ms": args.sample_cost_ms,
            "parameters": sum(p.numel() for p in _model(args.seed).parameters())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
