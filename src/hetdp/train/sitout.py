"""Ranks that sit out: the drop-in's side of the allocation's membership decision (``allocate.membership``).

A rank that sits out keeps running the user's loop in step with the others, on
stand-in batches (no share), but leaves the step's gradient exchange: the members
sum among themselves (nothing when one rank is left). Its replica
then falls behind; it is brought current (parameters, buffers and the state of the
optimizers over them, broadcast from a member) before it rejoins, at each epoch's
end and before a checkpoint, so that whatever the loop reads there is the model
every member holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from hetdp.runtime import global_rank, peer_failures
from hetdp.sync.gradient_sum import GradientSum, Route


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

    def route(self, step: int) -> Route:
        """Where this rank's gradient goes in ``step`` (the whole group's route while everyone takes part)."""
        members = self.members_at(step)
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
        parameters and buffers, and with ``state`` the optimizers' state too (a rank that rejoins steps with it; at
        an epoch's end, what the loop reads is the model)."""
        keeper = global_rank(self.members_at(max(steps_done - 1, 0))[0], self.group)
        with peer_failures("bringing the ranks that sat out current", self.timeout_s, self.group):
            for module in modules:
                for tensor in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(tensor.data, keeper, group=self.group)
            if not state:
                return
            for optimizer in optimizers:
                held = [_to_cpu(optimizer.state_dict())]
                dist.broadcast_object_list(held, keeper, group=self.group)
                if dist.get_rank() != keeper:
                    optimizer.load_state_dict(held[0])
        self.catch_up_at = None
        self.apart = False


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
        self.out = False
        """Whether this rank is out of the current step."""
        handles = [register_optimizer_step_pre_hook(_weakly(self, Optimizers._before_step)),
                   register_optimizer_step_post_hook(_weakly(self, Optimizers._stepped))]
        weakref.finalize(self, _remove, handles)

    def add(self, module: nn.Module) -> None:
        """Find the optimizers of ``module`` too (a model that follows this one's steps)."""
        self._modules.append(weakref.ref(module))

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.out:
            return
        for ref in self._modules:
            if (module := ref()) is not None:
                for parameter in module.parameters():
                    parameter.grad = None

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._found:
            return
        order = {id(p): i for ref in self._modules if (module := ref()) is not None
                 for i, p in enumerate(module.parameters())}
        first = min((order[id(p)] for group in optimizer.param_groups for p in group["params"] if id(p) in order),
                    default=None)
        if first is not None:
            self._found[optimizer] = first

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


class SitOutSeam:
    """A model's side of sitting out (``hetdp.DDP`` under allreduce): each step's gradient routed to the step's
    members, torch's forward broadcast of buffers off while some rank is out, the ranks that sat out brought current.

    The model that others follow owns the schedule (``SitOut``) and finds the optimizers (``Optimizers``); a model
    that follows it shares its schedule, and its catch-ups are the leader's.
    """

    def __init__(self, model: Any, sitting: SitOut, optimizers: Optimizers | None) -> None:
        self.sitting = sitting
        self.optimizers = optimizers
        """None on a model that follows another."""
        self._syncs_buffers = _buffer_sync(model, None)

    @classmethod
    def of(cls, model: Any, synchronizer: Any, module: nn.Module, group: dist.ProcessGroup, timeout_s: float,
           leader: SitOutSeam | None) -> SitOutSeam | None:
        """The seam of ``model`` over ``module``, None unless its synchronization is allreduce (``GradientSum``);
        ``leader``: the seam of the model it follows, if any."""
        if leader is not None and leader.optimizers is not None:
            leader.optimizers.add(module)
        if not isinstance(synchronizer, GradientSum):
            return None
        if leader is not None:
            return cls(model, leader.sitting, None)
        return cls(model, SitOut(group, timeout_s), Optimizers([module]))

    def route(self, model: Any, step: int) -> None:
        """Send the step's gradient to its members only; while some rank sits out, torch's forward broadcast of
        rank 0's buffers is off (rank 0 may be out): the members' buffers meet at the next catch-up."""
        route = self.sitting.route(step)
        everyone = route.world_size == model.world_size
        if route.group is not None:  # a follower exchanges over its own group
            route = Route(model._group, route.rank, route.world_size, None if everyone else route.peers)
        model.synchronizer.route = route
        _buffer_sync(model, self._syncs_buffers and everyone)
        if self.optimizers is not None:
            self.optimizers.out = route.world_size == 0

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
