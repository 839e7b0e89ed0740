"""The steps of a rank with no sample in them: training steps that weigh nothing. A stand-in runs in the module's own
mode and changes nothing that persists (buffers, the random streams) nor, through a ``SyncBatchNorm``, the other
ranks' statistics and gradients; a rank that sits out runs it without gradients, with a backward that only zeroes
the gradients."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle


def stand_in_samples(module: nn.Module) -> int:
    """The fewest samples a training step of ``module`` can run on: 2 where a batch-norm layer trains (its batch
    statistics need more than one value per channel), else 1. A stand-in batch has that many, and so does every
    nonzero share."""
    return 2 if any(isinstance(m, _BatchNorm) and m.training for m in module.modules()) else 1


def synchronizes_batches(module: nn.Module) -> bool:
    """Whether ``module`` holds a ``SyncBatchNorm``: its forward and backward are collectives of every rank."""
    return any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())


class _NoSample:
    """A stand-in's ``SyncBatchNorm``: it takes part in the layer's collectives as a rank with an empty batch, which
    torch's ``SyncBatchNorm`` function leaves out of the batch statistics (a count of 0, masked out of the all-gather)
    and adds nothing to the gradient's sums (its backward all-reduces zeros), and normalises the stand-in's own
    samples by their own statistics, so that its output has the shape a training step's has."""

    def __init__(self, layer: nn.SyncBatchNorm) -> None:
        self._inputs: list[torch.Tensor] = []
        # Its own output computed first among the forward hooks: before a unit's FSDP2 hook reshards its parameters.
        self.handles = [layer.register_forward_pre_hook(self._empty),
                        layer.register_forward_hook(self._own, prepend=True)]

    def _empty(self, layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self._inputs.append(args[0])
        empty = args[0][:0]
        # torch gathers a batch's statistics in their accumulate type (float32 for AMP's half or bfloat16 batch) but
        # an empty batch's in its own: the ranks' buffers must match in size, so the empty batch is float32 there.
        return (empty.float() if empty.dtype in (torch.float16, torch.bfloat16) else empty, *args[1:])

    def _own(self, layer: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        own = nn.functional.batch_norm(self._inputs.pop(), None, None, layer.weight, layer.bias, True, 0.0,
                                       layer.eps)  # type: ignore[arg-type]
        return own + output.sum()  # 0, tied to the empty batch's node: its backward joins the layer's all-reduce


def kept_state(module: nn.Module) -> Callable[[], None]:
    """Let a stand-in forward of ``module`` change nothing that persists, and return what ends it: every buffer
    (BatchNorm's running statistics and ``num_batches_tracked``) is swapped for a copy the forward may change,
    torch's CPU and CUDA random states are put back, so that its dropout draws nothing from the rank's stream, and
    every ``SyncBatchNorm`` that trains joins its collectives with no sample (``_NoSample``), so that the others'
    statistics and gradients count none of the stand-in's.

    Copies, not a write-back: a training forward's backward may read the buffers it was given (BatchNorm's does),
    and a write-back would change them under it."""
    handles: list[RemovableHandle] = [handle for m in module.modules()
                                      if isinstance(m, nn.SyncBatchNorm) and m.training
                                      for handle in _NoSample(m).handles]
    owned = [(m, name, buffer) for m in module.modules() for name, buffer in m._buffers.items() if buffer is not None]
    copies: dict[int, torch.Tensor] = {}
    for m, name, buffer in owned:
        m._buffers[name] = copies.setdefault(id(buffer), buffer.detach().clone())
    cpu = torch.get_rng_state()
    devices = sorted({t.device.index or 0 for t in itertools.chain(module.parameters(), module.buffers())
                      if t.device.type == "cuda"})
    cuda = [torch.cuda.get_rng_state(device) for device in devices]

    def restore() -> None:
        for handle in handles:
            handle.remove()
        for m, name, buffer in owned:
            m._buffers[name] = buffer
        torch.set_rng_state(cpu)
        for device, state in zip(devices, cuda):
            torch.cuda.set_rng_state(state, device)

    return restore


@contextlib.contextmanager
def weighing_nothing(module: nn.Module) -> Iterator[None]:
    """Run a stand-in forward of ``module`` in its own mode, then put back what it changed that persists
    (``kept_state``), noted as the module's own forward starts: after what a wrapper runs before it, such as torch
    DDP's broadcast of rank 0's buffers, whose values the rank keeps."""
    restores: list[Callable[[], None]] = []
    handle = module.register_forward_pre_hook(lambda m, args: restores.append(kept_state(m)), prepend=True)
    try:
        yield
    finally:
        handle.remove()
        for restore in reversed(restores):
            restore()


class StandIn:
    """The steps a rank sits out, run for next to nothing: what the loop asks of them, and no more.

    The stand-in's forward runs the module in its own mode (so that its output has the structure a training step's
    has), without gradients, with its buffers and random states put back (``weighing_nothing``) and outside torch
    DDP (no reducer, no buffer broadcast): nothing of the step leaves the rank. Its floating-point outputs are tied
    to one zero-valued anchor, so that the loop's loss still has a backward; that backward computes nothing but the
    anchor's gradient, and gives every parameter of the models a zero gradient, as a stand-in weighted 0 had (a
    ``GradScaler`` and the loop's clipping find gradients; ``Optimizers`` still skips the step).
    """

    def __init__(self) -> None:
        self._modules: list[weakref.ref[nn.Module]] = []
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._zeros: dict[int, torch.Tensor] = {}
        """A zero gradient per parameter (by ``id``), kept while the rank sits out: allocating one each step costs
        the host more than zeroing it."""

    def add(self, module: nn.Module) -> None:
        self._modules.append(weakref.ref(module))

    def forward(self, model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The output of ``model``'s module on a stand-in batch, with a backward that costs nothing."""
        if model.device_ids:  # torch DDP would have moved the inputs to the module's device
            device = torch.device(model.device_type, model.device_ids[0])
            inputs, kwargs = tree_map(lambda value: _moved(value, device), (inputs, kwargs))
        with torch.no_grad(), weighing_nothing(model.module):
            output = model.module(*inputs, **kwargs)
        return tree_map(self._tied, output)

    def rejoined(self) -> None:
        """This rank takes part again: free the zero gradients."""
        self._zeros.clear()

    def _tied(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            return value
        anchor = self._anchors.get(value.device)
        if anchor is None:
            anchor = self._anchors[value.device] = torch.zeros((), device=value.device, requires_grad=True)
            anchor.register_hook(self._backward)
        return value + anchor

    def _backward(self, grad: torch.Tensor) -> None:
        for ref in self._modules:
            if (module := ref()) is None:
                continue
            for parameter in module.parameters():
                if not parameter.requires_grad:
                    continue
                if parameter.grad is None:
                    zeros = self._zeros.get(id(parameter))
                    if zeros is None or zeros.shape != parameter.shape:
                        zeros = self._zeros[id(parameter)] = torch.zeros_like(parameter)
                    parameter.grad = zeros.zero_()
                else:
                    parameter.grad.zero_()


def _moved(value: Any, device: torch.device) -> Any:
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
