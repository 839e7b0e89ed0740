"""Ranks that sit out: the drop-in's side of the allocation's membership decision (``allocate.membership``).

A rank that sits out keeps running the user's loop, one stand-in batch per step
(no share), but leaves the step's gradient exchange: the members sum among
themselves (nothing when one rank is left). Its steps must cost the members
nothing: they share the machine's cores, the bus and the host with it. So its
forward runs the module on the stand-in without gradients, in eval mode, and skips
torch DDP's own forward (``StandIn``): its backward then computes nothing and
exchanges nothing. Its replica falls behind; it is brought current (parameters,
buffers and the state of the optimizers over them, from a member) before it
rejoins, at each epoch's end and before a checkpoint, so that whatever the loop
reads there is the model every member holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map

from hetdp.runtime import global_rank, peer_failures, wait_for
from hetdp.sync.averaging import ParameterAveraging
from hetdp.sync.gradient_sum import GradientSum, Route
from hetdp.train.loader import StepTicket
from hetdp.train.step import evaluating


class SitOut:
    """The members of every step, this rank's route through each step's exchange, and the catch-ups they need.

    Every rank schedules the same membership changes at the same steps (they come
    from gathered figures), so the subgroups and the catch-up broadcasts line up.

    .. warning::
        ``schedule`` and ``catch_up`` are called by every rank at the same points; ``catch_up`` is collective.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        everyone = tuple(range(self.world_size))
        self._schedule: list[tuple[int, tuple[int, ...]]] = [(0, everyone)]
        """(first step, members from it on), by step."""
        self.catch_up_at: int | None = None
        """The step before which a rank rejoins: the ranks catch up as the step before it ends."""
        self.apart = False
        """Whether some rank sat out a step since the ranks last caught up."""
        self._sending: list[tuple[torch.Tensor, dist.Work]] = []
        """The keeper's relayed replica, one message per dtype, with the sends in flight (``flush`` waits)."""
        self.exchanges: list[weakref.ref[GradientSum]] = []
        """The exchanges of the model and of those that follow it. A rank runs none while it sits out, so its count
        of rounds (which tags the point-to-point sends) is brought current with its replica."""

    def members_at(self, step: int) -> tuple[int, ...]:
        for first, members in reversed(self._schedule):
            if first <= step:
                return members
        return self._schedule[0][1]

    @property
    def members(self) -> tuple[int, ...]:
        """The members as last scheduled."""
        return self._schedule[-1][1]

    def schedule(self, first: int, members: Sequence[int]) -> None:
        """Take ``members`` from step ``first`` on."""
        members = tuple(sorted(members))
        if members == self.members:
            return
        before = self.members
        self._schedule.append((first, members))
        if set(members) - set(before):
            self.catch_up_at = first if self.catch_up_at is None else min(self.catch_up_at, first)

    def taking_part(self, step: int, holding: Sequence[int] = ()) -> tuple[int, ...]:
        """The ranks in the exchange of ``step``: its members, and ``holding``, the ranks that took part in an earlier
        step of an open accumulation window (gradients wait under ``no_sync`` for a synchronized backward). Each of
        those holds part of the window's sum, so it takes part until the window closes: a rank the schedule let go
        runs its stand-ins weighted 0 through the exchange and keeps its gradient. Had it left, the window's gradient
        would lack its earlier steps' samples."""
        return tuple(sorted({*self.members_at(step), *holding}))

    def route(self, members: tuple[int, ...]) -> Route:
        """Where this rank's gradient goes in a step whose exchange ``members`` take part in (``taking_part``): the
        whole group's route while everyone does."""
        if len(members) < self.world_size:
            self.apart = True
        if self.rank not in members:
            return Route(None, -1, 0)
        if len(members) == 1:
            return Route(None, 0, 1)
        return Route(self.group, members.index(self.rank), len(members), members)

    def due(self, steps_done: int) -> bool:
        """Whether a rank rejoins at step ``steps_done``, so that the ranks must catch up now."""
        return self.catch_up_at is not None and steps_done >= self.catch_up_at

    def catch_up(self, steps_done: int, modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                 *, state: bool = True) -> None:
        """Collective: give every rank the replica of the first member of the step just ended (``steps_done - 1``):
        parameters and buffers, and with ``state`` the optimizers' state and the exchanges' rounds too (a rank that
        rejoins steps with them). Without ``state`` (an epoch's end, where the loop may read the model on any rank)
        the replica is relayed rank to rank, the keeper's send left in flight: the keeper trains on at once."""
        keeper = self.members_at(max(steps_done - 1, 0))[0]
        tensors = [tensor.data for module in modules for tensor in (*module.parameters(), *module.buffers())]
        with peer_failures("bringing the ranks that sat out current", self.timeout_s, self.group):
            self.flush()
            if not state:
                members = self.members_at(max(steps_done - 1, 0))
                order = [*members, *(rank for rank in range(self.world_size) if rank not in members)]
                self._sending = _relay(tensors, order, self.rank, self.group, self.timeout_s)
                return
            _broadcast(tensors, global_rank(keeper, self.group), self.group)
            exchanges = [exchange for ref in self.exchanges if (exchange := ref()) is not None]
            optimizers = list(optimizers)
            held = [[exchange.rounds for exchange in exchanges], [_to_cpu(o.state_dict()) for o in optimizers]]
            dist.broadcast_object_list(held, global_rank(keeper, self.group), group=self.group)
            if self.rank != keeper:
                for exchange, rounds in zip(exchanges, held[0]):
                    exchange.rounds = rounds
                for optimizer, saved in zip(optimizers, held[1]):
                    optimizer.load_state_dict(saved)
        self.catch_up_at = None
        self.apart = False

    def flush(self) -> None:
        """Wait for the keeper's relayed replica to leave (before the next catch-up, and before the group closes)."""
        sending, self._sending = self._sending, []
        for _, work in sending:
            wait_for(work, "sending the model to the ranks that sat out", self.timeout_s, self.group)


