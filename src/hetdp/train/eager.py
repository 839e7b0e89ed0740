"""EagerSGD: an optimizer wrapper whose steps wait for a partial allreduce of the gradients, not for every rank.

Deprecated: eager-SGD is the drop-in's partial synchronization,
``hetdp.DDP(model, allocation, "majority")`` (or ``"solo"``, ``"quorum:K"``,
``hetdp.Partial(...)``), which runs in the user's own loop, steps the loop's
optimizer once per round and meets with a deadline. ``hetdp.EagerSGD`` warns and
goes in the next release; this module keeps it working until then.

Eager-SGD paper, Algorithm 2 and section 5: each step sums the local gradients
with a solo / majority / quorum / full partial allreduce and updates with
G = sum / P; a gradient that missed a round is carried to the next one. Beyond
the paper, every rank applies every round it receives, in order, so replicas
stay identical without the paper's periodic model synchronization. The partial
allreduce of gradients is ``hetdp.sync.partial.PartialGradients``, the same the
drop-in uses, and the periodic synchronization is ``hetdp.sync.averaging``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from hetdp.cluster.emulate import Emulation
from hetdp.collectives.flat import broadcast_in_place
from hetdp.collectives.partial import PartialConfig, PartialResult
from hetdp.collectives.protocol import Mode
from hetdp.errors import ConfigError
from hetdp.runtime import global_rank
from hetdp.sync.averaging import average_parameters, float_state
from hetdp.sync.partial import GradientRound, PartialGradients

log = logging.getLogger(__name__)

DivideBy = Literal["world", "contributors"]


class EagerSGD:
    """Wrap any torch optimizer so that a step waits for a partial allreduce of the gradients (eager-SGD).

    Call it where you would call ``optimizer.step()``, after ``loss.backward()``.
    ``step()`` flattens the gradients of ``model``, contributes them to a
    ``PartialAllreduce`` and, for each round the call returns, sets every
    parameter's ``.grad`` to ``G`` and runs ``optimizer.step()``:

    - ``G = sum / P`` (the paper's Algorithm 2), or with ``divide_by="contributors"``
      ``G = sum / n``, n being the gradients summed in the round (its
      contributors' fresh ones plus stale ones carried into it). With
      ``step(samples=n)`` each gradient is weighted by the samples behind it, and
      ``n`` counts samples;
    - a gradient that missed its round waits in the send buffer and is summed
      into the next one (paper, section 5), so every gradient is applied exactly
      once, by every rank;
    - ``catch_up=True`` (the default, beyond the paper): a rank that lagged
      applies every round it missed, in order, so all replicas hold the same
      parameters after the same round. ``catch_up=False`` applies only the latest
      round, as the paper's receive buffer does; replicas then drift apart until
      the next synchronization;
    - every ``sync_every`` rounds (0: never), the parameters are averaged over
      the group with a blocking allreduce, at the same round on every rank.

    Rounds that hold no gradient at all (an empty last round at ``close()``) are
    not applied. Parameters without a gradient count as zero gradients. At
    construction, every rank takes rank 0's parameters and buffers, as DDP does.
    Under ``hetdp run --stragglers / --speeds`` the emulation applies by itself:
    ``zero_grad`` sleeps a drawn straggler's delay, ``step`` pads the compute.

    .. warning::
        Every rank of the group must construct it in the same order and call
        ``close()`` at the end, and ``flush()`` before any other collective
        (evaluation, checkpoint, barrier): both apply the rounds the others ran
        after this rank's last step and a last round that empties every send
        buffer, and return once every rank has called them.

    Example::

        >>> # on every rank, under torchrun / `hetdp run -n 4`
        >>> model = nn.Linear(32, 1)
        >>> with hetdp.EagerSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, mode="majority") as eager:
        ...     for inputs, targets in loader:           # the same number of batches on every rank
        ...         eager.zero_grad()
        ...         nn.functional.mse_loss(model(inputs), targets).backward()
        ...         eager.step()                         # waits for the round's initiator, not for the slowest
        >>> eager.divergence()                           # 0.0: every replica applied the same rounds
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        mode: Mode | PartialConfig = "majority",
        sync_every: int = 0,
        *,
        divide_by: DivideBy = "world",
        catch_up: bool = True,
        group: dist.ProcessGroup | None = None,
        emulation: Emulation | None = None,
    ) -> None:
        """Start the partial allreduce of ``model``'s gradients; collective over ``group``.

        Args:
            optimizer: any torch optimizer over ``model``'s parameters; it runs once per applied round.
            model: the replica this rank trains.
            mode: ``"solo"``, ``"majority"``, ``"quorum"``, ``"full"``, or a ``PartialConfig`` for the quorum size,
                the initiator seed and the timeouts.
            sync_every: average the parameters over the group every this many rounds (0: never).
            divide_by: ``"world"`` (G = sum / P, the paper) or ``"contributors"`` (G = sum / gradients summed).
            catch_up: apply every round missed while lagging (identical replicas) rather than only the latest.
            group: the ranks training together (None: the default group).
            emulation: how this machine pretends ranks are unequal (None: ``hetdp run``'s settings, if any).

        Raises:
            ConfigError: a bad setting, no trainable parameter, or parameters of mixed dtype or device.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 0:
            raise ConfigError(f"sync_every must be an integer >= 0 (0: never), got {sync_every!r}")
        if divide_by not in ("world", "contributors"):
            raise ConfigError(f"divide_by must be 'world' or 'contributors', got {divide_by!r}")
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ConfigError("the model has no trainable parameter")
        kinds = {(p.dtype, p.device) for p in self._params}
        if len(kinds) > 1:
            raise ConfigError(f"EagerSGD needs parameters of one dtype and device, got {sorted(map(str, kinds))}")
        self.optimizer = optimizer
        self.model = model
        self.sync_every = sync_every
        self.divide_by: DivideBy = divide_by
        self.catch_up = catch_up
        self.group = group
        config = mode if isinstance(mode, PartialConfig) else PartialConfig(mode=mode)
        broadcast_in_place(float_state(model), global_rank(0, group), group)
        self.sync = PartialGradients(parameters_to_vector(self._params).detach(), config, group)
        self.partial = self.sync.partial
        """The partial allreduce underneath."""
        self.world_size = self.partial.world_size
        rank = dist.get_rank(group)
        self._pacer = (emulation or Emulation.from_env()).pacer(rank, self.world_size)
        self._started_at: float | None = None
        self.steps = 0
        """Calls to ``step()`` so far."""
        self.rounds = 0
        """Rounds received so far (the same count on every rank after the same round)."""
        self.applied = 0
        """Rounds applied with the optimizer (fewer than ``rounds`` with ``catch_up=False`` or empty rounds)."""
        self.syncs = 0
        """Parameter averagings so far."""
        self.gradients = 0
        """Gradients summed into the rounds received so far: the group's work, the same on every rank after the
        same round. A budget on it stops every rank at about the same point, where fixed per-rank step counts
        let the last ranks to finish drag the model toward their own data."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Apply the rounds completed since the last step, then clear the gradients.

        Called before the forward pass, as usual, it starts the next gradient from
        every round already done: a rank back from a stall would otherwise compute
        on parameters several rounds old (staler than the paper's eager-SGD needs).
        """
        self._receive(self.sync.poll())
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._started_at = time.perf_counter()
        self._pacer.start(self.steps, 0)

    def step(self, samples: int | None = None) -> PartialResult:
        """Contribute this rank's gradients and apply the rounds that come back; returns the latest round.

        Args:
            samples: the samples behind this gradient (its batch size): rounds then weigh gradients by their
                samples, and sample-cost emulation paces the step. None: one unit, as in the paper.

        Raises:
            PeerTimeoutError: a peer died or did not arrive in time (see ``PartialAllreduce.allreduce``).
        """
        if self._started_at is not None:
            self._pacer.finish(self.steps, samples or 0, time.perf_counter() - self._started_at)
            self._started_at = None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        rounds = self.sync.contribute(parameters_to_vector(grads), 1.0 if samples is None else float(samples))
        self.steps += 1
        self._receive(rounds)
        return rounds[-1].result

    def flush(self) -> None:
        """Apply the rounds run after this rank's last step, then the round that empties every send buffer.

        Collective: every rank calls it at the same point of its loop (say, at
        the end of an epoch), and it returns once every rank has. Afterwards every
        rank has applied the same rounds and holds no carried gradient: call it
        before evaluating, checkpointing or any other collective.
        """
        self.sync.flush(on_round=lambda gradient_round: self._receive((gradient_round,)))

    def close(self) -> None:
        """Flush (see ``flush``) and stop the partial allreduce; every rank must call it."""
        self.sync.close(on_round=lambda gradient_round: self._receive((gradient_round,)))

    def synchronize(self) -> None:
        """Average the parameters over the group (every rank must call it at the same point).

        Raises:
            PeerTimeoutError: a rank did not join within the partial allreduce's ``timeouts.round_s``.
        """
        average_parameters(self.model, 1.0 / self.world_size, group=self.group,
                           timeout_s=self.partial.config.timeouts.round_s)
        self.syncs += 1

    def divergence(self) -> float:
        """The largest absolute difference between a parameter here and on the group's first rank, over all ranks.

        Collective over the group: every rank must call it, and gets the same value.
        """
        flat = parameters_to_vector(self._params).detach().double()
        reference = flat.clone()
        dist.broadcast(reference, group=self.group, group_src=0)
        gap = (flat - reference).abs().max().reshape(1)
        dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=self.group)
        return float(gap.item())

    def __enter__(self) -> EagerSGD:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is None:
            self.close()
        else:
            self.partial.__exit__(kind, error, trace)

    def __repr__(self) -> str:
        return (f"EagerSGD({type(self.optimizer).__name__}, mode={self.partial.mode!r}, sync_every={self.sync_every}, "
                f"divide_by={self.divide_by!r}, catch_up={self.catch_up}, steps={self.steps}, rounds={self.rounds})")

    def _receive(self, rounds: Sequence[GradientRound]) -> None:
        for index, gradient_round in enumerate(rounds):
            if self.catch_up or index == len(rounds) - 1:
                self._apply(gradient_round)
            self.rounds = gradient_round.result.round + 1
            self.gradients += gradient_round.result.parts
            if self.sync_every and self.rounds % self.sync_every == 0:
                self.synchronize()

    def _apply(self, gradient_round: GradientRound) -> None:
        parts, samples = gradient_round.result.parts, gradient_round.samples
        if parts == 0 or samples == 0:
            return
        if self.divide_by == "world":  # the paper's sum / P, each gradient counted as one of mean size
            update = gradient_round.weighted_sum * (parts / (samples * self.world_size))
        else:
            update = gradient_round.mean()
        offset = 0
        for p in self._params:
            p.grad = update[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.optimizer.step()
        self.applied += 1
