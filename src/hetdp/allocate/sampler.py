"""WeightedDistributedSampler: disjoint, deterministic shards whose sizes follow per-rank shares."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized

import torch
from torch.utils.data import Sampler

from hetdp.allocate.apportion import apportion
from hetdp.errors import ConfigError


def split_step(shares: Sequence[int], count: int) -> list[int]:
    """Each rank's part of a step of ``count`` samples: ``shares`` for a full step, else in proportion to them.

    A short step (an epoch's last) gives every rank with a share at least one
    sample whenever it has enough samples for that, so no rank sits out a step
    it could take part in; with fewer samples than such ranks, some get none.
    """
    if count == sum(shares):
        return list(shares)
    active = [rank for rank, share in enumerate(shares) if share > 0]
    parts = apportion([shares[rank] for rank in active], count, minimum=1 if count >= len(active) else 0)
    block = [0] * len(shares)
    for rank, part in zip(active, parts):
        block[rank] = part
    return block


def step_blocks(shares: Sequence[int], total: int) -> list[list[int]]:
    """Per step, how many of ``total`` samples each rank takes: full steps of ``sum(shares)``, then a remainder.

    The remainder step (if ``total`` is not a multiple of ``sum(shares)``) is split
    by ``split_step``, so every sample is used exactly once.
    """
    step_size = sum(shares)
    full_steps, remainder = divmod(total, step_size)
    blocks = [list(shares) for _ in range(full_steps)]
    if remainder:
        blocks.append(split_step(shares, remainder))
    return blocks


class WeightedDistributedSampler(Sampler[int]):
    """Give each rank a share of every step's samples, in proportion to ``shares``.

    The epoch is one seeded permutation of the dataset, cut into consecutive steps
    of ``sum(shares)`` samples; each step is cut into one block per rank, rank ``r``
    taking ``shares[r]`` samples. Iterating yields this rank's blocks in step order,
    so a loader with ``batch_size=shares[rank]`` yields exactly one step per batch.
    The shards of all ranks are disjoint and, with ``drop_last=False``, cover the
    epoch (the last, partial step is split in proportion to the shares).

    Every rank gets the same number of batches, as DDP needs: a rank whose block
    in a step is empty (a share of 0, or an epoch's last step with fewer samples
    than ranks) yields one padding sample instead, the step's first, which is then
    trained twice in that step, as ``DistributedSampler`` pads. ``hetdp.DDP``'s
    loader does better: such a rank joins the step with a weight of 0.

    Shares may change between epochs (``set_shares``) or mid-epoch: ``set_epoch(e,
    start=n)`` resumes the epoch after its first ``n`` permuted samples, so samples
    taken before the change are not taken again.

    .. warning::
        Every rank must construct it with the same ``shares`` and ``seed`` and call
        ``set_epoch`` / ``set_shares`` with the same values, or shards will overlap.

    Example::

        >>> # on every rank, with dataset of 10 samples
        >>> sampler = WeightedDistributedSampler(dataset, shares=[1, 3], rank=rank, seed=0)
        >>> sampler.set_epoch(0)
        >>> loader = DataLoader(dataset, batch_size=sampler.shares[rank], sampler=sampler)
        >>> # rank 0 sees 1 + 1 + 0 samples (the last step splits 2 as [0, 2]), rank 1 sees 3 + 3 + 2
    """

    def __init__(
        self, dataset: Sized, shares: Sequence[int], rank: int, seed: int = 0, drop_last: bool = False, shuffle: bool = True
    ) -> None:
        self.dataset_size = len(dataset)
        self.rank = rank
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0
        self.set_shares(shares)
        if not 0 <= rank < len(self.shares):
            raise ConfigError(f"rank must be in [0, {len(self.shares)}), got {rank}")

    def set_shares(self, shares: Sequence[int]) -> None:
        """Use ``shares`` (samples per step, one per rank) from the next iteration on."""
        shares = [int(share) for share in shares]
        if any(share < 0 for share in shares) or sum(shares) == 0:
            raise ConfigError(f"shares must be >= 0 with a positive sum, got {shares}")
        self.shares = shares

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation; ``start`` skips the samples already taken this epoch."""
        if not 0 <= start <= self.dataset_size:
            raise ConfigError(f"start must be in [0, {self.dataset_size}], got {start}")
        self.epoch = epoch
        self.start = start

    def permutation(self) -> list[int]:
        """The epoch's order of all dataset indices, identical on every rank."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def blocks(self) -> list[list[int]]:
        """For each remaining step of the epoch, the number of samples of every rank."""
        remaining = self.dataset_size - self.start
        if self.drop_last:
            remaining -= remaining % sum(self.shares)
        return step_blocks(self.shares, remaining)

    def __iter__(self) -> Iterator[int]:
        order = self.permutation()
        cursor = self.start
        for block in self.blocks():
            offset = cursor + sum(block[: self.rank])
            yield from order[offset : offset + block[self.rank]] if block[self.rank] else [order[cursor]]
            cursor += sum(block)

    def __len__(self) -> int:
        return sum(max(block[self.rank], 1) for block in self.blocks())

    @property
    def num_steps(self) -> int:
        """Steps left in the epoch; the same on every rank."""
        remaining = self.dataset_size - self.start
        step_size = sum(self.shares)
        return remaining // step_size if self.drop_last else math.ceil(remaining / step_size)
