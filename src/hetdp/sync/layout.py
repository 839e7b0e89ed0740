"""Where each parameter's gradient lies in the flat gradient partial rounds carry: one order for every step and every
rank, whatever order torch DDP's gradient buckets take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from hetdp.errors import ConfigError


class _Run(NamedTuple):
    """Gradients that lie contiguously both in a bucket and in the layout: one slice each side."""

    bucket: int
    source: int
    """Offset in the bucket's buffer."""
    target: int
    """Offset in the layout."""
    numel: int


class _Plan(NamedTuple):
    """The runs of one bucket order, for each direction: one ``torch.cat`` gathers, one per bucket scatters."""

    gather: list[_Run]
    """Every run, in the layout's order."""
    scatter: list[list[_Run]]
    """Each bucket's runs, in the bucket's order."""


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
        self._plans: dict[tuple[tuple[int, ...], ...], _Plan] = {}
        """The runs between the layout and each bucket order seen (torch DDP's first, and its rebuilt one)."""

    def gather(self, buffers: Sequence[torch.Tensor], parameters: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """The gradients in ``buffers`` (each the flat gradients of its ``parameters``, in order), in this layout.

        Raises:
            ConfigError: the buckets hold other parameters than the layout.
        """
        views = [buffer.reshape(-1) for buffer in buffers]
        return torch.cat([views[run.bucket][run.source : run.source + run.numel]
                          for run in self._plan(parameters).gather])

    def scatter(self, flat: torch.Tensor, buffers: Sequence[torch.Tensor],
                parameters: Sequence[Sequence[torch.Tensor]]) -> None:
        """Copy ``flat`` (in this layout) into ``buffers``, each laid out as its ``parameters``."""
        for buffer, runs in zip(buffers, self._plan(parameters).scatter):
            torch.cat([flat[run.target : run.target + run.numel] for run in runs], out=buffer.view(-1))

    def _plan(self, parameters: Sequence[Sequence[torch.Tensor]]) -> _Plan:
        key = tuple(tuple(id(p) for p in held) for held in parameters)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan_for(parameters)
        return plan

    def _plan_for(self, parameters: Sequence[Sequence[torch.Tensor]]) -> _Plan:
        """The runs of one bucket order, neighbours in both merged into one."""
        scatter: list[list[_Run]] = []
        for bucket, held in enumerate(parameters):
            runs: list[_Run] = []
            source = 0
            for parameter in held:
                target = self._offsets.get(id(parameter))
                if target is None:
                    raise ConfigError(f"a gradient bucket holds a parameter of shape {tuple(parameter.shape)} that is "
                                      f"not among the {len(self.parameters)} trainable parameters the synchronization "
                                      "was built for: unfreeze or add parameters before wrapping the module")
                if runs and runs[-1].source + runs[-1].numel == source and runs[-1].target + runs[-1].numel == target:
                    runs[-1] = runs[-1]._replace(numel=runs[-1].numel + parameter.numel())
                else:
                    runs.append(_Run(bucket, source, target, parameter.numel()))
                source += parameter.numel()
            scatter.append(runs)
        gather = sorted((run for runs in scatter for run in runs), key=lambda run: run.target)
        if not _tiles(gather, self.numel):
            raise ConfigError("the gradient buckets must hold every trainable parameter once; they hold "
                              f"{sum(p.numel() for held in parameters for p in held)} elements of the {self.numel}")
        return _Plan(gather, scatter)


def _tiles(runs: Sequence[_Run], numel: int) -> bool:
    """Whether ``runs``, in the layout's order, cover its ``numel`` elements once each."""
    covered = 0
    for run in runs:
        if run.target != covered:
            return False
        covered += run.numel
    return covered == numel
