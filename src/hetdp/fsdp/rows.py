"""Memory-sized shards as numbers: how many whole rows (dim 0) of each parameter of a unit each rank holds, and where
each rank's rows sit in its flat segment.

Pure: no torch.distributed, no tensors. ``hetdp.fsdp.rowshard`` places the rows
these functions count; ``hetdp.fsdp.budgets`` gives the weights (each rank's memory).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetdp.allocate.apportion import apportion
from hetdp.errors import ConfigError


@dataclass(frozen=True)
class RowSplit:
    """One parameter's rows, rank by rank: rank r holds rows ``offsets[r] : offsets[r] + rows[r]`` of dim 0."""

    rows: tuple[int, ...]
    """Rows each rank holds (0: none), summing to the parameter's dim 0."""

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first row each rank holds: the rows of the ranks before it."""
        return tuple(itertools.accumulate(self.rows, initial=0))[:-1]

    @property
    def total(self) -> int:
        return sum(self.rows)

    @property
    def owner(self) -> int | None:
        """The one rank that holds every row, if one does (a parameter too small to split)."""
        holders = [rank for rank, count in enumerate(self.rows) if count]
        return holders[0] if len(holders) == 1 else None


def split_rows(row_counts: Sequence[int], row_bytes: Sequence[int], weights: Sequence[float]) -> list[RowSplit]:
    """Split each parameter of a unit into whole rows per rank so that each rank's bytes follow ``weights``.

    The parameters are placed in order, each by what every rank still lacks of its proportion of the bytes placed so
    far (its weight times the running total, less what it holds): the rounding of one parameter is made up by the
    next, so a rank's bytes over the unit stay within a few rows of its proportion instead of drifting by a row a
    parameter toward the same ranks. A parameter with fewer rows than ranks of nonzero weight is too small to split:
    it goes whole to the rank that lacks the most. A rank of weight 0 holds no row.

    Args:
        row_counts: each parameter's dim 0.
        row_bytes: the bytes of one row of each parameter.
        weights: each rank's memory, or anything proportional to it (>= 0, not all 0).

    Raises:
        ConfigError: a weight is negative or not finite, all are 0, or a count or a row's bytes is negative.
    """
    if len(row_counts) != len(row_bytes):
        raise ConfigError(f"{len(row_counts)} row counts for {len(row_bytes)} row sizes")
    if any(not math.isfinite(weight) or weight < 0 for weight in weights) or not sum(weights) > 0:
        raise ConfigError(f"row weights must be finite, >= 0 and not all 0, got {list(weights)}")
    if any(count < 0 for count in row_counts) or any(size < 0 for size in row_bytes):
        raise ConfigError(f"row counts and row sizes must be >= 0, got {list(row_counts)} and {list(row_bytes)}")
    share = [weight / sum(weights) for weight in weights]
    holders = [rank for rank, weight in enumerate(weights) if weight > 0]
    held = [0.0] * len(weights)
    placed = 0.0
    splits = []
    for count, size in zip(row_counts, row_bytes):
        placed += count * size
        lacking = [share[rank] * placed - held[rank] for rank in range(len(weights))]
        rows = [0] * len(weights)
        if count < len(holders):
            if count:
                rows[max(holders, key=lambda rank: (lacking[rank], weights[rank], -rank))] = count
        else:
            rows = apportion([max(lacking[rank], 0.0) if rank in holders else 0.0 for rank in range(len(weights))]
                             if any(lacking[rank] > 0 for rank in holders) else list(weights), count, minimum=0)
        for rank, taken in enumerate(rows):
            held[rank] += taken * size
        splits.append(RowSplit(tuple(rows)))
    return splits


def segment_sizes(splits: Sequence[RowSplit], row_numels: Sequence[int]) -> list[int]:
    """Elements of each rank's flat segment of a unit: its rows of every parameter, one parameter after another."""
    ranks = len(splits[0].rows) if splits else 0
    return [sum(split.rows[rank] * numel for split, numel in zip(splits, row_numels)) for rank in range(ranks)]


def segment_offsets(splits: Sequence[RowSplit], row_numels: Sequence[int], rank: int) -> list[int]:
    """Where each parameter's rows start in ``rank``'s flat segment, in elements."""
    sizes = [split.rows[rank] * numel for split, numel in zip(splits, row_numels)]
    return list(itertools.accumulate(sizes, initial=0))[:-1]
