"""The largest forward a rank's memory allows: from its emulated device, or measured on CUDA.

A share above it runs as accumulated micro-batches (``AllocatedTrainer``), or is
not allowed at all when the user's loop runs each share as one forward (the
drop-in). On CUDA the cap comes from the free memory (``torch.cuda.mem_get_info``)
and the peak memory of trial steps at two batch sizes; on CPU there is none.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from hetdp.cluster.emulate import Emulation
from hetdp.errors import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

HEADROOM = 0.85
"""Fraction of the free memory a cap plans for: room for fragmentation and for optimizer state (Adam's two moments)
that appears only at the first ``optimizer.step()``, after the trial steps."""


def cap_from_memory(free_bytes: float, fixed_bytes: float, per_sample_bytes: float,
                    headroom: float = HEADROOM) -> int | None:
    """The largest forward that fits: ``floor((headroom * free - fixed) / per_sample)`` (C-ADP eq. 3's P_max).

    Args:
        free_bytes: memory a step may still take (free on the device, plus what torch's allocator caches unused).
        fixed_bytes: what a step adds whatever its batch (workspace, the loss), beyond what is already allocated.
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


def largest_forward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, rank: int,
                    emulation: Emulation | None = None, loss_fn: LossFn = nn.functional.cross_entropy,
                    headroom: float = HEADROOM) -> int | None:
    """This rank's memory cap in samples: its emulated device's, else measured on CUDA, else None (no cap).

    Args:
        model: the model on its device, as it will train.
        inputs, targets: a trial batch of at least two samples (its first dimension is the batch).
        rank: this rank (indexes the emulated devices).
        emulation: the emulation of this run, if any.
        loss_fn: the training loss.
        headroom: the fraction of the free memory to plan for.
    """
    if emulation is not None and emulation.devices is not None:
        return emulation.devices[rank].max_batch
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    return _measure_cuda(model, inputs.to(device), targets.to(device), loss_fn, headroom)


def _measure_cuda(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
                  headroom: float) -> int | None:
    """Peak memory of one forward and backward at two batch sizes: the slope is the per-sample memory, the rest
    at zero samples the fixed part; the free memory is the driver's plus what torch's allocator holds unused.
    The model's gradients, buffers (BatchNorm statistics) and the RNG are left as they were."""
    if len(inputs) < 2:
        raise ConfigError(f"measuring the memory cap needs a trial batch of at least 2 samples, got {len(inputs)}")
    device = inputs.device
    sizes = (len(inputs), len(inputs) // 2)
    grads = [p.grad for p in model.parameters()]

    def peak_of(size: int) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss_fn(model(inputs[:size]), targets[:size]).backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)

    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with torch.random.fork_rng(devices=[device]):  # the trial steps leave no trace: no RNG draws, no statistics
        peak_of(sizes[1])  # a first step allocates the gradients, which every later step already has
        baseline = torch.cuda.memory_allocated(device)
        peaks = [peak_of(size) for size in sizes]
        free, _ = torch.cuda.mem_get_info(device)  # with the gradients allocated, as in training
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    for parameter, grad in zip(model.parameters(), grads):
        parameter.grad = grad
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    per_sample = (peaks[0] - peaks[1]) / (sizes[0] - sizes[1])
    fixed = peaks[0] - baseline - per_sample * sizes[0]
    return cap_from_memory(free, fixed, per_sample, headroom)
