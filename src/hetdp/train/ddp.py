"""The drop-in: DDP whose ranks compute unequal shares of every step, combined by the synchronization of your choice.

A user's DDP script adopts it by wrapping the model with ``hetdp.DDP`` instead of
torch's and passing its DataLoader through ``model.allocate``; the loop body
(forward, backward, AMP, clipping, ``optimizer.step()``, schedulers) stays theirs.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import inspect
import logging
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader

from hetdp.allocate.pack import CostBalance
from hetdp.allocate.policy import PLAN_LAG, AllocationPolicy, Allocator, allocation_policy
from hetdp.cluster.emulate import Emulation
from hetdp.errors import ConfigError
from hetdp.liveness import Heartbeat
from hetdp.runtime import peer_failures, wait_for
from hetdp.sync.averaging import ParameterAveraging
from hetdp.sync.base import Synchronizer
from hetdp.sync.gradient_sum import GradientSum
from hetdp.sync.partial import PartialGradients
from hetdp.sync.policy import Allreduce, LocalAveraging, Partial, SyncPolicy, sync_policy
from hetdp.train.accumulation import StepAccumulation
from hetdp.train.clock import StepClock
from hetdp.train.loader import AllocatedLoader, StepTicket, per_rank_batch
from hetdp.train.metrics import EpochReport, MetricsConfig, MetricsWriter, StepFigures
from hetdp.train.stepcheckpoint import Checkpointer

log = logging.getLogger(__name__)

HISTORY_STEPS = 10_000
"""Per-step figures kept in ``step_figures`` (the oldest are dropped; a metrics file keeps them all)."""


@dataclass
class _PlanningGather:
    """An all-gather of step figures in flight: started at one step, awaited ``PLAN_LAG`` steps later."""

    work: dist.Work
    rows: list[torch.Tensor]
    pending: list[tuple[StepTicket, float, float]]
    """This rank's steps whose figures it carries."""
    await_after: int
    """``steps_done`` from which ``end_step`` waits for it."""
    guard: int
    """The first step this rank's loader may not cut before the plan is known: the plan applies from the latest
    rank's ``guard`` on, so no rank has cut a step whose shares the plan changes."""


