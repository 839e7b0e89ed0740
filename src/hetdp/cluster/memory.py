"""The largest forward a rank's memory allows: from its emulated device, or measured on CUDA; and the measures the
sharded drop-in's caps are made of (what one more sample adds to a step's peak, the bytes a shard holds).

The drop-in cannot split a share of the user's loop into micro-batches, so this
cap bounds the shares (``model.allocate(loader, max_batch="measure")``). On CUDA
it comes from the free memory (``torch.cuda.mem_get_info``) and the peak memory
of trial steps at two batch sizes; on CPU there is none. A trial step's loss is
``trial_loss``, which holds what a loss on logits holds.
"""

from __future__ import annotations

import gc
import itertools
import math
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hetdp.cluster.emulate import Emulation
from hetdp.errors import ConfigError

HEADROOM = 0.85
"""Fraction of the free memory a cap plans for: room for fragmentation and for optimizer state (Adam's two moments)
that appears only at the first ``optimizer.step()``, after the trial steps."""


def cap_from_memory(free_bytes: float, fixed_bytes: float, per_sample_bytes: float,
                    headroom: float = HEADROOM) -> int | None:
    """The largest forward that fits: ``floor((headroom * free - fixed) / per_sample)`` (C-ADP eq. 3's P_max).

    Args:
        free_bytes: memory a step may still take (free on the device, plus what torch's allocator caches unused).
        fixed_bytes: what a step adds whatever its batch (workspace, gradients), beyond what is already allocated.
        per_sample_bytes: what one more sample adds to the step's peak; 0 or less: memory does not limit the batch.
        headroom: the fraction of ``free_bytes`` to plan for.

    Returns:
        The cap in samples (at least 1), or None when memory does not grow with the batch.

    Raises:
        ConfigError: not even one sample fits, or a bad headroom.
    """
    if not 0 < headroom <= 1:
        raise ConfigError(f"headroom must be a fraction in (0, 1], got {headroom!r}")
    if per_sample_bytes <= 0:
        return None
    cap = math.floor((headroom * free_bytes - max(fixed_bytes, 0.0)) / per_sample_bytes)
    if cap < 1:
        raise ConfigError(f"not one sample fits in memory: {free_bytes / 1e6:.0f} MB free x {headroom:g} headroom, "
                          f"{fixed_bytes / 1e6:.0f} MB fixed, {per_sample_bytes / 1e6:.1f} MB per sample")
    return cap


def largest_forward(module: nn.Module, loader: Iterable[Any], *, rank: int, emulation: Emulation) -> int | None:
    """This rank's memory cap in samples: its emulated device's, else measured on CUDA, else None (no cap).

    Args:
        module: the model on its device, as it will train (not its DDP wrapper, whose forward opens a step).
        loader: its first batch is the trial batch (read on CUDA only), at least 2 samples: see ``trial_step``.
        rank: this rank (indexes the emulated devices).
        emulation: the emulation of this run.
    """
    if emulation.devices is not None:
        return emulation.devices[rank].max_batch
    device = next(module.parameters()).device
    if device.type != "cuda":
        return None
    with torch.random.fork_rng(devices=[device]):  # the loader's shuffle and dropout draw nothing for good
        return _measure_cuda(module, next(iter(loader), None), device)


def _measure_cuda(module: nn.Module, batch: Any, device: torch.device) -> int | None:
    """Peak memory of trial steps at two batch sizes: the slope is the per-sample memory, the rest at zero samples
    the fixed part; the free memory is the driver's plus what torch's allocator holds unused."""
    first = next(iter(_tensors(batch)), None)
    size = first.shape[0] if first is not None and first.dim() else 0
    if size < 2:
        raise ConfigError(f"max_batch='measure' needs a first batch of at least 2 samples, got {size}")
    sizes = (size, size // 2)

    def peak_of(samples: int) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        trial_step(module, batch, samples)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)

    peak_of(sizes[1])  # a first step allocates what every later one reuses (cuBLAS workspace, cuDNN plans)
    baseline = torch.cuda.memory_allocated(device)
    peaks = [peak_of(samples) for samples in sizes]
    free = cuda_free_bytes(device)
    per_sample = (peaks[0] - peaks[1]) / (sizes[0] - sizes[1])
    fixed = peaks[0] - baseline - per_sample * sizes[0]
    return cap_from_memory(free, fixed, per_sample)


