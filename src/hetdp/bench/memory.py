"""``hetdp bench memory``: how large a model four ranks of unequal memory train with memory-sized shards against
torch's even ones (``hetdp.fully_shard``, ``shard_sizes="memory"`` against ``"even"``).

One launch of 4 ranks over gloo, whose emulated devices (``hetdp run
--devices``'s table, through the environment) have memories in the ratio 1,1,2,4.
Each rank runs its steps under a ``MemoryMeter``: what it holds, measured from its
tensors at every unit's edges (its parameters and gradients as registered, whole
or in shards; the optimizer's state; the activations autograd saved), never
computed from the model's shape. A step at which any rank held more than its
device's memory is an emulated out-of-memory, raised on every rank. Then:

* ``capacity_even`` and ``capacity_uneven``: the largest ``bench.models.TinyLM``
  (more layers of the same width) that trains an epoch with each kind of shards,
  found by real epochs (the largest that trained and the next that ran out), in
  parameters, and
  ``capacity_ratio`` (ideal 2.0: the smallest device holds 1/8 of the state instead
  of 1/4);
* ``state_bytes_per_rank``: the parameters, gradients and optimizer state each rank
  held at the end of the largest memory-sized run, with ``memory_per_rank``;
* ``speed_vs_even``: on the largest model both fit, torch's even epoch time over the
  memory-sized one (the price of hetdp's exchange), epochs alternated;
* ``param_gap``: a memory-sized run's parameters against one process on the same
  global batches (SGD; ``adamw_gap``: the timed runs' under AdamW, both kinds).

The family is wide and short (width 128, 4 tokens, one sample a rank a step), so
that the optimizer's state, not activations, fills the devices, as in the
training memory-sized shards are for. Run as a module under torchrun it is the worker;
imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterator
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
from hetdp.data.steps import StepSampler
from hetdp.errors import ConfigError, HetDPError
from hetdp.fsdp.rowshard import full_tensor
from hetdp.fsdp.shard import fully_shard
from hetdp.fsdp.uneven import UnevenModule
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed

RATIO = (1.0, 1.0, 2.0, 4.0)
"""The devices' memories, in units of the smallest one."""
SMALLEST_MB = 12.0
"""The smallest device's memory: the others hold 12, 24 and 48 MB."""
FAMILY = {"width": 128, "heads": 4, "context": 4, "vocab": 64}
"""``TinyLM`` at every size; only ``layers`` grows."""
SIZES = {"quick": {"steps": 2, "timed_epochs": 3, "timed_steps": 4}, "full": {"steps": 4, "timed_epochs": 5,
                                                                            "timed_steps": 8}}
"""Steps of the epochs that decide whether a model fits, and the alternated epochs (and their steps) of the timing,
after one untimed epoch of each."""
LR = 1e-3
"""AdamW's learning rate: the capacity and timed runs (two copies of state a parameter, as most training holds)."""
SGD_LR = 0.05
"""SGD's (momentum 0.9), in the run ``param_gap`` is read from: AdamW turns the attention key bias's gradient, 0 in
theory and rounding noise in practice, into steps of its learning rate's size in any two runs that sum in another
order, torch's even shards as much as memory-sized ones (``adamw_gap`` reports both)."""
GAP_EPOCHS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smallest-mb", type=float, default=SMALLEST_MB, metavar="MB",
                        help=f"the smallest emulated device's memory in MB (default {SMALLEST_MB:g}); the others "
                             f"hold {', '.join(f'{r:g}' for r in RATIO[1:])} times it")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not args.smallest_mb > 0:
        raise ConfigError(f"--smallest-mb must be > 0, got {args.smallest_mb}")
    size = SIZES["quick" if args.quick else "full"]
    memories = tuple(args.smallest_mb * ratio for ratio in RATIO)
    env = Emulation(sample_cost_ms=0.001, seed=args.seed,
                    devices=tuple(DeviceModel(memory_mb=memory) for memory in memories)).to_env()
    raw = launch_workers("hetdp.bench.memory", len(RATIO),
                         ["--seed", args.seed, "--steps", size["steps"], "--timed-epochs", size["timed_epochs"],
                          "--timed-steps", size["timed_steps"]],
                         total=9 + 2 * (size["timed_epochs"] + 1), description="epochs", unit="epoch", env=env)
    return summarize(raw, memories)


