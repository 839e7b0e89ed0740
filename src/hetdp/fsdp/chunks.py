"""How a memory-sized shard shows ``torch.distributed.checkpoint`` (DCP) the rows it really holds.

A DTensor ``Shard(0)`` tells DCP its offset by torch.chunk's arithmetic, which is
wrong for rows sized by memory: DCP would record the even split's offsets beside
the uneven rows' bytes. DCP asks the local tensor of a DTensor first
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``,
its protocol for tensors that lay out their own shards), so each local tensor of
a row-sharded parameter, and of the optimizer's state over it, is given its real
first row and the global shape: its rank's one chunk, or none where it holds no
row. Checkpoints then record every rank's real offsets, and DCP reshards them
onto any other split (another count of ranks, torch's even shards) on load.

The tensors DCP sees are made fresh by ``state_dict()`` and ``optimizer.step()``:
the parameters' are shown in a ``state_dict`` post-hook of their unit, an
optimizer's state in a ``state_dict`` post-hook of that optimizer, which a global
step pre-hook registers on each optimizer the first time it steps row-sharded
parameters (the optimizer is the user's; hetdp first meets it there).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

_FIRST_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Row-sharded parameters (the sharded ``nn.Parameter`` objects) -> the first row this rank holds."""

_MET: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
"""Optimizers whose steps were seen (and hooked where they step row-sharded parameters)."""

_HOOKED: list[torch.utils.hooks.RemovableHandle] = []
"""The global step pre-hook, registered once a process and never removed (a removal while torch iterates the hooks,
in another optimizer's step, would fail it)."""


def register_parameter(parameter: nn.Parameter, first_row: int) -> None:
    """Remember that this rank's rows of ``parameter`` (a DTensor) start at ``first_row``, so that the state of an
    optimizer that steps it is shown to DCP too."""
    _FIRST_ROWS[parameter] = first_row
    show_chunk(parameter, first_row)
    if not _HOOKED:
        _HOOKED.append(register_optimizer_step_pre_hook(_before_step))


def show_chunk(tensor: DTensor, first_row: int) -> None:
    """Give the local tensor of ``tensor`` (a ``Shard(0)`` DTensor over this rank's rows) DCP's three methods, so that
    DCP writes and reads its rows at ``first_row`` of the global shape (no chunk where it holds no row)."""
    with torch.no_grad():
        local = tensor.to_local()  # without autograd, the DTensor's own local tensor
    if getattr(local, "_hetdp_first_row", None) == first_row:
        return
    shape = tensor.shape
    offsets = torch.Size([first_row] + [0] * (len(shape) - 1))
    sizes = local.shape

    def chunks() -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)] if local.numel() else []

    def write_items(fqn: str, whole: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local),
                                                      size=shape))
                for chunk in chunks()]

    local.__create_chunk_list__ = chunks  # type: ignore[attr-defined]
    local.__create_write_items__ = write_items  # type: ignore[attr-defined]
    local.__get_tensor_shard__ = lambda index: local  # type: ignore[attr-defined]
    local._hetdp_first_row = first_row  # type: ignore[attr-defined]


def show_state_dict_chunks(state_dict: dict[str, Any], first_rows: dict[str, int]) -> None:
    """Show DCP the real rows of the entries of a module's ``state_dict`` named in ``first_rows`` (key -> first row
    this rank holds): a ``state_dict`` post-hook's work, since ``state_dict()`` makes fresh DTensors."""
    for key, first_row in first_rows.items():
        value = state_dict.get(key)
        if isinstance(value, DTensor):
            show_chunk(value, first_row)


def show_optimizer_chunks(optimizer: torch.optim.Optimizer) -> None:
    """Show DCP the real rows of the optimizer's state over row-sharded parameters (each state tensor shaped as its
    parameter: Adam's moments, SGD's momentum)."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            first_row = _FIRST_ROWS.get(parameter)
            if first_row is None:
                continue
            for value in optimizer.state.get(parameter, {}).values():
                if isinstance(value, DTensor) and value.shape == parameter.shape:
                    show_chunk(value, first_row)


def _before_step(optimizer: torch.optim.Optimizer, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """The first step of an optimizer: where it steps row-sharded parameters, show DCP its state whenever its
    ``state_dict()`` is taken (the state appears in this step, and ``load_state_dict`` may replace it)."""
    if optimizer in _MET:
        return
    _MET.add(optimizer)
    if any(parameter in _FIRST_ROWS for group in optimizer.param_groups for parameter in group["params"]):
        optimizer.register_state_dict_post_hook(_on_state_dict)


def _on_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    show_optimizer_chunks(optimizer)
