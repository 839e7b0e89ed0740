"""Memory-sized shards of one unit's parameters: hetdp's own storage where FSDP2's even split (torch.chunk) cannot
follow the ranks' memories.

Each parameter of the unit is cut along dim 0 into whole rows per rank
(``hetdp.fsdp.rows``). This rank's rows of every parameter lie in one flat
segment; what the module, the optimizer, ``clip_grad_norm_`` and DCP see of each
parameter is a DTensor ``Shard(0)`` over its rows, with the global shape and
stride (``DTensor.from_local(..., run_check=False)``: torch's own placement,
whose pointwise and norm ops need no offsets). DCP learns the real offsets from
``hetdp.fsdp.chunks``.

For compute the unit is gathered whole: one ``all_to_all_single`` in which each
rank sends its segment to every rank and receives theirs, each at its own size
(gloo's all-gather needs equal sizes, and a padded one would move the largest
segment from every rank). Gradients go back to their owners the same way: each
rank sends every other its rows of the gradient, weighed by its part of the step
first (``hetdp.fsdp.comms``' rule), and each owner sums what it receives in rank
order. The unsharded parameters keep one storage each, freed (resized to 0)
between uses and refilled through a tensor of their own version counter, so that
autograd's saved references to them stay valid across a reshard and a regather.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hetdp.fsdp.chunks import register_parameter, show_state_dict_chunks
from hetdp.fsdp.rows import RowSplit, segment_offsets, segment_sizes

Start = Callable[[bool, "dist.ProcessGroup"], "dist.Work | None"]
"""Starts a collective: called with ``async_op`` and the group to run it over, returns its work (or None once done)."""
RunCollective = Callable[[Start, "dist.ProcessGroup", str, bool], None]
"""Runs a collective over a group to its end: ``run(start, group, what, reduces)`` (the drop-in's ``Exchange``: timed,
paced, bounded, perhaps over a group of its own with the same ranks)."""


def _show_rows(first_rows: dict[str, int], module: nn.Module, state_dict: dict, prefix: str,
               local_metadata: dict) -> None:
    show_state_dict_chunks(state_dict, {prefix + name: first for name, first in first_rows.items()})


def run_now(start: Start, group: dist.ProcessGroup, what: str, reduces: bool) -> None:
    """The collectives' runner outside the drop-in: start over ``group`` and wait, under the group's own timeout."""
    work = start(False, group)
    if work is not None:
        work.wait()


@dataclass
class RowShardedParameter:
    """One parameter of a unit, sharded in memory-sized rows."""

    owners: list[tuple[weakref.ref[nn.Module], str]]
    """Where the module holds it: (submodule, attribute name), one entry per place it is registered; held weakly, so
    that a module and its unit are freed together when the model goes, not left to the cyclic collector."""
    sharded: nn.Parameter
    """What the module shows between uses: a DTensor ``Shard(0)`` over this rank's rows, a view into the segment."""
    unsharded: nn.Parameter
    """The whole parameter the unit computes with (in ``param_dtype``); its storage is freed between uses."""
    split: RowSplit
    """Every rank's rows."""
    row_numel: int
    """Elements of one row."""
    writer: torch.Tensor
    """The unsharded storage, flat, seen through a tensor of its own version counter: refilling it through this one
    leaves the version autograd saved with the parameter unchanged."""

    @property
    def numel(self) -> int:
        return self.split.total * self.row_numel