def cuda_free_bytes(device: torch.device) -> int:
    """Bytes a step may still take on a CUDA ``device``: the driver's free memory plus what torch's allocator holds
    unused, within the process's share of the card (``torch.cuda.set_per_process_memory_fraction``)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    free += torch.cuda.memory_reserved(device) - allocated
    return min(free, int(torch.cuda.get_per_process_memory_fraction(device) * total) - allocated)


def trial_step(module: nn.Module, batch: Any, samples: int) -> None:
    """Forward and backward on the first ``samples`` of ``batch``, leaving ``module`` untouched.

    ``batch`` is a tensor, a sequence whose first item is the model's input, or a
    mapping of keyword arguments. Its loss is ``trial_loss``, so that the peak
    counts the logits, the loss's own tensors and their gradients as a loop's
    loss holds them; under activation checkpointing the peak is the recomputation's.
    The step runs on detached parameters and copied buffers, so the model's
    gradients, its DDP hooks and its BatchNorm statistics never see it.
    """
    device = next(module.parameters()).device
    state = {name: p.detach().requires_grad_(p.requires_grad) for name, p in module.named_parameters()}
    state.update((name, buffer.clone()) for name, buffer in module.named_buffers())
    try:
        args, kwargs = trial_input(batch, samples, device)
        trial_loss(functional_call(module, state, args, kwargs)).backward()
    except Exception as error:  # the batch, the model or the memory: the user can still give the cap
        reason = (str(error).splitlines() or [""])[0]
        raise ConfigError(f"max_batch='measure' could not run a trial step on the loader's first batch "
                          f"({type(error).__name__}: {reason}): pass max_batch=<samples> instead") from error


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nest of sequences and mappings (a batch, a model's output), in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [tensor for item in tree for tensor in _tensors(item)]
    return []


def saved_tensor_bytes(forward: Callable[[], Any], parameters: Callable[[], Iterable[torch.Tensor]]
                       ) -> tuple[int, Any]:
    """Run ``forward()`` and count the bytes autograd saves for its backward: the activations a batch holds.

    Each storage counts once (views of one tensor share it), and a storage of ``parameters()`` at the moment a
    tensor is saved does not count: a layer saves its weight, which is the model's state, not the batch's. Under
    FSDP2 a unit's unsharded parameters live only while it runs, so ``parameters()`` is read at each save. Counted
    this way, what is left is the batch's; the caps assume it grows linearly with the batch.

    Returns:
        (bytes saved, what ``forward()`` returned: its backward is the caller's to run or drop).
    """
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address and address not in {p.untyped_storage().data_ptr() for p in parameters()}:
            saved[address] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    return sum(saved.values()), output


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (a DTensor's local shard), each storage once: what they take in
    memory, padding included (FSDP2's shards are views into padded buffers)."""
    # A DTensor exists only once torch.distributed.tensor was imported: importing it here would cost every DDP
    # rank 1.4 s of start-up for a type it never holds.
    dtensor = sys.modules.get("torch.distributed.tensor")
    storages: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def trial_input(batch: Any, samples: int, device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments a trial forward takes from the first ``samples`` of ``batch`` (a
    tensor, a sequence whose first item is the model's input, or a mapping of keyword arguments)."""

    def cut(value: Any) -> Any:
        return value[:samples].to(device) if isinstance(value, torch.Tensor) else value

    if isinstance(batch, Mapping):
        return (), {key: cut(value) for key, value in batch.items()}
    return (cut(batch[0] if isinstance(batch, (list, tuple)) else batch),), {}


def trial_loss(output: Any) -> torch.Tensor:
    """A trial step's loss on ``output``, holding what the loop's loss would hold of memory.

    A scalar that requires grad is the model's own loss (transformers' models compute it when given labels): it
    is the trial's as is. Otherwise each floating tensor that requires grad is taken as logits over its last
    dimension and scored by a cross-entropy in float32, the most common loss on logits and the largest of the
    common ones: it saves a float32 copy of the logits (their log-softmax) and its backward makes a gradient of
    that size, which at a language model's vocabulary outweighs every activation of a layer. A loss that holds
    less (a regression's mean squared error) leaves the cap on the safe side.

    Raises:
        ValueError: ``output`` holds no tensor that requires grad.
    """
    tensors = [tensor for tensor in _tensors(output) if tensor.requires_grad]
    if not tensors:
        raise ValueError("the model's output holds no tensor that requires grad")
    losses = [tensor for tensor in tensors if tensor.dim() == 0]
    if losses:
        return torch.stack([loss.float() for loss in losses]).sum()
    terms = [-torch.log_softmax(tensor.float(), dim=-1).select(-1, 0).sum() if tensor.is_floating_point()
             else tensor.sum() for tensor in tensors]
    return torch.stack(terms).sum()


class LiveBytes(TorchDispatchMode):
    """The storages that operators make while it is active, each with its size, the operator that made it and the
    one after which it was freed: a step's memory over time, on any device (on CPU nothing else tells it).

    A storage counts from the operator that made it (an output whose storage is none of the operator's inputs':
    not a view, not written in place) until it is freed, however many tensors hold it. What existed before (the
    parameters, the batch) never counts. Backward runs its operators on this thread where its graph is on the CPU,
    and carries the mode to the device threads where it is on an accelerator, so a backward's gradients and an
    activation checkpoint's recomputation count as they happen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.operators: list[str] = []
        """Each operator's name, in the order they ran."""
        self.sizes: list[int] = []
        """Each storage's bytes, in the order they were made."""
        self.made: list[int] = []
        """The operator (its index) that made each storage."""
        self.freed: dict[int, int] = {}
        """Storage -> the operators run when it was freed (a storage alive at the end is absent)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        given = {_address(value) for value in tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)}
        output = func(*args, **kwargs)
        for value in tree_leaves(output):
            if not isinstance(value, torch.Tensor):
                continue
            address = _address(value)
            if address and address not in given:
                given.add(address)
                storage = value.untyped_storage()
                weakref.finalize(storage, self._free, len(self.sizes))
                self.sizes.append(storage.nbytes())
                self.made.append(len(self.operators))
        self.operators.append(str(func))
        return output

    def _free(self, storage: int) -> None:
        self.freed[storage] = len(self.operators)

    def timeline(self, counted: Sequence[bool]) -> list[int]:
        """The bytes alive after each operator, of the storages ``counted`` (by the order they were made)."""
        change = [0] * (len(self.operators) + 1)
        for storage, (size, made) in enumerate(zip(self.sizes, self.made)):
            if counted[storage]:
                change[made] += size
                change[self.freed.get(storage, len(self.operators))] -= size
        return list(itertools.accumulate(change))[:-1]


def _address(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s storage lives (0: it has none of its own, as a DTensor or another wrapper)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


def per_sample_bytes(trial: Callable[[int], int], sizes: tuple[int, int]) -> float:
    """What one more sample adds to the peak memory of ``trial(samples)``: a forward and backward on that many
    samples, which returns the bytes autograd saved in it (``saved_tensor_bytes``).

    Both sizes run under ``LiveBytes``, after one warm-up trial at the smaller (a first step makes what later ones
    reuse: lazy initialisation, FSDP2's buffers). Where both ran the same operators and made as many storages, the
    storages whose size differs between the two are the batch's, and their bytes alive are compared operator by
    operator: the largest difference is what the batch holds at its peak, wherever that peak falls. What does not
    grow with the batch (parameters gathered, gradients of parameters, communication buffers, freed when another
    thread lets them go) is left out: comparing the two peaks instead reads the batch's part where the smaller
    trial peaks (at a few samples, where a gathered unit or the gradients of parameters do), not where the batch
    does. A model whose operators depend on the data (a mixture of experts routing tokens) runs other operators at
    each size: then the larger of the peaks' difference and of the saved bytes' is taken.
    """
    small, large = sizes
    gc.collect()
    trial(small)
    runs, saved = [], []
    for samples in sizes:
        gc.collect()  # what earlier trials left in reference cycles goes now, not inside the next
        with LiveBytes() as live:
            saved.append(trial(samples))
        runs.append(live)
    first, second = runs
    if first.operators == second.operators and len(first.sizes) == len(second.sizes):
        batch = [a != b for a, b in zip(first.sizes, second.sizes)]
        grown = max((b - a for a, b in zip(first.timeline(batch), second.timeline(batch))), default=0)
    else:
        everything = [True] * max(len(first.sizes), len(second.sizes))
        peaks = [max(run.timeline(everything), default=0) for run in runs]
        grown = max(peaks[1] - peaks[0], saved[1] - saved[0])
    return max(grown, 0) / (large - small)
