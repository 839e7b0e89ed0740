"""``hetdp.fully_shard``: torch's ``fully_shard``, whose modules also take ``allocate``, ``shares`` and the drop-in's
figures: a user's FSDP2 script adopts hetdp by its import and one ``model.allocate(loader)``.

Every module it shards gets ``ShardedModule`` mixed in ahead of torch's
``FSDP<Class>`` (so that it sees ``set_requires_gradient_sync``, where a loop
lets gradients wait); the module whose ``allocate`` is called becomes the root of
a ``ShardedDropIn`` over every unit under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.data import DataLoader

from hetdp.allocate.pack import CostBalance
from hetdp.allocate.policy import AllocationPolicy, Allocator
from hetdp.checkpoint.sharded import ShardedCheckpointer
from hetdp.cluster.emulate import Emulation
from hetdp.data.loader import AllocatedLoader
from hetdp.errors import ConfigError
from hetdp.figures.metrics import EpochReport, MetricsConfig, StepFigures
from hetdp.floor import check_sharded
from hetdp.fsdp.budgets import MemoryBudget, memory_budgets, row_weights
from hetdp.fsdp.dropin import DropInSettings, ShardedDropIn, sharded_units
from hetdp.fsdp.uneven import UnevenModule, default_device_type, shard_rows
from hetdp.sync.base import LossConvention
from hetdp.sync.policy import SyncPolicy

_KEPT_OPTIONS = ("mesh", "reshard_after_forward", "mp_policy", "shard_sizes")
"""The ``fully_shard`` keywords the drop-in reads back: the mesh it checks, and what sizes a rank's memory."""


