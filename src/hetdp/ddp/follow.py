"""A model that follows another's steps (``hetdp.DDP(..., follow=leader)``): what it refuses, and the leader's list.

A GAN's generator beside its discriminator, one tower feeding another: the
follower opens and closes its steps and epochs with its leader's, so that its
gradient too is the mean over the step's samples (the leader's shares).
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, Protocol, TypeVar

import torch.distributed as dist
from torch import nn

from hetdp.ddp.hook import waits_for_rounds
from hetdp.errors import ConfigError
from hetdp.membership.standin import synchronizes_batches
from hetdp.runtime.teardown import release_group
from hetdp.sync.policy import SyncPolicy


class _Model(Protocol):
    rank: int
    world_size: int
    sync: SyncPolicy
    _group: dist.ProcessGroup | None


Model = TypeVar("Model", bound=_Model)


def check_follows(follow: Any, kind: type, *, own_settings: bool, sync: SyncPolicy, module: nn.Module) -> None:
    """Raise ConfigError unless a model of ``module`` may follow ``follow``: one of ``kind`` (``hetdp.DDP``), with the
    follower's allocation and emulation left to it (``own_settings``: some were given), neither one's rounds waiting
    for other ranks, which would wait on the other model's exchange, and no ``SyncBatchNorm`` in ``module`` where
    ``follow``'s ranks may sit out (the layer meets every rank in every step)."""
    if not isinstance(follow, kind):
        raise ConfigError(f"follow must be a hetdp.DDP, got {type(follow).__name__}")
    if own_settings:
        raise ConfigError("a model that follows another takes its shares and emulation: give allocation= "
                          "and emulation= to the model it follows")
    if waits_for_rounds(sync) or waits_for_rounds(follow.sync):
        raise ConfigError(f"a model that follows another cannot run beside it under {sync.describe()} and "
                          f"{follow.sync.describe()}: a partial allreduce whose rounds wait for other ranks "
                          "(majority, quorum, full) would wait on the other model's exchange and they would "
                          "deadlock; use allreduce, solo or local for both")
    if synchronizes_batches(module) and follow._sitting is not None:
        raise ConfigError(f"this {type(module).__name__}'s SyncBatchNorm meets every rank in every step, and the model "
                          "it follows lets ranks sit out of steps: give that model's module a SyncBatchNorm too (no "
                          "rank then sits out), or follow none")


def check_place(follow: _Model, place: tuple[int, int], made: dist.ProcessGroup | None) -> None:
    """Raise ConfigError unless the follower is ``place`` (rank, world size) in its group as ``follow`` is; the group
    the follower ``made`` for itself, if any, is released first."""
    if (follow.rank, follow.world_size) != place:
        if made is not None:
            release_group(made)
        raise ConfigError(f"a model follows another on the same ranks: this is rank {place[0]} of {place[1]}, "
                          f"the one it follows rank {follow.rank} of {follow.world_size}")


class Followers(Generic[Model]):
    """The models that follow a leader, weakly held: each opens and closes its steps and epochs with the leader's."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[Model]] = []

    def add(self, model: Model) -> None:
        self._refs.append(weakref.ref(model))

    def open(self) -> list[Model]:
        """The followers alive and not closed."""
        return [model for ref in self._refs if (model := ref()) is not None and model._group is not None]
