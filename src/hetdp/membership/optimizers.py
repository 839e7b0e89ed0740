"""The optimizers over a module's parameters, found as the loop steps them, and kept from stepping while this rank
sits out a step."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class Optimizers:
    """The optimizers that step a module's parameters, found as the loop steps them (torch's global optimizer hooks):
    the drop-in does not own the loop's optimizer, and a rank that sat out needs its state too.

    While this rank is ``out`` of the step, an optimizer over those parameters finds no gradient (it skips them):
    the stand-in's gradient means nothing, and a step on it would cost the host as much as a member's and move
    the replica (momentum, weight decay) for nothing until its catch-up.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._modules = [weakref.ref(module) for module in modules]
        self._found: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._others: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        """Optimizers over none of the modules' parameters, each with its number of parameter groups then: the hook
        is global, and looking again at every step of another model's optimizer would cost that model's loop."""
        self.out = False
        """Whether this rank is out of the current step."""
        handles = [register_optimizer_step_pre_hook(_weakly(self, Optimizers._before_step)),
                   register_optimizer_step_post_hook(_weakly(self, Optimizers._stepped))]
        weakref.finalize(self, _remove, handles)

    def add(self, module: nn.Module) -> None:
        """Find the optimizers of ``module`` too (a model that follows this one's steps)."""
        self._modules.append(weakref.ref(module))
        self._others.clear()

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.out:
            return
        for ref in self._modules:
            if (module := ref()) is not None:
                for parameter in module.parameters():
                    parameter.grad = None

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._found or self._others.get(optimizer) == len(optimizer.param_groups):
            return
        order = {id(p): i for ref in self._modules if (module := ref()) is not None
                 for i, p in enumerate(module.parameters())}
        first = min((order[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in order),
                    default=None)
        if first is None:
            self._others[optimizer] = len(optimizer.param_groups)  # looked at again once it gains a group
        else:
            self._found[optimizer] = first
            self._others.pop(optimizer, None)

    def __iter__(self):  # type: ignore[no-untyped-def]
        """The optimizers found, in the order of their first parameter in the modules (the same on every rank)."""
        return iter(sorted(self._found.keys(), key=lambda optimizer: self._found[optimizer]))


def _weakly(optimizers: Optimizers, method: Any) -> Any:
    """A global optimizer hook calling ``method`` of ``optimizers`` while it lives (the hook must not keep it)."""
    ref = weakref.ref(optimizers)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is not None:
            method(owner, optimizer)

    return hook


def _remove(handles: Sequence[Any]) -> None:
    for handle in handles:
        handle.remove()


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it on the host: a rank on another device unpickles it (``load_state_dict``
    moves optimizer state to each parameter's device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(item) for item in value)
    return value
