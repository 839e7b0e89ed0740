"""The loop the task-allocation benchmarks train through the drop-in: the loop body a user writes around
``hetdp.DDP`` and ``model.allocate(loader, accumulates=True)`` (examples/allocation_train.py), with a share larger
than one forward may hold run as micro-batches under ``no_sync``."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hetdp.cluster.devices import micro_batches
from hetdp.ddp.model import DistributedDataParallel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Gathered(Dataset):
    """A TensorDataset whose batches are one gather per tensor (``__getitems__``), not one item at a time."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(tensor[index] for tensor in self.tensors)

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(tensor[index] for tensor in self.tensors)


def _as_is(batch: object) -> object:
    return batch


def tensor_loader(dataset: TensorDataset, batch_size: int, drop_last: bool = False) -> DataLoader:
    """A DataLoader over ``dataset`` that gathers each batch at once: an emulated step's cost is the emulation's,
    not the default collate's, item by item."""
    return DataLoader(_Gathered(dataset), batch_size=batch_size, collate_fn=_as_is, drop_last=drop_last)


def train_share(model: DistributedDataParallel, inputs: torch.Tensor, targets: torch.Tensor, *,
                largest: int | None, loss_fn: LossFn = nn.functional.cross_entropy) -> None:
    """Forward and backward this rank's share of the step: as few near-equal micro-batches of at most ``largest``
    samples (None: one) as fit, all but the last under ``no_sync``; each loss weighed by its part of the share,
    so that the gradient is the share's mean. The caller zeroes the gradients before and steps after."""
    count = len(inputs)
    # Near-equal micro-batches, not full ones and a remainder: a small remainder runs below the device's knee.
    sizes = micro_batches(count, max(1, math.ceil(count / (largest or count))))
    start = 0
    for index, size in enumerate(sizes):
        piece = slice(start, start + size)
        start += size
        with contextlib.nullcontext() if index == len(sizes) - 1 else model.no_sync():
            loss = loss_fn(model(inputs[piece]), targets[piece])
            (loss * (size / count)).backward()
        model.record_loss(loss, size)
