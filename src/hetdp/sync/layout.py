"""Where each parameter's gradient lies in the flat gradient partial rounds carry: one order for every step and every
rank, whatever order torch DDP's gradient buckets take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hetdp.errors import ConfigError


class _Run(NamedTuple):
    """Gradients that lie contiguously both in a bucket and in the layout: one copy moves them."""

    bucket: int
    source: int
    """Offset in the bucket's buffer."""
    target: int
    """Offset in the layout."""
    numel: int


class GradientLayout:
    """Each trainable parameter's place in a partial round's flat gradient: the parameters' own order.

    torch DDP lays a step's gradients out in its buckets, and rebuilds the buckets once
    after the first step, in the order the gradients became ready there. A partial round
    sums contributions of different steps (a stale one carried from a round it missed),
    and a rank may apply a round in a later step than the one it contributed in: laid
    out as the buckets of each step, a contribution from before the rebuild would be
    summed with, and applied as, the gradients of other parameters. In this layout every
    contribution and every round means the same parameters on every rank, in every step.
    """

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        """Lay out the gradients of ``parameters`` (the same parameters, in the same order, on every rank)."""
        self.parameters = list(parameters)
        self._offsets: dict[int, int] = {}
        offset = 0
        for parameter in self.parameters:
            self._offsets[id(parameter)] = offset
            offset += parameter.numel()
        self.numel = offset
        self.placed = [(parameter, self._offsets[id(parameter)]) for parameter in self.parameters]
        """Each parameter with the offset of its gradient."""
        self._runs: dict[tuple[tuple[int, ...], ...], list[_Run]] = {}
        """Copies between the layout and each bucket order seen (torch DDP's first, and its rebuilt one)."""

    def gather(self, buffers: Sequence[torch.Tensor], parameters: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """The gradients in ``buffers`` (each the flat gradients of its ``parameters``, in order), in this layout.

        Raises:
            ConfigError: the buckets hold other parameters than the layout.
        """
        flat = buffers[0].new_empty(self.numel)
        views = [buffer.reshape(-1) for buffer in buffers]
        for run in self._plan(parameters):
            flat[run.target : run.target + run.numel].copy_(views[run.bucket][run.source : run.source + run.numel])
        return flat

    def scatter(self, flat: torch.Tensor, buffers: Sequence[torch.Tensor],
                parameters: Sequence[Sequence[torch.Tensor]]) -> None:
        """Copy ``flat`` (in this layout) into ``buffers``, each laid out as its ``parameters``."""
        views = [buffer.view(-1) for buffer in buffers]
        for run in self._plan(parameters):
            views[run.bucket][run.source : run.source + run.numel].copy_(flat[run.target : run.target + run.numel])

    def _plan(self, parameters: Sequence[Sequence[torch.Tensor]]) -> list[_Run]:
        key = tuple(tuple(id(p) for p in held) for held in parameters)
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = self._runs_for(parameters)
        return runs

    def _runs_for(self, parameters: Sequence[Sequence[torch.Tensor]]) -> list[_Run]:
        """The copies for one bucket order, neighbours in both merged into one."""
        runs: list[_Run] = []
        seen = 0
        for bucket, held in enumerate(parameters):
            source = 0
            for parameter in held:
                target = self._offsets.get(id(parameter))
                if target is None:
                    raise ConfigError(f"a gradient bucket holds a parameter of shape {tuple(parameter.shape)} that is "
                                      f"not among the {len(self.parameters)} trainable parameters the synchronization "
                                      "was built for: unfreeze or add parameters before wrapping the module")
                numel = parameter.numel()
                last = runs[-1] if runs else None
                if (last is not None and last.bucket == bucket and last.source + last.numel == source
                        and last.target + last.numel == target):
                    runs[-1] = last._replace(numel=last.numel + numel)
                else:
                    runs.append(_Run(bucket, source, target, numel))
                source += numel
                seen += numel
        if seen != self.numel:
            raise ConfigError(f"the gradient buckets hold {seen} elements, the trainable parameters {self.numel}: "
                              "the synchronization must see every trainable parameter, once")
        return runs
