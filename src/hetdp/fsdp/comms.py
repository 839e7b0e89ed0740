"""The sharded drop-in's side of FSDP2's collectives: every reduce-scatter weighs this rank's gradient by its share of
the step, and every collective is timed and paced on the step's clock.

FSDP2 has one gradient divide factor per unit, the same on every rank, so its
reduce-scatter can only average the ranks. Here each unit reduce-scatters with a
plain SUM (``set_force_sum_reduction_for_comms`` and a divide factor of 1) of
gradients each rank has weighed by ``samples / total`` of the step first: the sum is
exactly the mean over the step's samples, whatever the shares (the comm hook's
rule in ``hetdp.DDP``). A stand-in's gradient is zeroed, not multiplied by 0
(0 x NaN stays NaN).

Gradients that wait across backwards (``set_requires_gradient_sync(False)``) reach
the reduce-scatter as one sum, which one weight cannot split by step: while they
wait, a hook on each unsharded parameter weighs every backward by its own step's
weight as it runs, and the reduce-scatter that ends the window sums with weight 1
(as ``hetdp.ddp.accumulation`` does for DDP's ``no_sync``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hetdp.figures.shardclock import ShardedClock
from hetdp.runtime import wait_for


class Weighing:
    """What this rank's gradient weighs in the backward that runs: its part of the open step, or while gradients wait
    across backwards, 1 in the reduce-scatter and the step's own in the parameters' hooks (``UnshardedHooks``)."""

    def __init__(self, world_size: int) -> None:
        self.outside = 1.0 / world_size
        """Outside any step: FSDP2's own mean over the ranks, so that a training forward outside a step (a warm-up,
        a loop that left the allocated loader) trains as under plain ``fully_shard``."""
        self.step = self.outside
        """The open step's weight of this rank: its samples over the step's (0 for a stand-in)."""
        self.syncing = True
        """Whether the model's gradients reduce in the next backward (``set_requires_gradient_sync``)."""
        self.waiting = False
        """Whether gradients of an earlier backward wait, unreduced, for the next one that reduces."""

    @property
    def in_hooks(self) -> bool:
        """Whether the parameters' hooks weigh the running backward (the reduce-scatter then sums with weight 1)."""
        return self.waiting or not self.syncing

    def reduce_weight(self) -> float:
        return 1.0 if self.in_hooks else self.step

    def backward_ended(self) -> None:
        self.waiting = not self.syncing

    def scale(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A parameter hook: the gradient of one backward, weighed by its step while gradients wait."""
        if not self.in_hooks or self.step == 1.0:
            return None
        return torch.zeros_like(grad) if self.step == 0.0 else grad * self.step


class UnshardedHooks:
    """The hooks that weigh each backward while gradients wait, on the unsharded parameters FSDP2 computes with.

    FSDP2 swaps each unit's unsharded parameters into its modules during the unit's forward and keeps the same
    parameter objects from one step to the next: a forward pre-hook on every unit (after FSDP2's own) notes them at
    the first forward. The hooks go on once a loop first lets gradients wait, so a loop that never does pays nothing.
    """

    def __init__(self, units: Sequence[nn.Module], weighing: Weighing) -> None:
        self.weighing = weighing
        self.parameters: dict[int, nn.Parameter] = {}
        self.hooking = False
        self._noting = {id(unit): unit.register_forward_pre_hook(self._note) for unit in units}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _note(self, unit: nn.Module, args: object) -> None:
        for module in unit.modules():
            for parameter in module._parameters.values():  # the unsharded ones while the unit's forward runs
                if (parameter is not None and parameter.requires_grad and not isinstance(parameter, DTensor)
                        and id(parameter) not in self.parameters):
                    self.parameters[id(parameter)] = parameter
                    if self.hooking:
                        self._handles.append(parameter.register_hook(self.weighing.scale))
        self._noting.pop(id(unit)).remove()

    def start(self) -> None:
        """Weigh every backward in the parameters' hooks from now on, where ``Weighing.in_hooks`` says."""
        if not self.hooking:
            self.hooking = True
            self._handles = [parameter.register_hook(self.weighing.scale) for parameter in self.parameters.values()]

    def close(self) -> None:
        for handle in [*self._noting.values(), *self._handles]:
            handle.remove()
        self._noting, self._handles = {}, []


class Exchange:
    """What every unit's collectives share: the step's clock, and the deadline a collective waits for its peers.

    Over gloo each collective waits at most ``timeout_s`` (a dead or hung peer ends in a ``PeerTimeoutError`` that
    the heartbeats of ``group`` name), where FSDP2 alone would wait the default group's timeout; NCCL's collectives
    stay asynchronous (a bounded wait would block the host), their deadline the group's and its watchdog's.

    Over gloo a collective FSDP2 asks of its mesh's group also runs over ``group``, the drop-in's, where the two hold
    the same ranks in the same order: gloo's own deadline is then ``timeout_s`` too. Over the mesh's group (the default
    group, whose deadline is the connection's) a collective whose wait ran out would go on on that group's thread,
    and a survivor's exit, which joins the thread as it ends the group, would wait for it: a named failure, then a
    launch that does not end.
    """

    def __init__(self, clock: ShardedClock, *, group: dist.ProcessGroup, timeout_s: float, bounded: bool) -> None:
        self.clock = clock
        self.group: dist.ProcessGroup | None = group
        """The drop-in's group; None once it released it (FSDP2's collectives then run over the mesh's group)."""
        self.timeout_s = timeout_s
        self.bounded = bounded
        self._ranks = dist.get_process_group_ranks(group)
        self._same: dict[str, bool] = {}
        """By group name: whether a group FSDP2 runs over holds ``group``'s ranks in its order."""

    def run(self, start: Callable[[bool, dist.ProcessGroup], dist.Work | None], group: dist.ProcessGroup,
            async_op: bool, what: str, *, reduces: bool) -> dist.Work | None:
        """Run a collective over ``group`` (``start(async_op, group)``, perhaps over the drop-in's group instead),
        paced and timed on the clock."""
        if async_op or not self.bounded:
            return self.clock.collective(lambda: start(async_op, group), reduces=reduces)
        over = self.group if self.group is not None and self._holds_ranks_of(group) else group

        def bounded() -> None:
            work = start(True, over)
            if work is not None:
                wait_for(work, what, self.timeout_s, self.group)

        return self.clock.collective(bounded, reduces=reduces)

    def release(self) -> None:
        """The drop-in closed and released its group: FSDP2's collectives run over their own group from now on."""
        self.group = None

    def _holds_ranks_of(self, group: dist.ProcessGroup) -> bool:
        name = group.group_name
        if name not in self._same:
            self._same[name] = dist.get_process_group_ranks(group) == self._ranks
        return self._same[name]


class TimedAllGather:
    """FSDP2's all-gather (the ``AllGather`` interface of ``torch.distributed.fsdp``'s ``set_custom_all_gather``,
    duck-typed: torch defines it in a private module), timed, paced and bounded by the ``Exchange``."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return self.exchange.run(lambda asynchronous, over: dist.all_gather_single(
            output_tensor, input_tensor, group=over, async_op=asynchronous), group, async_op, "FSDP2's all-gather",
            reduces=False)


class WeighedReduceScatter(TimedAllGather):
    """FSDP2's reduce-scatter (``set_custom_reduce_scatter``): this rank's gradient weighed by its part of the step,
    then summed over the ranks; timed, paced and bounded."""

    def __init__(self, exchange: Exchange, weighing: Weighing) -> None:
        super().__init__(exchange)
        self.weighing = weighing

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,  # type: ignore[override]
                 group: dist.ProcessGroup, op: object = None, async_op: bool = False) -> dist.Work | None:
        weight = self.weighing.reduce_weight()
        if weight == 0.0:
            input_tensor.zero_()
        elif weight != 1.0:
            input_tensor.mul_(weight)
        return self.exchange.run(lambda asynchronous, over: dist.reduce_scatter_single(
            output_tensor, input_tensor, group=over, op=dist.ReduceOp.SUM, async_op=asynchronous), group, async_op,
            "FSDP2's reduce-scatter", reduces=True)
