"""The memory a piece of training actually allocates, counted tensor by tensor as torch makes them: a check on the
drop-in's memory caps that shares none of their arithmetic.

On a CPU torch keeps no peak of its own allocator's (CUDA has
``torch.cuda.max_memory_allocated``), so ``HeldBytes`` watches every operator's
outputs under a dispatch mode: a storage that no input of the operator already
held is new; it counts from then until it is freed.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hetdp.cluster.memory import storage_bytes


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its memory); any other tensor itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    """The storages of the tensors in a nest of sequences and mappings (an operator's arguments or outputs)."""
    if isinstance(tree, torch.Tensor):
        return [_local(tree).untyped_storage()]
    if isinstance(tree, Mapping):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [storage for item in tree for storage in _storages(item)]
    return []


class HeldBytes(TorchDispatchMode):
    """Within its ``with`` block, the bytes of the storages allocated there and not yet freed (``now``), and their
    most at any moment (``peak``); storages that existed before the block (parameters, optimizer state) do not
    count: add them as ``storage_bytes`` measures them.

    Views and in-place results share a storage with an input and are not new. The
    count runs on every thread the block's work runs on (autograd's backward carries
    dispatch modes along); a storage freed after the block leaves ``now`` then too.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {storage.data_ptr() for storage in _storages((args, kwargs))}
        for storage in _storages(out):
            if storage.data_ptr() not in given:
                self._allocated(storage)
        return out

    def _allocated(self, storage: torch.UntypedStorage) -> None:
        address, size = storage.data_ptr(), storage.nbytes()
        if not address or address in self._live:
            return
        self._live[address] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._freed, address)

    def _freed(self, address: int) -> None:
        self.now -= self._live.pop(address, 0)


def state_bytes(parameters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes a rank holds between steps: its parameters (a DTensor's shard), their gradients where set, and the
    optimizer's state tensors (``storage_bytes``: each storage once, padding included)."""
    parameters = list(parameters)
    state = [value for entry in optimizer.state.values() for value in entry.values() if isinstance(value, torch.Tensor)]
    return (storage_bytes(parameters) + storage_bytes(p.grad for p in parameters if p.grad is not None)
            + storage_bytes(state))