class ShardedModule:
    """What ``hetdp.fully_shard`` adds to a module: the drop-in's surface, as ``hetdp.DDP`` has it.

    ``allocate`` on the root makes the drop-in (collective); before it, ``shares`` is empty and there is no epoch.
    """

    _hetdp_settings: DropInSettings
    _hetdp_options: dict[str, Any]
    _hetdp_drop_in: ShardedDropIn | None = None

    def allocate(self, loader: DataLoader, *, global_batch: int | None = None, shuffle: bool | None = None,
                 seed: int | None = None, max_batch: int | Sequence[int | None] | Literal["measure"] | None = None,
                 accumulates: bool = False, cost: CostBalance | Sequence[float] | None = None) -> AllocatedLoader:
        """Re-cut ``loader`` so that each batch is this rank's share of a step (``hetdp.DDP.allocate``'s arguments),
        and make this module the root of the sharded drop-in over every unit under it (collective, the first time).

        ``max_batch`` None (and ``"measure"``): each rank's cap comes from its memory once its shard is placed, on
        CUDA and under ``hetdp run --devices`` (a device table's memory fields); numbers are taken as given.
        ``accumulates=True`` also says the loop lets gradients wait (``set_requires_gradient_sync(False)``): the
        caps then count FSDP2's unsharded gradients, which it keeps meanwhile.
        ``own_data`` does not map: each rank holds a shard of one model that every rank trains on every step.

        Raises:
            ConfigError: as ``hetdp.DDP.allocate``; settings given to a unit below the root; a synchronization
                other than allreduce; a device that cannot hold its shard plus one sample (named, with the bytes
                it would need).
        """
        return self._drop_in_here().allocate(loader, global_batch=global_batch, shuffle=shuffle, seed=seed,
                                             max_batch=max_batch, accumulates=accumulates, cost=cost)

    def _drop_in_here(self) -> ShardedDropIn:
        drop_in = self._hetdp_drop_in
        if drop_in is None:
            units = sharded_units(self)  # type: ignore[arg-type]
            below = [unit for unit in units if unit is not self and getattr(unit, "_hetdp_settings", None) is not None
                     and unit._hetdp_settings.given]
            if below:
                raise ConfigError(f"hetdp settings (allocation, sync, ...) were given to fully_shard of a "
                                  f"{type(below[0]).__name__} below the root: give them to the root's fully_shard")
            drop_in = ShardedDropIn(self, units, self._hetdp_settings)  # type: ignore[arg-type]
            for unit in units:
                unit._hetdp_drop_in = drop_in
        elif drop_in.module is not self:
            raise ConfigError(f"this {type(self).__name__} is a unit of a {type(drop_in.module).__name__} that "
                              "allocates already: call allocate on that root")
        return drop_in

    def _drop_in(self) -> ShardedDropIn:
        if self._hetdp_drop_in is None:
            raise ConfigError("call model.allocate(loader) first: the drop-in is made there")
        return self._hetdp_drop_in

    @property
    def drop_in(self) -> ShardedDropIn | None:
        """The sharded drop-in (``begin_step``, ``end_step``, ``record_loss``, ``allocator``, ...), once allocated."""
        return self._hetdp_drop_in

    @property
    def shares(self) -> list[int]:
        """Samples per step of every rank, as last planned ([] before ``allocate``)."""
        return [] if self._hetdp_drop_in is None else self._hetdp_drop_in.shares

    @property
    def allocator(self) -> Allocator | None:
        """The allocation's state (for adaptive allocation, what it measured), or None before ``allocate``."""
        return None if self._hetdp_drop_in is None else self._hetdp_drop_in.allocator

    @property
    def last_epoch(self) -> EpochReport | None:
        """The latest epoch's report (identical on every rank), or None before the first epoch ended."""
        return None if self._hetdp_drop_in is None else self._hetdp_drop_in.last_epoch

    @property
    def epoch_reports(self) -> list[EpochReport]:
        """Every epoch's report so far, oldest first (identical on every rank)."""
        return [] if self._hetdp_drop_in is None else self._hetdp_drop_in.epoch_reports

    @property
    def step_figures(self) -> Sequence[StepFigures]:
        """Every rank's figures per step, as far as the last gather."""
        return [] if self._hetdp_drop_in is None else self._hetdp_drop_in.step_figures

    @property
    def step_samples(self) -> int | None:
        """This rank's samples in the open step (None outside one; 0: a stand-in that trains nothing)."""
        return None if self._hetdp_drop_in is None else self._hetdp_drop_in.step_samples

    def set_shares(self, shares: Sequence[int], *, at_step: int | None = None) -> None:
        """Set every rank's samples per step by hand (``hetdp.DDP.set_shares``); a share of 0 runs stand-ins."""
        self._drop_in().set_shares(shares, at_step=at_step)

    def checkpointer(self, folder: str | Path, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                     scaler: Any = None, every: int = 100) -> ShardedCheckpointer:
        """Save the sharded state every ``every`` steps through torch.distributed.checkpoint, atomically; ``resume()``
        it before the loop. Every rank writes into ``folder``: across machines, a folder every rank reaches.

        Raises:
            ConfigError: before ``allocate``.
        """
        return self._drop_in().checkpointer(folder, optimizer, scheduler=scheduler, scaler=scaler, every=every)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        super().set_requires_gradient_sync(requires_gradient_sync, recurse=recurse)  # type: ignore[misc]
        if self._hetdp_drop_in is not None:
            self._hetdp_drop_in.gradient_sync(requires_gradient_sync)

    def close(self) -> None:
        """Release the drop-in's process groups and heartbeat (collective, idempotent; nothing before ``allocate``)."""
        if self._hetdp_drop_in is not None:
            self._hetdp_drop_in.close()


_SURFACE = {name for name in vars(ShardedModule) if not name.startswith("__")} - {"set_requires_gradient_sync"}
_MIXED: dict[type, type] = {}


def _check_names(module: nn.Module) -> None:
    """Raise ConfigError where the drop-in's surface would hide a name of the module's own class."""
    clash = sorted(name for name in _SURFACE if hasattr(type(module), name))
    if clash:
        raise ConfigError(f"hetdp.fully_shard adds {', '.join(clash)} to {type(module).__name__}, which has its own: "
                          "rename yours, or shard with torch's fully_shard")


