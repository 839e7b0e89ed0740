"""Synchronous data-parallel training where ranks compute unequal shares of every step, in a loop hetdp owns.

Deprecated: ``hetdp.AllocatedTrainer`` and ``hetdp.AllocationConfig`` warn and go in
the next release. The same training is the drop-in in the user's own loop:
``hetdp.DDP(model, allocation)``, ``model.allocate(loader, accumulates=True)``
with the share run as micro-batches under ``no_sync``, and
``model.checkpointer(folder, optimizer)`` (examples/allocation_train.py). This
module keeps the trainer working until then (``hetdp bench allocation`` and
``hetdp bench devices`` still run it).

Task-allocation paper: rank i computes ``shares[i]`` samples per step (as several
accumulated micro-batches, or one batch), then one allreduce combines them. The
shares are equal, static or re-planned from measured compute times.
``AllocatedTrainer`` is a convenience over the drop-in (``hetdp.DDP`` with
``model.allocate``): the same allocation and the same gradient sum, plus
micro-batching, a loss and checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hetdp.allocate.policy import Adaptive, AllocationPolicy, Equal, Static
from hetdp.cluster.devices import micro_batches
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import largest_forward
from hetdp.errors import CheckpointError, ConfigError
from hetdp.runtime import local_device
from hetdp.train.checkpoint import load_checkpoint, save_checkpoint
from hetdp.train.ddp import DistributedDataParallel
from hetdp.train.metrics import EpochReport, diagnose_straggler

__all__ = ["AllocatedTrainer", "AllocationConfig", "EpochReport", "diagnose_straggler"]

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

TRIAL_BATCH = 16
"""Samples of the trial steps that measure a CUDA rank's memory cap (at this size and half of it)."""


