"""The order plain torch gives a shuffled epoch, for the tests' one-process references: drawn by torch's own
``DistributedSampler``, never by hetdp's sampler, so that a reference which claims exactness does not take its batches
from the code it checks."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """Every index of a dataset of ``size`` in the order a shuffled ``DistributedSampler(seed=seed)`` deals them out at
    ``epoch``: rank r of W reads positions r, r + W, ..., so plain DDP's ranks, B samples each, train positions
    k W B to (k + 1) W B at step k."""
    sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def global_batches(size: int, global_batch: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """The indices of each step's global batch at ``epoch``: ``epoch_order`` cut into ``global_batch`` samples, the
    last step holding what is left."""
    return list(torch.tensor(epoch_order(size, seed, epoch)).split(global_batch))
