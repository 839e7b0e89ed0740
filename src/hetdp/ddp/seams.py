"""What a step's forward runs instead of torch DDP's where nothing of it is exchanged: the stand-in of a rank that sits
out, the lone member's forward, and every forward of local training; and each step's route through the exchange
(``SitOutSeam``, the drop-in's side of ``hetdp.membership``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from hetdp.data.steps import StepTicket
from hetdp.ddp.hook import HookState
from hetdp.ddp.step import StepRunner
from hetdp.membership.optimizers import Optimizers
from hetdp.membership.schedule import SitOut
from hetdp.membership.standin import StandIn, synchronizes_batches
from hetdp.sync.averaging import ParameterAveraging
from hetdp.sync.base import Synchronizer
from hetdp.sync.gradient_sum import GradientSum, Route


class Unexchanged:
    """Forwards whose gradient no other rank needs, run as under torch's ``no_sync``: autograd leaves the gradient
    in ``.grad`` rather than the reducer copying it through its buckets and back, and the reducer never records the
    order of its first backward, so no bucket rebuild (a collective) ever waits for the slowest rank. The end of
    each backward through the output marks the step's compute done, as the last bucket would."""

    def __init__(self, hook: Any) -> None:
        self._hook = hook
        self._queued = False
        """Whether the end of the running backward is awaited (``_backward_ended``)."""

    def forward(self, model: Any, ddp_forward: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        model.require_backward_grad_sync = False
        try:
            output = ddp_forward(*inputs, **kwargs)
        finally:
            model.require_backward_grad_sync = True
        tree_map(self._watch, output)
        return output

    def _watch(self, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._queued = False
        hook = self._hook
        hook.reached = True
        hook.clock.mark_ready(last_bucket=True, alone=hook.local and not hook.meets)
        hook.clock.mark_synced()


class LocalSeam:
    """A model's side of local training (``"local"``, ``"local:K"``): no step's gradient leaves its rank, so every
    forward is ``Unexchanged``, and a stand-in step (no sample of this rank) moves nothing (``Optimizers``). The
    replicas meet in the planner's meetings, not here."""

    sitting = None
    """No rank ever sits out of an exchange that does not happen."""

    def __init__(self, parts: SeamParts, module: nn.Module) -> None:
        self.optimizers = Optimizers([module])
        self._lone = Unexchanged(parts.hook)

    def route(self, model: Any, ticket: StepTicket) -> None:
        self.optimizers.out = ticket.samples == 0

    def shortcut(self, model: Any) -> bool:
        """Every forward that would synchronize, on every rank, also the one that ends an accumulation under
        ``no_sync`` (its gradient stays local all the same): no reducer ever records a backward, so none rebuilds
        its buckets, a collective the others would not join."""
        return model.require_backward_grad_sync

    def forward(self, model: Any, ddp_forward: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._lone.forward(model, ddp_forward, inputs, kwargs)

    def catch_up(self, steps_done: int, modules: Sequence[nn.Module], force: bool = False, state: bool = True) -> None:
        """Nothing to bring current: every rank trained every step."""


@dataclass(frozen=True)
class SeamParts:
    """What a seam works with of its model, besides torch DDP's own fields: the comm hook's state, the steps, the
    synchronization and the group it runs over."""

    hook: HookState
    steps: StepRunner
    synchronizer: Synchronizer
    group: dist.ProcessGroup
    world_size: int


def seam(model: Any, parts: SeamParts, module: nn.Module, timeout_s: float,
         leader: SitOutSeam | LocalSeam | None) -> SitOutSeam | LocalSeam | None:
    """The seam of ``model`` (a torch DDP) over ``module`` for its synchronization: ``SitOutSeam`` under allreduce
    (``GradientSum``), ``LocalSeam`` under local training, None under partial synchronization and for a module with
    a ``SyncBatchNorm``; ``leader``: the seam of the model it follows, if any.

    A ``SyncBatchNorm`` all-gathers every rank's statistics in each forward and all-reduces its gradient's sums in
    each backward, over all ranks: a rank cannot leave its steps, so none sits out, and a share of 0 runs a
    stand-in in the exchange, weighted 0, that joins the layer's collectives with no sample (``kept_state``).
    """
    if leader is not None and leader.optimizers is not None:
        leader.optimizers.add(module)
    if isinstance(parts.synchronizer, ParameterAveraging):
        return LocalSeam(parts, module)
    if not isinstance(parts.synchronizer, GradientSum):
        return None
    if synchronizes_batches(module):  # a follower's is refused beside a leader whose ranks may sit out
        return None
    if isinstance(leader, SitOutSeam):
        return SitOutSeam(model, parts, leader.sitting, None, leader.stand_in)
    return SitOutSeam(model, parts, SitOut(parts.group, timeout_s), Optimizers([module]), StandIn())


class SitOutSeam:
    """A model's side of sitting out (``hetdp.DDP`` under allreduce): each step's gradient routed to the step's
    members, torch's forward broadcast of buffers off while some rank is out, the ranks that sat out brought current.

    The model that others follow owns the schedule (``SitOut``) and finds the optimizers (``Optimizers``); a model
    that follows it shares its schedule, and its catch-ups are the leader's.
    """

    def __init__(self, model: Any, parts: SeamParts, sitting: SitOut, optimizers: Optimizers | None,
                 stand_in: StandIn) -> None:
        self.parts = parts
        self.sitting = sitting
        self.optimizers = optimizers
        """None on a model that follows another."""
        self.stand_in = stand_in
        """The leader's, shared: one backward through any of the models' stand-in outputs zeroes all their
        gradients."""
        self.out = False
        """Whether this rank sits out the open step: its forwards run ``stand_in``."""
        self.alone = False
        """Whether this rank is the open step's only member (the others sit out, or it runs alone): it has nothing to
        exchange, so its gradient need not pass through torch DDP's buckets."""
        self._lone = Unexchanged(parts.hook)
        self._holding: tuple[int, ...] = ()
        """The ranks that take part in the open step (``route``): in the next one too if it closes a window."""
        self._syncs_buffers = _buffer_sync(model, None)
        stand_in.add(model.module)
        sitting.exchanges.append(weakref.ref(parts.synchronizer))

    def route(self, model: Any, ticket: StepTicket) -> None:
        """Send the step's gradient to its members only; while some rank sits out, torch's forward broadcast of
        rank 0's buffers is off (rank 0 may be out): the members' buffers meet at the next catch-up."""
        accumulation = self.parts.steps.accumulation
        # Every rank runs the same loop, so the ranks agree on the window and on who holds part of it.
        holding = self._holding if accumulation is not None and accumulation.waiting else ()
        self._holding = self.sitting.taking_part(ticket.step, holding)
        route = self.sitting.route(self._holding)
        everyone = route.world_size == self.parts.world_size
        if route.group is not None:  # a follower exchanges over its own group
            route = Route(self.parts.group, route.rank, route.world_size, None if everyone else route.peers)
        self.parts.synchronizer.route = route  # type: ignore[attr-defined]
        _buffer_sync(model, self._syncs_buffers and everyone)
        if self.out and route.world_size:
            self.stand_in.rejoined()
        self.out = route.world_size == 0
        self.alone = route.world_size == 1
        if self.optimizers is not None:
            self.optimizers.out = self.out

    def shortcut(self, model: Any) -> bool:
        """Whether this rank's forwards in the open step bypass torch DDP's reducer: it sits the step out, or it is
        the step's only member and the loop accumulates nothing under ``no_sync`` (nothing to weigh or exchange).
        Not before torch DDP rebuilt its buckets: the rebuild is a collective joined by the ranks whose reducer
        recorded a backward, so every rank must record the same first one (a run resumed with a rank out would
        otherwise leave the members alone in it)."""
        if not model._has_rebuilt_buckets:
            return False
        if self.out:
            return True
        accumulation = self.parts.steps.accumulation
        return self.alone and model.require_backward_grad_sync and (accumulation is None or not accumulation.waiting)

    def forward(self, model: Any, ddp_forward: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A forward that ``shortcut`` allows: a stand-in's, or the lone member's (``Unexchanged``): its gradient is
        the mean over the whole step's samples already."""
        if self.out:
            return self.stand_in.forward(model, inputs, kwargs)
        return self._lone.forward(model, ddp_forward, inputs, kwargs)

    def catch_up(self, steps_done: int, modules: Sequence[nn.Module], force: bool = False, state: bool = True) -> None:
        """Bring the ranks that sat out current where one rejoins, or, with ``force``, wherever some rank sat out
        since the last full catch-up (``state``: the optimizers' state too, else only the model): collective, on the
        model that the others follow (``modules``: its own and its followers')."""
        if self.optimizers is None:
            return
        if self.sitting.due(steps_done):
            self.sitting.catch_up(steps_done, modules, self.optimizers)
        elif force and self.sitting.apart:
            self.sitting.catch_up(steps_done, modules, self.optimizers, state=state)


def _buffer_sync(model: Any, on: bool | None) -> bool:
    """Turn torch DDP's forward broadcast of buffers on or off (None: leave it); return the setting before."""
    name = "forward_sync_buffers" if hasattr(model, "forward_sync_buffers") else "broadcast_buffers"
    before = bool(getattr(model, name))
    if on is not None:
        setattr(model, name, on)
    return before