def _mix(unit: nn.Module) -> None:
    """Put ``ShardedModule`` ahead of the unit's ``FSDP<Class>`` (or ``Uneven<Class>``); torch's ``FSDPModule.__new__``
    finds the original class by its place in the order, which moves by two (the new class and the mixin)."""
    sharded_class = type(unit)
    mixed = _MIXED.get(sharded_class)
    if mixed is None:
        extra = ({"_orig_cls_mro_index": sharded_class._orig_cls_mro_index + 2}  # type: ignore[attr-defined]
                 if isinstance(unit, FSDPModule) else {})
        mixed = _MIXED[sharded_class] = type(sharded_class.__name__, (ShardedModule, sharded_class), {
            "__module__": sharded_class.__module__, **extra})
    unit.__class__ = mixed


def _check_one_kind(module: nn.Module | list[nn.Module], *, even: bool) -> None:
    """Raise ConfigError where ``module`` holds units of the other kind of shards than it is about to get: torch's
    ``fully_shard`` would take memory-sized rows for tensor parallelism, and hetdp's cannot take FSDP2's."""
    other = UnevenModule if even else FSDPModule
    for each in module if isinstance(module, list) else [module]:
        inner = next((unit for unit in each.modules() if isinstance(unit, other)), None)
        if inner is not None:
            kinds = ("memory-sized shards", "torch's even ones") if even else ("torch's even shards", "memory-sized ones")
            raise ConfigError(f"{type(inner).__name__} has {kinds[0]} and {type(each).__name__} would get {kinds[1]}: "
                              "give every fully_shard call of a model the same shard_sizes")