RELAY_TAG = 2**30
"""The tag of a relayed replica's first message (one per dtype, tagged on from there): apart from the gradient
exchange's (steps x buckets), which a rank that sits out does not run."""


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    return list(by_dtype.values())


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    flat = flat.to(tensors[0].device)  # one copy to a GPU, not one per tensor
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def _flat(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors`` (of one dtype and device) as one flat tensor on ``device``: joined where they lie, then moved
    in one copy (one wait for a GPU, not one per tensor)."""
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors]).to(device)


def _message_device(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> torch.device:
    """Where a message of ``tensors`` travels from: the host under gloo (whose point-to-point sends and a group
    that mixes devices take host memory), else the tensors' device."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else tensors[0].device


def _broadcast(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` from ``src`` in place, as one message per dtype: a model of many small tensors would
    pay a collective's latency for each."""
    for alike in _by_dtype(tensors):
        flat = _flat(alike, _message_device(alike, group))
        dist.broadcast(flat, src, group=group)
        if dist.get_rank() != src:
            _unflatten(flat, alike)


def _relay(tensors: Sequence[torch.Tensor], order: Sequence[int], rank: int, group: dist.ProcessGroup,
           timeout_s: float) -> list[tuple[torch.Tensor, dist.Work]]:
    """Pass ``tensors`` along ``order`` (ranks of ``group``; the first holds them), one message per dtype, each rank
    sending on what it received; return the first rank's sends, still in flight (the others wait for theirs)."""
    place = order.index(rank)
    sending = []
    for tag, alike in enumerate(_by_dtype(tensors), start=RELAY_TAG):
        device = _message_device(alike, group)
        if place == 0:
            flat = _flat(alike, device)
        else:
            flat = torch.empty(sum(tensor.numel() for tensor in alike), dtype=alike[0].dtype, device=device)
            wait_for(group.recv([flat], order[place - 1], tag), "receiving the model", timeout_s, group)
        if place + 1 < len(order):
            sending.append((flat, group.send([flat], order[place + 1], tag)))
        if place > 0:
            _unflatten(flat, alike)
    if place == 0:
        return sending
    for _, work in sending:
        wait_for(work, "relaying the model", timeout_s, group)
    return []


class Optimizers:
    """The optimizers that step a module's parameters, found as the loop steps them (torch's global optimizer hooks):
    the drop-in does not own the loop's optimizer, and a rank that sat out needs its state too.

    While this rank is ``out`` of the step, an optimizer over those parameters finds no gradient (it skips them):
    the stand-in's gradient means nothing, and a step on it would cost the host as much as a member's and move
    the replica (momentum, weight decay) for nothing until its catch-up.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._modules = [weakref.ref(module) for module in modules]
        self._found: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._others: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        """Optimizers over none of the modules' parameters, each with its number of parameter groups then: the hook
        is global, and looking again at every step of another model's optimizer would cost that model's loop."""
        self.out = False
        """Whether this rank is out of the current step."""
        handles = [register_optimizer_step_pre_hook(_weakly(self, Optimizers._before_step)),
                   register_optimizer_step_post_hook(_weakly(self, Optimizers._stepped))]
        weakref.finalize(self, _remove, handles)

    def add(self, module: nn.Module) -> None:
        """Find the optimizers of ``module`` too (a model that follows this one's steps)."""
        self._modules.append(weakref.ref(module))
        self._others.clear()

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.out:
            return
        for ref in self._modules:
            if (module := ref()) is not None:
                for parameter in module.parameters():
                    parameter.grad = None

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._found or self._others.get(optimizer) == len(optimizer.param_groups):
            return
        order = {id(p): i for ref in self._modules if (module := ref()) is not None
                 for i, p in enumerate(module.parameters())}
        first = min((order[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in order),
                    default=None)
        if first is None:
            self._others[optimizer] = len(optimizer.param_groups)  # looked at again once it gains a group
        else:
            self._found[optimizer] = first
            self._others.pop(optimizer, None)

    def __iter__(self):  # type: ignore[no-untyped-def]
        """The optimizers found, in the order of their first parameter in the modules (the same on every rank)."""
        return iter(sorted(self._found.keys(), key=lambda optimizer: self._found[optimizer]))


def _weakly(optimizers: Optimizers, method: Any) -> Any:
    """A global optimizer hook calling ``method`` of ``optimizers`` while it lives (the hook must not keep it)."""
    ref = weakref.ref(optimizers)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is not None:
            method(owner, optimizer)

    return hook


def _remove(handles: Sequence[Any]) -> None:
    for handle in handles:
        handle.remove()


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it on the host: a rank on another device unpickles it (``load_state_dict``
    moves optimizer state to each parameter's device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


class StandIn:
    """The steps a rank sits out, run for next to nothing: what the loop asks of them, and no more.

    The stand-in's forward runs the module without gradients, in eval mode (no
    BatchNorm statistics from it) and outside torch DDP (no reducer, no buffer
    broadcast): nothing of the step leaves the rank. Its floating-point outputs are
    tied to one zero-valued anchor, so that the loop's loss still has a backward;
    that backward computes nothing but the anchor's gradient, and gives every
    parameter of the models a zero gradient, as a stand-in weighted 0 had (a
    ``GradScaler`` and the loop's clipping find gradients; ``Optimizers`` still
    skips the step).
    """

    def __init__(self) -> None:
        self._modules: list[weakref.ref[nn.Module]] = []
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._zeros: dict[int, torch.Tensor] = {}
        """A zero gradient per parameter (by ``id``), kept while the rank sits out: allocating one each step costs
        the host more than zeroing it."""

    def add(self, module: nn.Module) -> None:
        self._modules.append(weakref.ref(module))

    def forward(self, model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The output of ``model``'s module on a stand-in batch, with a backward that costs nothing."""
        if model.device_ids:  # torch DDP would have moved the inputs to the module's device
            device = torch.device(model.device_type, model.device_ids[0])
            inputs, kwargs = tree_map(lambda value: _moved(value, device), (inputs, kwargs))
        with torch.no_grad(), evaluating(model.module):
            output = model.module(*inputs, **kwargs)
        return tree_map(self._tied, output)

    def rejoined(self) -> None:
        """This rank takes part again: free the zero gradients."""
        self._zeros.clear()

    def _tied(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            return value
        anchor = self._anchors.get(value.device)
        if anchor is None:
            anchor = self._anchors[value.device] = torch.zeros((), device=value.device, requires_grad=True)
            anchor.register_hook(self._backward)
        return value + anchor

    def _backward(self, grad: torch.Tensor) -> None:
        for ref in self._modules:
            if (module := ref()) is None:
                continue
            for parameter in module.parameters():
                if not parameter.requires_grad:
                    continue
                if parameter.grad is None:
                    zeros = self._zeros.get(id(parameter))
                    if zeros is None or zeros.shape != parameter.shape:
                        zeros = self._zeros[id(parameter)] = torch.zeros_like(parameter)
                    parameter.grad = zeros.zero_()
                else:
                    parameter.grad.zero_()


def _moved(value: Any, device: torch.device) -> Any:
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


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

    def __init__(self, model: Any, module: nn.Module) -> None:
        self.optimizers = Optimizers([module])
        self._lone = Unexchanged(model._hook)

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


def seam(model: Any, synchronizer: Any, module: nn.Module, group: dist.ProcessGroup, timeout_s: float,
         leader: SitOutSeam | LocalSeam | None) -> SitOutSeam | LocalSeam | None:
    """The seam of ``model`` over ``module`` for its synchronization: ``SitOutSeam`` under allreduce
    (``GradientSum``), ``LocalSeam`` under local training, None under partial synchronization; ``leader``: the seam
    of the model it follows, if any."""
    if leader is not None and leader.optimizers is not None:
        leader.optimizers.add(module)
    if isinstance(synchronizer, ParameterAveraging):
        return LocalSeam(model, module)
    if not isinstance(synchronizer, GradientSum):
        return None
    if isinstance(leader, SitOutSeam):
        return SitOutSeam(model, leader.sitting, None, leader.stand_in)
    return SitOutSeam(model, SitOut(group, timeout_s), Optimizers([module]), StandIn())


class SitOutSeam:
    """A model's side of sitting out (``hetdp.DDP`` under allreduce): each step's gradient routed to the step's
    members, torch's forward broadcast of buffers off while some rank is out, the ranks that sat out brought current.

    The model that others follow owns the schedule (``SitOut``) and finds the optimizers (``Optimizers``); a model
    that follows it shares its schedule, and its catch-ups are the leader's.
    """

    def __init__(self, model: Any, sitting: SitOut, optimizers: Optimizers | None, stand_in: StandIn) -> None:
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
        self._lone = Unexchanged(model._hook)
        self._holding: tuple[int, ...] = ()
        """The ranks that take part in the open step (``route``): in the next one too if it closes a window."""
        self._syncs_buffers = _buffer_sync(model, None)
        stand_in.add(model.module)
        sitting.exchanges.append(weakref.ref(model.synchronizer))

    def route(self, model: Any, ticket: StepTicket) -> None:
        """Send the step's gradient to its members only; while some rank sits out, torch's forward broadcast of
        rank 0's buffers is off (rank 0 may be out): the members' buffers meet at the next catch-up."""
        accumulation = model._steps.accumulation
        # Every rank runs the same loop, so the ranks agree on the window and on who holds part of it.
        holding = self._holding if accumulation is not None and accumulation.waiting else ()
        self._holding = self.sitting.taking_part(ticket.step, holding)
        route = self.sitting.route(self._holding)
        everyone = route.world_size == model.world_size
        if route.group is not None:  # a follower exchanges over its own group
            route = Route(model._group, route.rank, route.world_size, None if everyone else route.peers)
        model.synchronizer.route = route
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
        accumulation = model._steps.accumulation
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
