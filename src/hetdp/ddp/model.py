"""The drop-in: DDP whose ranks compute unequal shares of every step, combined by the synchronization of your choice.

A user's DDP script adopts it by wrapping the model with ``hetdp.DDP`` instead of
torch's and passing its DataLoader through ``model.allocate``; the loop body
(forward, backward, AMP, clipping, ``optimizer.step()``, schedulers) stays theirs.
The model coordinates parts that each do one job: the comm hook (``hook``), the open
step (``step``), the gathers and re-plans (``planning``), the epochs' figures
(``tally``), the allocation (``allocating``, ``caps``), the models that follow it
(``follow``) and checkpoints (``stepcheckpoint``, a step-end listener).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from types import TracebackType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hetdp.allocate.policy import AllocationPolicy, allocation_policy
from hetdp.checkpoint.checkpointer import CheckpointState
from hetdp.cluster.emulate import Emulation
from hetdp.collectives.paths import agree_in_group
from hetdp.data.steps import StepTicket
from hetdp.ddp.allocating import Allocating
from hetdp.ddp.follow import Followers, check_follows, check_place
from hetdp.ddp.hook import HookState, buffer_options, comm_hook, progress, synchronizer
from hetdp.ddp.seams import SeamParts, seam
from hetdp.ddp.step import StepListener, StepRunner, rebuild_buckets, warn_unstepped
from hetdp.errors import ConfigError
from hetdp.figures.clock import StepClock
from hetdp.figures.gather import Planner
from hetdp.figures.metrics import EpochReport, MetricsConfig, MetricsWriter
from hetdp.figures.tally import Epochs
from hetdp.liveness import Heartbeat
from hetdp.membership.standin import evaluating
from hetdp.runtime import host_group, new_step_group, peer_failures
from hetdp.sync.policy import SyncPolicy, sync_policy


class DistributedDataParallel(Allocating, CheckpointState, TorchDDP):
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
    gets a one-sample stand-in batch, run in eval mode and weighted 0. Under ``hetdp run --speeds / --stragglers /
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
        policy, sync_spec = allocation_policy(allocation), sync_policy(sync)
        if follow is not None:
            check_follows(follow, DistributedDataParallel, own_settings=allocation is not None or emulation is not None,
                          sync=sync_spec)
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
        self._steps = StepRunner(self._hook, module)
        self._seam = seam(self, SeamParts(self._hook, self._steps, self.synchronizer, group, self.world_size), module,
                          step_timeout_s, follow._seam if follow is not None else None)
        self._sitting = self._seam.sitting if self._seam is not None else None
        self.register_comm_hook(self._hook, comm_hook)
        self.metrics = metrics or MetricsConfig()
        self._writer = MetricsWriter(self.metrics) if self.metrics.enabled and self.rank == 0 else None
        self._figures_group = host_group(group, step_timeout_s)
        self._planner = Planner(self.synchronizer, module, self._figures_group, timeout_s=step_timeout_s,
                                metrics=self.metrics, writer=self._writer, on_replan=self._replanned)
        self._planner.sitting = self._sitting
        self.step_figures = self._planner.step_figures
        """Every rank's figures per step, as far as the last gather (every ``metrics.every`` steps, at re-plans,
        meetings and epoch ends)."""
        self._epochs = Epochs(self._writer)
        self.epoch_reports = self._epochs.reports
        self.resume_position: tuple[int, int] = (0, 0)
        """(epoch, step within it) a loaded checkpoint resumes at; the allocated loader starts there."""
        self.resume_random_state: dict[str, Any] | None = None
        """This rank's random state a loaded checkpoint saved; the allocated loader restores it as the loop starts."""
        self._listeners: list[StepListener] = []
        self._followers: Followers[DistributedDataParallel] = Followers()
        self._follows = follow is not None
        if follow is not None:
            follow._followers.add(self)
        self._warned: set[str] = set()
        self._heartbeat = Heartbeat(group, functools.partial(progress, weakref.ref(self))).start()
        weakref.finalize(self, self._heartbeat.stop)

    @property
    def steps_done(self) -> int:
        """Steps finished, over all epochs: the global index of the next step."""
        return self._planner.steps_done

    @property
    def epochs_done(self) -> int:
        """Epochs ended: the index of the next one, which a plain shuffled loader's order follows."""
        return self._epochs.next

    @property
    def step_samples(self) -> int | None:
        """This rank's samples in the open step (None outside one). 0: its batch is a stand-in that trains nothing
        (it sits out, or a short last step has none for it); leave it out of samples seen and accuracy."""
        return None if self._steps.open is None else self._steps.open.ticket.samples

    def _first_warning(self, key: str) -> bool:
        """Whether the warning ``key`` is due: on rank 0, the first time (one line a run, not one a rank)."""
        if self.rank != 0 or key in self._warned:
            return False
        self._warned.add(key)
        return True

    # --- the step lifecycle (the allocated loader drives it; loops with their own batching may too) -------------

    def begin_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Start the epoch's figures; the allocated loader calls it."""
        self._epochs.begin(epoch, first=self.steps_done - start_step)
        for model in self._open_followers():
            model.begin_epoch(epoch, start_step)

    def begin_step(self, samples: int, total: int) -> None:
        """Open a step in which this rank computes ``samples`` of the step's ``total`` (0: a stand-in batch, run in
        eval mode and weighted 0). The allocated loader calls it; a loop with its own batching calls it before each
        step's first forward, and ``end_step`` after ``optimizer.step()``."""
        if not 0 <= samples <= total or total < 1:
            raise ConfigError(f"a step needs 0 <= samples <= total and total >= 1, got {samples} of {total}")
        if self._epochs.tally is None:
            self.begin_epoch(0)
        tally = self._epochs.tally
        block = tuple(samples if rank == self.rank else 0 for rank in range(self.world_size))
        self.begin_ticket(StepTicket(step=self.steps_done, epoch=tally.epoch, index=self.steps_done - tally.first,
                                     block=block, rank=self.rank), total)

    def begin_ticket(self, ticket: StepTicket, total: int | None = None) -> None:
        """Open a step cut by the allocated loader (``total`` defaults to the ticket's)."""
        if self._epochs.tally is None:
            self.begin_epoch(ticket.epoch)
        total = ticket.total if total is None else total
        wanted = any(listener.meets_after(self.steps_done + 1) for listener in self._listeners)
        self._steps.begin(ticket, total, meets=self._planner.meets_after(ticket, wanted))
        if self._seam is not None:
            self._seam.route(self, ticket)
        DistributedDataParallel.steps_in_process += 1
        for model in self._open_followers():
            model.begin_ticket(ticket, total)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._steps.open is not None and torch.is_grad_enabled():
            self._steps.forward(self.require_backward_grad_sync, functools.partial(
                rebuild_buckets, self, self.step_timeout_s, self._group))
        elif (torch.is_grad_enabled() and self.module.training and not self._follows
              and self._first_warning("unstepped")):
            warn_unstepped()
        if self._seam is not None and self._steps.open is not None and self._seam.shortcut(self):
            return self._seam.forward(self, super().forward, inputs, kwargs)  # nothing to exchange (sitout.py)
        # torch's DDP may broadcast rank 0's buffers (BatchNorm's) as a forward starts: a collective too
        broadcast = (peer_failures("the forward's buffer broadcast", self.step_timeout_s, self._group)
                     if self.will_sync_module_buffers() else contextlib.nullcontext())
        with broadcast, evaluating(self.module) if self._steps.stand_in() else contextlib.nullcontext():
            return super().forward(*inputs, **kwargs)

    def record_loss(self, loss: torch.Tensor | float, samples: int | None = None) -> None:
        """Count a loss (the mean over ``samples``, default this step's) into the epoch report's ``loss``."""
        open_step = self._steps.open
        samples = open_step.ticket.samples if samples is None and open_step is not None else samples
        if samples and self._epochs.tally is not None:
            self._epochs.tally.add_loss(loss, samples)

    def end_step(self) -> None:
        """Close the step (after ``optimizer.step()``): record its figures; meet or re-plan when due."""
        ended = self._steps.end()
        if ended is None:
            raise ConfigError("end_step() without an open step (call begin_step first)")
        if self._epochs.tally is not None:
            self._epochs.tally.add_step(ended.times, ended.ticket.samples)
        self._planner.step_ended(ended)
        self._catch_up()
        for model in self._open_followers():  # before a checkpoint, which meets their synchronization too
            model.end_step()
        for listener in self._listeners:
            listener.step_ended(self.steps_done)

    def end_epoch(self) -> EpochReport:
        """Close the epoch: merge where the synchronization meets per epoch, gather its figures, re-plan if due.

        Collective; the allocated loader calls it after the epoch's last step.
        """
        assert self._epochs.tally is not None, "end_epoch() without begin_epoch()"
        totals = self._epochs.tally.totals().values()
        every_rank = self._planner.gather(meet=self._planner.apart, extra=totals, epoch_end=True)
        self.clock.restart()  # the ranks just met, announced or not: no emulated step runs on past it
        self._catch_up(force=True, state=False)
        allocator = self.allocator
        report = self._epochs.end(every_rank, shares=self.shares, stable=allocator.stable if allocator else True,
                                  sat_out=dict(allocator.sat_out) if allocator else {})
        for model in self._open_followers():
            model.end_epoch()
        return report

    def _replanned(self, first_step: int, shares: list[int]) -> None:
        """The planner's news: ``shares`` from global step ``first_step`` on."""
        if self._epochs.tally is not None:
            self._epochs.tally.add_replan(first_step, shares)
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

    @property
    def last_epoch(self) -> EpochReport | None:
        """The latest epoch's report (identical on every rank), or None before the first epoch ended."""
        return self.epoch_reports[-1] if self.epoch_reports else None

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
        if self._writer is not None:
            self._writer.close()
        if self._figures_group is not self._group:
            dist.destroy_process_group(self._figures_group)
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


DDP = DistributedDataParallel
