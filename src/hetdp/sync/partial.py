"""Partial synchronization of gradients: each round is the sample-weighted mean of the contributions it holds.

The one implementation of the partial synchronization (eager-SGD paper), which the
drop-in runs from its DDP comm hook. It contributes ``[n * g, n]`` (n samples
behind gradient g) to a ``PartialAllreduce``, so a round that holds a fast rank's
large batch and a slow rank's small one weighs them by their samples, as one
synchronous step over the same samples would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hetdp.collectives.partial import Partial, PartialAllreduce, PartialResult
from hetdp.errors import ConfigError
from hetdp.sync.averaging import average_parameters
from hetdp.sync.base import Synchronizer
from hetdp.sync.layout import GradientLayout
from hetdp.sync.round_steps import RoundSteps

STANDBY_PAUSE_S = 0.001
"""Pause between a standby rank's empty contributions: it still fires its rounds promptly, without spinning."""


@dataclass(frozen=True, eq=False)
class GradientRound:
    """One round of sample-weighted gradients, identical on every rank except ``result.fresh``."""

    weighted_sum: torch.Tensor
    """sum_i n_i g_i over the contributions the round holds."""
    samples: float
    """sum_i n_i: the weight behind those contributions (the drop-in's: a contribution's samples over its step's); 0
    for a round of empty contributions."""
    result: PartialResult
    """The round itself: its index, contributors, parts and whether this rank's tensor is fresh in it."""

    def mean(self) -> torch.Tensor:
        """The weighted mean gradient of the round (zeros if it holds no weight)."""
        return self.weighted_sum / self.samples if self.samples else torch.zeros_like(self.weighted_sum)


def combine(rounds: Sequence[GradientRound], like: torch.Tensor) -> torch.Tensor:
    """The gradient of one step that applies several rounds whose contributions are weighted by the part of their
    own step they are (a rank's samples over the step's): the sum of the rounds' weighted sums.

    Every sample then moves the model as much as in a synchronous step (the eager-SGD
    paper's sum / P, with samples for calls): a round that holds a slow rank's 8 of 64
    samples is an eighth of a step, not a whole one on 8 samples' noise; a rank that
    lagged and receives three full rounds at once moves three steps' worth, as a rank
    that applied them one by one (the drop-in steps the loop's optimizer once per
    round, ``RoundSteps``: exactly as far, with any optimizer); a round that holds
    the whole step (all ranks fresh) is exactly the synchronous gradient; and a
    contribution to a full step that a rank applies in the epoch's short last step
    still counts as its part of the full step.
    """
    gradient = torch.zeros_like(like)
    for gradient_round in rounds:
        gradient += gradient_round.weighted_sum
    return gradient


