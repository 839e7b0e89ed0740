"""Memory-sized sharding of a module, run as FSDP2 runs its units: ``shard_rows`` is ``fully_shard`` for ranks whose
memories differ, and ``UnevenModule`` the part of ``FSDPModule``'s surface it keeps.

A unit's parameters live in ``hetdp.fsdp.rowshard`` (its rows of each, as DTensors).
Hooks on the module run the life cycle FSDP2 runs: before its forward the unit is
gathered and the whole parameters registered on the module; after it they are
freed again (``reshard_after_forward``: by default for every unit but the
outermost); an output's gradient regathers them for the backward; once the
gradient reaches the unit's inputs (or the backward ends, for a unit whose inputs
need none) every rank's gradient is reduced to the rows' owners, weighed by its
part of the step, and the unit is freed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from hetdp.errors import ConfigError
from hetdp.fsdp.budgets import MemoryBudget, check_room
from hetdp.fsdp.memory import OPTIMIZER_COPIES
from hetdp.fsdp.rows import split_rows
from hetdp.fsdp.rowshard import RowShardedUnit, RunCollective, run_now

REFUSED: dict[str, str] = {
    "set_modules_to_forward_prefetch": "each unit is gathered when its forward starts, none ahead",
    "set_modules_to_backward_prefetch": "each unit is gathered when its backward starts, none ahead",
    "set_custom_all_gather": "hetdp gathers memory-sized shards with its own exchange",
    "set_custom_reduce_scatter": "hetdp reduces memory-sized shards with its own exchange",
    "set_all_reduce_hook": "there is no HSDP all-reduce: the shards span every rank",
    "set_requires_all_reduce": "there is no HSDP all-reduce: the shards span every rank",
    "set_post_optim_event": "the exchange waits for the optimizer's step on the host",
    "set_is_last_backward": "every backward reduces its gradients as it ends",
    "set_unshard_in_backward": "a unit is always regathered for its backward when its forward freed it",
    "set_reduce_scatter_divide_factor": "each rank's gradient is weighed by its part of the step",
    "set_gradient_divide_factor": "each rank's gradient is weighed by its part of the step",
    "set_force_sum_reduction_for_comms": "the exchange always sums gradients weighed by their part of the step",
}
"""FSDP2 methods with no meaning on memory-sized shards, and why: each is one ConfigError."""


@dataclass
class _Backward:
    """What one unit did in the iteration under way."""

    forwarded: bool = False
    """A forward with gradients ran: a backward may follow."""
    started: bool = False
    """Its backward began (an output's gradient arrived): it is gathered for it."""
    done: bool = False
    """Its gradients were reduced (or, with the reduction off, kept) and it was freed."""


@dataclass
class UnitGroup:
    """The units under one outermost unit, in the order they were sharded (the same on every rank): the order in
    which the end of a backward reduces those whose inputs took no gradient."""

    units: list[UnitState] = field(default_factory=list)
    queued: bool = False
    """Whether the end-of-backward callback is queued for the backward under way."""

    def begin_iteration(self) -> None:
        for unit in self.units:
            unit.backward = _Backward()

    def queue_end(self) -> None:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self.queued = False
        for unit in self.units:
            if unit.backward.forwarded and not unit.backward.done:
                unit.post_backward()
        self.begin_iteration()


class UnitState:
    """One memory-sized unit's storage, settings and place in the iteration."""

    def __init__(self, storage: RowShardedUnit, *, reshard_after_forward: bool | None,
                 policy: MixedPrecisionPolicy) -> None:
        self.storage = storage
        self.reshard_after_forward = reshard_after_forward
        """As ``fully_shard`` takes it: None frees every unit but the outermost after forward."""
        self.reshard_after_backward = True
        """Whether a unit is freed after its backward (``set_reshard_after_backward``)."""
        self.policy = policy
        self.syncing = True
        """Whether a backward reduces the gradients (``set_requires_gradient_sync``)."""
        self.outermost = True
        """No unit holds this one (FSDP2's root): by default it stays gathered from its forward to its backward."""
        self.group = UnitGroup([self])
        self.backward = _Backward()
        self.weight: Callable[[], float] = functools.partial(float, 1.0 / storage.world_size)
        """This rank's weight in the reduction: FSDP2's mean over the ranks until the drop-in weighs the steps."""

    def use(self, run: RunCollective, weight: Callable[[], float]) -> None:
        """Run the collectives through ``run`` and weigh each rank's gradient by ``weight()`` (the drop-in's)."""
        self.storage.run, self.weight = run, weight

    def release(self) -> None:
        """Back to plain collectives and FSDP2's mean (the drop-in closed)."""
        self.use(run_now, functools.partial(float, 1.0 / self.storage.world_size))

    @property
    def frees_after_forward(self) -> bool:
        return self.reshard_after_forward is True or (self.reshard_after_forward is None and not self.outermost)

    def gather(self) -> None:
        self.storage.gather()
        self.storage.show("unsharded")

    def free(self) -> None:
        self.storage.show("sharded")
        self.storage.free()

    def post_backward(self) -> None:
        """Reduce (or, with the reduction off, keep) this unit's gradients and free it (collective)."""
        if self.backward.done:
            return
        self.backward.done = True
        if self.syncing:
            self.storage.reduce(self.weight())
        if self.reshard_after_backward:
            self.free()

    # --- hooks ------------------------------------------------------------------------------------------------

    # The hooks run eagerly under torch.compile (a graph break at each unit): they free and refill the parameters'
    # storage, which a traced graph would take for fixed.
    @torch.compiler.disable
    def pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.backward.started and not self.backward.done:  # recomputed inside its backward (checkpointing)
            self.gather()
            return self._cast_inputs(args, kwargs)
        if self.outermost and torch.is_grad_enabled():
            self.group.begin_iteration()
        self.gather()
        if torch.is_grad_enabled():
            self.backward.forwarded = True
            args, kwargs = _after_inputs_grad(self, args, kwargs)
        return self._cast_inputs(args, kwargs)

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if self.backward.started and not self.backward.done:
            return None
        if not torch.is_grad_enabled() or self.frees_after_forward:
            self.free()
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward)
        if self.policy.output_dtype is not None:
            return _map_tensors(output, lambda tensor: tensor.to(self.policy.output_dtype)
                                if tensor.is_floating_point() else tensor)
        return None

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if not self.backward.started:
            self.backward.started = True
            self.group.queue_end()
            self.gather()

    def _cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.policy.param_dtype
        if dtype is None or not self.policy.cast_forward_inputs:
            return args, kwargs
        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(dtype) if tensor.is_floating_point() else tensor
        return _map_tensors(args, cast), _map_tensors(kwargs, cast)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the gradient reached them: the unit's own backward is
    then done, and its gradients reduce (FSDP2's rule, with a public ``autograd.Function``)."""

    @staticmethod
    def forward(ctx: Any, unit: UnitState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.unit.post_backward()
        return (None, *grads)


def _after_inputs_grad(unit: UnitState, args: tuple[Any, ...], kwargs: dict[str, Any]
                       ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    needing = [tensor for tensor in _tensors((args, kwargs)) if tensor.requires_grad]
    if not needing:
        return args, kwargs
    passed = dict(zip(map(id, needing), _PostBackward.apply(unit, *needing)))
    def swap(tensor: torch.Tensor) -> torch.Tensor:
        return passed.get(id(tensor), tensor)
    return _map_tensors(args, swap), _map_tensors(kwargs, swap)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(_map_tensors(item, fn) for item in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(item, fn) for item in tree)
    if isinstance(tree, dict):
        return {key: _map_tensors(value, fn) for key, value in tree.items()}
    return tree


class UnevenModule:
    """What memory-sized sharding adds to a module: the part of torch's ``FSDPModule`` that maps onto it.

    ``unshard``, ``reshard``, ``set_requires_gradient_sync``, ``set_reshard_after_forward`` and
    ``set_reshard_after_backward`` behave as FSDP2's; the methods in ``REFUSED`` raise one ConfigError each.
    """

    _uneven: UnitState

    def unshard(self, async_op: bool = False) -> _Done | None:
        """Gather this unit's parameters whole and register them on the module (collective; not recursive). With
        ``async_op`` the gather has completed when the returned handle is made."""
        self._uneven.gather()
        return _Done() if async_op else None

    def reshard(self) -> None:
        """Register the sharded parameters again and free the whole ones (not recursive)."""
        self._uneven.free()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backwards reduce the gradients (False: they wait, summed, for a backward that does)."""
        for unit in _units(self, recurse):
            unit.syncing = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether units are freed after their forward (and regathered for their backward), the outermost too."""
        if not isinstance(reshard_after_forward, bool):
            raise ConfigError(f"reshard_after_forward should be a bool, got {reshard_after_forward!r}")
        for unit in _units(self, recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether units are freed after their backward (False: they stay whole for the next forward)."""
        for unit in _units(self, recurse):
            unit.reshard_after_backward = reshard_after_backward


def _refuse(name: str, reason: str) -> Callable[..., None]:
    def refused(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(f"{name} does not map onto memory-sized shards ({reason}): shard with "
                          "hetdp.fully_shard(..., shard_sizes='even') for FSDP2's own units")
    refused.__name__ = name
    return refused


for _name, _reason in REFUSED.items():
    setattr(UnevenModule, _name, _refuse(_name, _reason))


class _Done:
    """The handle ``unshard(async_op=True)`` returns: the gather has already completed."""

    def wait(self) -> None:
        return None


def _units(module: Any, recurse: bool) -> list[UnitState]:
    modules = module.modules() if recurse else [module]
    return [each._uneven for each in modules if isinstance(each, UnevenModule)]


def default_device_type() -> str:
    """The device type of FSDP2's default mesh: this process's accelerator, or the CPU."""
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"


def default_mesh() -> DeviceMesh:
    """A 1-D mesh of every rank, as FSDP2 makes its default (a mesh of the default group: no group is created; none
    is cached either, so that nothing holds the group past its end)."""
    return init_device_mesh(default_device_type(), (dist.get_world_size(),))


def shard_rows(module: nn.Module, weights: Sequence[float], budgets: Sequence[MemoryBudget], *,
               mesh: DeviceMesh | None = None, reshard_after_forward: bool | None = None,
               mp_policy: MixedPrecisionPolicy | None = None, offload_policy: OffloadPolicy | None = None,
               **unsupported: Any) -> nn.Module:
    """Shard ``module``'s own parameters (those of no unit inside it) in whole rows per rank, in proportion to
    ``weights`` (collective-free: every rank splits alike). The module becomes an ``UnevenModule`` of its class.

    Raises:
        ConfigError: a ``fully_shard`` option that does not map (named), a parameter that cannot be split by rows,
            or a rank whose memory (``budgets``) cannot hold the unit whole for compute beside its part of the state.
    """
    mesh = mesh or default_mesh()
    options = {name: value for name, value in unsupported.items() if value is not None}
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        options["offload_policy"] = offload_policy
    if options:
        raise ConfigError(f"fully_shard's {', '.join(sorted(options))} does not map onto memory-sized shards: shard "
                          "with hetdp.fully_shard(..., shard_sizes='even') for FSDP2's own units")
    if mesh.ndim != 1 or mesh.size() != dist.get_world_size():
        raise ConfigError(f"memory-sized shards span every rank of the default group (a 1-D mesh of "
                          f"{dist.get_world_size()}); got a mesh of shape {tuple(mesh.shape)}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ConfigError(f"reshard_after_forward={reshard_after_forward!r}: memory-sized shards reshard to every "
                          "rank or keep the unit whole (True, False or None)")
    policy = mp_policy or MixedPrecisionPolicy()
    own = _own_parameters(module)
    name = type(module).__name__
    for owners, parameter in own:
        where = f"{name}.{owners[0][1]}"
        if isinstance(parameter, DTensor):
            raise ConfigError(f"{where} is a DTensor already (a unit sharded it, or tensor parallelism): memory-sized "
                              "shards take plain parameters, each in one unit")
        if parameter.dim() == 0:
            raise ConfigError(f"{where} is a 0-d parameter, which has no rows to split: make it of shape (1,)")
    if len({parameter.dtype for _, parameter in own}) > 1:
        raise ConfigError(f"{name}'s parameters mix dtypes {sorted(str(p.dtype) for _, p in own)}: memory-sized "
                          "shards keep one dtype a unit; shard its parts apart, or give them one dtype")
    item = own[0][1].element_size() if own else 4
    splits = split_rows([parameter.shape[0] for _, parameter in own],
                        [math.prod(parameter.shape[1:]) * item for _, parameter in own], weights)
    compute = policy.param_dtype or (own[0][1].dtype if own else torch.float32)
    reduce = policy.reduce_dtype or compute
    numel = sum(parameter.numel() for _, parameter in own)
    parts = [sum(split.rows[rank] * math.prod(parameter.shape[1:]) for split, (_, parameter) in zip(splits, own))
             * item * (2 + OPTIMIZER_COPIES) for rank in range(len(weights))]
    check_room(budgets, numel * (compute.itemsize + reduce.itemsize), parts, name)
    storage = RowShardedUnit(own, splits, mesh, param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    state = UnitState(storage, reshard_after_forward=reshard_after_forward, policy=policy)
    _adopt_inner(module, state)
    module.__class__ = _uneven_class(type(module))
    module._uneven = state  # type: ignore[attr-defined]
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward, with_kwargs=True)
    return module


def _own_parameters(module: nn.Module) -> list[tuple[list[tuple[nn.Module, str]], nn.Parameter]]:
    """The module's parameters that no unit inside it holds, each with every (submodule, name) that registers it (a
    parameter tied between two places of the unit is one parameter; tied across units, it cannot be: shard the
    modules that share it as one unit)."""
    found: dict[int, tuple[list[tuple[nn.Module, str]], nn.Parameter]] = {}
    for owner in _modules_outside_units(module):
        for attribute, parameter in owner._parameters.items():
            if parameter is not None:
                found.setdefault(id(parameter), ([], parameter))[0].append((owner, attribute))
    return list(found.values())


def _modules_outside_units(module: nn.Module) -> Iterator[nn.Module]:
    yield module
    for child in module.children():
        if not isinstance(child, UnevenModule):
            yield from _modules_outside_units(child)


def _adopt_inner(module: nn.Module, state: UnitState) -> None:
    """The units inside ``module`` are no longer outermost: their groups join ``module``'s, ahead of it."""
    inner = [unit._uneven for unit in module.modules() if unit is not module and isinstance(unit, UnevenModule)]
    units: list[UnitState] = []
    for unit in inner:
        unit.outermost = False
        units.extend(each for each in unit.group.units if each not in units)
    state.group = UnitGroup([*units, state])
    for unit in state.group.units:
        unit.group = state.group


_CLASSES: dict[type, type] = {}


def _uneven_class(cls: type) -> type:
    """``cls`` with ``UnevenModule`` ahead of it (one class per original, as FSDP2 makes ``FSDP<Class>``)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Uneven{cls.__name__}", (UnevenModule, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]

