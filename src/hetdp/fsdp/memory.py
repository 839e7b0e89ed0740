"""What bounds a rank's share under sharding: the memory its device leaves once its shard of the model's state and
FSDP2's buffers are placed, over what one sample adds to a step's peak.

Under ``hetdp.DDP`` every rank holds a replica, so a group trains only what its
smallest device holds; sharded, rank r holds 1/W of the parameters, gradients and
optimizer state, and its cap is C-ADP eq. 3's P_max with the shard in the fixed part:
``floor((memory - shard - buffers) / bytes per sample)``. Where the loop lets
gradients wait (``set_requires_gradient_sync(False)``), FSDP2 keeps every unit's
unsharded gradient between backwards: ``footprint(..., gradients_wait=True)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import (
    HEADROOM,
    cuda_free_bytes,
    per_sample_bytes,
    saved_tensor_bytes,
    trial_input,
    trial_loss,
)
from hetdp.errors import ConfigError

OPTIMIZER_COPIES = 2
"""The optimizer's state per parameter, in copies of its shard: Adam's two moments, the most common optimizer's
(SGD with momentum holds one, plain SGD none: their caps err on the safe side). It appears at the first
``optimizer.step()``, after ``allocate``, so it is counted, not measured."""


@dataclass(frozen=True)
class UnitShape:
    """One FSDP2 unit as memory sees it: the bytes of its own parameters once gathered, and of their gradients."""

    gathered_bytes: int
    """Its parameters unsharded, in the dtype it computes with (``MixedPrecisionPolicy.param_dtype``)."""
    reduced_bytes: int
    """Its unsharded gradients in the dtype it reduce-scatters in (``reduce_dtype``)."""
    kept: bool
    """Whether its parameters stay gathered from its forward to its backward (``reshard_after_forward=False``, and
    the root's by default)."""


@dataclass(frozen=True)
class Footprint:
    """What one rank holds whatever its batch, in bytes."""

    parameters: int
    """Its shards of the parameters, as placed (padded to a multiple of the world size)."""
    gradients: int
    """Its shards of the gradients: as many bytes as the parameters'."""
    optimizer: int
    """The optimizer's state over its shards (``OPTIMIZER_COPIES`` of them)."""
    buffers: int
    """FSDP2's: the unit computing and the next one gathered ahead, the largest unit's unsharded gradients and
    reduce-scatter input, and the units kept gathered from forward to backward."""
    waiting: int = 0
    """Gradients that wait: while the loop lets them (``set_requires_gradient_sync(False)``, as accumulation does)
    FSDP2 keeps every unit's unsharded gradient, in the dtype it reduce-scatters in, from one backward to the next
    instead of reduce-scattering it into the shard; 0 where counted for a loop that lets none wait."""

    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def held(self) -> int:
        return self.state + self.buffers + self.waiting


def unit_shapes(units: Sequence[nn.Module], options: Callable[[nn.Module], Mapping[str, Any]]) -> list[UnitShape]:
    """Every unit's ``UnitShape``, its own parameters being those no unit nested in it holds; ``options(unit)`` are
    the ``fully_shard`` keywords it was sharded with. An outermost unit is FSDP2's root, which keeps its parameters
    gathered from forward to backward unless told otherwise."""
    roots = [unit for unit in units if not any(other is not unit and _contains(other, unit) for other in units)]
    shapes = []
    for unit in units:
        nested = {id(p) for other in units if other is not unit and _contains(unit, other) for p in other.parameters()}
        own = [p for p in unit.parameters() if id(p) not in nested]
        policy = options(unit).get("mp_policy")
        param_dtype = getattr(policy, "param_dtype", None)
        reduce_dtype = getattr(policy, "reduce_dtype", None) or param_dtype
        gathered = sum(p.numel() * (param_dtype or p.dtype).itemsize for p in own)
        reduced = sum(p.numel() * (reduce_dtype or p.dtype).itemsize for p in own)
        reshard = options(unit).get("reshard_after_forward")
        kept = reshard is False or (reshard is None and any(unit is top for top in roots))
        shapes.append(UnitShape(gathered_bytes=gathered, reduced_bytes=reduced, kept=kept))
    return shapes


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(module is inner for module in outer.modules())


def footprint(shapes: Sequence[UnitShape], parameter_bytes: int, *, gradients_wait: bool = False) -> Footprint:
    """A rank's ``Footprint`` from its units' shapes and the bytes of its parameter shards (``storage_bytes``);
    ``gradients_wait``: the loop lets gradients wait, so every unit's unsharded gradient is held too."""
    gathered = max((shape.gathered_bytes for shape in shapes), default=0)
    reduced = max((shape.reduced_bytes for shape in shapes), default=0)
    kept = sum(shape.gathered_bytes for shape in shapes if shape.kept)
    waiting = sum(shape.reduced_bytes for shape in shapes) if gradients_wait else 0
    return Footprint(parameters=parameter_bytes, gradients=parameter_bytes,
                     optimizer=OPTIMIZER_COPIES * parameter_bytes, buffers=3 * gathered + reduced + kept,
                     waiting=waiting)


@dataclass(frozen=True)
class Budget:
    """One rank's memory, as a cap is cut from it."""

    device: str
    """What errors call the device (after its rank: "rank 3: its ... cannot hold ...")."""
    memory_bytes: float
    """What the rank's training may take of the device."""
    held_bytes: int
    """What of that it holds whatever the batch, and has not placed yet (``Footprint``)."""
    per_sample_bytes: float | None
    """Activation bytes one sample holds, where the device's description gives them (None: probe the model)."""


def budget(rank: int, device: torch.device, emulation: Emulation, held: Footprint) -> Budget | None:
    """This rank's ``Budget``: its emulated device's memory fields under ``hetdp run --devices`` (the model's state
    beside the table's ``fixed_memory_mb``), else its CUDA device's free memory (``HEADROOM`` of it; its parameter
    shards are placed already), else None: memory does not bound the share."""
    devices = emulation.devices
    if devices is not None and devices[rank].memory_mb is not None:
        model = devices[rank]
        per_sample = model.activation_mb_per_sample * 1e6 or None
        return Budget(device=f"its emulated device of {model.memory_mb:g} MB",
                      memory_bytes=(model.memory_mb - model.fixed_memory_mb) * 1e6, held_bytes=held.held,
                      per_sample_bytes=per_sample)
    if device.type == "cuda":
        return Budget(device=f"its {torch.cuda.get_device_name(device)} ({device})",
                      memory_bytes=HEADROOM * cuda_free_bytes(device), held_bytes=held.held - held.parameters,
                      per_sample_bytes=None)
    return None


def probe_activation_bytes(module: nn.Module, batch: Any, parameters: Callable[[], Iterable[torch.Tensor]]) -> float:
    """What one more sample adds to the peak memory of a training step of ``module`` (sharded), from trial forwards
    and backwards on two small slices of ``batch`` (its first item, or its keyword arguments, is the model's
    input), compared operator by operator (``per_sample_bytes``): the activations, the output and the loss's own
    tensors (``trial_loss``), the gradients backward makes, and under activation checkpointing what a recomputation
    holds at its peak. Collective: every rank runs the same trials (FSDP2 gathers and reduces in them); no
    gradient, buffer or random draw is left behind.

    Args:
        module: the root of the units, as it trains.
        batch: the loader's first batch, at least 2 samples.
        parameters: FSDP2's unsharded parameters while they are (what ``saved_tensor_bytes`` leaves out).

    Raises:
        ConfigError: the batch has fewer than 2 samples, or the trial cannot run the model on it.
    """
    first = next((value for value in _leaves(batch) if isinstance(value, torch.Tensor) and value.dim()), None)
    size = 0 if first is None else first.shape[0]
    if size < 2:
        raise ConfigError(f"probing the activations needs a first batch of at least 2 samples, got {size}")
    sizes = (2, 4) if size >= 4 else (1, 2)
    device = next(module.parameters()).device
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]

    def trial(samples: int) -> int:
        args, kwargs = trial_input(batch, samples, device)
        saved, output = saved_tensor_bytes(functools.partial(module, *args, **kwargs), parameters)
        trial_loss(output).backward()
        for parameter in module.parameters():
            parameter.grad = None
        return saved

    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return per_sample_bytes(trial, sizes)
    except Exception as error:  # the batch, the model or the memory
        reason = (str(error).splitlines() or [""])[0]
        raise ConfigError(f"could not probe the activations on the loader's first batch ({type(error).__name__}: "
                          f"{reason}): pass max_batch=<samples> to allocate") from error
    finally:
        for parameter in module.parameters():
            parameter.grad = None
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)


def _leaves(batch: Any) -> list[Any]:
    if isinstance(batch, Mapping):
        return list(batch.values())
    return list(batch) if isinstance(batch, (list, tuple)) else [batch]