class PartialGradients(Synchronizer):
    """Sample-weighted gradients through a partial allreduce (solo / majority / quorum / full).

    ``contribute(flat, samples)`` adds this rank's gradient (the mean over its
    ``samples``) and returns every round completed since the last call, oldest
    first: each rank receives every round, in order, and a gradient that missed its
    round travels in the next one (see ``PartialAllreduce``).

    As the drop-in's synchronization, each step's gradient buckets are pooled into
    one contribution at the last bucket, and the step applies every round the call
    returned, each contribution counted as the part of its step its samples are
    (``combine``); the loop's ``optimizer.step()`` then runs once per round the
    step holds (``RoundSteps``), so a rank that catches up on several rounds moves
    its replica as the ranks that received them one by one, whatever the
    optimizer's state. Every ``every`` steps and at each epoch's end the ranks
    *meet*: the step before contributes in a flush, so every rank applies every
    round still in flight in that step, and then they average their parameters,
    which removes what little drift is left (clipping by norm clips a caught-up
    step's rounds together; a step with a closure applies them at once).

    Warning:
        Collective at construction, ``meet``, ``flush`` and ``close``; see ``PartialAllreduce``.
    """

    def __init__(
        self,
        like: torch.Tensor | int,
        config: Partial,
        group: dist.ProcessGroup | None = None,
        *,
        every: int = 0,
        timeout_s: float = 60.0,
        parameters: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Start the partial allreduce for gradients shaped like ``like`` (or of that many elements).

        Args:
            like: a flat gradient (its dtype and device), or its element count (float32 on the CPU).
            config: the partial allreduce's mode, quorum, seed and timeouts.
            group: the ranks taking part (None: the default group).
            every: as the drop-in's synchronization, steps between meetings (0: per epoch only).
            timeout_s: deadline of a meeting's parameter averaging.
            parameters: as the drop-in's synchronization, the trainable parameters (the same, in the same order, on
                every rank): rounds lay their gradients out in this order, whatever order torch DDP's buckets take.

        Raises:
            ConfigError: ``like`` is not a tensor or a positive count, or ``parameters`` hold another element count.
        """
        numel = like if isinstance(like, int) else like.numel()
        if isinstance(numel, bool) or numel < 1:
            raise ConfigError(f"like must be a tensor or a positive element count, got {like!r}")
        payload = torch.zeros(numel + 1) if isinstance(like, int) else like.detach().new_zeros(numel + 1)
        self.numel = numel
        self._layout = None if parameters is None else GradientLayout(parameters)
        if self._layout is not None and self._layout.numel != numel:
            raise ConfigError(f"parameters hold {self._layout.numel} elements, like {numel}")
        self._nothing = payload.new_zeros(numel)
        self.partial = PartialAllreduce.from_config(payload, config, group)
        self.world_size = self.partial.world_size
        self.group = group
        self.every = every
        self.timeout_s = timeout_s
        self._buckets: list[tuple[dist.GradBucket, torch.futures.Future[torch.Tensor]]] = []
        self._round_steps: RoundSteps | None = None
        """As the drop-in's synchronization: the step's rounds, for the loop's optimizer to apply one by one."""
        self.carried: list[GradientRound] = []
        """Rounds received between steps (flushed at a meeting, or in ``standby``), applied with the next step."""
        self._flushed = False
        """Whether the last step ended in a flush: then no rank carries a round the others applied."""
        self._owed = payload.new_zeros(numel)
        """What unforeseen meetings left every rank to apply with its next step (the same on every rank)."""

    # --- the partial allreduce of gradients ----------------------------------------------------------------

    def contribute(self, flat: torch.Tensor, samples: float = 1.0) -> list[GradientRound]:
        """Add ``flat`` (a mean gradient) weighted by ``samples`` (its samples, or its part of a step), and return the
        rounds the call completes, oldest first.

        Raises:
            PeerTimeoutError: a peer died or did not arrive in time.
        """
        return self._rounds(self.partial.allreduce(self._payload(flat, samples)).rounds)

    def poll(self) -> list[GradientRound]:
        """The rounds completed since the last call, without contributing or waiting."""
        return self._rounds(self.partial.poll())

    def flush(self, on_round: Callable[[GradientRound], None] | None = None, flat: torch.Tensor | None = None,
              samples: float = 1.0) -> list[GradientRound]:
        """Collective: the rounds this rank has not received, then one that empties every send buffer; ``flat``
        (weighted by ``samples``, as in ``contribute``), if given, is contributed first and travels in one of them."""
        tensor = None if flat is None else self._payload(flat, samples)
        return self._rounds(self.partial.flush(self._forward(on_round), tensor))

    @staticmethod
    def _payload(flat: torch.Tensor, samples: float) -> torch.Tensor:
        """``[n g, n]``: a gradient weighted by its samples, and the samples, so that rounds sum both."""
        return torch.cat([flat.detach().reshape(-1) * samples, flat.new_full((1,), float(samples))])

    def _forward(self, on_round: Callable[[GradientRound], None] | None) -> Callable[[PartialResult], None] | None:
        return None if on_round is None else lambda result: on_round(self._round(result))

    def _rounds(self, results: Sequence[PartialResult]) -> list[GradientRound]:
        return [self._round(result) for result in results]

    def _round(self, result: PartialResult) -> GradientRound:
        flat = result.tensor.reshape(-1)
        samples = result.last if result.last is not None else float(flat[self.numel])
        return GradientRound(weighted_sum=flat[: self.numel], samples=samples, result=result)

    # --- as the drop-in's synchronization ------------------------------------------------------------------

    @property
    def extra_steps(self) -> int:
        """Optimizer steps the loop's optimizer ran for earlier rounds of a step: a rank catching up."""
        return 0 if self._round_steps is None else self._round_steps.extra_steps

    def reduce(self, bucket: dist.GradBucket, samples: int, total: int, meets: bool = False
               ) -> torch.futures.Future[torch.Tensor]:
        """Pool the step's buckets; at the last one, contribute them and fill every bucket with the rounds' mean.

        The pooled gradient is laid out in the parameters' order (``GradientLayout``), not in the buckets': torch DDP
        rebuilds its buckets after the first step, and a round may hold, or a rank apply, a contribution of a step
        before the rebuild.

        Before a meeting (``meets``) the contribution goes in a flush instead, so that the step returns every round
        still in flight: all ranks then apply the same rounds in this step, and the parameters they average at the
        meeting hold the same gradients. Averaged while some ranks still carried rounds that others had applied,
        those rounds would count more than once on some replicas and partly on others.
        """
        if self._layout is None:
            raise ConfigError("PartialGradients.reduce needs the trainable parameters: pass parameters=")
        pending: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._buckets.append((bucket, pending))
        if bucket.is_last():
            buckets, self._buckets = self._buckets, []
            buffers = [held.buffer() for held, _ in buckets]
            parameters = [held.parameters() for held, _ in buckets]
            flat = self._layout.gather(buffers, parameters)
            part = samples / total
            fresh = self.flush(flat=flat, samples=part) if meets else self.contribute(flat, part)
            rounds, self.carried, self._flushed = self.carried + fresh, [], meets
            # A round without weight (the empty one of a flush) is no step of its own; what a meeting left owed
            # travels with the oldest round.
            parts = [r.weighted_sum for r in rounds if r.samples]
            if parts:
                parts[0] = parts[0] + self._owed
            gradient = combine(rounds, flat) + self._owed
            self._owed.zero_()
            if self._round_steps is None:
                self._round_steps = RoundSteps()
            self._round_steps.hold(self._layout.placed, parts, gradient)
            self._layout.scatter(gradient, buffers, parameters)
            for buffer, (_, future) in zip(buffers, buckets):
                future.set_result(buffer)
        return pending

    def due(self, steps_since_meeting: int) -> bool:
        return self.every > 0 and steps_since_meeting >= self.every

    def standby(self, done: Callable[[], bool], timeout_s: float) -> float:
        """Keep the rounds firing until ``done()``: between steps, this rank joins each round with nothing (0
        samples), so that a round waiting for it (majority: its initiator; quorum: its k-th rank) never holds up a
        rank still at its steps, perhaps the very one ``done`` waits for. The rounds received are applied with the
        next step, as a meeting's are; return the seconds left of ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self.carried += self.contribute(self._nothing, 0.0)
            time.sleep(STANDBY_PAUSE_S)
        return max(deadline - time.monotonic(), 0.0)

    def meet(self, model: nn.Module, carry: torch.Tensor | None = None) -> torch.Tensor | None:
        """Flush the rounds in flight and average the parameters equally; ``carry`` rides along, summed.

        After a step that ``reduce`` flushed (``meets``), no round is left in flight and the replicas hold the same
        gradients. At a meeting nobody foresaw (``DDP.synchronize()`` from the loop, an epoch the loop left early)
        each rank still carries the rounds it has not received, which others applied: the average holds each such
        round as far as the replicas that applied it, so every rank applies the rest, the mean over the ranks of
        what they carry, with its next step, and the replicas stay one model.
        """
        self.carried += self.flush()
        weight = 1.0 / self.world_size
        if self._flushed:
            self._flushed = False
            return average_parameters(model, weight, group=self.group, timeout_s=self.timeout_s, carry=carry)
        carried, self.carried = combine(self.carried, self._nothing).mul_(weight), []
        # The rounds carried ride in the gradient's own dtype and device, beside the merge: no float64 copy.
        figures = average_parameters(model, weight, group=self.group, timeout_s=self.timeout_s, carry=carry,
                                     alongside=carried)
        self._owed += carried
        return figures

    def close(self, on_round: Callable[[GradientRound], None] | None = None) -> list[GradientRound]:  # type: ignore[override]
        """Flush and stop the partial allreduce (idempotent; every rank calls it)."""
        if self._round_steps is not None:
            self._round_steps.close()
        return self._rounds(self.partial.close(self._forward(on_round)))

