"""The drop-in's comm hook: each bucket weighed by this rank's part of the step, combined by the synchronization.

The hook is the one seam between torch's DDP and hetdp's synchronizations
(``hetdp.sync``): the factory here builds the synchronization a ``SyncPolicy``
names, and ``HookState`` carries what the hook needs into torch's reducer.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from hetdp.collectives.paths import Paths
from hetdp.errors import ConfigError
from hetdp.figures.clock import StepClock
from hetdp.runtime import Timeouts
from hetdp.sync.averaging import ParameterAveraging
from hetdp.sync.base import LossConvention, Synchronizer, check_loss
from hetdp.sync.gradient_sum import GradientSum
from hetdp.sync.partial import PartialGradients
from hetdp.sync.policy import Allreduce, LocalAveraging, Partial, SyncPolicy


class HookState:
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
        self.local = isinstance(synchronizer, ParameterAveraging)
        """Whether gradients stay on their rank: a step that no meeting follows then exchanges nothing."""

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.reached = True
        self.clock.mark_ready(bucket.is_last(), alone=self.local and not self.meets)
        combined = self.synchronizer.reduce(bucket, self.samples, self.total, self.meets)
        if combined.done():  # combined already (alone, the small last bucket, partial, local): no callback to run
            self.clock.mark_synced()
            return combined
        return combined.then(self._synced)

    def _synced(self, future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        self.clock.mark_synced()
        return future.value()

    def outside_step(self) -> None:
        """Weigh the next backward as plain DDP does (the mean over ranks), as between steps."""
        self.samples, self.total, self.meets = 1, self.world_size, False


def comm_hook(state, bucket):  # no annotations: DDP checks them as types, and here they would be strings
    """DDP comm hook: weight and combine a bucket by the step's shares (see ``HookState``)."""
    return state.reduce(bucket)


def waits_for_rounds(spec: SyncPolicy) -> bool:
    """Whether the synchronization is a partial allreduce whose rounds wait for other ranks (all but solo and
    quorum:1, where a rank's own arrival fires its round)."""
    return isinstance(spec, Partial) and spec.mode != "solo" and not (spec.mode == "quorum" and spec.quorum == 1)


def loss_convention(loss: object, spec: SyncPolicy) -> LossConvention:
    """The loss convention ``loss`` names, if the synchronization ``spec`` combines it exactly (ConfigError if not):
    a sum or a global mean only under allreduce, where every step combines every rank's gradient; partial rounds and
    local averaging weigh what they hold by samples, which only a per-rank mean makes the step's mean."""
    convention = check_loss(loss)
    if convention != "mean" and not isinstance(spec, Allreduce):
        raise ConfigError(f"loss={convention!r} needs sync='allreduce', got {spec.describe()!r}: partial rounds and "
                          "local averaging weigh each rank's gradient by its samples, which is exact for "
                          "loss='mean' (each rank's loss the mean over its own batch) only")
    return convention


def synchronizer(spec: SyncPolicy, module: nn.Module, group: dist.ProcessGroup, timeout_s: float,
                 paths: Paths) -> Synchronizer:
    """The synchronization ``spec`` names, over ``group``, for the trainable parameters of ``module``."""
    if isinstance(spec, Allreduce):
        return GradientSum(group, timeout_s, paths)
    if isinstance(spec, LocalAveraging):
        return ParameterAveraging(spec.every, group, timeout_s)
    params = [p for p in module.parameters() if p.requires_grad]
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ConfigError(f"partial synchronization needs trainable parameters of one dtype and device, got {kinds}")
    like = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    if spec.timeouts is not None:
        warnings.warn("hetdp.Partial(timeouts=...) in hetdp.DDP is deprecated and goes after 0.1.0: a round "
                      "is the step's exchange, so it waits hetdp.DDP(step_timeout_s=...), as every step does",
                      DeprecationWarning, stacklevel=4)
    config = dataclasses.replace(spec, timeouts=spec.timeouts or Timeouts(round_s=timeout_s))
    if dist.get_backend(group) == "nccl":  # every rank's gradient is on a GPU: the rounds' data stays there
        config = dataclasses.replace(config, data_backend="nccl")
    return PartialGradients(like, config, group, every=spec.every, timeout_s=timeout_s, parameters=params)


def buffer_options(spec: SyncPolicy, ddp_options: dict[str, Any], world_size: int) -> dict[str, Any]:
    """torch DDP's options with its forward broadcast of rank 0's buffers off, unless the user set it, where the
    synchronization is partial or local (there it would make every forward wait for rank 0), and alone (a rank by
    itself has nobody to take buffers from: torch's DDP would still run the broadcast, a collective, every forward)."""
    every_step = isinstance(spec, Allreduce) and world_size > 1
    if "forward_sync_buffers" in inspect.signature(TorchDDP.__init__).parameters:
        ddp_options.setdefault("forward_sync_buffers", every_step)
    elif not every_step:
        ddp_options.setdefault("broadcast_buffers", False)
    return ddp_options