class RowShardedUnit:
    """One unit's parameters in memory-sized rows: gathered whole for compute, freed after, their gradients reduced to
    the rows' owners (each a collective: every rank calls them in the same order).

    Args:
        parameters: the unit's own parameters (not those of a unit nested in it), each with where the module holds
            it; every rank builds it from the same parameters (the same seed), as torch's ``fully_shard`` does.
        splits: each parameter's rows per rank (``hetdp.fsdp.rows.split_rows``).
        mesh: the 1-D mesh of every rank.
        param_dtype: the dtype the unit computes in (None: the parameters').
        reduce_dtype: the dtype gradients are reduced in (None: ``param_dtype``).
    """

    def __init__(self, parameters: Sequence[tuple[list[tuple[nn.Module, str]], nn.Parameter]],
                 splits: Sequence[RowSplit], mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.mesh = mesh
        """The ranks' mesh; its group is looked up by name at each collective (DeviceMesh keeps names, not groups), so
        that nothing here keeps a destroyed process group alive until the interpreter's last collection."""
        group = mesh.get_group()
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.device = (torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda"
                       else torch.device(mesh.device_type))
        dtypes = {parameter.dtype for _, parameter in parameters}
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.param_dtype = param_dtype or self.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        row_numels = [math.prod(parameter.shape[1:]) for _, parameter in parameters]
        self.sizes = segment_sizes(splits, row_numels)
        """Elements of each rank's segment."""
        self._starts = [segment_offsets(splits, row_numels, rank) for rank in range(self.world_size)]
        """Where each parameter's rows start in each rank's segment."""
        self.segment = torch.empty(self.sizes[self.rank], dtype=self.dtype, device=self.device)
        """This rank's rows of every parameter, one after another: what the sharded parameters are views of."""
        self.parameters = [self._shard(owners, parameter, split, numel, self._starts[self.rank][index])
                           for index, ((owners, parameter), split, numel)
                           in enumerate(zip(parameters, splits, row_numels))]
        self.gathered = False
        """Whether the unsharded parameters hold the whole unit."""
        self.run: RunCollective = run_now
        self.show("sharded")
        self._show_dcp_real_rows()

    def _shard(self, owners: list[tuple[nn.Module, str]], whole: nn.Parameter, split: RowSplit, row_numel: int,
               start: int) -> RowShardedParameter:
        first, rows = split.offsets[self.rank], split.rows[self.rank]
        with torch.no_grad():
            local = self.segment[start : start + rows * row_numel].view(rows, *whole.shape[1:])
            local.copy_(whole.detach()[first : first + rows])
            sharded = nn.Parameter(DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                                      shape=whole.shape, stride=whole.stride()),
                                   requires_grad=whole.requires_grad)
        unsharded = nn.Parameter(torch.empty(whole.shape, dtype=self.param_dtype, device=self.device),
                                 requires_grad=whole.requires_grad)
        writer = torch.empty(0, dtype=self.param_dtype, device=self.device).set_(
            unsharded.untyped_storage(), 0, (whole.numel(),), (1,))
        unsharded.untyped_storage().resize_(0)
        register_parameter(sharded, first)
        return RowShardedParameter(owners=[(weakref.ref(module), name) for module, name in owners], sharded=sharded, unsharded=unsharded, split=split,
                                   row_numel=row_numel, writer=writer)

    def _show_dcp_real_rows(self) -> None:
        """Have each module that holds these parameters show DCP their real rows in every ``state_dict()`` it makes
        (``hetdp.fsdp.chunks``)."""
        first_rows: dict[int, tuple[nn.Module, dict[str, int]]] = {}
        for parameter in self.parameters:
            for owner, name in parameter.owners:
                module = owner()
                first_rows.setdefault(id(module), (module, {}))[1][name] = parameter.split.offsets[self.rank]
        for module, names in first_rows.values():
            module.register_state_dict_post_hook(functools.partial(_show_rows, names))

    # --- what the module holds -------------------------------------------------------------------------------

    def show(self, which: str) -> None:
        """Register the ``"sharded"`` or the ``"unsharded"`` parameters on the modules (the sharded ones at first)."""
        for parameter in self.parameters:
            for owner, name in parameter.owners:
                module = owner()
                if module is not None:
                    module._parameters[name] = getattr(parameter, which)

    def gather(self) -> None:
        """Fill the unsharded parameters with every rank's rows (collective; nothing where already gathered)."""
        if self.gathered or not self.parameters:
            return
        mine = self.segment if self.param_dtype == self.dtype else self.segment.to(self.param_dtype)
        received = torch.empty(sum(self.sizes), dtype=self.param_dtype, device=self.device)
        sent = mine.repeat(self.world_size)
        self.run(lambda async_op, group: dist.all_to_all_single(
            received, sent, output_split_sizes=self.sizes, input_split_sizes=[self.sizes[self.rank]] * self.world_size,
            group=group, async_op=async_op), self.mesh.get_group(), "the all-gather of memory-sized shards", False)
        segments = received.split(self.sizes)
        with torch.no_grad():
            for index, parameter in enumerate(self.parameters):
                parameter.unsharded.untyped_storage().resize_(parameter.numel * parameter.writer.element_size())
                rows = [segments[rank][self._starts[rank][index]:][: parameter.split.rows[rank] * parameter.row_numel]
                        for rank in range(self.world_size)]
                torch.cat(rows, out=parameter.writer)
        self.gathered = True

    def free(self) -> None:
        """Free the unsharded parameters' storage (their gradients stay)."""
        for parameter in self.parameters:
            parameter.unsharded.untyped_storage().resize_(0)
        self.gathered = False

    # --- gradients -------------------------------------------------------------------------------------------

    def reduce(self, weight: float) -> None:
        """Sum every rank's gradient of this rank's rows into the sharded parameters' gradients, each rank's weighed
        by ``weight`` (its part of the step; 0 zeroes it, so a NaN does not survive), and drop the unsharded ones
        (collective)."""
        if not self.parameters:
            return
        with torch.no_grad():
            wholes = [(parameter.unsharded.grad if parameter.unsharded.grad is not None
                       else torch.zeros(parameter.unsharded.shape, dtype=self.reduce_dtype, device=self.device))
                      .to(self.reduce_dtype).reshape(-1) for parameter in self.parameters]
            sent = torch.cat([whole[self._span(index, rank)] for rank in range(self.world_size)
                              for index, whole in enumerate(wholes)])
            for parameter in self.parameters:
                parameter.unsharded.grad = None
            del wholes
            if weight == 0.0:
                sent.zero_()
            elif weight != 1.0:
                sent.mul_(weight)
            mine = self.sizes[self.rank]
            received = torch.empty(self.world_size * mine, dtype=self.reduce_dtype, device=self.device)
            self.run(lambda async_op, group: dist.all_to_all_single(
                received, sent, output_split_sizes=[mine] * self.world_size, input_split_sizes=self.sizes,
                group=group, async_op=async_op), self.mesh.get_group(), "the reduce-scatter of memory-sized shards",
                True)
            summed = received.view(self.world_size, mine).sum(0).to(self.dtype)
            for index, parameter in enumerate(self.parameters):
                if not parameter.sharded.requires_grad:
                    continue
                start = self._starts[self.rank][index]
                rows = parameter.split.rows[self.rank]
                local = summed[start : start + rows * parameter.row_numel].view(rows, *parameter.sharded.shape[1:])
                if parameter.sharded.grad is None:
                    parameter.sharded.grad = DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                                                shape=parameter.sharded.shape,
                                                                stride=parameter.sharded.stride())
                else:
                    parameter.sharded.grad.to_local().add_(local)

    def _span(self, index: int, rank: int) -> slice:
        """Where ``rank``'s rows of parameter ``index`` lie in the flat whole parameter."""
        parameter = self.parameters[index]
        first = parameter.split.offsets[rank] * parameter.row_numel
        return slice(first, first + parameter.split.rows[rank] * parameter.row_numel)


def full_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` whole on every rank (collective): a ``Shard(0)`` DTensor over any rows per rank (memory-sized or
    torch's), where DTensor's own ``full_tensor()`` assumes torch.chunk's split; any other tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device_mesh.ndim != 1 or not tensor.placements[0].is_shard(0):
        return tensor.full_tensor()
    group = group or tensor.device_mesh.get_group()
    with torch.no_grad():
        local = tensor.to_local()
        rows = torch.tensor([local.shape[0]], device=local.device)
        every = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, rows, group=group)
        counts = [int(count) for count in every]
        padded = local.new_zeros((max(counts), *tensor.shape[1:]))
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        return torch.cat([part[:count] for part, count in zip(gathered, counts)])
