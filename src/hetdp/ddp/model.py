"""The drop-in: DDP whose ranks compute unequal shares of every step, combined by the synchronization of your choice.

A user's DDP script adopts it by wrapping the model with ``hetdp.DDP`` instead of
torch's and passing its DataLoader through ``model.allocate``; the loop body
(forward, backward, AMP, clipping, ``optimizer.step()``, schedulers) stays theirs.
The steps, epochs, figures and allocation are the ``StepCoordinator`` it shares with
the sharded drop-in (``coordinator``); the model adds torch DDP's side of a step:
the comm hook (``hook``), the open step (``step``), who sits out (``seams``) and the
models that follow it (``follow``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hetdp.allocate.policy import AllocationPolicy, allocation_policy
from hetdp.cluster.emulate import Emulation
from hetdp.collectives.paths import agree_in_group
from hetdp.data.steps import StepTicket
from hetdp.ddp.coordinator import StepCoordinator
from hetdp.ddp.follow import Followers, check_follows, check_place
from hetdp.ddp.hook import HookState, buffer_options, comm_hook, loss_convention, synchronizer
from hetdp.ddp.seams import SeamParts, seam
from hetdp.ddp.step import StepRunner, rebuild_buckets, warn_unstepped
from hetdp.ddp.windows import BackwardEnd
from hetdp.errors import ConfigError
from hetdp.figures.clock import EndedStep, StepClock
from hetdp.figures.metrics import EpochReport, MetricsConfig
from hetdp.membership.standin import weighing_nothing
from hetdp.runtime import new_step_group, peer_failures
from hetdp.runtime.teardown import release_group
from hetdp.sync.base import LossConvention, batch_statistics_mix
from hetdp.sync.policy import SyncPolicy, sync_policy


class DistributedDataParallel(StepCoordinator, TorchDDP):
    """DDP in which rank i computes ``shares[i]`` samples of every step, for an allocation × synchronization pairing.

    Allocation (who computes how much): ``"equal"`` (plain DDP), ``hetdp.Static(weights)``, ``"adaptive"`` (the
    default: re-planned from measured compute times, and again when a device drifts) or ``hetdp.Planned(cluster)``.
    Synchronization (how contributions combine): ``"allreduce"`` (the default: the gradient is exactly the mean over
    the step's samples, whatever the shares), a partial allreduce (``"solo"``, ``"majority"``, ``"quorum:K"``: a
    step does not wait for the slowest; each round is the sample-weighted mean of what it holds) or local training
    with weighted parameter averaging (``"local"`` per epoch, ``"local:K"`` every K steps). Both may also come from
    ``hetdp run --allocation / --sync`` when the code leaves them out.

    The loop stays the user's: ``model.allocate(loader)`` returns their DataLoader re-cut so that each batch is this
    rank's share of the step, and the comm hook weighs each rank's gradient (the mean loss over its own batch) by
    its share of the step. A rank with no sample in a step (the epoch's last step, with fewer samples than ranks)
    gets a stand-in batch (one sample, two where a BatchNorm trains), run as a training step that weighs nothing: in
    the module's own mode, weighted 0, its buffers and random states put back after its forward. Under ``hetdp run --speeds / --stragglers /
    --speed-change`` every step is paced to its emulated device by itself.

    Warning:
        Every rank must construct it with the same allocation and synchronization,
        and iterate the allocated loader the same way: every step is collective.
        Build it after ``init_process_group`` (or ``hetdp.init_distributed``), and
        ``close()`` it (or use it as a context manager) before destroying the group.

    Examples:
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
        loss: LossConvention = "mean",
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
            loss: what each rank's loss is, so that the step's gradient is plain DDP's on the same global batch
                whatever the shares: ``"mean"`` (the default: the mean over the rank's own batch, weighed by its
                samples), ``"sum"`` (``reduction="sum"``) or ``"global_mean"`` (the sum over the rank's tokens over
                the step's token count, which the loop all-reduces, counting 0 tokens where ``model.step_samples``
                is 0); those two are weighed 1 / ranks, as plain DDP averages them (allreduce only).
            ddp_options: passed to ``torch.nn.parallel.DistributedDataParallel`` (``device_ids``, ...).

        Raises:
            ConfigError: a bad allocation, synchronization or setting, or torch.distributed not initialized.
        """
        if not dist.is_initialized():
            raise ConfigError("hetdp.DDP needs torch.distributed: call init_process_group (or hetdp.init_distributed)")
        if not step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be > 0 seconds, got {step_timeout_s!r}")
        policy, sync_spec = allocation_policy(allocation), sync_policy(sync)
        convention = loss_convention(loss, sync_spec)
        if follow is not None:
            check_follows(follow, DistributedDataParallel, own_settings=allocation is not None or emulation is not None,
                          sync=sync_spec, module=module)
        own_group = process_group is None
        group = new_step_group(step_timeout_s) if own_group else process_group
        place = (dist.get_rank(group), dist.get_world_size(group))
        if follow is not None:
            check_place(follow, place, group if own_group else None)
        super().__init__(module, process_group=group, **buffer_options(sync_spec, ddp_options, place[1]))
        self.allocation, self.sync, self.step_timeout_s = policy, sync_spec, step_timeout_s
        self.rank, self.world_size = place
        self._own_group, self._group = own_group, group
        if follow is not None:
            emulation = Emulation()  # its steps run inside its leader's, which the emulation already paces
        self.emulation = emulation if emulation is not None else Emulation.from_env()
        device = next(module.parameters()).device
        self.clock = StepClock(device, self.emulation.pacer(self.rank, self.world_size))
        self.paths = agree_in_group(device, group, step_timeout_s)
        """The collective paths every rank's device allows, agreed at construction (a group may mix devices)."""
        self.synchronizer = synchronizer(sync_spec, module, group, step_timeout_s, self.paths)
        self._hook = HookState(self.clock, self.synchronizer, self.world_size)
        self._steps = StepRunner(self._hook, module, convention)
        self._seam = seam(self, SeamParts(self._hook, self._steps, self.synchronizer, group, self.world_size), module,
                          step_timeout_s, follow._seam if follow is not None else None)
        self._sitting = self._seam.sitting if self._seam is not None else None
        self.register_comm_hook(self._hook, comm_hook)
        self._coordinate(module, self.synchronizer, group, metrics)
        if (mix := batch_statistics_mix(module, convention)) is not None and self._first_warning("batch statistics"):
            warnings.warn(f"hetdp.DDP: {mix}", stacklevel=2)
        self._followers: Followers[DistributedDataParallel] = Followers()
        self._follows = follow is not None
        self._leading = None if follow is None else weakref.ref(follow)
        self._backward_end = BackwardEnd(functools.partial(_backward_ended, weakref.ref(self)))
        if follow is not None:
            follow._followers.add(self)

    # --- the step lifecycle (the allocated loader drives it; loops with their own batching may too) -------------

    def begin_epoch(self, epoch: int, start_step: int = 0) -> None:
        super().begin_epoch(epoch, start_step)
        for model in self._open_followers():
            model.begin_epoch(epoch, start_step)

    def begin_ticket(self, ticket: StepTicket, total: int | None = None) -> None:
        super().begin_ticket(ticket, total)
        for model in self._open_followers():
            model.begin_ticket(ticket, total)

    def _open_step(self, ticket: StepTicket, total: int, meets: bool) -> None:
        self._steps.begin(ticket, total, meets=meets)
        if self._seam is not None:
            self._seam.route(self, ticket)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled()
        if training and self._steps.open is not None:
            self._training_forward(inputs, kwargs, self.require_backward_grad_sync)  # may open the next batch's step
            self._steps.forward(self.require_backward_grad_sync, functools.partial(
                rebuild_buckets, self, self.step_timeout_s, self._group))
        elif training and self.module.training and not self._follows and self._first_warning("unstepped"):
            warn_unstepped()
        if self._seam is not None and self._steps.open is not None and self._seam.shortcut(self):
            output = self._seam.forward(self, super().forward, inputs, kwargs)  # nothing to exchange (seams.py)
        else:
            # torch's DDP may broadcast rank 0's buffers (BatchNorm's) as a forward starts: a collective too
            broadcast = (peer_failures("the forward's buffer broadcast", self.step_timeout_s, self._group)
                         if self.will_sync_module_buffers() else contextlib.nullcontext())
            with broadcast, weighing_nothing(self.module) if self._steps.stand_in() else contextlib.nullcontext():
                output = super().forward(*inputs, **kwargs)
        if training and self._steps.open is not None and self._leader._ahead:  # a loop that fetched batches ahead
            self._backward_end.watch(output)
        return output

    @property
    def _leader(self) -> DistributedDataParallel:
        leader = None if self._leading is None else self._leading()
        return self if leader is None else leader

    def _close_step(self) -> EndedStep | None:
        return self._steps.end()

    def _reducing(self) -> bool:
        return self._hook.reached

    def _step_closed(self) -> None:
        self._catch_up()
        for model in self._open_followers():  # before a checkpoint, which meets their synchronization too
            model.end_step()

    def end_epoch(self) -> EpochReport:
        report = super().end_epoch()
        for model in self._open_followers():
            model.end_epoch()
        return report

    def _epoch_met(self) -> None:
        self._catch_up(force=True, state=False)

    def _replanned(self, first_step: int, shares: list[int]) -> None:
        super()._replanned(first_step, shares)
        if self._sitting is not None and self.allocator is not None:
            self._sitting.schedule(first_step, self.allocator.members)

    def _catch_up(self, force: bool = False, state: bool = True) -> None:
        """Bring the ranks that sat out current when due (``SitOutSeam.catch_up``); collective."""
        if self._seam is not None:
            modules = [self.module, *(model.module for model in self._open_followers())]
            self._seam.catch_up(self.steps_done, modules, force=force, state=state)

    def synchronize(self) -> None:
        """Collective: under partial or local synchronization, meet now, as at an epoch's end (the rounds in flight
        are flushed, the parameters averaged); under allreduce the replicas are already one. A checkpoint calls it:
        it then saves the model every rank holds, and no round waits meanwhile for a rank that is saving."""
        if self._planner.apart:
            self._planner.gather(meet=True)
            self.clock.restart()
        self._catch_up(force=True)
        for model in self._open_followers():
            model.synchronize()

    def _open_followers(self) -> list[DistributedDataParallel]:
        return self._followers.open()

    # --- life cycle -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the synchronization and release the process group the model made; every rank calls it
        (idempotent). A gloo group left alive at interpreter exit can abort the process."""
        if self._group is None:
            return
        self._planner.settle()
        if self._sitting is not None:
            self._sitting.flush()
        self._heartbeat.stop()
        self.synchronizer.close()
        self._steps.close()
        self._release_figures(self._group)
        if self._own_group:
            release_group(self._group)
        self._group = None

    def __enter__(self) -> DistributedDataParallel:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"hetdp.DDP(allocation={self.allocation.describe()}, sync={self.sync.describe()}, "
                f"rank={self.rank}/{self.world_size}, shares={self.shares}, steps={self.steps_done})")


def _backward_ended(ref: weakref.ref[DistributedDataParallel]) -> None:
    """A backward through a model's output ran (weakly held: the hook lives on in the output's graph)."""
    model = ref()
    if model is not None and model._steps.open is not None:
        model._backward_ran()


DDP = DistributedDataParallel
