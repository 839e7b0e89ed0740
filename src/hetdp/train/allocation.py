"""Deprecated: ``hetdp.AllocatedTrainer`` and ``hetdp.AllocationConfig`` warn and go in the next release.

The same training is the drop-in in your own loop (examples/allocation_train.py):
``hetdp.DDP(model, allocation)``, ``model.allocate(loader, accumulates=True)`` with a
share above one forward run as micro-batches under ``no_sync``, and
``model.checkpointer(folder, optimizer)``. What is left here only maps the old
names onto that loop, the benchmarks' own (``hetdp.bench.loop``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hetdp.allocate.policy import Adaptive, AllocationPolicy, Equal, Static
from hetdp.bench.loop import tensor_loader, train_share
from hetdp.cluster.emulate import Emulation
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import CheckpointError, ConfigError
from hetdp.figures.metrics import EpochReport
from hetdp.runtime import local_device


@dataclass(kw_only=True, frozen=True)
class AllocationConfig:
    """The old trainer's settings: the allocation (``policy_spec``), the global batch and how a share runs."""

    policy: Literal["equal", "static", "adaptive"] = "adaptive"
    global_batch: int = 256
    micro_batch: int = 32
    """Samples per forward with ``mode="accumulate"``."""
    mode: Literal["accumulate", "batch"] = "accumulate"
    """accumulate: the share runs as micro-batches under ``no_sync``; batch: as one forward, split only by a cap."""
    max_batch: tuple[int, ...] | None = None
    """Per rank, the most samples one forward holds; None: the emulated devices' caps, if any."""
    weights: tuple[float, ...] | None = None
    minimum: int = 1
    replan_every: int = 0
    smoothing: float = 0.0
    tolerance: float = 0.02
    patience: int = 2
    drift: float | None = 0.2
    rule: Literal["auto", "paper", "piecewise"] = "auto"
    seed: int = 0
    drop_last: bool = False
    step_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in ("accumulate", "batch") or min(self.global_batch, self.micro_batch, self.minimum) < 1:
            raise ConfigError(f"mode must be accumulate or batch, and global_batch, micro_batch and minimum >= 1, "
                              f"got {self.mode!r}, {self.global_batch}, {self.micro_batch}, {self.minimum}")
        self.policy_spec()

    def policy_spec(self) -> AllocationPolicy:
        """The drop-in's allocation for this config."""
        if self.policy == "equal":
            return Equal()
        if self.policy == "static":
            if self.weights is None:
                raise ConfigError("policy 'static' needs weights, one per rank")
            return Static(tuple(self.weights))
        if self.policy != "adaptive":
            raise ConfigError(f"policy must be equal, static or adaptive, got {self.policy!r}")
        return Adaptive(weights=self.weights, replan_every=self.replan_every, tolerance=self.tolerance,
                        patience=self.patience, smoothing=self.smoothing, drift=self.drift, rule=self.rule)

    def largest_forward(self, cap: int | None) -> int | None:
        """The most samples one forward holds on a rank whose memory allows ``cap`` (None: any)."""
        limits = [limit for limit in (self.micro_batch if self.mode == "accumulate" else None, cap) if limit]
        return min(limits) if limits else None


class AllocatedTrainer:
    """Deprecated: ``hetdp.DDP`` and ``model.allocate(loader, accumulates=True)`` in your own loop.

    Each rank computes its share of every global batch, as micro-batches under
    ``no_sync``, and the gradient is the mean over the step's samples.

    .. warning::
        Every rank builds it with the same config and calls ``train_epoch`` for the same epochs.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset,
                 config: AllocationConfig, *, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] =
                 nn.functional.cross_entropy, emulation: Emulation | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.config, self.optimizer, self.loss_fn, self.device = config, optimizer, loss_fn, local_device()
        self.model = DistributedDataParallel(
            model.to(self.device), config.policy_spec(), "allreduce", step_timeout_s=config.step_timeout_s,
            emulation=emulation, process_group=group,
            device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.rank, self.world_size = self.model.rank, self.model.world_size
        devices = self.model.emulation.devices
        self.caps = (list(config.max_batch) if config.max_batch is not None else
                     [device.max_batch for device in devices] if devices else [None] * self.world_size)
        """Every rank's memory cap, the most samples one forward may hold (None: no cap)."""
        loader = (tensor_loader(dataset, config.global_batch, config.drop_last) if isinstance(dataset, TensorDataset)
                  else DataLoader(dataset, batch_size=config.global_batch, drop_last=config.drop_last))
        largest = [config.largest_forward(cap) for cap in self.caps]
        self.largest = largest[self.rank]
        self.loader = self.model.allocate(loader, global_batch=config.global_batch, shuffle=True, seed=config.seed,
                                          max_batch=largest, accumulates=True)
        self.start_epoch = 0
        """The epoch to train next."""

    @property
    def shares(self) -> list[int]:
        return self.model.shares

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> AllocatedTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def train_epoch(self, epoch: int) -> EpochReport:
        """One epoch of the user's loop over the allocated loader; its report."""
        self.model.train()
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self.optimizer.zero_grad()
            train_share(self.model, inputs.to(self.device), targets.to(self.device), largest=self.largest,
                        loss_fn=self.loss_fn)
            self.optimizer.step()
        self.start_epoch = epoch + 1
        return self.model.last_epoch  # type: ignore[return-value]

    def save_checkpoint(self, folder: str | Path) -> None:
        """``model.checkpointer(folder, optimizer).save()``: a folder of step checkpoints, resumed at the next step."""
        self.model.checkpointer(folder, self.optimizer).save()

    def load_checkpoint(self, folder: str | Path, *, missing_ok: bool = False) -> int:
        """``model.checkpointer(folder, optimizer).resume()``; return the epoch to continue from.

        Raises:
            CheckpointError: no checkpoint in ``folder`` on rank 0 (unless ``missing_ok``), or an unreadable one.
        """
        checkpointer = self.model.checkpointer(folder, self.optimizer)
        if checkpointer.resume():
            self.start_epoch = checkpointer.epoch
        elif not missing_ok:
            raise CheckpointError(f"no checkpoint in {folder} on rank 0")
        return self.start_epoch
