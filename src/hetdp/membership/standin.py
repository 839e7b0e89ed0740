"""The steps of a rank with no sample in them, run for next to nothing: the module without gradients, in eval mode,
with a backward that only zeroes the gradients."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Run ``module`` in eval mode, then restore every submodule's own mode."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training



class StandIn:
    """The steps a rank sits out, run for next to nothing: what the loop asks of them, and no more.

    The stand-in's forward runs the module without gradients, in eval mode (no
    BatchNorm statistics from it) and outside torch DDP (no reducer, no buffer
    broadcast): nothing of the step leaves the rank. Its floating-point outputs are
    tied to one zero-valued anchor, so that the loop's loss still has a backward;
    that backward computes nothing but the anchor's gradient, and gives every
    parameter of the models a zero gradient, as a stand-in weighted 0 had (a
    ``GradScaler`` and the loop's clipping find gradients; ``Optimizers`` still
    skips the step).
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
        with torch.no_grad(), evaluating(model.module):
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
