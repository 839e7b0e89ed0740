"""What the drop-in asks of a synchronization: reduce each gradient bucket, and now and then make the ranks meet."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

from hetdp.errors import ConfigError

LossConvention = Literal["mean", "sum", "global_mean"]
"""What each rank's loss is, which says what its gradient must weigh for the step's to be plain DDP's:

- ``"mean"``: the mean over the rank's own samples (``reduction="mean"``, the default). Weighed by its samples over
  the step's, the ranks' gradients sum to the mean over the step's samples: one process's gradient on the global
  batch, and plain DDP's at equal shares.
- ``"sum"``: the sum over the rank's samples (``reduction="sum"``). Plain DDP averages the ranks' gradients, so its
  step's gradient is the sum over the step's samples over the number of ranks: each rank's is weighed by 1 / ranks.
- ``"global_mean"``: the sum over the rank's tokens over the step's token count over all ranks (the loop all-reduces
  it: ``num_items_in_batch``, a global token mean). Plain DDP's gradient is the global mean over the number of ranks:
  each rank's is weighed by 1 / ranks. A stand-in batch (``model.step_samples`` 0) counts 0 tokens and weighs 0.
"""


def check_loss(loss: object) -> LossConvention:
    """Return ``loss`` if it names a loss convention, else raise ConfigError."""
    if loss not in get_args(LossConvention):
        raise ConfigError(f"loss must be one of {', '.join(map(repr, get_args(LossConvention)))}, got {loss!r}")
    return loss  # type: ignore[return-value]


def batch_statistics_mix(module: nn.Module, loss: LossConvention) -> str | None:
    """Why ``module`` under ``loss`` is not exact at unequal shares, or None. A ``SyncBatchNorm``'s backward sums the
    gradients of its output over the ranks before the drop-in weighs them: exact where each sample's loss has one
    scale on every rank (a sum, a global mean), not where each rank's is the mean over its own share (1 / samples)."""
    if loss != "mean" or not any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        return None
    return ("a SyncBatchNorm sums the ranks' gradients before they are weighed, so under loss='mean' (each rank's "
            "loss the mean over its own share) unequal shares give another gradient than one process: divide each "
            "rank's summed loss by the equal share (global batch / ranks) and pass loss='sum'")


def step_part(loss: LossConvention, samples: float, total: float, world_size: int) -> tuple[float, float]:
    """(this rank's part, the step's whole) a rank's gradient is weighed by, for a rank with ``samples`` of the
    step's ``total`` (its cost, where cost-balanced) under the loss convention ``loss``: its part of the step for a
    per-rank mean, plain DDP's 1 / ``world_size`` for a sum or a global mean (0 for a stand-in, either way)."""
    if loss == "mean":
        return samples, total
    return (1 if samples else 0), world_size


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
