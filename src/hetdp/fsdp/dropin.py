"""The sharded drop-in's coordinator: FSDP2's units under one root, their collectives weighed, timed and paced, and
the steps, figures and allocation ``hetdp.DDP`` has (``StepCoordinator``).

``hetdp.fully_shard`` makes it when ``model.allocate(loader)`` is first called on
the root (``hetdp.fsdp.shard``); the module's methods hand the rest to it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader

from hetdp.allocate.caps import memory_caps, shard_cap
from hetdp.allocate.policy import AllocationPolicy, allocation_policy
from hetdp.checkpoint.sharded import ShardedCheckpointer
from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import storage_bytes
from hetdp.data.steps import StepTicket
from hetdp.ddp.coordinator import StepCoordinator
from hetdp.errors import ConfigError
from hetdp.figures.clock import EndedStep, StepTimes
from hetdp.figures.metrics import MetricsConfig
from hetdp.figures.shardclock import ShardedClock
from hetdp.floor import check_sharded
from hetdp.fsdp.comms import Exchange, TimedAllGather, UnshardedHooks, WeighedReduceScatter, Weighing
from hetdp.fsdp.memory import Footprint, budget, footprint, probe_activation_bytes, unit_shapes
from hetdp.fsdp.rowmemory import uneven_footprint
from hetdp.fsdp.uneven import UnevenModule
from hetdp.membership.standin import kept_state
from hetdp.runtime import new_step_group
from hetdp.runtime.teardown import release_group
from hetdp.sync.base import LossConvention, Synchronizer, batch_statistics_mix, check_loss, step_part
from hetdp.sync.policy import Allreduce, LocalAveraging, SyncPolicy, sync_policy


@dataclass(kw_only=True, frozen=True)
class DropInSettings:
    """The sharded drop-in's settings, given to ``hetdp.fully_shard`` on the root (``hetdp.DDP`` takes them)."""

    allocation: str | AllocationPolicy | None = None
    """Who computes how much (None: ``$HETDP_ALLOCATION``, else ``"adaptive"``)."""
    sync: str | SyncPolicy | None = None
    """Only ``"allreduce"`` (None: ``$HETDP_SYNC``, else allreduce); see ``check_sync``."""
    step_timeout_s: float = 60.0
    """Seconds a step's collectives wait for the slowest rank (over gloo, FSDP2's too) before a ``PeerTimeoutError``
    names it."""
    metrics: MetricsConfig | None = None
    """Where rank 0 writes per-step and per-epoch figures, if anywhere."""
    emulation: Emulation | None = None
    """How this machine pretends its ranks are unequal (None: ``hetdp run``'s settings, if any)."""
    loss: LossConvention = "mean"
    """What each rank's loss is: the mean over its batch (weighed by its samples), a sum or a global token mean
    (weighed 1 / ranks, as FSDP2 averages them); ``hetdp.sync.base.LossConvention``."""

    def __post_init__(self) -> None:
        check_loss(self.loss)
        if not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be > 0 seconds, got {self.step_timeout_s!r}")

    @property
    def given(self) -> bool:
        """Whether any setting differs from its default."""
        return self != DropInSettings()


def check_sync(spec: SyncPolicy) -> None:
    """Raise ConfigError unless ``spec`` maps onto sharding: only the every-step exchange does."""
    if isinstance(spec, Allreduce):
        return
    if isinstance(spec, LocalAveraging):
        raise ConfigError(f"sync={spec.describe()!r} does not map onto hetdp.fully_shard: local training averages "
                          "replicas that trained alone, but each rank holds only a shard of the model, so there is no "
                          "replica to train alone or average; use sync='allreduce' (the default), or hetdp.DDP")
    raise ConfigError(f"sync={spec.describe()!r} does not map onto hetdp.fully_shard: a partial allreduce lets a step "
                      "go on without some ranks, but FSDP2 gathers and reduce-scatters every unit in every forward and "
                      "backward, so every rank takes part in every step (a rank with no share joins with a stand-in "
                      "weighted 0); use sync='allreduce' (the default), or hetdp.DDP")


