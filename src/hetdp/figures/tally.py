"""One rank's figures of the epoch in progress, and the epoch report built from every rank's at its end."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hetdp.figures.clock import StepTimes, TimesTotal
from hetdp.figures.metrics import EpochReport, MetricsWriter


@dataclass(frozen=True)
class EpochTotals:
    """What one rank adds to the gather at an epoch's end (floats: they travel in one float64 row)."""

    compute_s: float
    wait_s: float
    samples: float
    elapsed_s: float
    """Seconds from the epoch's start to its end on this rank."""
    loss: float
    """The sum of the recorded losses, each times its samples."""
    loss_samples: float

    def values(self) -> list[float]:
        return [float(value) for value in dataclasses.astuple(self)]

    @classmethod
    def of(cls, values: Sequence[float]) -> EpochTotals:
        return cls(*(float(value) for value in values))


@dataclass
class EpochTally:
    """This rank's figures of the epoch so far (the model adds each step's; ``record_loss`` its losses)."""

    epoch: int
    first: int
    """The global index of the epoch's first step (a resumed epoch counts the steps it skipped)."""
    started: float = field(default_factory=time.perf_counter)
    times: TimesTotal = field(default_factory=TimesTotal)
    """The steps' compute and wait seconds, read at a gather or the epoch's end (on CUDA, reading waits)."""
    samples: int = 0
    steps: int = 0
    loss: torch.Tensor | float | None = None
    """The sum of the losses times their samples; a tensor stays on its device until the epoch ends."""
    loss_samples: int = 0
    replans: list[tuple[int, list[int]]] = field(default_factory=list)
    """Re-plans that took effect in the epoch: (steps of it before, the new shares)."""

    def add_step(self, times: StepTimes, samples: int) -> None:
        self.times.add(times)
        self.samples += samples
        self.steps += 1

    def add_loss(self, loss: torch.Tensor | float, samples: int) -> None:
        value = loss.detach().float() * samples if isinstance(loss, torch.Tensor) else float(loss) * samples
        self.loss = value if self.loss is None else self.loss + value
        self.loss_samples += samples

    def add_replan(self, first_step: int, shares: list[int]) -> None:
        """Shares planned from global step ``first_step`` on."""
        self.replans.append((first_step - self.first, shares))

    def totals(self) -> EpochTotals:
        compute_s, wait_s = self.times.totals()
        return EpochTotals(compute_s=compute_s, wait_s=wait_s, samples=float(self.samples),
                           elapsed_s=time.perf_counter() - self.started,
                           loss=0.0 if self.loss is None else float(self.loss), loss_samples=float(self.loss_samples))

    def report(self, every_rank: Sequence[EpochTotals], *, shares: list[int], stable: bool,
               sat_out: dict[int, str], caps: list[int | None] | None = None) -> EpochReport:
        """The epoch's report from every rank's totals (in rank order): the same on every rank."""
        loss_samples = sum(totals.loss_samples for totals in every_rank)
        return EpochReport(
            epoch=self.epoch,
            shares=shares,
            steps=self.steps,
            epoch_s=max(totals.elapsed_s for totals in every_rank),
            compute_s=[totals.compute_s for totals in every_rank],
            wait_s=[totals.wait_s for totals in every_rank],
            samples=[int(totals.samples) for totals in every_rank],
            loss=sum(totals.loss for totals in every_rank) / loss_samples if loss_samples else None,
            replans=self.replans,
            stable=stable,
            sat_out=sat_out,
            caps=caps,
        )


class Epochs:
    """This rank's epochs: the tally of the one in progress, the reports of those ended, where a resume starts."""

    def __init__(self, writer: MetricsWriter | None) -> None:
        self.writer = writer
        self.tally: EpochTally | None = None
        self.reports: list[EpochReport] = []
        self.next = 0
        """The epoch after the last one ended: where a checkpoint taken between epochs resumes."""

    def begin(self, epoch: int, first: int) -> None:
        self.tally = EpochTally(epoch, first=first)

    def end(self, every_rank: Sequence[Sequence[float]], *, shares: list[int], stable: bool,
            sat_out: dict[int, str], caps: list[int | None] | None = None) -> EpochReport:
        """Close the epoch in progress on every rank's ``EpochTotals`` values (in rank order); return its report."""
        assert self.tally is not None, "an epoch ends that did not begin"
        report = self.tally.report([EpochTotals.of(values) for values in every_rank], shares=shares, stable=stable,
                                  sat_out=sat_out, caps=caps)
        self.reports.append(report)
        self.next = report.epoch + 1
        if self.writer is not None:
            self.writer.write_epoch(report)
        self.tally = None
        return report

    def position(self, steps_done: int) -> tuple[int, int]:
        """(epoch, steps of it done) at ``steps_done``: where a resumed run's data order continues."""
        tally = self.tally
        return (tally.epoch, steps_done - tally.first) if tally is not None else (self.next, 0)
