"""Local training on the data a rank holds, merged across ranks every epoch or every step.

C-ADP and local SGD train each rank alone for an epoch and merge by weighted
parameter averaging, w = sum_i (D_i / D) w_i (C-ADP paper, section 3). The same
loop with a gradient allreduce at every step is synchronous data parallelism
(DDP), the baseline they are measured against. Both merges are the library's
one implementation of their synchronization: ``hetdp.sync.averaging`` and the
drop-in ``hetdp.DDP``. Emulation paces each batch to a device's batch time and
each model transfer to its link, so one machine behaves like the described
cluster.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from hetdp.cluster.emulate import Emulation
from hetdp.errors import ConfigError
from hetdp.runtime import wait_for
from hetdp.sync.averaging import average_parameters
from hetdp.train.ddp import DistributedDataParallel

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def epoch_order(size: int, *, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """The order in which ``rank`` visits its ``size`` local samples in ``epoch``: a permutation seeded by all three."""
    state = int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])
    return torch.randperm(size, generator=torch.Generator().manual_seed(state))


class Pace:
    """A deadline clock for emulated work: ``wait(s)`` sleeps until ``s`` more seconds have passed.

    Deadlines accumulate from the last ``reset``, so sleep overshoot and Python
    overhead do not add up over many batches: a phase of k batches of T seconds
    lasts k T as long as the real work of every prefix is cheaper than that.
    A disabled pace never sleeps (a real cluster).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._deadline = time.perf_counter()

    def reset(self) -> None:
        """Start counting from now (after a collective that synchronized the ranks)."""
        self._deadline = time.perf_counter()

    def wait(self, seconds: float) -> None:
        """Move the deadline ``seconds`` later and sleep until it."""
        if not self.enabled:
            return
        self._deadline += seconds
        remaining = self._deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


class Merge(ABC):
    """How ranks combine their local training: the loop calls these hooks on every rank in the same order.

    .. warning::
        Every rank of the group must call the hooks with the same ``steps`` and
        epochs: each merge is a collective.
    """

    def __init__(self, *, link_s: float = 0.0, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0) -> None:
        self.link_s = link_s
        """Emulated seconds to move the model one way over this rank's link (alpha + M / B); 0 without emulation."""
        self.group = group
        self.timeout_s = timeout_s
        """Longest wait for one merge collective; past it, PeerTimeoutError names this rank."""

    def steps(self, local_batches: int) -> int:
        """Optimizer steps this rank runs per epoch; it may exceed its batches when steps are collective."""
        return local_batches

    def module(self, model: nn.Module) -> nn.Module:
        """What the loop runs forward through: the model itself, or a wrapper that synchronizes its gradients."""
        return model

    def start_epoch(self, pace: Pace) -> None:
        """Before the epoch's first batch."""

    def begin_step(self, step: int, samples: int) -> None:
        """Before the forward of epoch step ``step``, in which this rank trains on ``samples`` samples (0: none)."""

    def end_step(self, pace: Pace) -> None:
        """After the step's optimizer update."""

    def close(self) -> None:
        """Release what the merge holds; every rank calls it."""

    def end_epoch(self, model: nn.Module, pace: Pace, totals: torch.Tensor) -> torch.Tensor:
        """After the epoch's last optimizer step: return ``totals`` (float64 epoch figures) summed over ranks.

        A merge that runs a collective here carries them in it; by default they travel alone.
        """
        summed = totals.clone()
        wait_for(dist.all_reduce(summed, group=self.group, async_op=True), "epoch statistics", self.timeout_s)
        return summed

    @abstractmethod
    def describe(self) -> str:
        """A short name for logs and reports."""


