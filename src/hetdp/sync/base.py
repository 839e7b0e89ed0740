"""What the drop-in asks of a synchronization: reduce each gradient bucket, and now and then make the ranks meet."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


class Synchronizer(ABC):
    """One rank's side of a synchronization, driven by the drop-in at fixed points of every step.

    Warning:
        Every rank calls ``reduce`` for the same buckets of the same steps and
        ``meet`` at the same points (``due`` gives the same answer everywhere):
        both may be collectives.
    """

    meets_every_step = False
    """Whether every step already synchronizes the ranks (then no meeting is ever due)."""

    @abstractmethod
    def reduce(self, bucket: dist.GradBucket, samples: int, total: int, meets: bool = False
               ) -> torch.futures.Future[torch.Tensor]:
        """Combine one gradient bucket of a step in which this rank holds ``samples`` of the step's ``total``;
        ``meets``: the ranks meet after this step (every rank says the same)."""

    def weight(self, samples: float, total: float) -> float:
        """The factor ``reduce`` puts on a gradient of ``samples`` of the step's ``total``. Gradients the loop
        accumulates over several steps under ``no_sync`` take each its own step's as its backward runs, and
        ``reduce`` gets their sum as a step of weight 1 (``samples == total``)."""
        return samples / total

    def count(self, samples: int, total: int) -> None:
        """Record a finished step (``samples`` here, ``total`` over all ranks)."""

    def due(self, steps_since_meeting: int) -> bool:
        """Whether the ranks meet after this step."""
        return False

    def meet(self, model: nn.Module, carry: torch.Tensor | None = None) -> torch.Tensor | None:
        """Bring every rank to the same parameters (collective); ``carry`` (float64) rides along, summed."""
        return None

    def standby(self, done: Callable[[], bool], timeout_s: float) -> float:
        """Wait outside a step until ``done()`` (a collective the drop-in started in the background), at most
        ``timeout_s`` seconds, without holding up the others' steps; return the seconds left."""
        return timeout_s

    def close(self) -> None:
        """Release threads and groups; every rank calls it."""
