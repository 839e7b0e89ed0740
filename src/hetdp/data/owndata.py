"""Steps over rank-local data: each rank trains the samples it holds, in batches of its own size.

C-ADP (paper, section 3): the data owner sends device i its D_i samples once
(``hetdp.distribute``); every epoch, device i trains them in batches of its own
size, and the models merge as w = sum_i (D_i / D) w_i. There is no dataset the
ranks share, so ``model.allocate(loader, own_data=True)`` cuts each step from
the rank's own loader: step k gives rank i its k-th batch of b_i samples, and
an epoch has as many steps as the rank with the most batches (a rank out of
batches runs a stand-in, weighted 0).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hetdp.allocate.policy import AllocationPolicy, Equal, Planned
from hetdp.data.steps import StepSampler, StepTicket
from hetdp.errors import ConfigError


def epoch_order(size: int, *, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """The order in which ``rank`` visits its ``size`` own samples in ``epoch``: a permutation seeded by all three."""
    state = int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])
    return torch.randperm(size, generator=torch.Generator().manual_seed(state))


def own_batch_sizes(policy: AllocationPolicy, loader_batches: Sequence[int | None]) -> list[int]:
    """Every rank's batch size over its own data: the cluster's devices' under ``Planned`` (the C-ADP plan's), each
    rank's own loader's under ``Equal``.

    Raises:
        ConfigError: another allocation (own data cannot move between ranks), or a loader without a batch size.
    """
    if isinstance(policy, Planned):
        if len(policy.cluster.devices) != len(loader_batches):
            raise ConfigError(f"the cluster has {len(policy.cluster.devices)} devices for {len(loader_batches)} "
                              "ranks; give one per rank")
        return [device.feasible_batch_size for device in policy.cluster.devices]
    if not isinstance(policy, Equal):
        raise ConfigError(f"own_data=True takes allocation 'equal' (each loader's batch size) or "
                          f"hetdp.Planned(cluster) (each device's), got {policy.describe()}: a rank's own samples "
                          "cannot move to another")
    if any(batch is None for batch in loader_batches):
        raise ConfigError(f"own_data=True needs every rank's loader to have a batch_size, got {list(loader_batches)}")
    return [int(batch) for batch in loader_batches]  # type: ignore[arg-type]


def own_blocks(counts: Sequence[int], batch_sizes: Sequence[int], index: int, drop_last: bool) -> tuple[int, ...]:
    """Every rank's samples in step ``index`` of an epoch: its ``index``-th batch, 0 once it ran out (with
    ``drop_last``, a partial last batch is 0 too)."""
    blocks = [min(size, max(0, count - index * size)) for count, size in zip(counts, batch_sizes)]
    return tuple(0 if drop_last and block < size else block for block, size in zip(blocks, batch_sizes))


@dataclass(frozen=True)
class OwnData:
    """What the ranks agree on before cutting steps of their own data: every rank's samples and batch size."""

    counts: tuple[int, ...]
    """D_i: the samples rank i holds."""
    batch_sizes: tuple[int, ...]
    """b_i: the samples rank i trains per step."""

    def __post_init__(self) -> None:
        if any(count < 1 for count in self.counts):
            raise ConfigError(f"own_data=True needs samples on every rank, got {list(self.counts)}: a data owner that "
                              "does not train stays out of the model's process group")
        if any(size < 1 for size in self.batch_sizes):
            raise ConfigError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")

    def sampler(self, rank: int, *, shuffle: bool, seed: int, drop_last: bool, epoch_source: Any = None
                ) -> OwnDataSampler:
        return OwnDataSampler(self, rank, shuffle=shuffle, seed=seed, drop_last=drop_last, epoch_source=epoch_source)


class OwnDataSampler(StepSampler):
    """A batch sampler over this rank's own samples: per step, its next batch of its own size.

    Each epoch, every rank visits its samples in an order seeded by the seed, the epoch
    and the rank (``epoch_order``). Step k's ticket gives every rank's block (``own_blocks``),
    so every rank knows each step's total and the merge's D without a gather.
    """

    def __init__(self, own: OwnData, rank: int, *, shuffle: bool, seed: int, drop_last: bool,
                 epoch_source: Any = None) -> None:
        shares = list(own.batch_sizes)
        super().__init__(own.counts[rank], sum(shares), rank, shares_at=lambda _: shares, shuffle=shuffle, seed=seed,
                         drop_last=drop_last, epoch_source=epoch_source)
        self.own = own

    @property
    def steps_per_epoch(self) -> int:
        rounding = (lambda n, b: n // b) if self.drop_last else (lambda n, b: -(-n // b))
        return max(rounding(n, b) for n, b in zip(self.own.counts, self.own.batch_sizes))

    def permutation(self) -> list[int]:
        """This rank's order of its own samples in the epoch."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        return epoch_order(self.dataset_size, seed=self.seed, epoch=self.epoch, rank=self.rank).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.permutation()
        size = self.own.batch_sizes[self.rank]
        for index in range(self.start, self.steps_per_epoch):
            block = own_blocks(self.own.counts, self.own.batch_sizes, index, self.drop_last)
            self.tickets.append(StepTicket(step=self.next_step, epoch=self.epoch, index=index, block=block,
                                           rank=self.rank, last=index == self.steps_per_epoch - 1))
            self.next_step += 1
            first = index * size
            yield order[first : first + block[self.rank]] if block[self.rank] else order[:1]
