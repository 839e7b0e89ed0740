"""Gradient accumulation over steps: each step's gradient weighed by its own share, however the shares change.

A loop that accumulates under DDP's ``no_sync`` runs several batches of the
allocated loader, each a step of its own to hetdp (its own shares, timed and
emulated alone), and synchronizes their summed gradient once. The comm hook sees
only that sum; weighed there by the last step's share, the earlier steps would
take it too, which is wrong when the shares changed in between (a re-plan) or a
step was a stand-in of 0 samples. So once accumulated gradients outlive their
step, they are weighed by that step's weight (``Synchronizer.weight``), a hook
on every parameter weighs each later backward of the window by its own step's
as it runs, and the comm hook reduces the sum with weight 1. Micro-batches
within one step (``allocate(loader, accumulates=True)``) share its weight: the comm hook weighs
them, as any step.
"""

from __future__ import annotations

import torch
from torch import nn


class StepAccumulation:
    """Tracks gradients accumulated under ``no_sync`` and weighs them step by step once they span steps."""

    def __init__(self, module: nn.Module) -> None:
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.waiting = False
        """Whether gradients of a ``no_sync`` backward wait for a synchronized one."""
        self.weighted = False
        """Whether those gradients span steps and are weighed already: the synchronized backward sums them."""
        self._scale: float | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def forward_starts(self, weight: float, synchronizing: bool) -> bool:
        """A forward with gradients of a step of ``weight`` starts; return whether its backward must be reduced with
        weight 1 (it completes a window that spans steps)."""
        if not synchronizing:
            self.waiting = True
        if self.weighted:
            self._scale = weight
        return self.weighted and synchronizing

    def step_ended(self, weight: float, synchronized: bool) -> None:
        """The step of ``weight`` ended; ``synchronized``: its backward reduced the gradients."""
        self._scale = None
        if synchronized:
            self.waiting = self.weighted = False
        elif self.waiting and not self.weighted:  # the window outlives its first step
            with torch.no_grad():
                for parameter in self.parameters:
                    if parameter.grad is not None:
                        parameter.grad.mul_(weight)
            self.weighted = True
            if not self._handles:
                self._handles = [p.register_hook(self._scaled) for p in self.parameters]

    def _scaled(self, grad: torch.Tensor) -> torch.Tensor | None:
        return None if self._scale is None or self._scale == 1.0 else grad * self._scale

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
