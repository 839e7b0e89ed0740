"""``hetdp bench gpu``'s sharded parts, on one GPU (NCCL, one rank): the sharded drop-in's overhead against torch's own
``fully_shard`` on the same loop, and a card made small with ``torch.cuda.set_per_process_memory_fraction`` whose
cap the drop-in finds and trains under without running out of memory.

* overhead: a causal transformer LM (``bench.models.TinyLM`` at 8 blocks of width
  512, 26M parameters) under a bf16 ``MixedPrecisionPolicy``, batch 32; torch's
  ``fully_shard`` and ``hetdp.fully_shard`` alternate epochs on the same batches;
  the figure is hetdp's samples/s against torch's (target: at most 3% slower).
* small card: the process's share of the card is set so that ``SMALL_CAP`` samples
  fit beside the model's state (``card_fraction``, from a probe on the whole card);
  ``allocate(loader, accumulates=True)`` then measures the cap on the small card,
  and the loop runs each step's share as micro-batches of at most the cap.

Not yet run on a GPU. Run as a module under torchrun it is the worker.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hetdp.bench.models import TinyLM, token_sequences
from hetdp.cluster.devices import micro_batches
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import HEADROOM
from hetdp.fsdp.shard import fully_shard
from hetdp.launch import EventWriter
from hetdp.runtime import init_distributed, synchronize

SHAPE = {"vocab": 1024, "width": 512, "heads": 8, "layers": 8, "context": 128}
SAMPLES, BATCH = 4096, 32
SMALL_CAP = 8
"""Samples one forward may hold on the small card: a quarter of a step's 32."""
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def card_fraction(cap: int, *, total_bytes: float, used_bytes: float, held_bytes: float,
                  per_sample_bytes: float, headroom: float = HEADROOM) -> float:
    """The share of a card of ``total_bytes`` (``set_per_process_memory_fraction``) that holds ``cap`` samples and a
    half: what is ``used`` already, plus what the drop-in counts beside it (``held``: gradients, optimizer state,
    FSDP2's buffers) and the samples' activations, over the ``headroom`` the cap plans for."""
    return min(1.0, used_bytes / total_bytes + (held_bytes + (cap + 0.5) * per_sample_bytes) / headroom / total_bytes)


def _pairs(count: int, seed: int) -> TensorDataset:
    """Token sequences as (inputs, targets): the first item is the model's input, as the memory probe reads it."""
    (tokens,) = token_sequences(count, context=SHAPE["context"], vocab=SHAPE["vocab"], seed=seed).tensors
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _model(seed: int, shard: Any, **settings: Any) -> nn.Module:
    torch.manual_seed(seed)
    model = TinyLM(**SHAPE).cuda()
    for block in model.blocks:
        shard(block, mp_policy=POLICY)
    return shard(model, mp_policy=POLICY, **settings)


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _epoch(model: nn.Module, loader: Any, optimizer: torch.optim.Optimizer, epoch: int,
           largest: int | None = None) -> float:
    """One epoch of the loop, each batch as micro-batches of at most ``largest`` samples; its seconds."""
    loader.sampler.set_epoch(epoch)
    synchronize(torch.device("cuda"))
    started = time.perf_counter()
    for inputs, targets in loader:
        inputs, targets = inputs.cuda(non_blocking=True), targets.cuda(non_blocking=True)
        count = len(inputs)
        sizes = micro_batches(count, math.ceil(count / (largest or count)))
        first = 0
        for index, size in enumerate(sizes):
            model.set_requires_gradient_sync(index == len(sizes) - 1)
            (_loss(model, inputs[first : first + size], targets[first : first + size]) * (size / count)).backward()
            first += size
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    synchronize(torch.device("cuda"))
    return time.perf_counter() - started


def _overhead(args: argparse.Namespace, progress: EventWriter) -> dict[str, Any]:
    data = _pairs(SAMPLES, args.seed)
    runs = {"torch_fully_shard": _model(args.seed, torch_fully_shard),
            "hetdp_fully_shard": _model(args.seed, fully_shard, allocation="equal", emulation=Emulation())}
    loaders = {"torch_fully_shard": DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=args.seed),
                                               pin_memory=True)}
    loaders["hetdp_fully_shard"] = runs["hetdp_fully_shard"].allocate(
        DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=args.seed), pin_memory=True),
        max_batch=[None])
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in runs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for epoch in range(args.epochs):
        for name, model in runs.items():
            seconds[name].append(_epoch(model, loaders[name], optimizers[name], epoch))
            progress.update(row={"part": "sharded overhead", "run": name, "epoch": epoch, "epoch_s": seconds[name][-1]})
    runs["hetdp_fully_shard"].close()
    return {"epoch_s": seconds, "samples": SAMPLES,
            "parameters": sum(p.numel() for p in TinyLM(**SHAPE).parameters())}


def _small_card(args: argparse.Namespace, progress: EventWriter) -> dict[str, Any]:
    device = torch.device("cuda")
    data = _pairs(SAMPLES // 4, args.seed)

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=args.seed), pin_memory=True)

    whole = _model(args.seed, fully_shard, allocation="equal", emulation=Emulation())
    whole.allocate(loader(), accumulates=True)  # counts the state and probes the activations on the whole card
    held, per_sample = whole.drop_in.footprint, whole.drop_in.activation_bytes_per_sample
    whole.close()
    del whole
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = card_fraction(SMALL_CAP, total_bytes=total, used_bytes=torch.cuda.memory_allocated(device)
                             + held.parameters, held_bytes=held.held - held.parameters, per_sample_bytes=per_sample)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    torch.cuda.reset_peak_memory_stats(device)
    model = _model(args.seed, fully_shard, allocation="equal", emulation=Emulation())
    small = model.allocate(loader(), accumulates=True)  # measures the cap on the small card
    cap = model.allocator.chunks[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    error = None
    try:
        epoch_s = _epoch(model, small, optimizer, 0, largest=cap)
    except torch.OutOfMemoryError as oom:
        epoch_s, error = None, str(oom).splitlines()[0]
    row = {"part": "small card", "fraction": fraction, "cap": cap, "expected_cap": SMALL_CAP,
           "per_sample_bytes": per_sample, "limit_bytes": fraction * total,
           "peak_bytes": torch.cuda.max_memory_allocated(device), "epoch_s": epoch_s, "out_of_memory": error}
    progress.update(row=row)
    model.close()
    torch.cuda.set_per_process_memory_fraction(1.0, device)
    return row


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The sharded figures: hetdp's samples/s against torch's ``fully_shard`` (steady epochs: all but the first), and
    the small card's cap and peak."""
    seconds = raw["overhead"]["epoch_s"]
    torch_s = statistics.median(seconds["torch_fully_shard"][1:])
    hetdp_s = statistics.median(seconds["hetdp_fully_shard"][1:])
    return {"overhead": hetdp_s / torch_s - 1.0, "torch_samples_s": raw["overhead"]["samples"] / torch_s,
            "hetdp_samples_s": raw["overhead"]["samples"] / hetdp_s, "parameters": raw["overhead"]["parameters"],
            "small_card": raw["small_card"]}


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.gpu_sharded")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rank, _ = init_distributed("nccl")
    progress = EventWriter(enabled=rank == 0)
    result = {"overhead": _overhead(args, progress), "small_card": _small_card(args, progress)}
    if rank == 0:
        args.out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