def summarize(raw: dict[str, Any], memories_mb: tuple[float, ...]) -> dict[str, Any]:
    """The benchmark's figures from rank 0's record."""
    even, uneven = raw["capacity"]["even"], raw["capacity"]["uneven"]
    state = raw["state_bytes_per_rank"]
    proportional = [sum(state) * memory / sum(memories_mb) for memory in memories_mb]
    timed = raw["timed"]
    return {
        "capacity_even": even["parameters"],
        "capacity_uneven": uneven["parameters"],
        "capacity_ratio": uneven["parameters"] / even["parameters"] if even["parameters"] else None,
        "layers_even": even["layers"],
        "layers_uneven": uneven["layers"],
        "state_bytes_per_rank": state,
        "memory_per_rank": [round(memory * 1e6) for memory in memories_mb],
        "state_vs_proportional": max(abs(held / ideal - 1.0) for held, ideal in zip(state, proportional)),
        "peak_held_per_rank": {"even": even["peak_held"], "uneven": uneven["peak_held"]},
        "param_gap": raw["param_gap"],
        "adamw_gap": raw["adamw_gap"],
        "speed_vs_even": statistics.median(timed["even"]) / statistics.median(timed["uneven"]),
        "epoch_s": timed,
        "timed_layers": raw["timed_layers"],
        "timed_parameters": raw["timed_parameters"],
        "probes": raw["probes"],
        "family": FAMILY,
        "optimizer": f"AdamW(lr={LR:g}) (param_gap: SGD(lr={SGD_LR:g}, momentum=0.9)), clip_grad_norm_ 1.0",
        "global_batch": len(memories_mb),
    }


def render(result: dict[str, Any]) -> str:
    rows = [{"run": probe["kind"], "layers": probe["layers"], "parameters": probe["parameters"],
             "fits": "yes" if probe["fits"] else "no", "peak held MB per rank": _megabytes(probe["peak_held"]),
             "why not": probe["reason"]} for probe in result["probes"]]
    memories = [memory / 1e6 for memory in result["memory_per_rank"]]
    title = (f"hetdp.fully_shard on 4 ranks of {', '.join(f'{m:g}' for m in memories)} MB: the largest TinyLM "
             f"(width {result['family']['width']}, {result['family']['context']} tokens) that trains an epoch")
    ratio = result["capacity_ratio"]
    lines = [
        f"capacity_even {result['capacity_even']:,} ({result['layers_even']} layers); capacity_uneven "
        f"{result['capacity_uneven']:,} ({result['layers_uneven']} layers)",
        "capacity_ratio: none (the smallest model does not fit torch's even shards)" if ratio is None else
        f"capacity_ratio {ratio:.2f} (ideal 2.0; target >= 1.6, goal 1.8)",
        f"state_bytes_per_rank {_megabytes(result['state_bytes_per_rank'])} MB beside memory_per_rank "
        f"{[round(m) for m in memories]} MB: {result['state_vs_proportional']:.1%} from proportional (ideal 0; "
        "target <= 15%)",
        f"param_gap {result['param_gap']:.1e} (ideal 0; target <= 1e-5) under SGD; under AdamW, where the key bias's "
        f"rounding noise grows to steps of the learning rate, even {result['adamw_gap']['even']:.1e} and "
        f"memory-sized {result['adamw_gap']['uneven']:.1e}",
        f"speed_vs_even {result['speed_vs_even']:.2f} (ideal 1.0 or more; target >= 0.9) on "
        f"{result['timed_layers']} layers: epochs even {_rounded(result['epoch_s']['even'])} s, memory-sized "
        f"{_rounded(result['epoch_s']['uneven'])} s",
    ]
    return "\n".join([format_table(rows, title=title), *lines])


def _megabytes(values: list[int] | None) -> list[float] | str:
    return "" if values is None else [round(value / 1e6, 1) for value in values]


def _rounded(values: list[float]) -> list[float]:
    return [round(value, 2) for value in values]


# --- what a rank holds -----------------------------------------------------------------------------------------