class EveryStep(Synchronizer):
    """The sharded drop-in's synchronization as the planner sees it: FSDP2's reduce-scatters (``comms``) combine
    every step, so the ranks never need to meet."""

    meets_every_step = True

    def reduce(self, bucket: dist.GradBucket, samples: int, total: int, meets: bool = False
               ) -> torch.futures.Future[torch.Tensor]:
        raise TypeError("the sharded drop-in reduces in FSDP2's reduce-scatters: no DDP gradient bucket reaches it")


@dataclass
class _OpenStep:
    ticket: StepTicket
    started: bool = False
    """Whether a forward with gradients ran in it (its clock started)."""
    kept: dict[int, Callable[[], None]] = field(default_factory=dict)
    """A stand-in step's forwards under way, by top unit: what puts back the buffers and random states it changes
    (``kept_state``)."""

    @property
    def stand_in(self) -> bool:
        return self.ticket.samples == 0


class _Steps:
    open: _OpenStep | None = None


@dataclass(frozen=True)
class _Unwaited:
    """What a memory cap cut for a loop that lets no gradient wait leaves out: FSDP2's unsharded gradients that
    wait, and the rank's cap with them counted (0: not one sample fits)."""

    bytes: int
    cap: int


class ShardedDropIn(StepCoordinator):
    """FSDP2 units under ``root`` in which rank i computes ``shares[i]`` samples of every step, exactly.

    Built by ``root.allocate(loader)`` (collective: every rank builds it). Each unit reduce-scatters this rank's
    gradient weighed by its part of the step and summed (``comms``; memory-sized shards, ``hetdp.fsdp.uneven``, by
    the same weights through their own exchange), so the gradient is the mean over the step's samples whatever the
    shares; every collective is timed and paced on ``ShardedClock``; the steps, epochs,
    figures, re-plans and allocation are the ones ``hetdp.DDP`` has.

    Warning:
        Every rank must run every step, in the same order: FSDP2 gathers and reduce-scatters every unit in every
        forward and backward. A rank with no sample in a step runs a stand-in batch (one sample, two where a
        BatchNorm trains) as a training step that weighs nothing: in the module's own mode (the same output structure
        and parameters as the others' steps), weighted 0, its buffers and random states put back after its forward.
    """

    def __init__(self, root: nn.Module, units: Sequence[nn.Module], settings: DropInSettings) -> None:
        if not dist.is_initialized():
            raise ConfigError("hetdp.fully_shard needs torch.distributed: call init_process_group first")
        check_sharded()
        if not units:
            raise ConfigError(f"{type(root).__name__} holds no module sharded with fully_shard")
        self.allocation = allocation_policy(settings.allocation)
        self.sync = sync_policy(settings.sync)
        self.loss = settings.loss
        check_sync(self.sync)
        world_size = dist.get_world_size()
        for unit in units:
            mesh = unit_options(unit).get("mesh")
            if mesh is not None and (mesh.ndim != 1 or mesh.size() != world_size):
                raise ConfigError(f"hetdp.fully_shard shards over every rank of the default group (a 1-D mesh of "
                                  f"{world_size}); {type(unit).__name__} has a mesh of shape {tuple(mesh.shape)}")
        self.step_timeout_s = settings.step_timeout_s
        group = new_step_group(self.step_timeout_s)
        self.rank, self.world_size = dist.get_rank(group), world_size
        self._group: dist.ProcessGroup | None = group
        self.module = root
        self.units = list(units)
        self.emulation = settings.emulation if settings.emulation is not None else Emulation.from_env()
        self._follows, self._sitting = False, None  # no rank leaves the exchange: each joins every unit's
        self.clock = ShardedClock(next(root.parameters()).device, self.emulation.pacer(self.rank, self.world_size))
        self.weighing = Weighing(self.world_size)
        self._install_comms()
        self._unsharded = UnshardedHooks(self.units, self.weighing)
        self._steps = _Steps()
        self._probing = False
        self._backward_queued = False
        self.footprint: Footprint | None = None
        """What this rank holds whatever its batch, as ``allocate`` counted it for the caps (None: not counted)."""
        self.activation_bytes_per_sample: float | None = None
        """What one sample adds to a step's peak memory, as ``allocate`` probed it (None: not probed)."""
        self._unwaited: _Unwaited | None = None
        """What the memory caps ``allocate`` cut leave out where the loop lets gradients wait (None: nothing)."""
        self._tops = [unit for unit in self.units if not any(other is not unit and _holds(other, unit)
                                                             for other in self.units)]
        self._handles = [handle for unit in self._tops for handle in (
            unit.register_forward_pre_hook(self._forward_starts, prepend=True, with_kwargs=True),
            unit.register_forward_hook(self._forward_ended))]
        self._coordinate(root, EveryStep(), group, settings.metrics)
        if (mix := batch_statistics_mix(root, self.loss)) is not None and self._first_warning("batch statistics"):
            warnings.warn(f"hetdp.fully_shard: {mix}", stacklevel=4)

    def _install_comms(self) -> None:
        exchange = self._exchange = Exchange(self.clock, group=self._group, timeout_s=self.step_timeout_s,
                                             bounded=dist.get_backend(self._group) == "gloo")
        all_gather, reduce_scatter = TimedAllGather(exchange), WeighedReduceScatter(exchange, self.weighing)
        uneven = [unit for unit in self.units if isinstance(unit, UnevenModule)]
        if uneven:  # memory-sized shards: hetdp's own exchange (hetdp.fsdp.rowshard), weighed and timed alike
            if len(uneven) < len(self.units):
                even = next(unit for unit in self.units if not isinstance(unit, UnevenModule))
                raise ConfigError(f"{type(uneven[0]).__name__} has memory-sized shards and {type(even).__name__} "
                                  "torch's even ones: give every fully_shard call of a model the same shard_sizes")
            for unit in uneven:
                unit._uneven.use(lambda start, group, what, reduces: exchange.run(start, group, False, what,
                                                                                  reduces=reduces),
                                 self.weighing.reduce_weight)
            return
        for unit in self.units:
            try:
                unit.set_custom_all_gather(all_gather)
                unit.set_custom_reduce_scatter(reduce_scatter)
            except ValueError as error:
                raise ConfigError(f"hetdp.fully_shard weighs each unit's reduce-scatter, which torch allows on a "
                                  f"unit with one parameter group only ({type(unit).__name__}: {error})") from error
            # A SUM with no divide: the weights make the mean (a divide factor of 1 alone picks PREMUL_SUM, which gloo
            # refuses; forcing the sum makes it a SUM and a divide by 1, which FSDP2 skips).
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(1.0)
            # Ranks may use different parameters in a step (experts without tokens, a branch only some data takes):
            # every parameter of the unit reduce-scatters, zero where unused, so the ranks' buffers match in size.
            unit.set_reduce_scatter_unused_params(True, recurse=False)

    # --- a step's side of FSDP2 ------------------------------------------------------------------------------

    def _open_step(self, ticket: StepTicket, total: int, meets: bool) -> None:
        weights = ticket.weights
        mine, whole = ((ticket.samples, total) if weights is None
                       else (weights[self.rank], sum(weights)))  # cost-balanced: its part of the step's cost
        part, of = step_part(self.loss, mine, whole, self.world_size)
        self.weighing.step = part / of
        self._steps.open = _OpenStep(ticket)

    def _forward_starts(self, unit: nn.Module, args: Any, kwargs: Any) -> None:
        """A top unit's forward begins (before FSDP2 gathers it): the step's first starts its clock; in a loop that
        fetched batches ahead it may begin the next batch's step first (``_training_forward``)."""
        if not torch.is_grad_enabled() or self._probing:
            return
        if unit is self._tops[0] and self._steps.open is not None:
            self._training_forward(args, kwargs, self.weighing.syncing)
        step = self._steps.open
        if step is None:
            if unit.training and self._first_warning("unstepped"):
                warnings.warn("hetdp.fully_shard: a training forward outside any step, so its backward averages the "
                              "ranks' gradients as plain FSDP2 does, and nothing is allocated, timed or emulated: "
                              "iterate the loader that model.allocate(loader) returns (was its result dropped?)",
                              stacklevel=3)
            return
        if step.stand_in and unit.training:  # a training step that weighs nothing: it changes nothing that persists
            step.kept[id(unit)] = kept_state(unit)
        if not step.started:
            step.started = True
            self.clock.start(step.ticket.step, step.ticket.work)
        if unit is self._tops[0]:
            self.clock.forwards += 1

    def _forward_ended(self, unit: nn.Module, args: Any, output: Any) -> None:
        """Put back what a stand-in's forward changed; watch the output's backward: its end closes the backward's
        compute and wait."""
        step = self._steps.open
        if step is not None and (restore := step.kept.pop(id(unit), None)) is not None:
            restore()
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._backward_starts)

    def _backward_starts(self, grad: torch.Tensor) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            # Queued after FSDP2's own end-of-backward callback (its hook on the output ran first): runs once the
            # last reduce-scatter is done.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._backward_queued = False
        reduced = self.clock.backward_ended()
        if reduced is False and self.weighing.syncing and self.world_size > 1 and self._first_warning("unseen"):
            warnings.warn("hetdp.fully_shard: a backward of a step reduced nothing though the drop-in was not told "
                          "that gradients wait: set_requires_gradient_sync(False) on a unit that torch's fully_shard "
                          "sharded is not seen, and gradients that wait are then weighed wrong; shard every unit "
                          "with hetdp.fully_shard", stacklevel=2)
        self.weighing.backward_ended()
        if self._steps.open is not None and self._ahead:  # a loop that fetched batches ahead
            self._backward_ran(waiting=not self.weighing.syncing)

    def gradient_sync(self, syncing: bool) -> None:
        """The loop turned the gradients' reduction on or off (``set_requires_gradient_sync``)."""
        self.weighing.syncing = syncing
        if not syncing:
            self._unsharded.start()
            self._warn_unwaited()

    def _warn_unwaited(self) -> None:
        """Warn once where gradients wait above this rank's memory cap, which ``allocate`` cut for a loop that lets
        none wait: FSDP2 then holds every unit's unsharded gradient beside the shard."""
        unwaited, self._unwaited = self._unwaited, None
        allocator = self.allocator
        caps = allocator.caps if allocator is not None else None
        cap = caps[self.rank] if caps is not None else None
        if unwaited is None or cap is None or unwaited.cap >= cap:
            return
        holds = (f"{unwaited.cap} sample{'' if unwaited.cap == 1 else 's'} a forward" if unwaited.cap
                 else "not one sample")
        warnings.warn(f"hetdp.fully_shard: rank {self.rank}: gradients that wait (set_requires_gradient_sync(False)) "
                      f"keep every unit's unsharded gradient, {unwaited.bytes / 1e6:.3g} MB, which its memory cap of "
                      f"{cap} samples did not count; with them it holds {holds}: pass allocate(..., accumulates=True) "
                      f"(shares then run as micro-batches), or a max_batch that leaves room for them", stacklevel=4)

    def _close_step(self) -> EndedStep | None:
        step, self._steps.open = self._steps.open, None
        if step is None:
            return None
        self.weighing.step = self.weighing.outside
        return EndedStep(step.ticket, self.clock.finish() if step.started else StepTimes(None, []))

    def _reducing(self) -> bool:
        return self.clock.reducing

    # --- memory --------------------------------------------------------------------------------------------------

    def _memory_caps(self, max_batch: int | Sequence[int | None] | Literal["measure"] | None,
                     loader: DataLoader, *, accumulates: bool = False) -> list[int | None] | None:
        """Caps given as numbers stay as given; otherwise (None, ``"measure"``) each rank's comes from its memory once
        its shard is placed (``hetdp.fsdp.memory``): its emulated device's memory fields, or its CUDA device's free
        memory, over what a sample adds to a step's peak, probed where nobody gave it. ``accumulates``: the loop lets
        gradients wait, whose unsharded copies the footprint then counts. A probe that cannot run the model on the
        loader's first batch raises under ``"measure"`` and leaves the shares uncapped, with a warning, by default."""
        if max_batch is not None and not (isinstance(max_batch, str) and max_batch == "measure"):
            return super()._memory_caps(max_batch, loader, accumulates=accumulates)
        shapes, placed = unit_shapes(self.units, unit_options), storage_bytes(self.module.parameters())
        def held_with(gradients_wait: bool) -> Footprint:
            return (uneven_footprint(self.units, shapes, placed, gradients_wait=gradients_wait)
                    if isinstance(self.units[0], UnevenModule) else footprint(shapes, placed,
                                                                               gradients_wait=gradients_wait))

        held = self.footprint = held_with(accumulates)
        mine = budget(self.rank, self.clock.device, self.emulation, held)
        per_sample: float | ConfigError | None = None
        if any(self._gather_objects(mine is not None and mine.per_sample_bytes is None, "agreeing on a probe")):
            try:
                per_sample = self.activation_bytes_per_sample = self._probe(loader)
            except ConfigError as error:
                per_sample = error
                if max_batch is None and self._first_warning("probe"):
                    warnings.warn(f"hetdp.fully_shard: no memory cap: {error}", stacklevel=4)

        def cap() -> int | None:
            if mine is None:
                return None
            sample_bytes = mine.per_sample_bytes or per_sample
            if isinstance(sample_bytes, ConfigError):
                if max_batch is None:
                    return None
                raise sample_bytes
            if not accumulates and sample_bytes:  # the cap were gradients to wait, for gradient_sync's warning
                waiting = held_with(True).waiting
                room = math.floor((mine.memory_bytes - mine.held_bytes - waiting) / sample_bytes)
                self._unwaited = _Unwaited(waiting, max(room, 0))
            return shard_cap(mine.memory_bytes, mine.held_bytes, sample_bytes or 0.0, device=mine.device)

        return memory_caps("measure", self.world_size, self.emulation, self._gather_objects, cap)

    def _probe(self, loader: DataLoader) -> float:
        """Activation bytes per sample of the model on the loader's first batch (collective: trial steps)."""
        self._probing = True
        try:
            with torch.random.fork_rng(devices=[self.clock.device] if self.clock.device.type == "cuda" else []):
                batch = next(iter(loader), None)
            return probe_activation_bytes(self.module, batch, lambda: self._unsharded.parameters.values())
        finally:
            self._probing = False

    # --- checkpoints and life cycle ------------------------------------------------------------------------------

    def checkpointer(self, folder: str | Path, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                     scaler: Any = None, every: int = 100) -> ShardedCheckpointer:
        """Save the sharded training state to ``folder`` every ``every`` steps through torch.distributed.checkpoint
        (every rank writes its shards: the folder must be one every rank reaches); ``resume()`` it before the loop.
        A resume on another number of ranks reshards the state and goes on at the saved step."""
        checkpointer = ShardedCheckpointer(self, folder, optimizer, scheduler=scheduler, scaler=scaler, every=every)
        self._listeners = [*(old for old in self._listeners if not isinstance(old, ShardedCheckpointer)),
                           checkpointer]
        return checkpointer

    def close(self) -> None:
        """Stop the heartbeat and release the groups the drop-in made; every rank calls it (idempotent). The units
        keep their weighing, at FSDP2's mean over ranks."""
        if self._group is None:
            return
        self._planner.settle()
        self._heartbeat.stop()
        self._unsharded.close()
        for unit in self.units:
            if isinstance(unit, UnevenModule):
                unit._uneven.release()
        for handle in self._handles:
            handle.remove()
        self._release_figures(self._group)
        self._exchange.release()
        release_group(self._group)
        self._group = None

    def __repr__(self) -> str:
        return (f"hetdp.fully_shard(allocation={self.allocation.describe()}, rank={self.rank}/{self.world_size}, "
                f"shares={self.shares}, steps={self.steps_done})")


def sharded_units(root: nn.Module) -> list[nn.Module]:
    """The units under ``root`` (itself included): FSDP2's, or hetdp's memory-sized ones."""
    return [module for module in root.modules() if isinstance(module, (FSDPModule, UnevenModule))]


def unit_options(unit: nn.Module) -> Mapping[str, Any]:
    """The ``fully_shard`` keywords hetdp reads back of a unit (``hetdp.fully_shard`` keeps them; a unit torch's own
    sharded has none)."""
    return getattr(unit, "_hetdp_options", {})


def _holds(outer: nn.Module, inner: nn.Module) -> bool:
    return any(module is inner for module in outer.modules())
