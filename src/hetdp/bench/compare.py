"""How every benchmark times a comparison: one clock, one warm-up, the sides in turn, and the ideal beside the ratio.

Each side of a ratio is timed the same way: the wall clock of a whole epoch, from a
barrier before its first step to a barrier after its end work (the figures' gather,
a merge, the catch-up of ranks that sat out), the slowest rank's. The sides run an
epoch each in turn, in an order that alternates from epoch to epoch, so that a
loaded machine's slow spells and a second place's warm caches fall on all of them
alike. Each side's first ``warmup`` epochs are dropped alike; its steady figure is
the median of the rest.

A speed-up is read against its ideal, worked out from the run's own measurements: the
baseline's measured epoch less the compute that perfectly balanced shares would save
at the per-sample compute the ranks measured, the exchange and the host's work staying
as the baseline measured them. Nothing here is tuned to the ratio it produces.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hetdp.figures.metrics import EpochReport
from hetdp.launch import EventWriter

Row = dict[str, Any]


class Side(Protocol):
    """One side of a comparison: a loop that trains an epoch, and what it reports of it."""

    name: str

    def train_epoch(self, epoch: int) -> None:
        """Train epoch ``epoch`` to its end, end work included (timed; collective)."""

    def describe(self) -> Row:
        """The epoch just trained: at least its ``shares`` and the ranks that ``sat_out`` (not timed; collective where
        it evaluates)."""

    def close(self) -> None:
        """Release the side (collective)."""


def timed(work: Callable[[], None], group: dist.ProcessGroup | None = None) -> float:
    """Wall seconds of ``work`` on the slowest rank, from a barrier before it to a barrier after it (collective)."""
    dist.barrier(group)
    started = time.perf_counter()
    work()
    dist.barrier(group)
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return float(seconds)


class EpochMarks:
    """The same clock for a loop that a framework runs: ``mark`` at each epoch's start and once after the last
    epoch's end, on every rank, each after a barrier; ``epochs_s`` then gives each epoch's seconds from its mark to the
    next, the slowest rank's (collective)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._marks: list[float] = []

    def mark(self) -> None:
        dist.barrier(self.group)
        self._marks.append(time.perf_counter())

    def epochs_s(self) -> list[float]:
        seconds = torch.tensor([b - a for a, b in itertools.pairwise(self._marks)], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=self.group)
        return seconds.tolist()


def alternate(sides: Sequence[Side], epochs: int, *, warmup: int, progress: EventWriter | None = None
              ) -> dict[str, list[Row]]:
    """Train ``epochs`` epochs of every side, an epoch of each in turn, the order reversed every other epoch; each
    side's rows, an epoch a row: its wall clock ``epoch_s`` (``timed``), whether it is ``warmup``, and what it
    ``describe``s."""
    rows: dict[str, list[Row]] = {side.name: [] for side in sides}
    for epoch in range(epochs):
        for side in sides if epoch % 2 == 0 else reversed(sides):
            epoch_s = timed(lambda: side.train_epoch(epoch))
            row = {"side": side.name, "epoch": epoch, "epoch_s": epoch_s, "warmup": epoch < warmup, **side.describe()}
            rows[side.name].append(row)
            if progress is not None:
                progress.update(row=row)
    return rows


def steady_s(rows: Iterable[Row]) -> float:
    """A side's steady epoch: the median ``epoch_s`` of its epochs past the warm-up."""
    seconds = [row["epoch_s"] for row in rows if not row["warmup"]]
    if not seconds:
        raise ValueError("no epoch past the warm-up: run more epochs than the warm-up's")
    return statistics.median(seconds)


def report_row(report: EpochReport) -> Row:
    """What a drop-in's epoch report says of the epoch: the shares, who sat out and why, and its measured compute,
    waits and samples per rank (``report_epoch_s``: its own clock, which ends before the epoch's end work)."""
    return {"shares": list(report.shares), "sat_out": {str(rank): why for rank, why in report.sat_out.items()},
            "steps": report.steps, "samples": list(report.samples), "compute_s": list(report.compute_s),
            "wait_s": list(report.wait_s), "replans": report.replans, "report_epoch_s": report.epoch_s}


def plain_row(shares: Sequence[int]) -> Row:
    """A side with no drop-in (torch's DDP or FSDP2, a plain loop): its fixed shares, nobody out."""
    return {"shares": list(shares), "sat_out": {}}


def sat_out(rows: Sequence[Row]) -> list[int]:
    """The ranks out of the exchange at a side's last epoch."""
    return sorted(int(rank) for rank in rows[-1]["sat_out"]) if rows else []


def per_sample_s(rows: Iterable[Row]) -> list[float | None]:
    """Each rank's measured compute seconds per sample over a drop-in side's epochs past the warm-up (None: a rank
    that computed no sample)."""
    steady = [row for row in rows if not row["warmup"]]
    ranks = len(steady[0]["samples"])
    computed = [sum(row["compute_s"][rank] for row in steady) for rank in range(ranks)]
    samples = [sum(row["samples"][rank] for row in steady) for rank in range(ranks)]
    return [seconds / count if count else None for seconds, count in zip(computed, samples)]


def exchange_s(rows: Iterable[Row]) -> float:
    """Seconds per step that even the rank that waited least spent waiting, over a drop-in side's epochs past the
    warm-up: the exchange itself (the median epoch's)."""
    steady = [row for row in rows if not row["warmup"]]
    return statistics.median(min(row["wait_s"][rank] for rank in _members(row)) / row["steps"] for row in steady)


def _members(row: Row) -> list[int]:
    return [rank for rank in range(len(row["wait_s"])) if str(rank) not in row["sat_out"]]


@dataclass(frozen=True)
class Ideal:
    """What a perfect allocation would reach against a baseline run, from the run's own measurements."""

    speedup: float
    """The baseline's steady epoch over ``epoch_s``."""
    epoch_s: float
    """The baseline's steady epoch less ``saved_s``: the exchange and the host's work as the baseline measured them."""
    saved_s: float
    """Compute a perfect allocation saves an epoch: the baseline's slowest rank's compute of its samples, less that of
    the epoch's samples split in proportion to the ranks' measured speeds."""

    def efficiency(self, measured_s: float) -> float:
        """The speed-up reached over the ideal one: ``epoch_s`` over the measured epoch."""
        return self.epoch_s / measured_s


def ideal(baseline_s: float, *, baseline_samples: Sequence[int], per_sample: Sequence[float | None]) -> Ideal:
    """The ideal against a baseline of ``baseline_s`` seconds an epoch in which rank r computed
    ``baseline_samples[r]`` samples, the ranks computing a sample in ``per_sample`` seconds (None: unknown, a rank
    left out of the ideal)."""
    known = [(samples, seconds) for samples, seconds in zip(baseline_samples, per_sample) if seconds]
    if not known:
        raise ValueError("no rank's compute per sample is known")
    slowest_s = max(samples * seconds for samples, seconds in known)
    balanced_s = sum(baseline_samples) / sum(1.0 / seconds for _, seconds in known)
    saved_s = max(slowest_s - balanced_s, 0.0)
    epoch_s = baseline_s - saved_s
    if epoch_s <= 0:
        raise ValueError(f"the compute saved ({saved_s:.3g} s) is not less than the baseline's epoch ({baseline_s:.3g} "
                         "s): the compute figures do not belong to this baseline")
    return Ideal(speedup=baseline_s / epoch_s, epoch_s=epoch_s, saved_s=saved_s)
