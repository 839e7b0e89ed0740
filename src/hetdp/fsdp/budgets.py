"""Each rank's memory, agreed before a unit's state is placed: what sizes its shard under ``hetdp.fully_shard``.

A rank's budget is its emulated device's memory under ``hetdp run --devices`` (the
table's ``memory_mb`` less its ``fixed_memory_mb``), else on CUDA the memory its
process may use (the driver's free memory plus what this process holds already,
the model it is sharding included, within ``set_per_process_memory_fraction``),
else unknown. Ranks whose budgets are all known and differ by more than
``EVEN_WITHIN`` get memory-sized shards; otherwise torch's even ones. The budget
is read the same way at every ``fully_shard`` call: what the process holds counts
as its own, so placing one unit's shards does not move the next unit's split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetdp.cluster.emulate import Emulation
from hetdp.cluster.memory import cuda_free_bytes
from hetdp.errors import ConfigError
from hetdp.runtime import Timeouts, peer_failures

EVEN_WITHIN = 0.05
"""Budgets whose largest is within this fraction above the smallest are equal: the ranks get torch's even shards
(FSDP2 itself). CUDA's free memory differs by a few MB between equal cards; a split that follows it would trade
FSDP2's own collectives for hetdp's to move a few rows."""


@dataclass(frozen=True)
class MemoryBudget:
    """One rank's memory, as placement reads it."""

    bytes: float | None
    """What the rank's training may take of its device (None: unknown, so shards stay even)."""
    device: str
    """What errors call the device, after its rank: ``rank 3: its emulated device of 40 MB ...``."""


def memory_budgets(device: torch.device, group: dist.ProcessGroup | None = None,
                   emulation: Emulation | None = None) -> list[MemoryBudget] | None:
    """Every rank's ``MemoryBudget``, the same list on every rank, or None where no rank's memory is known.

    Under ``hetdp run --devices`` (``emulation``, default: its settings in the environment) every rank reads every
    rank's from the same table, with no collective; on CUDA the ranks agree on theirs in one all-gather (collective);
    elsewhere memory is unknown.
    """
    emulation = Emulation.from_env() if emulation is None else emulation
    world_size = dist.get_world_size(group)
    if emulation.devices is not None:
        return table_budgets(emulation, world_size)
    if device.type != "cuda":
        return None
    mine = MemoryBudget(bytes=float(cuda_free_bytes(device) + torch.cuda.memory_allocated(device)),
                        device=f"its {torch.cuda.get_device_name(device)} ({device})")
    every: list[MemoryBudget | None] = [None] * world_size
    with peer_failures("agreeing on every rank's memory before sharding", Timeouts.round_s, group):
        dist.all_gather_object(every, mine, group=group)
    return every  # type: ignore[return-value]


def table_budgets(emulation: Emulation, world_size: int) -> list[MemoryBudget]:
    """Every rank's budget from the emulated devices' table: its ``memory_mb`` less its ``fixed_memory_mb`` (unknown
    where the table gives no memory, or no device, for the rank)."""
    devices = emulation.devices or ()
    budgets = []
    for rank in range(world_size):
        model = devices[rank] if rank < len(devices) else None
        if model is None or model.memory_mb is None:
            budgets.append(MemoryBudget(bytes=None, device="its emulated device of unlimited memory"))
        else:
            budgets.append(MemoryBudget(bytes=(model.memory_mb - model.fixed_memory_mb) * 1e6,
                                        device=f"its emulated device of {model.memory_mb:g} MB"))
    return budgets


def row_weights(budgets: Sequence[MemoryBudget], even_within: float = EVEN_WITHIN) -> tuple[float, ...] | None:
    """The weights of memory-sized shards (each rank's budget), or None where torch's even shards serve: a budget
    unknown, one rank, or budgets within ``even_within`` of each other."""
    sizes = [budget.bytes for budget in budgets]
    if len(sizes) < 2 or any(size is None for size in sizes):
        return None
    for rank, size in enumerate(sizes):
        if not size > 0:  # type: ignore[operator]
            raise ConfigError(f"rank {rank}: {budgets[rank].device} leaves no memory to hold a shard "
                              f"({size:,.0f} bytes); give it memory, or leave it out of the group")
    if max(sizes) <= (1.0 + even_within) * min(sizes):  # type: ignore[type-var, operator]
        return None
    return tuple(float(size) for size in sizes)  # type: ignore[arg-type]


def check_room(budgets: Sequence[MemoryBudget], whole_bytes: int, part_bytes: Sequence[int], unit: str) -> None:
    """Raise one ConfigError, the same on every rank, if a rank's memory cannot hold ``unit`` at all: computing with it
    takes its parameters and their gradients whole (``whole_bytes``) beside the rank's part of its state
    (``part_bytes[rank]``: parameters, gradients and the optimizer's state), whatever the rank's share."""
    for rank, budget in enumerate(budgets):
        need = whole_bytes + part_bytes[rank]
        if budget.bytes is not None and budget.bytes < need:
            raise ConfigError(f"rank {rank}: {budget.device} cannot hold any shard of {unit}: it would need "
                              f"{_megabytes(need)} ({_megabytes(whole_bytes)} to compute with it whole, "
                              f"{_megabytes(part_bytes[rank])} of its state) and has {_megabytes(budget.bytes)}; "
                              "give it more memory, or leave it out of the group")


def _megabytes(count: float) -> str:
    return f"{count / 1e6:,.4g} MB"
