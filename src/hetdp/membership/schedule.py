"""Ranks that sit out: the drop-in's side of the allocation's membership decision (``allocate.membership``).

A rank that sits out keeps running the user's loop, one stand-in batch per step
(no share), but leaves the step's gradient exchange: the members sum among
themselves (nothing when one rank is left). Its steps must cost the members
nothing: they share the machine's cores, the bus and the host with it. So its
forward runs the module on the stand-in without gradients, in the module's own mode
with nothing that persists changed, and skips torch DDP's own forward (``StandIn``):
its backward then computes nothing and exchanges nothing. A module with a
``SyncBatchNorm`` never sits out: that layer meets every rank in every forward and
backward (``hetdp.ddp.seams``). Its replica falls behind; it is brought current (parameters,
buffers and the state of the optimizers over them, from a member) before it
rejoins, at each epoch's end and before a checkpoint, so that whatever the loop
reads there is the model every member holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hetdp.collectives.flat import broadcast_in_place, relay
from hetdp.membership.optimizers import to_cpu
from hetdp.runtime import global_rank, peer_failures, wait_for
from hetdp.sync.gradient_sum import GradientSum, Route


class SitOut:
    """The members of every step, this rank's route through each step's exchange, and the catch-ups they need.

    Every rank schedules the same membership changes at the same steps (they come
    from gathered figures), so the subgroups and the catch-up broadcasts line up.

    Warning:
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
                self._sending = relay(tensors, order, self.rank, self.group, self.timeout_s)
                return
            broadcast_in_place(tensors, global_rank(keeper, self.group), self.group)
            exchanges = [exchange for ref in self.exchanges if (exchange := ref()) is not None]
            optimizers = list(optimizers)
            held = [[exchange.rounds for exchange in exchanges], [to_cpu(o.state_dict()) for o in optimizers]]
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