class EmulatedOutOfMemory(HetDPError):
    """A rank held more than its emulated device's memory: the step that did is where a real device would fail."""


class MemoryMeter:
    """What this rank holds, measured from its tensors, at every unit's edges: as its forward starts (gathered) and
    ends (before and after it is freed), as its backward starts and as its gradients reach its inputs (before they
    reduce), and after each optimizer step.

    Held is the storages, each once and as large as they are when sampled, of the parameters as the modules register
    them (whole while gathered), of the optimizer's parameters (the shards) and their gradients, of the optimizer's
    state, and of the tensors autograd saved for the backward, while it holds them. The exchange's own transient
    buffers are in neither kind of shards' count.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.peak = 0
        self._saved: dict[int, weakref.ref[torch.Tensor]] = {}
        """The tensors autograd holds for the backward, by id, while it holds them."""
        self._handles = []
        for unit in model.modules():
            if isinstance(unit, (FSDPModule, UnevenModule)):
                self._handles += [unit.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                                  unit.register_forward_hook(self._sample_hook, prepend=True),
                                  unit.register_forward_hook(self._after_forward)]

    def held(self) -> int:
        storages: dict[int, int] = {}
        for tensor in self._state_tensors():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            _add(storages, local)
        for saved in list(self._saved.values()):
            tensor = saved()
            if tensor is not None:  # its storage as it is now: a whole parameter's view is freed with the parameter
                _add(storages, tensor)
        return sum(storages.values())

    def state_bytes(self) -> int:
        """The parameters' shards, their gradients and the optimizer's state: what the drop-in's caps call state."""
        storages: dict[int, int] = {}
        for tensor in self._optimizer_tensors():
            _add(storages, tensor.to_local() if isinstance(tensor, DTensor) else tensor)
        return sum(storages.values())

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                yield parameter
                if parameter.grad is not None:
                    yield parameter.grad
                yield from (value for value in self.optimizer.state.get(parameter, {}).values()
                            if isinstance(value, torch.Tensor))

    def _state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self._optimizer_tensors()
        for module in self.model.modules():
            for parameter in module._parameters.values():  # the whole ones while a unit is gathered
                if parameter is not None:
                    yield parameter
                    if parameter.grad is not None:
                        yield parameter.grad

    def sample(self) -> None:
        self.peak = max(self.peak, self.held())

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context a step's forward and backward run in, so that what autograd saves is counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor)
        self._saved[key] = weakref.ref(tensor, lambda _: self._saved.pop(key, None))
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _sample_hook(self, *args: Any) -> None:
        self.sample()

    def _before_forward(self, unit: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.sample()
        if torch.is_grad_enabled():
            for tensor in _tensors((args, kwargs)):
                if tensor.requires_grad:
                    tensor.register_hook(self._sample_hook)

    def _after_forward(self, unit: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.sample()
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._sample_hook)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _add(storages: dict[int, int], tensor: torch.Tensor) -> None:
    """Count ``tensor``'s storage in ``storages`` (data pointer -> bytes), once however many tensors view it."""
    storage = tensor.untyped_storage()
    if storage.nbytes():
        storages[storage.data_ptr()] = storage.nbytes()


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def check_room(meter: MemoryMeter, memory_bytes: list[float], step: int) -> None:
    """Raise ``EmulatedOutOfMemory`` on every rank if any rank held more than its memory so far (collective)."""
    peaks = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, meter.peak)
    over = [rank for rank, (peak, memory) in enumerate(zip(peaks, memory_bytes)) if peak > memory]
    if over:
        rank = over[0]
        raise EmulatedOutOfMemory(f"step {step}: rank {rank} held {peaks[rank] / 1e6:.1f} MB, more than its "
                                  f"{memory_bytes[rank] / 1e6:g} MB")


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