class ParameterAveraging(Merge):
    """Merge once per epoch by weighted parameter averaging, w = sum_i weight_i w_i (C-ADP, local SGD).

    One allreduce of the weighted parameters gives every rank the merged model,
    as the paper's parameter server does by gathering and broadcasting. Emulated,
    a rank's epoch is download (link_s), its batches, upload (link_s): its cycle
    lasts T_comp,i + T_comm,i of C-ADP eq. (6) and the merge waits for the
    slowest, which is eq. (7)'s max_i (T_comp,i + T_comm,i).

    Example::

        >>> # rank 0 trained on 300 samples, rank 1 on 100 (launched with torchrun)
        >>> merge = ParameterAveraging(weight=[0.75, 0.25][dist.get_rank()])
        >>> merge.end_epoch(model, Pace(enabled=False))   # model is now 0.75 w_0 + 0.25 w_1 on both ranks
    """

    def __init__(self, weight: float, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= weight <= 1.0:
            raise ConfigError(f"merge weight must be in [0, 1] (D_i / D), got {weight!r}")
        self.weight = weight
        """D_i / D of this rank."""

    def start_epoch(self, pace: Pace) -> None:
        pace.wait(self.link_s)  # receive the current global model

    def end_epoch(self, model: nn.Module, pace: Pace, totals: torch.Tensor) -> torch.Tensor:
        pace.wait(self.link_s)  # send the local model
        summed = average_parameters(model, self.weight, group=self.group, timeout_s=self.timeout_s, carry=totals)
        pace.reset()
        return summed

    def describe(self) -> str:
        return "parameter averaging per epoch"


class GradientAllreduce(Merge):
    """Merge at every step by the drop-in's synchronous gradient sum (DDP with unequal batches).

    Every rank runs ``steps_per_epoch`` collective steps: rank i trains on
    ``batch_sizes[i]`` of its ``counts[i]`` samples per step, and a rank out of
    batches joins with a one-sample stand-in weighted 0. The gradient is
    sum_r n_r g_r / sum_r n_r, the mean over the step's samples (plain DDP's mean
    when batches are equal). Emulated, each step's exchange lasts ``link_s`` there
    and back over the slowest link, which every rank of a synchronous allreduce
    waits for.
    """

    def __init__(self, model: nn.Module, counts: Sequence[int], batch_sizes: Sequence[int], **kwargs) -> None:
        super().__init__(**kwargs)
        if len(counts) != len(batch_sizes) or min(batch_sizes) < 1:
            raise ConfigError(f"need a batch size >= 1 per rank, got counts {list(counts)} and {list(batch_sizes)}")
        self.counts, self.batch_sizes = list(counts), list(batch_sizes)
        self.steps_per_epoch = max(-(-n // b) for n, b in zip(self.counts, self.batch_sizes))
        if self.steps_per_epoch < 1:
            raise ConfigError(f"no rank has a sample to train on: counts {self.counts}")
        self.ddp = DistributedDataParallel(model, "equal", "allreduce", step_timeout_s=self.timeout_s,
                                           emulation=Emulation(), process_group=self.group)

    def steps(self, local_batches: int) -> int:
        return self.steps_per_epoch

    def module(self, model: nn.Module) -> nn.Module:
        return self.ddp

    def begin_step(self, step: int, samples: int) -> None:
        total = sum(min(b, max(0, n - step * b)) for n, b in zip(self.counts, self.batch_sizes))
        self.ddp.begin_step(samples, total)

    def end_step(self, pace: Pace) -> None:
        self.ddp.end_step()
        pace.reset()
        pace.wait(2 * self.link_s)

    def end_epoch(self, model: nn.Module, pace: Pace, totals: torch.Tensor) -> torch.Tensor:
        self.ddp.end_epoch()
        return super().end_epoch(model, pace, totals)

    def close(self) -> None:
        self.ddp.close()

    def describe(self) -> str:
        return "gradient allreduce per step"


@dataclass(frozen=True)
class EpochStats:
    """One epoch of local training, identical on every rank."""

    epoch: int
    seconds: float
    """Wall-clock seconds from the epoch's start to its merge, on this rank (the merge synchronizes ranks)."""
    loss: float
    """Mean training loss over every rank's samples of the epoch."""
    samples: int
    """Samples trained on by all ranks together."""


def train_local(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: TensorDataset,
    merge: Merge,
    *,
    batch_size: int,
    epochs: int,
    batch_time_s: float = 0.0,
    emulate: bool = False,
    seed: int = 0,
    loss_fn: LossFn = nn.functional.cross_entropy,
    on_epoch: Callable[[EpochStats], None] | None = None,
) -> list[EpochStats]:
    """Train ``model`` on this rank's ``data`` for ``epochs``, combining ranks through ``merge``.

    Each epoch visits the local samples once, in a fresh seeded order, in batches
    of ``batch_size`` (the last one partial). With ``emulate``, every batch lasts
    ``batch_time_s`` (a partial one too, as C-ADP eq. (5)'s ceiling counts it)
    and the merge's transfers last its ``link_s``.

    .. warning::
        Collective: every rank of the merge's group calls it with the same
        ``epochs`` (and, for per-step merges, the same step count).

    Raises:
        ConfigError: a bad batch size, epoch count or batch time, or no sample for a collective step.
        PeerTimeoutError: a merge waited past its deadline.
    """
    if batch_size < 1 or epochs < 1 or not batch_time_s >= 0:
        raise ConfigError(
            f"need batch_size >= 1, epochs >= 1 and batch_time_s >= 0, got {batch_size}, {epochs}, {batch_time_s}"
        )
    inputs, targets = data.tensors
    rank = dist.get_rank(merge.group)
    batches = -(-len(inputs) // batch_size)
    steps = merge.steps(batches)
    if steps > batches and not len(inputs):
        raise ConfigError(f"rank {rank} holds no sample but takes part in {steps} synchronous steps per epoch")
    forward = merge.module(model)
    pace = Pace(emulate)
    device = inputs.device
    history = []
    forward.train()
    for epoch in range(epochs):
        started = time.perf_counter()
        order = epoch_order(len(inputs), seed=seed, epoch=epoch, rank=rank).to(device)
        loss_sum = 0.0
        pace.reset()
        merge.start_epoch(pace)
        for step in range(steps):
            index = order[step * batch_size : (step + 1) * batch_size]
            optimizer.zero_grad()
            merge.begin_step(step, len(index))
            # A rank out of batches still joins a collective step, with a one-sample stand-in weighted 0.
            batch = index if len(index) else order[:1]
            loss = loss_fn(forward(inputs[batch]), targets[batch])
            loss.backward()
            if len(index):
                loss_sum += float(loss.detach()) * len(index)
                pace.wait(batch_time_s)
            optimizer.step()
            merge.end_step(pace)
        totals = torch.tensor([loss_sum, float(len(inputs))], dtype=torch.float64, device=device)
        totals = merge.end_epoch(model, pace, totals)
        stats = EpochStats(
            epoch=epoch,
            seconds=time.perf_counter() - started,
            loss=float(totals[0] / max(float(totals[1]), 1.0)),
            samples=int(totals[1]),
        )
        log.debug("rank %d epoch %d (%s): %.3f s, loss %.4f", rank, epoch, merge.describe(), stats.seconds, stats.loss)
        history.append(stats)
        if on_epoch is not None:
            on_epoch(stats)
    return history
