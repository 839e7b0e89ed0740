"""Parameter averaging: replicas that trained apart merge as w = sum_i weight_i w_i (local SGD, C-ADP).

The one implementation of the local synchronization: the drop-in merges with it
every K steps or once per epoch (C-ADP's per-epoch merge, weighted by each
replica's samples).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetdp.collectives.flat import flatten, unflatten_into
from hetdp.errors import ConfigError
from hetdp.runtime import wait_for
from hetdp.sync.base import Synchronizer


def merge_weights(samples: Sequence[int]) -> list[float]:
    """D_i / D for every device: its weight in the C-ADP merge w = sum_i (D_i / D) w_i.

    Raises:
        ConfigError: a count is negative, or all are zero.
    """
    counts = [int(n) for n in samples]
    if any(n < 0 for n in counts):
        raise ConfigError(f"sample counts must be >= 0, got {counts}")
    total = sum(counts)
    if total == 0:
        raise ConfigError(f"sample counts must not all be zero, got {counts}")
    return [n / total for n in counts]


def float_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a merge averages: parameters and floating-point buffers (counters are left alone)."""
    tensors = list(model.parameters())
    tensors += [b for b in model.buffers() if b.is_floating_point()]
    return tensors


def merge_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype a merge sums in: float32 where the tensors are of 16 bits or 32 (a weighted sum of a few 16-bit values
    would round), float64 only where some already is. On a GPU, a float64 copy of a float32 model would cost twice
    the model's memory for no precision the parameters can hold."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@torch.no_grad()
def average_parameters(
    model: nn.Module,
    weight: float,
    *,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 60.0,
    carry: torch.Tensor | None = None,
    alongside: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Replace the model's parameters and float buffers with sum over ranks of weight_r * w_r, on every rank.

    The weights of all ranks must sum to 1 (C-ADP: D_i / D); a rank with weight 0
    contributes nothing and receives the merged model. ``carry`` (float64 figures, on any device)
    rides along, summed unweighted, and is returned. ``alongside`` (a tensor of the model's size, say, already
    weighted) is summed over the ranks in place, in its own dtype: no float64 copy of it is ever made.

    The merge holds one copy of the model, in float32 (float64 only where a tensor is): a weighted sum of
    16-bit parameters rounds once, to their own precision, when it is copied back.

    Raises:
        PeerTimeoutError: a rank did not join within ``timeout_s`` seconds.
    """
    if weight == 1.0 and dist.get_world_size(group) == 1:  # alone: the merge is this replica, with no collective
        return None if carry is None else carry.to(torch.float64).reshape(-1)
    tensors = float_state(model)
    merged = flatten(tensors, dtype=merge_dtype(tensors)).mul_(weight)
    figures = None if carry is None else carry.to(merged.device, torch.float64).reshape(-1)
    extra = None if alongside is None else alongside.to(merged.device)
    # Each keeps its dtype (the figures are step counts and seconds) in a collective of its own, started together.
    works = [dist.all_reduce(tensor, group=group, async_op=True) for tensor in (merged, figures, extra)
             if tensor is not None]
    for work in works:
        wait_for(work, "parameter merge", timeout_s, group)
    unflatten_into(tensors, merged)
    if extra is not None and extra is not alongside:
        alongside.copy_(extra)  # type: ignore[union-attr]
    return figures


class ParameterAveraging(Synchronizer):
    """The local synchronization of the drop-in: no gradient leaves a rank; replicas merge every ``every`` steps
    (0: only at each epoch's end) with weights D_i / D, D_i being the samples rank i trained on since the last
    merge.

    Every rank knows D (the steps' global sample counts are the same everywhere), so a merge is one allreduce.
    """

    def __init__(self, every: int, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.every = every
        self.group = group
        self.timeout_s = timeout_s
        self.samples = 0
        """This rank's samples since the last merge."""
        self.total = 0
        """All ranks' samples since the last merge."""

    def reduce(self, bucket: dist.GradBucket, samples: int, total: int, meets: bool = False
               ) -> torch.futures.Future[torch.Tensor]:
        """Keep the local gradient: the optimizer steps on this rank's samples alone (none for a stand-in)."""
        buffer = bucket.buffer()
        if not samples:
            buffer.zero_()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    def weight(self, samples: float, total: float) -> float:
        """The local gradient is kept whole, or dropped for a stand-in."""
        return 1.0 if samples else 0.0

    def count(self, samples: int, total: int) -> None:
        """Record a finished step of ``samples`` here and ``total`` over all ranks."""
        self.samples += samples
        self.total += total

    def due(self, steps_since_meeting: int) -> bool:
        return self.every > 0 and steps_since_meeting >= self.every

    def meet(self, model: nn.Module, carry: torch.Tensor | None = None) -> torch.Tensor | None:
        """Merge the replicas (collective); ``carry`` rides along, summed."""
        weight = self.samples / self.total
        self.samples = self.total = 0
        return average_parameters(model, weight, group=self.group, timeout_s=self.timeout_s, carry=carry)

