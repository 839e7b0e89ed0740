"""The drop-in's allocation: ``model.allocate(loader)``, the shares by step, and the allocator that plans them.

``hetdp.DDP`` and the sharded drop-in take these methods from ``Allocating``; the planner (``figures.gather``)
keeps the schedule of shares, and ``caps`` bounds them by the ranks' memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from hetdp.allocate.caps import check_fits, memory_caps
from hetdp.allocate.pack import CostBalance
from hetdp.allocate.policy import AllocationPolicy, Allocator, Static
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import largest_forward
from hetdp.data.loader import AllocatedLoader
from hetdp.data.order import LoaderOrder
from hetdp.data.owndata import OwnData, OwnDataSampler, own_batch_sizes
from hetdp.data.steps import StepSampler
from hetdp.errors import ConfigError
from hetdp.figures.gather import Planner
from hetdp.membership.schedule import SitOut
from hetdp.membership.standin import stand_in_samples
from hetdp.runtime import peer_failures


class Allocating:
    """A drop-in's allocation (a mixin of ``hetdp.DDP`` and the sharded drop-in: the model sets the attributes
    declared here)."""

    rank: int
    world_size: int
    module: nn.Module
    allocation: AllocationPolicy
    emulation: Emulation
    step_timeout_s: float
    _group: dist.ProcessGroup | None
    _planner: Planner
    _follows: bool
    """Whether the model follows another's steps (its leader's loader cuts them)."""
    _sitting: SitOut | None
    """Under allreduce, who takes part in each step's exchange: the allocation decides who sits out."""
    steps_done: int
    _accumulates: bool = False
    """Whether the loop may run a batch as several forwards (``allocate(..., accumulates=True)``)."""

    def allocate(self, loader: DataLoader, *, global_batch: int | None = None, shuffle: bool | None = None,
                 seed: int | None = None, max_batch: int | Sequence[int | None] | Literal["measure"] | None = None,
                 accumulates: bool = False, cost: CostBalance | Sequence[float] | None = None,
                 own_data: bool = False) -> AllocatedLoader:
        """Re-cut ``loader`` so that each batch is this rank's share of a step of ``global_batch`` samples.

        Every DataLoader option is kept; only the batching changes. The epoch order
        follows the loader's ``DistributedSampler`` (its shuffle and seed), or
        ``shuffle`` / ``seed`` when given.

        Args:
            loader: the DataLoader this rank would iterate under plain DDP.
            global_batch: samples per step over all ranks (default: the loader's batch size x world size, as DDP).
            shuffle, seed: override the order read off the loader's sampler.
            max_batch: the most samples one forward may hold (memory): this rank's (an int; the ranks exchange
                theirs, so every rank must pass one) or every rank's (a sequence, None for no cap). ``"measure"``:
                each rank's own, so that memory sets the shares with no tuning by hand: on CUDA from the peak memory
                of trial forward and backward passes of ``loader``'s first batch at its full and half size, which
                leave no trace (not yet verified on a real GPU), elsewhere the emulated
                device's cap or none. None: the emulated devices' caps under ``hetdp run --devices``, else no cap.
                Unless ``accumulates``, each share is capped by it (collective: every rank passes the same kind of
                value).
            accumulates: whether the loop runs a share above ``max_batch`` as several forwards (micro-batches
                under ``no_sync``, as examples/allocation_train.py does). Then shares are not capped, and the
                piecewise adaptive rule counts each micro-batch in its step-time model.
            cost: per-sample costs of variable-length data (a sequence by dataset index, or a ``CostBalance``):
                shares become parts of each step's cost, and steps are packed so that each rank's block costs its
                part. With ``mean_over="cost"`` (the default) each rank's loss must be its mean per cost unit
                (per token) and the combined gradient is the mean per token over the global step.
            own_data: ``loader`` holds this rank's own samples, not a dataset every rank shares (C-ADP: what
                ``hetdp.distribute`` delivered). Each epoch, every rank trains all of its samples in batches of its
                own size: under ``hetdp.Planned(cluster)`` its device's ``batch_size``, under ``"equal"`` its
                loader's; an epoch has as many steps as the rank with the most batches (a rank out of batches runs
                stand-ins).
                Under ``"local"`` the epoch's merge weighs rank i's model by D_i / D.

        Raises:
            ConfigError: an iterable dataset, an unknown sampler without ``shuffle``, a global batch too small
                for the ranks, or one above the sum of capped ranks' ``max_batch`` (the drop-in cannot split a
                share into micro-batches for the loop: lower ``global_batch``, or use ``accumulates``); a model
                that follows another (its leader's loader cuts the steps); with ``own_data``, an allocation that
                would move samples between ranks (adaptive, static), or a rank that holds none; a bad
                ``max_batch``, or a trial step of ``"measure"`` that fails on some rank (raised on every rank).
        """
        if self._follows:
            raise ConfigError("this model follows another's steps: allocate that model's loader")
        order = LoaderOrder.read(loader, shuffle, seed)
        if order.drawn:
            order = replace(order, seed=self._rank0s(order.seed, "agreeing on the order's seed"))
        if own_data:
            sampler = self._own_sampler(order)
        else:
            sampler = self._step_sampler(loader, order, global_batch, max_batch, accumulates, cost)
        allocated = AllocatedLoader(self, loader, sampler)
        self._planner.loader = weakref.ref(allocated)
        return allocated

    def _step_sampler(self, loader: DataLoader, order: LoaderOrder, global_batch: int | None,
                      max_batch: int | Sequence[int | None] | Literal["measure"] | None, accumulates: bool,
                      cost: CostBalance | Sequence[float] | None) -> StepSampler:
        """Steps of ``global_batch`` samples of the dataset every rank shares, cut by the allocation's shares."""
        if global_batch is None:
            if order.batch is None:
                raise ConfigError(f"the loader batches with a {type(loader.batch_sampler).__name__}, which gives no "
                                  "batch size: pass global_batch= (samples per step over all ranks)")
            global_batch = order.batch * self.world_size
        balance = None if cost is None else CostBalance.of(cost)
        if self.allocator is None:
            caps = self._memory_caps(max_batch, loader, accumulates=accumulates)
            bounds = None if accumulates else caps
            if bounds is not None:
                check_fits(bounds, global_batch, balance)
            least = stand_in_samples(self.module)  # a BatchNorm that trains cannot take one sample
            self._planner.start(Allocator(
                self.allocation, self.world_size, global_batch,
                minimum=least if global_batch >= least * self.world_size else 0,
                dataset_size=order.size, caps=bounds, chunks=None if balance else caps,
                membership=self._sitting is not None))
            self._accumulates = accumulates
        elif self.allocator.total != global_batch:
            raise ConfigError(f"this model already allocates steps of {self.allocator.total} samples, "
                              f"not {global_batch}: one global batch per model")
        sampler = StepSampler(order.size, global_batch, self.rank, shares_at=self.shares_at, shuffle=order.shuffle,
                              seed=order.seed, drop_last=order.drop_last, cost=balance, epoch_source=order.source,
                              epoch_size=order.epoch_size(self.world_size))
        sampler.stand_in = stand_in_samples(self.module)
        return sampler

    def _own_sampler(self, order: LoaderOrder) -> OwnDataSampler:
        """``allocate(loader, own_data=True)``: steps of every rank's own batches; collective."""
        held = self._gather_objects((order.size, order.batch), "exchanging the ranks' own data")
        own = OwnData(counts=tuple(count for count, _ in held),
                      batch_sizes=tuple(own_batch_sizes(self.allocation, [batch for _, batch in held])))
        if self.allocator is None:
            # Each step's shares are the ranks' batch sizes, fixed: own samples cannot move between ranks.
            self._planner.start(Allocator(Static(own.batch_sizes), self.world_size, sum(own.batch_sizes), minimum=0))
        elif self.allocator.shares != list(own.batch_sizes):
            raise ConfigError(f"this model already allocates steps of {self.allocator.shares}, not of the batch "
                              f"sizes {list(own.batch_sizes)}: one allocation per model")
        return OwnDataSampler(own, self.rank, shuffle=order.shuffle, seed=order.seed, drop_last=order.drop_last,
                              epoch_source=order.source)

    def _memory_caps(self, max_batch: int | Sequence[int | None] | Literal["measure"] | None,
                     loader: DataLoader, *, accumulates: bool = False) -> list[int | None] | None:
        """Every rank's largest forward (None: no cap): ``max_batch`` as ``allocate`` takes it (collective). A
        replica holds its whole gradient whether or not the loop accumulates: ``accumulates`` changes nothing here."""
        return memory_caps(max_batch, self.world_size, self.emulation, self._gather_objects,
                           lambda: largest_forward(self.module, loader, rank=self.rank, emulation=self.emulation))

    @property
    def allocator(self) -> Allocator | None:
        """Who computes how much, and its re-plans (None before ``allocate``, and in a model that follows)."""
        return self._planner.allocator

    @property
    def shares(self) -> list[int]:
        """Samples per step of every rank, as last planned (they apply from the next step not yet cut)."""
        return self._planner.shares

    def shares_at(self, step: int) -> list[int]:
        """The shares of global step ``step`` (a step past a planning gather's guard waits for its plan)."""
        return self._planner.shares_at(step)

    def set_shares(self, shares: Sequence[int], *, at_step: int | None = None) -> None:
        """Set every rank's samples per step by hand, from step ``at_step`` on (a global step index; default: the
        first step no rank's loader has cut yet, which the ranks agree on in a collective).

        Every rank calls it with the same values at the same point of the loop. Under allreduce a rank given 0 sits
        out of the exchange, as a rank that sits out does; under adaptive allocation the re-plans go on from these
        shares.
        For benchmarks and experiments that pin the split; an allocation decides it otherwise.

        Raises:
            ConfigError: before ``allocate``, shares that do not fit the ranks and the global batch, or an
                ``at_step`` this rank's loader has already cut (its workers fetch batches ahead).
        """
        horizon = self._planner.horizon
        if at_step is None:
            at_step = max(self._gather_objects(horizon, "agreeing on the first step of the set shares"))
        elif at_step < horizon:
            raise ConfigError(f"set_shares(at_step={at_step}): this rank's loader has cut the steps up to "
                              f"{horizon - 1} already; give a later step, or leave at_step out")
        self._planner.force(at_step, list(shares))

    @property
    def _schedule(self) -> list[tuple[int, list[int]]]:
        return self._planner.schedule

    def _gather_objects(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order; collective."""
        values: list[Any] = [None] * self.world_size
        with peer_failures(what, self.step_timeout_s, self._group):
            dist.all_gather_object(values, value, group=self._group)
        return values

    def _rank0s(self, value: Any, what: str) -> Any:
        """Rank 0's ``value``, on every rank: what the ranks agree on where each drew its own; collective."""
        return self._gather_objects(value, what)[0]
