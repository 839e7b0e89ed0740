"""How the user's DataLoader walks an epoch, read off it once before it is re-cut: its order, its batch, and what it
drops.

``model.allocate(loader)`` keeps what the loader asked for: the ``DistributedSampler`` whose ``set_epoch`` picks
each epoch's order (or a plain shuffled or sequential sampler), the samples that sampler drops so that they divide
among the ranks, the partial last batch the loader drops, and the batch each rank of plain DDP would take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from hetdp.errors import ConfigError


@dataclass(frozen=True)
class LoaderOrder:
    """What the user's loader asks of an epoch (``shuffle`` and ``seed`` given to ``allocate`` override it)."""

    size: int
    """Samples in the dataset."""
    shuffle: bool
    seed: int
    drawn: bool
    """Whether ``seed`` is this rank's draw (a plain shuffled loader's, as torch's ``RandomSampler`` draws one per
    pass), which the ranks must agree on before cutting steps."""
    source: DistributedSampler | None
    """The user's ``DistributedSampler``, whose epoch the allocated loader follows."""
    drops_tail: bool
    """Whether the sampler drops the samples that do not divide among the ranks (``drop_last`` on it)."""
    drop_last: bool
    """Whether the loader drops a partial last batch (a ``BatchSampler`` of its own says so itself)."""
    batch: int | None
    """The batch each rank of plain DDP would take (None where the loader does not say)."""

    @classmethod
    def read(cls, loader: DataLoader, shuffle: bool | None = None, seed: int | None = None) -> LoaderOrder:
        """Read ``loader``. One that batches with a ``batch_sampler`` of its own ignores ``loader.sampler``: its order,
        batch and ``drop_last`` are the batch sampler's.

        Raises:
            ConfigError: an iterable dataset, or a sampler it cannot imitate without ``shuffle``.
        """
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError("allocate() needs a map-style dataset (with __len__ and __getitem__), "
                              f"got {type(dataset).__name__}")
        own = loader.batch_sampler if loader.batch_size is None else None
        sampler = loader.sampler
        if own is not None:
            sampler = own.sampler if type(own) is BatchSampler else own
        if isinstance(sampler, DistributedSampler):
            asked, asked_seed, source, drops_tail = sampler.shuffle, sampler.seed, sampler, sampler.drop_last
        elif isinstance(sampler, RandomSampler):
            asked, asked_seed, source, drops_tail = True, None, None, False
        elif isinstance(sampler, SequentialSampler):
            asked, asked_seed, source, drops_tail = False, 0, None, False
        elif shuffle is None:
            raise ConfigError(
                f"allocate() replaces the loader's sampler and cannot imitate a {type(sampler).__name__}: use a "
                f"DistributedSampler, or pass shuffle= (and seed=; cost= balances steps by length)"
            )
        else:
            asked, asked_seed, source, drops_tail = shuffle, None, None, False
        shuffle = asked if shuffle is None else shuffle
        if seed is None and asked_seed is None and not shuffle:
            seed = 0  # an order that is not shuffled needs no seed
        seed = asked_seed if seed is None else seed
        batched = own is None or type(own) is BatchSampler
        return cls(size=len(dataset), shuffle=shuffle, seed=_drawn_seed(loader) if seed is None else seed,
                   drawn=seed is None, source=source, drops_tail=drops_tail,
                   drop_last=own.drop_last if type(own) is BatchSampler else loader.drop_last,
                   batch=(loader.batch_size if own is None else own.batch_size) if batched else None)

    def epoch_size(self, world_size: int) -> int:
        """The samples an epoch trains: all, or those that divide among the ranks where the sampler drops the tail."""
        return self.size - self.size % world_size if self.drops_tail else self.size


def _drawn_seed(loader: DataLoader) -> int:
    """A seed for a plain shuffled loader's orders, drawn as torch's ``RandomSampler`` draws one: from the loader's
    ``generator`` if it has one, else from torch's global generator (``torch.manual_seed`` fixes it)."""
    generator: Any = getattr(loader.sampler, "generator", None) or loader.generator
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) % 2**62