class _HookState:
    """What the comm hook needs, kept apart from the module: a cycle through DDP would keep its group alive."""

    def __init__(self, clock: StepClock, synchronizer: Synchronizer, world_size: int) -> None:
        self.clock = clock
        self.synchronizer = synchronizer
        self.world_size = world_size
        self.samples, self.total = 1, world_size  # outside a step: plain DDP's mean over ranks
        self.meets = False
        """Whether the ranks meet after this step (the synchronization then completes the step everywhere)."""
        self.reached = False
        """Whether this step's gradient has reached the synchronization (a heartbeat's progress tells)."""

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.reached = True
        self.clock.mark_ready(bucket.is_last())
        return self.synchronizer.reduce(bucket, self.samples, self.total, self.meets).then(self._synced)

    def _synced(self, future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        self.clock.mark_synced()
        return future.value()


def _comm_hook(state, bucket):  # no annotations: DDP checks them as types, and here they would be strings
    """DDP comm hook: weight and combine a bucket by the step's shares (see ``_HookState``)."""
    return state.reduce(bucket)


def _progress(model_ref: weakref.ref[DistributedDataParallel]) -> int:
    """How far a rank got, for its heartbeat: two points a step, the second once its gradient is synchronizing.

    Weakly held: the heartbeat must not keep the model (and its process group) alive.
    """
    model = model_ref()
    return 0 if model is None else 2 * model.steps_done + int(model._hook.reached)


@dataclass
class _OpenStep:
    ticket: StepTicket
    total: int
    """Samples of the step over all ranks."""
    weight: tuple[float, float]
    """(this rank's part, the step's whole) the comm hook weighs the step's gradient by."""
    started: bool = False
    ends_accumulation: bool = False
    """Whether the step's backward synchronizes gradients accumulated under ``no_sync``."""


@contextlib.contextmanager
def _evaluating(module: nn.Module) -> Iterator[None]:
    """Run ``module`` in eval mode, then restore every submodule's own mode."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _waits_for_rounds(spec: SyncPolicy) -> bool:
    """Whether the synchronization is a partial allreduce whose rounds wait for other ranks (all but solo and
    quorum:1, where a rank's own arrival fires its round)."""
    return isinstance(spec, Partial) and spec.mode != "solo" and not (spec.mode == "quorum" and spec.quorum == 1)


def _synchronizer(spec: SyncPolicy, module: nn.Module, group: dist.ProcessGroup, timeout_s: float) -> Synchronizer:
    if isinstance(spec, Allreduce):
        return GradientSum(group, timeout_s)
    if isinstance(spec, LocalAveraging):
        return ParameterAveraging(spec.every, group, timeout_s)
    params = [p for p in module.parameters() if p.requires_grad]
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ConfigError(f"partial synchronization needs trainable parameters of one dtype and device, got {kinds}")
    like = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    return PartialGradients(like, spec.partial_config(), group, sync_every=spec.sync_every, timeout_s=timeout_s)


class DistributedDataParallel(TorchDDP):
    """DDP in which rank i computes ``shares[i]`` samples of every step, for an allocation × synchronization pairing.

    Allocation (who computes how much): ``"equal"`` (plain DDP), ``hetdp.Static(weights)``,
    ``"adaptive"`` (the default: re-planned from measured compute times, and again
    when a device drifts) or ``hetdp.Planned(cluster)``. Synchronization (how
    contributions combine): ``"allreduce"`` (the default: the gradient is exactly
    the mean over the step's samples, whatever the shares), a partial allreduce
    (``"solo"``, ``"majority"``, ``"quorum:K"``: a step does not wait for the
    slowest; each round is the sample-weighted mean of what it holds) or local
    training with weighted parameter averaging (``"local"`` per epoch,
    ``"local:K"`` every K steps). Both may also come from ``hetdp run --allocation
    / --sync`` when the code leaves them out.

    The loop stays the user's: ``model.allocate(loader)`` returns their DataLoader
    re-cut so that each batch is this rank's share of the step, and the comm hook
    weighs each rank's gradient (the mean loss over its own batch) by its share of
    the step. A rank with no sample in a step (the epoch's last step, with fewer
    samples than ranks) gets a one-sample stand-in batch, run in eval mode and
    weighted 0. Under ``hetdp run --speeds / --stragglers / --speed-change`` every
    step is paced to its emulated device by itself.

    .. warning::
        Every rank must construct it with the same allocation and synchronization,
        and iterate the allocated loader the same way: every step is collective.
        Build it after ``init_process_group`` (or ``hetdp.init_distributed``), and
        ``close()`` it (or use it as a context manager) before destroying the group.

    Example::

        >>> # on every rank, launched with `hetdp run -n 4 --speeds 1,1,2,4 train.py` or torchrun
        >>> model = hetdp.DDP(net.to(device))                      # was: DDP(net.to(device))
        >>> loader = model.allocate(DataLoader(data, batch_size=32, sampler=DistributedSampler(data)))
        >>> for epoch in range(epochs):
        ...     loader.sampler.set_epoch(epoch)
        ...     for batch in loader:                                 # rank i: shares[i] of 32 x 4 samples
        ...         optimizer.zero_grad()
        ...         loss_fn(model(batch["x"]), batch["y"]).backward()
        ...         optimizer.step()
        ...     print(model.last_epoch.diagnosis())                  # "rank 0 is the straggler, by compute: ..."
    """

    steps_in_process: ClassVar[int] = 0
    """Steps any ``hetdp.DDP`` opened in this process: ``hetdp run`` warns when its settings met none."""

    def __init__(
        self,
        module: nn.Module,
        allocation: str | AllocationPolicy | None = None,
        sync: str | SyncPolicy | None = None,
        *,
        step_timeout_s: float = 60.0,
        metrics: MetricsConfig | None = None,
        emulation: Emulation | None = None,
        process_group: dist.ProcessGroup | None = None,
        follow: DistributedDataParallel | None = None,
        **ddp_options: Any,
    ) -> None:
        """Wrap ``module`` (already on its device); collective over ``process_group``.

        Args:
            module: the model; rank 0's parameters and buffers reach every rank, as with DDP.
            allocation: see the class docstring (None: ``$HETDP_ALLOCATION``, else ``"adaptive"``).
            sync: see the class docstring (None: ``$HETDP_SYNC``, else ``"allreduce"``).
            step_timeout_s: how long a step's collectives wait for the slowest rank; past it a dead or hung peer
                raises ``PeerTimeoutError`` naming that rank on every survivor (a few seconds later: the ranks'
                heartbeats tell who went silent), instead of hanging. Too small: a slow but healthy step raises too.
            metrics: where rank 0 writes per-step and per-epoch figures (CSV, TensorBoard), if anywhere.
            emulation: how this machine pretends its ranks are unequal (None: ``hetdp run``'s settings, if any).
            process_group: the ranks training together (None: a new group of all ranks with ``step_timeout_s``).
            follow: another ``hetdp.DDP`` whose steps this model shares, in the same loop on the same batches (a
                GAN's generator beside its discriminator, one tower of several): its gradient is weighed by that
                model's shares, exactly the mean over the step's samples, and that model's loader, timing and
                emulation cover the step. It takes no ``allocation`` or ``emulation`` of its own, nor a loader.
            ddp_options: passed to ``torch.nn.parallel.DistributedDataParallel`` (``device_ids``, ...).

        Raises:
            ConfigError: a bad allocation, synchronization or setting, or torch.distributed not initialized.
        """
        if not dist.is_initialized():
            raise ConfigError("hetdp.DDP needs torch.distributed: call init_process_group (or hetdp.init_distributed)")
        if not step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be > 0 seconds, got {step_timeout_s!r}")
        if follow is not None:
            if not isinstance(follow, DistributedDataParallel):
                raise ConfigError(f"follow must be a hetdp.DDP, got {type(follow).__name__}")
            if allocation is not None or emulation is not None:
                raise ConfigError("a model that follows another takes its shares and emulation: give allocation= "
                                  "and emulation= to the model it follows")
        policy, sync_spec = allocation_policy(allocation), sync_policy(sync)
        if follow is not None and (_waits_for_rounds(sync_spec) or _waits_for_rounds(follow.sync)):
            raise ConfigError(f"a model that follows another cannot run beside it under {sync_spec.describe()} and "
                              f"{follow.sync.describe()}: a partial allreduce whose rounds wait for other ranks "
                              "(majority, quorum, full) would wait on the other model's exchange and they would "
                              "deadlock; use allreduce, solo or local for both")
        own_group = process_group is None
        group = dist.new_group(timeout=datetime.timedelta(seconds=step_timeout_s)) if own_group else process_group
        place = (dist.get_rank(group), dist.get_world_size(group))
        if follow is not None and (follow.rank, follow.world_size) != place:
            if own_group:
                dist.destroy_process_group(group)
            raise ConfigError(f"a model follows another on the same ranks: this is rank {place[0]} of {place[1]}, "
                              f"the one it follows rank {follow.rank} of {follow.world_size}")
        # Partial and local synchronization must not make every forward wait for rank 0's buffers.
        every_step = isinstance(sync_spec, Allreduce)
        if "forward_sync_buffers" in inspect.signature(TorchDDP.__init__).parameters:
            ddp_options.setdefault("forward_sync_buffers", every_step)
        elif not every_step:
            ddp_options.setdefault("broadcast_buffers", False)
        super().__init__(module, process_group=group, **ddp_options)
        self.allocation = policy
        self.sync = sync_spec
        self.step_timeout_s = step_timeout_s
        self.rank, self.world_size = place
        self._own_group = own_group
        self._group: dist.ProcessGroup | None = group
        device = next(module.parameters()).device
        if follow is not None:
            emulation = Emulation()  # its steps run inside its leader's, which the emulation already paces
        self.emulation = emulation if emulation is not None else Emulation.from_env()
        self.clock = StepClock(device, self.emulation.pacer(self.rank, self.world_size))
        self.synchronizer = _synchronizer(sync_spec, module, group, step_timeout_s)
        self._hook = _HookState(self.clock, self.synchronizer, self.world_size)
        self.register_comm_hook(self._hook, _comm_hook)
        self.metrics = metrics or MetricsConfig()
        self._writer = MetricsWriter(self.metrics) if self.metrics.enabled and self.rank == 0 else None
        self.allocator: Allocator | None = None
        self._loader: weakref.ref[AllocatedLoader] | None = None
        """The allocated loader (weakly: it holds the model, and a cycle would keep the process group alive)."""
        self._schedule: list[tuple[int, list[int]]] = []
        """(first step, shares from it on), by step: decisions apply only to steps not yet cut by any rank."""
        self.steps_done = 0
        """Steps finished, over all epochs: the global index of the next step."""
        self.resume_position: tuple[int, int] = (0, 0)
        """(epoch, step within it) a loaded checkpoint resumes at; the allocated loader starts there."""
        self.resume_random_state: dict[str, Any] | None = None
        """This rank's random state a loaded checkpoint saved; the allocated loader restores it as the loop starts."""
        self._checkpointer: Checkpointer | None = None
        self._accumulation: StepAccumulation | None = None
        """Set up by the first forward under ``no_sync``: gradients the loop accumulates, perhaps over steps."""
        self._next_epoch = 0
        """The epoch after the last one ended: where a checkpoint taken between epochs resumes."""
        self.step_figures: collections.deque[StepFigures] = collections.deque(maxlen=HISTORY_STEPS)
        """Every rank's figures per step, as far as the last gather (every ``metrics.every`` steps, at re-plans,
        meetings and epoch ends)."""
        self.epoch_reports: list[EpochReport] = []
        self._open: _OpenStep | None = None
        self._pending: list[tuple[StepTicket, float, float]] = []
        """This rank's (step, compute s, wait s) since the last gather."""
        self._since_meeting = 0
        self._planning: _PlanningGather | None = None
        """Partial and local synchronization: the planning gather in flight, if any."""
        self._epoch: dict[str, Any] = {}
        self._followers: list[weakref.ref[DistributedDataParallel]] = []
        """Models built with ``follow=self``, weakly held: each opens and closes its steps and epochs with this one's."""
        self._follows = follow is not None
        if follow is not None:
            follow._followers.append(weakref.ref(self))
        self._warned: set[str] = set()
        self._heartbeat = Heartbeat(group, functools.partial(_progress, weakref.ref(self))).start()
        weakref.finalize(self, self._heartbeat.stop)

    # --- the allocation ---------------------------------------------------------------------------------------

    def allocate(self, loader: DataLoader, *, global_batch: int | None = None, shuffle: bool | None = None,
                 seed: int | None = None, max_batch: int | Sequence[int | None] | None = None,
                 accumulates: bool = False, cost: CostBalance | Sequence[float] | None = None) -> AllocatedLoader:
        """Re-cut ``loader`` so that each batch is this rank's share of a step of ``global_batch`` samples.

        Every DataLoader option is kept; only the batching changes. The epoch order
        follows the loader's ``DistributedSampler`` (its shuffle and seed), or
        ``shuffle`` / ``seed`` when given.

        Args:
            loader: the DataLoader this rank would iterate under plain DDP.
            global_batch: samples per step over all ranks (default: the loader's batch size x world size, as DDP).
            shuffle, seed: override the order read off the loader's sampler.
            max_batch: the most samples one forward may hold (memory): this rank's (an int; the ranks exchange
                theirs, so every rank must pass one) or every rank's (a sequence, None for no cap). None: the
                emulated devices' caps under ``hetdp run --devices``, else no cap. Unless ``accumulates``, each share
                is capped by it (collective: every rank passes the same kind of value).
            accumulates: whether the loop runs a share above ``max_batch`` as several forwards (micro-batches under
                ``no_sync``, as ``AllocatedTrainer`` does). Then shares are not capped, and the piecewise adaptive
                rule counts each micro-batch in its step-time model.
            cost: per-sample costs of variable-length data (a sequence by dataset index, or a ``CostBalance``):
                shares become parts of each step's cost, and steps are packed so that each rank's block costs its
                part. With ``mean_over="cost"`` (the default) each rank's loss must be its mean per cost unit
                (per token) and the combined gradient is the mean per token over the global step.

        Raises:
            ConfigError: an iterable dataset, an unknown sampler without ``shuffle``, a global batch too small
                for the ranks, or one above the sum of capped ranks' ``max_batch`` (the drop-in cannot split a
                share into micro-batches for the loop: lower ``global_batch``, or use ``accumulates``); a model
                that follows another (its leader's loader cuts the steps).
        """
        if self._follows:
            raise ConfigError("this model follows another's steps: allocate that model's loader")
        if global_batch is None:
            batch = per_rank_batch(loader)
            if batch is None:
                raise ConfigError(f"the loader batches with a {type(loader.batch_sampler).__name__}, which gives no "
                                  "batch size: pass global_batch= (samples per step over all ranks)")
            global_batch = batch * self.world_size
        dataset_size = len(loader.dataset) if hasattr(loader.dataset, "__len__") else None
        balance = None if cost is None else CostBalance.of(cost)
        if self.allocator is None:
            minimum = 1 if global_batch >= self.world_size else 0
            caps = self._memory_caps(max_batch)
            bounds = None if accumulates else caps
            if bounds is not None:
                _check_fits(bounds, global_batch, balance)
            self.allocator = Allocator(self.allocation, self.world_size, global_batch, dataset_size=dataset_size,
                                       minimum=minimum, caps=bounds, chunks=None if balance else caps)
            self._schedule = [(self.steps_done, list(self.allocator.shares))]
        elif self.allocator.total != global_batch:
            raise ConfigError(f"this model already allocates steps of {self.allocator.total} samples, "
                              f"not {global_batch}: one global batch per model")
        allocated = AllocatedLoader(self, loader, global_batch=global_batch, shuffle=shuffle, seed=seed, cost=balance)
        self._loader = weakref.ref(allocated)
        return allocated

    def _memory_caps(self, max_batch: int | Sequence[int | None] | None) -> list[int | None] | None:
        """Every rank's largest forward: given for all, exchanged (each rank gives its own), or emulated."""
        if max_batch is None:
            devices = self.emulation.devices
            return None if devices is None else [device.max_batch for device in devices]
        if isinstance(max_batch, int):
            if max_batch < 1:
                raise ConfigError(f"max_batch must be >= 1 sample, got {max_batch}")
            return self._gather_objects(max_batch, "exchanging the ranks' max_batch")
        caps = list(max_batch)
        if len(caps) != self.world_size or any(cap is not None and cap < 1 for cap in caps):
            raise ConfigError(f"max_batch needs one cap >= 1 (or None) per rank for {self.world_size} ranks, "
                              f"got {caps}")
        return caps

    def _gather_objects(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order; collective."""
        values: list[Any] = [None] * self.world_size
        with peer_failures(what, self.step_timeout_s, self._group):
            dist.all_gather_object(values, value, group=self._group)
        return values

    def _rank0s(self, value: Any, what: str) -> Any:
        """Rank 0's ``value``, on every rank: what the ranks agree on where each drew its own; collective."""
        return self._gather_objects(value, what)[0]

    def _first_warning(self, key: str) -> bool:
        """Whether the warning ``key`` is due: on rank 0, the first time (one line a run, not one a rank)."""
        if self.rank != 0 or key in self._warned:
            return False
        self._warned.add(key)
        return True

    @property
    def epochs_done(self) -> int:
        """Epochs ended: the index of the next one, which a plain shuffled loader's order follows."""
        return self._next_epoch

    @property
    def shares(self) -> list[int]:
        """Samples per step of every rank, as last planned (they apply from the next step not yet cut)."""
        return list(self._schedule[-1][1]) if self._schedule else []

    def shares_at(self, step: int) -> list[int]:
        """The shares of global step ``step`` (a step past a planning gather's guard waits for its plan)."""
        if self._planning is not None and step >= self._planning.guard:
            self._await_planning()
        for first, shares in reversed(self._schedule):
            if first <= step:
                return list(shares)
        return list(self._schedule[0][1])

    # --- the step lifecycle (the allocated loader drives it; loops with their own batching may too) -------------

    def begin_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Start the epoch's figures; the allocated loader calls it."""
        self._epoch = {"epoch": epoch, "first": self.steps_done - start_step, "started": time.perf_counter(),
                       "compute_s": 0.0, "wait_s": 0.0, "samples": 0, "steps": 0, "loss": None, "loss_samples": 0,
                       "replans": []}
        for model in self._open_followers():
            model.begin_epoch(epoch, start_step)

    def begin_step(self, samples: int, total: int) -> None:
        """Open a step in which this rank computes ``samples`` of the step's ``total`` (0: a stand-in batch, run in
        eval mode and weighted 0). The allocated loader calls it; a loop with its own batching calls it before each
        step's first forward, and ``end_step`` after ``optimizer.step()``."""
        if not 0 <= samples <= total or total < 1:
            raise ConfigError(f"a step needs 0 <= samples <= total and total >= 1, got {samples} of {total}")
        if not self._epoch:
            self.begin_epoch(0)
        block = tuple(samples if rank == self.rank else 0 for rank in range(self.world_size))
        index = self.steps_done - self._epoch["first"]
        ticket = StepTicket(step=self.steps_done, epoch=self._epoch["epoch"], index=index, block=block,
                            rank=self.rank)
        self.begin_ticket(ticket, total)

    def begin_ticket(self, ticket: StepTicket, total: int | None = None) -> None:
        """Open a step cut by the allocated loader (``total`` defaults to the ticket's)."""
        if self._open is not None:
            log.debug("rank %d: step %d was left open (the loop broke off); its figures are dropped", self.rank,
                      self._open.ticket.step)
        if not self._epoch:
            self.begin_epoch(ticket.epoch)
        total = ticket.total if total is None else total
        weight = ((ticket.samples, total) if ticket.weights is None  # cost-balanced: its part of the step's cost
                  else (ticket.weights[ticket.rank], sum(ticket.weights)))
        self._open = _OpenStep(ticket, total, weight)
        DistributedDataParallel.steps_in_process += 1
        self._hook.samples, self._hook.total = weight
        self._hook.meets = self._meets_after(ticket)
        for model in self._open_followers():
            model.begin_ticket(ticket, total)

    def _meets_after(self, ticket: StepTicket) -> bool:
        """Whether the ranks will meet after the step of ``ticket`` (every rank gives the same answer): every
        ``sync_every`` steps, at the epoch's end and before a checkpoint. ``end_step``, ``end_epoch`` and the
        checkpointer then meet; knowing it before the step's gradient lets the synchronization complete the step
        everywhere first."""
        if self.synchronizer.meets_every_step:
            return False
        checkpoint = self._checkpointer is not None and self._checkpointer.saves_after(self.steps_done + 1)
        return ticket.last or checkpoint or self.synchronizer.due(self._since_meeting + 1)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        step = self._open
        if step is None and torch.is_grad_enabled() and self.module.training and not self._follows:
            self._warn_unstepped()
        if step is not None and not step.started and torch.is_grad_enabled():
            step.started = True
            self._rebuild_buckets()
            self.clock.start(step.ticket.step, step.ticket.work)
        if step is not None and torch.is_grad_enabled():
            self.clock.forwards += 1
            self._weigh_backward(step)
        stand_in = step is not None and step.ticket.samples == 0 and self.module.training
        # torch's DDP may broadcast rank 0's buffers (BatchNorm's) as a forward starts: a collective too
        broadcast = (peer_failures("the forward's buffer broadcast", self.step_timeout_s, self._group)
                     if self.will_sync_module_buffers() else contextlib.nullcontext())
        with broadcast, _evaluating(self.module) if stand_in else contextlib.nullcontext():
            return super().forward(*inputs, **kwargs)

    def _warn_unstepped(self) -> None:
        if self._first_warning("unstepped"):
            warnings.warn("hetdp.DDP: a training forward outside any step, so this backward averages the ranks' "
                          "gradients as plain DDP does, and nothing is allocated, timed or emulated: iterate the "
                          "loader that model.allocate(loader) returns (was its result dropped?), or open steps "
                          "with model.begin_step / end_step", stacklevel=5)

    def _rebuild_buckets(self) -> None:
        """Let torch's DDP rebuild its gradient buckets (once, at the second step's forward) before the step's
        compute is timed: the rebuild is a collective, and where the ranks are out of step (partial and local
        synchronization) a fast rank would time its wait for the slowest as compute: its window would read as noise,
        and the first plan would wait for more steps. torch's own call in ``forward`` then finds nothing to rebuild."""
        with peer_failures("DDP's bucket rebuild", self.step_timeout_s, self._group):
            if self.reducer._rebuild_buckets():
                self._has_rebuilt_buckets = True

    def _weigh_backward(self, step: _OpenStep) -> None:
        """Gradients accumulated under ``no_sync`` over several steps weigh each step by its own share
        (``StepAccumulation``); the backward that synchronizes their sum then reduces it with weight 1."""
        synchronizing = self.require_backward_grad_sync
        if self._accumulation is None:
            if synchronizing:
                return
            self._accumulation = StepAccumulation(self.module)
        if self._accumulation.forward_starts(self.synchronizer.weight(*step.weight), synchronizing):
            step.ends_accumulation = True
        if step.ends_accumulation:
            self._hook.samples, self._hook.total = 1, 1

    def record_loss(self, loss: torch.Tensor | float, samples: int | None = None) -> None:
        """Count a loss (the mean over ``samples``, default this step's) into the epoch report's ``loss``."""
        samples = self._open.ticket.samples if samples is None and self._open is not None else samples
        if not samples:
            return
        value = loss.detach().float() * samples if isinstance(loss, torch.Tensor) else float(loss) * samples
        self._epoch["loss"] = value if self._epoch.get("loss") is None else self._epoch["loss"] + value
        self._epoch["loss_samples"] = self._epoch.get("loss_samples", 0) + samples

    def end_step(self) -> None:
        """Close the step (after ``optimizer.step()``): record its figures; meet or re-plan when due."""
        step, self._open = self._open, None
        if step is None:
            raise ConfigError("end_step() without an open step (call begin_step first)")
        reached, self._hook.reached = self._hook.reached, False
        self._hook.samples, self._hook.total, self._hook.meets = 1, self.world_size, False
        ticket = step.ticket
        if self._accumulation is not None:
            self._accumulation.step_ended(self.synchronizer.weight(*step.weight), synchronized=reached)
        if step.started and not reached:  # a micro-batch under no_sync: no bucket marked its end
            self.clock.mark_ready(last_bucket=True)
            self.clock.mark_synced()
        compute_s = self.clock.compute_s() if step.started else 0.0
        wait_s = self.clock.wait_s() if step.started else 0.0
        self.synchronizer.count(ticket.samples, step.total)
        self._pending.append((ticket, compute_s, wait_s))
        for key, value in (("compute_s", compute_s), ("wait_s", wait_s), ("samples", ticket.samples), ("steps", 1)):
            self._epoch[key] += value
        self.steps_done += 1
        self._since_meeting += 1
        if self.synchronizer.meets_every_step:
            if self._gather_due():
                self._gather_and_plan()
        else:
            if self._planning is not None and self.steps_done >= self._planning.await_after:
                self._await_planning()
            if self.synchronizer.due(self._since_meeting):
                self._gather_and_plan(meet=True)
            elif self._planning_gather_due():
                self._start_planning()
        for model in self._open_followers():  # before a checkpoint, which meets their synchronization too
            model.end_step()
        if self._checkpointer is not None:
            self._checkpointer.step_ended()

    def end_epoch(self) -> EpochReport:
        """Close the epoch: merge where the synchronization meets per epoch, gather its figures, re-plan if due.

        Collective; the allocated loader calls it after the epoch's last step.
        """
        elapsed_s = time.perf_counter() - self._epoch["started"]
        loss = self._epoch["loss"]
        totals = [self._epoch["compute_s"], self._epoch["wait_s"], float(self._epoch["samples"]), elapsed_s,
                  0.0 if loss is None else float(loss), float(self._epoch["loss_samples"])]
        gathered = self._gather_and_plan(meet=self._replicas_apart, totals=totals, epoch_end=True)
        loss_samples = float(gathered[:, 5].sum())
        report = EpochReport(
            epoch=self._epoch["epoch"],
            shares=self.shares,
            steps=self._epoch["steps"],
            epoch_s=float(gathered[:, 3].max()),
            compute_s=gathered[:, 0].tolist(),
            wait_s=gathered[:, 1].tolist(),
            samples=[int(n) for n in gathered[:, 2].tolist()],
            loss=float(gathered[:, 4].sum()) / loss_samples if loss_samples else None,
            replans=self._epoch["replans"],
            stable=self.allocator.stable if self.allocator is not None else True,
        )
        self.epoch_reports.append(report)
        self._next_epoch = report.epoch + 1
        if self._writer is not None:
            self._writer.write_epoch(report)
        self._epoch = {}
        for model in self._open_followers():
            model.end_epoch()
        return report

    def synchronize(self) -> None:
        """Collective: under partial or local synchronization, meet now, as at an epoch's end (the rounds in flight
        are flushed, the parameters averaged); under allreduce the replicas are already one. A checkpoint calls it:
        it then saves the model every rank holds, and no round waits meanwhile for a rank that is saving."""
        if self._replicas_apart:
            self._gather_and_plan(meet=True)
        for model in self._open_followers():
            model.synchronize()

    def _open_followers(self) -> list[DistributedDataParallel]:
        """The open models that follow this one's steps (``follow=``)."""
        return [model for ref in self._followers if (model := ref()) is not None and model._group is not None]

    @property
    def _replicas_apart(self) -> bool:
        """Whether the ranks' replicas may differ: partial or local synchronization, with steps since the last
        meeting."""
        return not self.synchronizer.meets_every_step and self._since_meeting > 0

    @property
    def last_epoch(self) -> EpochReport | None:
        """The latest epoch's report (identical on every rank), or None before the first epoch ended."""
        return self.epoch_reports[-1] if self.epoch_reports else None

    # --- gathering figures, re-planning -----------------------------------------------------------------------

    def _gather_due(self) -> bool:
        window = self.allocator.window() if self.allocator is not None else None
        if window and self._window_steps() >= window:
            return True
        return self.metrics.enabled and len(self._pending) >= self.metrics.every

    def _planning_gather_due(self) -> bool:
        """Partial and local synchronization: an adaptive allocation gathers its step times in the background
        (``PLAN_LAG``) once its window was measured at the current shares, ``MEETING_WINDOW`` steps or more after its
        first decision (a window that short still has robust statistics under random stragglers), while the shares
        settle and, once stable, while it watches for drift; only the synchronization's own meetings make the ranks
        wait for each other."""
        if self.allocator is None or self._planning is not None:
            return False
        window = self.allocator.window()
        return bool(window) and self._window_steps() >= max(window, self.allocator.out_of_step_window())

    def _window_steps(self) -> int:
        """Steps measured at the current shares, gathered or not: what the allocator's next re-plan would use."""
        current = self.allocator.shares  # type: ignore[union-attr]
        return self.allocator.measured + sum(  # type: ignore[union-attr]
            1 for ticket, _, _ in self._pending if list(ticket.cut_by) == current)

    def _start_planning(self) -> None:
        pending, self._pending = self._pending, []
        row = self._figures_row(pending)
        mine = torch.tensor(row, dtype=torch.float64, device=self.clock.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(rows, mine, group=self._group, async_op=True)
        self._planning = _PlanningGather(work, rows, pending, await_after=self.steps_done + PLAN_LAG,
                                         guard=int(row[0]) + PLAN_LAG)

    def _await_planning(self) -> None:
        """Wait for the planning gather in flight, record its figures and re-plan from them."""
        planning, self._planning = self._planning, None
        if planning is None:
            return
        left = self.synchronizer.standby(planning.work.is_completed, self.step_timeout_s)
        wait_for(planning.work, "gathering step figures", max(left, 1.0), self._group)
        gathered = torch.stack(planning.rows).cpu()
        self._record(gathered, planning.pending)
        self._plan(int(gathered[:, 0].max().item()) + PLAN_LAG, epoch_end=False)

    def _gather_and_plan(self, *, meet: bool = False, totals: Sequence[float] = (), epoch_end: bool = False
                         ) -> torch.Tensor:
        """Bring every rank's figures since the last gather to all ranks (riding a meeting if one is due), record
        them, re-plan if the window is full; return the gathered ``totals`` (ranks x len(totals))."""
        self._await_planning()
        pending, self._pending = self._pending, []
        gathered = self._exchange([*self._figures_row(pending), *totals], meet)
        self._record(gathered, pending)
        self._plan(int(gathered[:, 0].max().item()), epoch_end)
        return gathered[:, 1 + 3 * len(pending) :]

    def _figures_row(self, pending: list[tuple[StepTicket, float, float]]) -> list[float]:
        """What this rank gathers: the next step its loader cuts, then the compute, wait and samples of ``pending``."""
        loader = self._loader() if self._loader is not None else None
        horizon = loader.sampler.next_step if loader is not None else self.steps_done
        return [float(horizon), *(c for _, c, _ in pending), *(w for _, _, w in pending),
                *(float(t.samples) for t, _, _ in pending)]

    def _record(self, gathered: torch.Tensor, pending: list[tuple[StepTicket, float, float]]) -> None:
        """Keep the gathered figures of ``pending`` (every rank's, a row each) and measure the allocator on them."""
        width = len(pending)
        compute, wait = gathered[:, 1 : 1 + width], gathered[:, 1 + width : 1 + 2 * width]
        samples = gathered[:, 1 + 2 * width : 1 + 3 * width].round().long()
        figures = [StepFigures(step=t.step, epoch=t.epoch, shares=samples[:, i].tolist(),
                               compute_s=compute[:, i].tolist(), wait_s=wait[:, i].tolist())
                   for i, (t, _, _) in enumerate(pending)]
        self.step_figures.extend(figures)
        if self._writer is not None and figures:
            self._writer.write_steps(figures)
        if self.allocator is not None:
            current = self.allocator.shares
            for i, (ticket, _, _) in enumerate(pending):
                if list(ticket.cut_by) == current:
                    self.allocator.measure(compute[:, i].tolist())

    def _exchange(self, row: list[float], meet: bool) -> torch.Tensor:
        """Every rank's ``row`` (equal lengths), as a ranks x len(row) float64 CPU tensor."""
        if meet:
            carry = torch.zeros(self.world_size, len(row), dtype=torch.float64)
            carry[self.rank] = torch.tensor(row, dtype=torch.float64)
            summed = self.synchronizer.meet(self.module, carry.reshape(-1))
            self._since_meeting = 0
            return summed.reshape(self.world_size, len(row)).cpu()  # type: ignore[union-attr]
        device = self.clock.device
        mine = torch.tensor(row, dtype=torch.float64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        wait_for(dist.all_gather(rows, mine, group=self._group, async_op=True), "gathering step figures",
                 self.step_timeout_s, self._group)
        return torch.stack(rows).cpu()

    def _plan(self, horizon: int, epoch_end: bool) -> None:
        allocator = self.allocator
        # Under partial and local synchronization a meeting soon after the last (at an epoch's end) holds too few
        # steps for robust statistics under random stragglers: they count towards the next meeting's re-plan.
        if allocator is None:
            return
        min_steps = 0 if self.synchronizer.meets_every_step else allocator.out_of_step_window()
        if not allocator.due(epoch_end, min_steps):
            return
        shares = allocator.replan()
        if shares is None:
            return
        first = max(horizon, self.steps_done)
        self._schedule.append((first, shares))
        if self._epoch:
            self._epoch["replans"].append((first - self._epoch["first"], shares))
        log.debug("rank %d: shares %s from step %d", self.rank, shares, first)

    # --- checkpoints ------------------------------------------------------------------------------------------

    def checkpointer(self, folder: str | Path, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                     scaler: Any = None, every: int = 100) -> Checkpointer:
        """Save the training state to ``folder`` every ``every`` steps; ``resume()`` it before the loop.

        Call after ``allocate``: the checkpoint holds the position in the epoch's order, and a resumed
        run continues the epoch at the saved step, also on another number of ranks.
        """
        self._checkpointer = Checkpointer(self, folder, optimizer, scheduler=scheduler, scaler=scaler, every=every)
        return self._checkpointer

    def hetdp_state_dict(self) -> dict[str, Any]:
        """What a resumed run needs beside the module and optimizer: the allocation and the position in the data.

        ``position`` is (epoch, steps of it done): where the data order continues.
        """
        self._await_planning()
        position = (self._epoch["epoch"], self.steps_done - self._epoch["first"]) if self._epoch else (
            self._next_epoch, 0)
        return {"allocator": None if self.allocator is None else self.allocator.state_dict(),
                "steps_done": self.steps_done, "world_size": self.world_size, "position": position}

    def load_hetdp_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``hetdp_state_dict``; call ``allocate`` first, so that the shares have a global batch.

        Saved by another number of ranks, the allocation starts afresh for this one (adaptive allocation
        re-learns the shares) and the epoch continues at the saved step: the steps keep their samples,
        only the split among ranks changes.
        """
        self._await_planning()
        self.steps_done = int(state["steps_done"])
        saved_world = int(state.get("world_size", self.world_size))
        if self.allocator is not None and state.get("allocator") is not None:
            if saved_world == self.world_size:
                self.allocator.load_state_dict(state["allocator"])
            else:
                log.warning("rank %d: checkpoint of %d ranks resumed on %d; the allocation starts afresh",
                            self.rank, saved_world, self.world_size)
            self._schedule = [(self.steps_done, list(self.allocator.shares))]
        self._pending = []
        self._since_meeting = 0
        self.resume_position = tuple(state["position"]) if state.get("position") is not None else (0, 0)
        self._next_epoch = self.resume_position[0]
        loader = self._loader() if self._loader is not None else None
        if loader is not None and state.get("position") is not None:
            loader.sampler.resume_at(*self.resume_position)

    # --- life cycle -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the synchronization and release the process group the model made; every rank calls it
        (idempotent). A gloo group left alive at interpreter exit can abort the process."""
        if self._group is None:
            return
        self._await_planning()
        self._heartbeat.stop()
        self.synchronizer.close()
        if self._accumulation is not None:
            self._accumulation.close()
        if self._writer is not None:
            self._writer.close()
        if self._own_group:
            dist.destroy_process_group(self._group)
        self._group = None

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"hetdp.DDP(allocation={self.allocation.describe()}, sync={self.sync.describe()}, "
                f"rank={self.rank}/{self.world_size}, shares={self.shares}, steps={self.steps_done})")


def _check_fits(caps: Sequence[int | None], global_batch: int, cost: CostBalance | None) -> None:
    """Raise ConfigError unless shares capped at ``caps`` (None: no cap) can hold a step of ``global_batch``."""
    limits = [cap for cap in caps if cap is not None]
    if not limits:
        return
    if cost is not None and cost.pack:
        raise ConfigError("memory caps bound a rank's samples, and cost-packed steps size blocks by cost: "
                          "pass accumulates=True and split large blocks in the loop, or drop max_batch")
    if len(limits) == len(caps) and global_batch > sum(limits):
        raise ConfigError(
            f"a global batch of {global_batch} does not fit under the ranks' memory caps {limits} (at most "
            f"{sum(limits)} samples, one forward each; the drop-in cannot split a share for your loop): lower "
            f"global_batch, or run shares as micro-batches (accumulates=True, or hetdp.AllocatedTrainer)")


DDP = DistributedDataParallel