def _model(layers: int, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(layers=layers, **FAMILY)


def _parameters(layers: int) -> int:
    """The parameters of the family's model of ``layers`` layers: the root's and as many blocks' (on the meta device:
    nothing allocated)."""
    with torch.device("meta"):
        root, block = (sum(p.numel() for p in TinyLM(layers=count, **FAMILY).parameters()) for count in (0, 1))
    return root + layers * (block - root)


def _sharded(layers: int, seed: int, shard_sizes: str) -> nn.Module:
    model = _model(layers, seed)
    for block in model.blocks:
        fully_shard(block, shard_sizes=shard_sizes)
    return fully_shard(model, allocation="equal", shard_sizes=shard_sizes)


def _loader(samples: int, seed: int) -> DataLoader:
    dataset = token_sequences(samples, context=FAMILY["context"], vocab=FAMILY["vocab"], seed=seed)
    return DataLoader(dataset, batch_size=1, sampler=DistributedSampler(dataset, seed=seed), drop_last=True)


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


class _Run:
    """The reference FSDP2 script's loop (AdamW, clipping) on one model, an epoch at a time."""

    def __init__(self, layers: int, seed: int, shard_sizes: str, steps: int, optimizer: str = "adamw") -> None:
        world = dist.get_world_size()
        self.model = _sharded(layers, seed, shard_sizes)
        self.loader = self.model.allocate(_loader(steps * world, seed), max_batch=[1] * world)
        self.optimizer = _optimizer(self.model, optimizer)

    def epoch(self, epoch: int, meter: MemoryMeter | None = None,
              after_step: Callable[[int], None] | None = None) -> float:
        self.loader.sampler.set_epoch(epoch)
        began = time.perf_counter()
        for step, (tokens,) in enumerate(self.loader):
            self.optimizer.zero_grad()
            if meter is None:
                next_token_loss(self.model, tokens).backward()
            else:
                with meter.saving():
                    next_token_loss(self.model, tokens).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            if meter is not None:
                meter.sample()
            if after_step is not None:
                after_step(step)
        return time.perf_counter() - began

    def close(self) -> None:
        self.model.close()


def _probe(kind: str, layers: int, seed: int, steps: int, memory_bytes: list[float]) -> dict[str, Any]:
    """Whether ``layers`` train an epoch on every rank's memory with ``kind`` shards (collective)."""
    record: dict[str, Any] = {"kind": kind, "layers": layers, "parameters": _parameters(layers), "fits": False,
                              "reason": "", "peak_held": None, "state_bytes": None}
    run: _Run | None = None
    meter: MemoryMeter | None = None
    try:
        run = _Run(layers, seed, "memory" if kind == "uneven" else "even", steps)
        meter = MemoryMeter(run.model, run.optimizer)
        meter.sample()  # the placed shards, before any step
        run.epoch(0, meter, after_step=lambda step: check_room(meter, memory_bytes, step))
        record.update(fits=True, state_bytes=meter.state_bytes())
    except EmulatedOutOfMemory as error:
        record["reason"] = str(error)
    except ConfigError as error:  # the same on every rank: placement found a device that cannot hold a unit at all
        record["reason"] = str(error)
    if meter is not None:
        every = [0] * dist.get_world_size()
        dist.all_gather_object(every, meter.peak)
        record["peak_held"] = every
        meter.close()
    if run is not None:
        run.close()
    return record


def _capacity(kind: str, seed: int, steps: int, memory_bytes: list[float], progress: EventWriter,
              probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The most layers that train an epoch with ``kind`` shards, and that run's record (collective).

    Two small runs measure how each rank's peak grows a layer; the model where the first rank would reach its memory
    is run, and the next larger (or smaller) ones, until one fits and the next does not: the answer is always two real
    epochs, one that fitted and one that ran out."""
    found: dict[int, dict[str, Any]] = {}

    def fit(layers: int) -> bool:
        if layers not in found:
            record = _probe(kind, layers, seed, steps, memory_bytes)
            probes.append(record)
            progress.update(row={key: record[key] for key in ("kind", "layers", "fits", "reason")})
            found[layers] = record
        return found[layers]["fits"]

    small, larger = 1, 3
    if not fit(small):
        return _found(found, 0)
    if not fit(larger):
        layers = larger - 1
        while layers > small and not fit(layers):
            layers -= 1
        return _found(found, layers)
    slopes = [(high - low) / (larger - small)
              for low, high in zip(found[small]["peak_held"], found[larger]["peak_held"])]
    layers = max(1, min(small + int((memory - low) // slope) if slope > 0 else 1 << 10
                        for memory, low, slope in zip(memory_bytes, found[small]["peak_held"], slopes)))
    if fit(layers):
        while fit(layers + 1):
            layers += 1
    else:
        while layers > 1 and not fit(layers - 1):
            layers -= 1
        layers -= 1
    return _found(found, layers)


def _found(found: dict[int, dict[str, Any]], layers: int) -> dict[str, Any]:
    best = found.get(layers)
    return {"layers": layers, "parameters": _parameters(layers) if layers else 0,
            "peak_held": best["peak_held"] if best else None, "record": best}


def _state_bytes(record: dict[str, Any] | None) -> list[int]:
    every = [0] * dist.get_world_size()
    dist.all_gather_object(every, None if record is None else record.get("state_bytes"))
    return every


def _reference_gap(model: nn.Module, layers: int, seed: int, steps: int, epochs: int, optimizer: str) -> float:
    """A sharded run's parameters against one process on the same global batches (collective; rank 0's figure)."""
    whole = {name: full_tensor(p).detach() for name, p in model.named_parameters()}
    if dist.get_rank() != 0:
        return 0.0
    reference = _model(layers, seed)
    step = _optimizer(reference, optimizer)
    world = dist.get_world_size()
    samples = steps * world
    (data,) = token_sequences(samples, context=FAMILY["context"], vocab=FAMILY["vocab"], seed=seed).tensors
    sampler = StepSampler(samples, world, 0, shares_at=lambda _: [world], shuffle=True, seed=seed, drop_last=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = sampler.permutation()
        for first in range(0, samples, world):
            step.zero_grad()
            next_token_loss(reference, data[torch.tensor(order[first : first + world])]).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            step.step()
    return max((whole[name] - p.detach()).abs().max().item() for name, p in reference.named_parameters())


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.memory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--timed-epochs", type=int, required=True)
    parser.add_argument("--timed-steps", type=int, required=True)
    args = parser.parse_args(argv)
    rank, _ = init_distributed("gloo")
    torch.set_num_threads(1)
    progress = EventWriter(enabled=rank == 0)
    devices = Emulation.from_env().devices or ()
    memory_bytes = [device.memory_mb * 1e6 for device in devices]  # type: ignore[operator]
    probes: list[dict[str, Any]] = []
    capacity = {kind: _capacity(kind, args.seed, args.steps, memory_bytes, progress, probes)
                for kind in ("even", "uneven")}
    state = _state_bytes(capacity["uneven"]["record"])
    layers = max(capacity["even"]["layers"], 1)
    runs = {kind: _Run(layers, args.seed, "memory" if kind == "uneven" else "even", args.timed_steps)
            for kind in ("even", "uneven")}
    timed: dict[str, list[float]] = {kind: [] for kind in runs}
    for epoch in range(args.timed_epochs + 1):  # alternated: a loaded machine's slow spells fall on both alike
        for kind, each in runs.items():
            dist.barrier()
            seconds = each.epoch(epoch)
            if epoch:  # the first sets up the optimizer's state and the exchange's buffers
                timed[kind].append(seconds)
            progress.update(row={"run": f"timed {kind}", "epoch": epoch, "epoch_s": round(seconds, 3)})
    adamw_gap = {kind: _reference_gap(each.model, layers, args.seed, args.timed_steps, args.timed_epochs + 1,
                                      "adamw") for kind, each in runs.items()}
    for each in runs.values():
        each.close()
    exact = _Run(layers, args.seed, "memory", args.timed_steps, "sgd")
    for epoch in range(GAP_EPOCHS):
        exact.epoch(epoch)
    progress.update(row={"run": "param_gap", "layers": layers})
    gap = _reference_gap(exact.model, layers, args.seed, args.timed_steps, GAP_EPOCHS, "sgd")
    exact.close()
    if rank == 0:
        for record in probes:
            record.pop("state_bytes", None)
        args.out.write_text(json.dumps({
            "capacity": {kind: {key: value for key, value in found.items() if key != "record"}
                         for kind, found in capacity.items()},
            "state_bytes_per_rank": state, "probes": probes, "timed": timed, "timed_layers": layers,
            "timed_parameters": _parameters(layers), "param_gap": gap, "adamw_gap": adamw_gap}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