def _memory_split(module: nn.Module | list[nn.Module], options: dict[str, Any]
                  ) -> tuple[tuple[float, ...], list[MemoryBudget]] | None:
    """The weights of memory-sized shards and every rank's budget, or None where torch's even shards serve (no
    process group of several ranks, memory unknown, or budgets within ``EVEN_WITHIN`` of each other)."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    device_type = options["mesh"].device_type if options.get("mesh") is not None else default_device_type()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    budgets = memory_budgets(device)
    weights = None if budgets is None else row_weights(budgets)
    if weights is None or budgets is None:
        return None
    if isinstance(module, list):
        raise ConfigError("fully_shard of a list of modules (one unit of several) does not map onto memory-sized "
                          "shards: shard each module, or pass shard_sizes='even'")
    return weights, budgets


@overload
def fully_shard(module: nn.Module, *, allocation: str | AllocationPolicy | None = ..., sync: str | SyncPolicy | None = ...,
                step_timeout_s: float = ..., metrics: MetricsConfig | None = ..., emulation: Emulation | None = ...,
                loss: LossConvention = ..., shard_sizes: Literal["memory", "even"] = ...,
                **fsdp_options: Any) -> nn.Module: ...


@overload
def fully_shard(module: list[nn.Module], *, allocation: str | AllocationPolicy | None = ...,
                sync: str | SyncPolicy | None = ..., step_timeout_s: float = ..., metrics: MetricsConfig | None = ...,
                emulation: Emulation | None = ..., loss: LossConvention = ...,
                shard_sizes: Literal["memory", "even"] = ..., **fsdp_options: Any) -> list[nn.Module]: ...


def fully_shard(module: nn.Module | list[nn.Module], *, allocation: str | AllocationPolicy | None = None,
                sync: str | SyncPolicy | None = None, step_timeout_s: float = 60.0,
                metrics: MetricsConfig | None = None, emulation: Emulation | None = None,
                loss: LossConvention = "mean", shard_sizes: Literal["memory", "even"] = "memory",
                **fsdp_options: Any) -> nn.Module | list[nn.Module]:
    """torch's ``fully_shard`` (every keyword of it passes through), whose modules also take the drop-in's surface:
    ``model.allocate(loader)`` on the root makes rank i compute ``shares[i]`` samples of every step, with the
    gradient exactly the mean over the step's samples.

    Shard as with torch (each block, then the root); the hetdp settings, where given, go to the root's call.

    Args:
        module: the module (or modules, grouped) to shard, as torch's ``fully_shard`` takes it.
        allocation: who computes how much (``hetdp.DDP``'s allocations; None: ``$HETDP_ALLOCATION``, else
            ``"adaptive"``).
        sync: ``"allreduce"`` only (the default): partial and local synchronization need whole replicas, and every
            rank takes part in every unit's collectives (``ConfigError`` names why).
        step_timeout_s: how long a collective of a step waits for the slowest rank before a ``PeerTimeoutError``
            names it on every survivor: the drop-in's gathers of figures and checkpoints, and over gloo each of
            FSDP2's all-gathers and reduce-scatters (under NCCL those wait their group's timeout). Too small: a
            slow but healthy rank raises too.
        metrics: where rank 0 writes per-step and per-epoch figures, if anywhere.
        emulation: how this machine pretends its ranks are unequal (None: ``hetdp run``'s settings, if any).
        loss: what each rank's loss is, as ``hetdp.DDP`` takes it: ``"mean"`` (the default: over the rank's own
            batch), ``"sum"`` or ``"global_mean"`` (over the step's tokens on all ranks); the gradient is FSDP2's on
            the same global batch at equal shares, whatever the shares.
        shard_sizes: ``"memory"`` (the default): where the ranks' memories are known (``hetdp run --devices``, or
            CUDA) and differ by more than 5%, each rank holds whole rows of every parameter in proportion to its
            memory (an ``UnevenModule``), agreed at each call before anything is placed; otherwise, and with
            ``"even"``, torch's ``fully_shard`` cuts 1/W of each. Give every call the same.
        fsdp_options: passed to torch's ``fully_shard`` (``mesh``: a 1-D mesh of every rank, if given;
            ``reshard_after_forward``, ``mp_policy``, ...).

    Returns:
        What torch's ``fully_shard`` returns: the module(s), now FSDP modules with the drop-in's surface.

    Raises:
        ConfigError: a torch whose FSDP2 lacks a method the drop-in calls (torch < 2.13), a bad
            setting, or a module with names of its own that the drop-in would hide, before anything is sharded.

    Examples:
        >>> # on every rank, launched with `hetdp run -n 4 --speeds 1,1,2,4 train.py` or torchrun
        >>> from hetdp import fully_shard                         # was: from torch.distributed.fsdp import ...
        >>> for block in model.blocks:
        ...     fully_shard(block)
        >>> fully_shard(model)
        >>> loader = model.allocate(DataLoader(data, batch_size=16, sampler=DistributedSampler(data)))
        >>> for epoch in range(epochs):
        ...     loader.sampler.set_epoch(epoch)
        ...     for (tokens,) in loader:                              # rank i: shares[i] of 16 x 4 samples
        ...         ...                                              # the loop, clipping, optimizer: unchanged
        ...     print(model.last_epoch.diagnosis())
    """
    check_sharded()
    settings = DropInSettings(allocation=allocation, sync=sync, step_timeout_s=step_timeout_s, metrics=metrics,
                              emulation=emulation, loss=loss)
    if shard_sizes not in ("memory", "even"):
        raise ConfigError(f"shard_sizes must be 'memory' or 'even', got {shard_sizes!r}")
    for each in module if isinstance(module, list) else [module]:
        _check_names(each)
    split = _memory_split(module, fsdp_options) if shard_sizes == "memory" else None
    _check_one_kind(module, even=split is None)
    sharded = (torch_fully_shard(module, **fsdp_options) if split is None
               else shard_rows(module, *split, **fsdp_options))  # type: ignore[arg-type]
    kept = {name: value for name, value in {**fsdp_options, "shard_sizes": shard_sizes}.items()
            if name in _KEPT_OPTIONS}
    for unit in sharded if isinstance(sharded, list) else [sharded]:
        _mix(unit)
        unit._hetdp_settings = settings
        unit._hetdp_options = kept
    return sharded