@dataclass(kw_only=True, frozen=True)
class AllocationConfig:
    """Who computes how much of each step, and how a rank runs its share."""

    policy: Literal["equal", "static", "adaptive"] = "adaptive"
    """equal: plain DDP split; static: split by ``weights``; adaptive: re-planned from measured compute times."""
    global_batch: int = 256
    """Samples per optimizer step over all ranks (the paper's C x minibatch); fixed, so the learning rate holds."""
    micro_batch: int = 32
    """Samples per forward/backward in ``accumulate`` mode (the paper's minibatch)."""
    mode: Literal["accumulate", "batch"] = "accumulate"
    """accumulate: the share runs as micro-batches under ``no_sync``; batch: as one forward of the whole share."""
    max_batch: tuple[int, ...] | None = None
    """Per rank, the most samples one forward may hold (its memory limit); larger shares are split. None: automatic,
    each rank's own cap: its emulated device's (``hetdp run --devices``), else measured on CUDA (free memory and
    the peak of trial steps), else none."""
    weights: tuple[float, ...] | None = None
    """Static weights, one per rank (``static``), or the adaptive policy's starting point. None: equal."""
    minimum: int = 1
    """Fewest samples any rank computes per step, so a slow rank keeps being measured."""
    replan_every: int = 0
    """Adaptive only: re-plan every this many steps as well as at each epoch's end; 0 re-plans per epoch (the paper)."""
    smoothing: float = 0.0
    """Adaptive only: weight of past speed estimates against timing noise (0 = newest measurement only)."""
    tolerance: float = 0.02
    """Adaptive only: apply a re-plan only if it shortens the predicted step time by this fraction (noise guard)."""
    patience: int = 2
    """Adaptive only: calm re-plans in a row after which the shares are stable."""
    drift: float | None = 0.2
    """Adaptive only: once stable, plan again when a rank runs this fraction slower or faster, sustained;
    None: stop re-planning once stable, as in the paper."""
    rule: Literal["auto", "paper", "piecewise"] = "auto"
    """Adaptive only: "paper" re-plans proportionally to measured speed (eq. 10); "piecewise" counts each rank's
    micro-batches in its step time, each one's cost fitted to the measurements, and takes the exact min-max shares;
    "auto": piecewise where a rank runs its share as micro-batches, else the paper's rule."""
    seed: int = 0
    """Seed of the per-epoch shuffle; every rank must use the same."""
    drop_last: bool = False
    """Drop the epoch's last, partial step instead of splitting it by the shares."""
    step_timeout_s: float = 60.0
    """Seconds a step's collectives may wait for the slowest rank; past it a dead or hung peer raises
    PeerTimeoutError instead of hanging. Too small: a slow but healthy step raises too."""

    def __post_init__(self) -> None:
        if self.policy not in ("equal", "static", "adaptive"):
            raise ConfigError(f"policy must be equal, static or adaptive, got {self.policy!r}")
        if self.mode not in ("accumulate", "batch"):
            raise ConfigError(f"mode must be accumulate or batch, got {self.mode!r}")
        for name in ("global_batch", "micro_batch", "minimum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replan_every < 0:
            raise ConfigError(f"replan_every must be >= 0 steps, got {self.replan_every}")
        if self.policy == "static" and self.weights is None:
            raise ConfigError("policy 'static' needs weights, one per rank")
        if not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be > 0 seconds, got {self.step_timeout_s!r}")
        if self.max_batch is not None and min(self.max_batch) < 1:
            raise ConfigError(f"max_batch must be >= 1 per rank, got {list(self.max_batch)}")
        if self.rule not in ("auto", "paper", "piecewise"):
            raise ConfigError(f"rule must be auto, paper or piecewise, got {self.rule!r}")

    def policy_spec(self) -> AllocationPolicy:
        """The drop-in's allocation for this config."""
        if self.policy == "equal":
            return Equal()
        if self.policy == "static":
            return Static(tuple(self.weights or ()))
        return Adaptive(weights=self.weights, replan_every=self.replan_every, tolerance=self.tolerance,
                        patience=self.patience, smoothing=self.smoothing, drift=self.drift, rule=self.rule)

    def chunk_size(self, rank: int, share: int) -> int:
        """Samples per forward/backward for ``rank`` computing ``share`` samples."""
        size = self.micro_batch if self.mode == "accumulate" else max(share, 1)
        return size if self.max_batch is None else min(size, self.max_batch[rank])

    def largest_forward(self, cap: int | None) -> int | None:
        """The most samples one forward holds on a rank whose memory allows ``cap`` (None: any)."""
        size = self.micro_batch if self.mode == "accumulate" else None
        limits = [limit for limit in (size, cap) if limit is not None]
        return min(limits) if limits else None


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


def _as_is(batch: Any) -> Any:
    return batch


def _loader(dataset: Dataset, global_batch: int, drop_last: bool) -> DataLoader:
    if isinstance(dataset, TensorDataset):
        return DataLoader(_Gathered(dataset), batch_size=global_batch, collate_fn=_as_is, drop_last=drop_last)
    return DataLoader(dataset, batch_size=global_batch, drop_last=drop_last)


class AllocatedTrainer:
    """Train a model where each rank computes its own share of every global batch, in a loop hetdp owns.

    The synchronized gradient is exactly the mean over all samples of the step
    (the drop-in's gradient sum), the share runs as micro-batches of
    ``micro_batch`` under DDP's ``no_sync`` (``mode="accumulate"``) or as one
    batch, and the trainer adds a loss, reports and checkpoints. Emulation from
    ``hetdp run`` applies without being passed.

    .. warning::
        Every rank of the group must build the trainer with the same config and
        dataset order, and call ``train_epoch`` for the same epochs: each step is
        a collective.

    Example::

        >>> # on every rank, launched with `hetdp run -n 4 train.py` or torchrun
        >>> hetdp.init_distributed()
        >>> trainer = AllocatedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), train_set,
        ...                            AllocationConfig(policy="adaptive", global_batch=128, micro_batch=16))
        >>> trainer.load_checkpoint("ckpt.pt", missing_ok=True)       # resume if rank 0 has one
        >>> for epoch in range(trainer.start_epoch, 10):
        ...     report = trainer.train_epoch(epoch)   # report.shares, report.compute_s, report.wait_s
        ...     trainer.save_checkpoint("ckpt.pt")    # resumes at epoch + 1
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset,
        config: AllocationConfig,
        *,
        loss_fn: LossFn = nn.functional.cross_entropy,
        emulation: Emulation | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Wrap ``model`` in ``hetdp.DDP`` over ``group`` (default: a new group of all ranks with the step timeout).

        ``emulation``: how this machine pretends ranks are unequal (None: ``hetdp run``'s settings, if any).
        """
        world_size = dist.get_world_size(group)
        for name in ("weights", "max_batch"):
            value = getattr(config, name)
            if value is not None and len(value) != world_size:
                raise ConfigError(f"{name} gives {len(value)} values for {world_size} ranks")
        if config.global_batch < config.minimum * world_size:
            raise ConfigError(
                f"global_batch {config.global_batch} cannot give {world_size} ranks {config.minimum} samples each"
            )
        self.config = config
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.device = local_device()
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(
            model.to(self.device), config.policy_spec(), "allreduce", step_timeout_s=config.step_timeout_s,
            emulation=emulation, process_group=group, device_ids=device_ids,
        )
        self.rank, self.world_size = self.model.rank, self.model.world_size
        self.caps = list(config.max_batch) if config.max_batch is not None else self._own_caps(dataset)
        """Every rank's memory cap, the most samples one forward may hold (None: no cap)."""
        self.loader = self.model.allocate(_loader(dataset, config.global_batch, config.drop_last),
                                          global_batch=config.global_batch, shuffle=True, seed=config.seed,
                                          max_batch=[config.largest_forward(cap) for cap in self.caps],
                                          accumulates=True)
        self.start_epoch = 0
        """The epoch to train next: 0, the one after the last ``train_epoch``, or a loaded checkpoint's."""

    def _own_caps(self, dataset: Dataset) -> list[int | None]:
        """Each rank's memory cap (emulated, else measured on CUDA on a trial batch), exchanged among the ranks."""
        inputs, targets = next(iter(_loader(dataset, min(TRIAL_BATCH, len(dataset)), False)))
        mine = largest_forward(self.model.module, inputs, targets, rank=self.rank, emulation=self.model.emulation,
                               loss_fn=self.loss_fn)
        caps: list[int | None] = [None] * self.world_size
        dist.all_gather_object(caps, mine, group=self.model.process_group)
        return caps

    @property
    def shares(self) -> list[int]:
        """Samples per step of every rank, as currently planned."""
        return self.model.shares

    @property
    def allocator(self) -> Any:
        return self.model.allocator

    def close(self) -> None:
        """Release the process group the trainer made; every rank must call it (idempotent)."""
        self.model.close()

    def __enter__(self) -> AllocatedTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def train_epoch(self, epoch: int) -> EpochReport:
        """Run one epoch; re-plan the shares if adaptive; return what every rank did."""
        self.model.train()
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self._step(inputs.to(self.device), targets.to(self.device))
        self.start_epoch = epoch + 1
        report = self.model.last_epoch
        assert report is not None
        return report

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """One step on this rank's share: micro-batches under ``no_sync``, then the synchronized backward."""
        self.optimizer.zero_grad()
        count = len(inputs)
        largest = self.config.largest_forward(self.caps[self.rank]) or count
        # Near-equal micro-batches, not full ones and a remainder: a small remainder runs below the device's knee.
        sizes = micro_batches(count, max(1, math.ceil(count / largest)))
        start = 0
        for index, size in enumerate(sizes):
            piece = slice(start, start + size)
            start += size
            with contextlib.nullcontext() if index == len(sizes) - 1 else self.model.no_sync():
                loss = self.loss_fn(self.model(inputs[piece]), targets[piece])
                (loss * (size / count)).backward()
            self.model.record_loss(loss, size)
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "hetdp": self.model.hetdp_state_dict(),
            "config": asdict(self.config),
            "world_size": self.world_size,
            "epoch": self.start_epoch,
        }

    def save_checkpoint(self, path: str | Path, next_epoch: int | None = None) -> None:
        """Rank 0 writes the model, optimizer, allocator and the epoch to resume at, atomically; every rank waits.

        ``next_epoch`` defaults to the one after the last ``train_epoch``.
        """
        if next_epoch is not None:
            self.start_epoch = next_epoch
        if self.rank == 0:
            save_checkpoint(path, self.state_dict())
        dist.barrier(group=self.model.process_group)

    def load_checkpoint(self, path: str | Path, *, missing_ok: bool = False) -> int:
        """Restore a checkpoint written by ``save_checkpoint``; return the epoch to continue from.

        Rank 0 reads the file and broadcasts it, so no shared filesystem is needed.
        With ``missing_ok``, no file on rank 0 means a fresh start (epoch 0).

        Raises:
            CheckpointError: on every rank: unreadable, or written by a run with another world size or config.
        """
        message: list[Any] = [None]
        if self.rank == 0:
            try:
                message[0] = load_checkpoint(path)
            except CheckpointError as error:
                message[0] = None if missing_ok and not Path(path).exists() else f"{error}"
        dist.broadcast_object_list(message, group=self.model.process_group, group_src=0)
        state = message[0]
        if state is None:
            return self.start_epoch
        if isinstance(state, str):
            raise CheckpointError(state)
        if state.get("world_size") != self.world_size:
            raise CheckpointError(f"{path} was written by {state.get('world_size')} ranks, this run has "
                                  f"{self.world_size}")
        # A field the checkpoint lacks is newer than the checkpoint: there is nothing to compare it with.
        changed = sorted(key for key, value in asdict(self.config).items()
                         if _comparable(state["config"].get(key, value)) != _comparable(value))
        if changed:
            raise CheckpointError(f"{path} was written with another config: {', '.join(changed)} differ")
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.model.load_hetdp_state_dict(state["hetdp"])
        self.start_epoch = state["epoch"]
        return self.start_epoch


def _comparable(value: Any) -> Any:
    """Tuples and lists compare alike (a checkpoint's config went through pickling as saved)."""
    return list(value) if isinstance(value, tuple) else value

