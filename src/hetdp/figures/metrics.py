"""What a run measures per step and per epoch, the straggler diagnosis, and the CSV / TensorBoard writers."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetdp.errors import ConfigError

TIE = 0.02
"""Ranks whose compute is within this fraction of the slowest one's are named together: equal devices tie."""
SPREAD = 0.05
"""A compute spread below this fraction of the step is noise, not a straggler (adaptive allocation leaves one)."""
COMMUNICATION_BOUND = 0.2
"""The share of the step the exchange must take before a run is called communication-bound."""


def diagnose_straggler(compute_s: Sequence[float], wait_s: Sequence[float]) -> str:
    """Name the rank(s) that held a synchronous run back, and whether by compute or by communication.

    A step lasts as long as its longest rank (compute + wait); every rank spends at
    least the smallest wait exchanging. The slowest computer is the straggler when
    its extra compute over the median rank exceeds that exchange and ``SPREAD`` of
    the step; otherwise the run is communication-bound when the exchange takes
    ``COMMUNICATION_BOUND`` of the step or more, and bound by compute (balanced)
    when it takes less. Ranks within ``TIE`` of the slowest are named together, so
    equal devices get the same verdict every run.
    """
    if len(compute_s) == 1:
        return f"one rank: nothing to wait for ({compute_s[0]:.2f} s computing)"
    step_s = max(c + w for c, w in zip(compute_s, wait_s))
    slowest_s = max(compute_s)
    slowest = [rank for rank, seconds in enumerate(compute_s) if seconds >= (1.0 - TIE) * slowest_s]
    extra_s = slowest_s - statistics.median(compute_s)
    comm_s = min(wait_s)
    share = round(comm_s / step_s, 2) if step_s > 0 else 0.0  # judged as shown: "20%" is communication-bound
    if extra_s > comm_s and extra_s >= SPREAD * step_s:
        who = f"rank {slowest[0]} is" if len(slowest) == 1 else f"ranks {', '.join(map(str, slowest))} are"
        return (
            f"{who} the straggler{'s' if len(slowest) > 1 else ''}, by compute: {slowest_s:.2f} s computing, "
            f"{extra_s:.2f} s more than the median rank; the others wait up to {max(wait_s):.2f} s"
        )
    if share >= COMMUNICATION_BOUND:
        return (
            f"no compute straggler: communication-bound, the exchange takes {share:.0%} of the time "
            f"(every rank spends {comm_s:.2f} s of {step_s:.2f} s in it), more than the {extra_s:.2f} s compute spread"
        )
    return (
        f"no straggler: bound by compute, the exchange takes {share:.0%} of the time ({comm_s:.2f} s of "
        f"{step_s:.2f} s) and the ranks' compute differs by {extra_s:.2f} s"
    )


@dataclass(frozen=True)
class StepFigures:
    """One step on every rank; identical on all ranks."""

    step: int
    """Global step index, counted from the start of training."""
    epoch: int
    shares: list[int]
    """Samples each rank computed in the step."""
    compute_s: list[float]
    """Per rank: seconds computing (forward, backward, emulated slowness), no waiting."""
    wait_s: list[float]
    """Per rank: seconds from its compute's end to its gradients combined."""

    def diagnosis(self) -> str:
        return diagnose_straggler(self.compute_s, self.wait_s)


@dataclass
class EpochReport:
    """What one epoch did on every rank; identical on all ranks."""

    epoch: int
    shares: list[int]
    """Samples per step of each rank at the end of the epoch."""
    steps: int
    epoch_s: float
    """Wall-clock seconds of the epoch on the slowest rank, from its start to the figures' gather at its end: the
    gather itself, an epoch's merge and the catch-up of ranks that sat out come after it. To compare runs, time
    whole epochs on one clock, their end work included (as ``hetdp bench`` does)."""
    compute_s: list[float]
    """Per rank: seconds computing its shares (forward, backward, emulated slowness), no waiting."""
    wait_s: list[float]
    """Per rank: seconds from its compute's end to the synchronized gradient (waiting for others + exchange)."""
    samples: list[int]
    loss: float | None = None
    """Mean training loss over the epoch's samples, where the loop reported it (``record_loss``)."""
    replans: list[tuple[int, list[int]]] = field(default_factory=list)
    """Each re-plan that changed the shares: (steps of this epoch done before it took effect, the new shares)."""
    stable: bool = False
    sat_out: dict[int, str] = field(default_factory=dict)
    """Ranks out of the step's exchange at the epoch's end (no share, stand-in batches), each with why: what its
    compute would save against what its exchange adds (``allocate.membership``)."""
    caps: list[int | None] | None = None
    """Each rank's memory cap in samples per forward (None: none), where memory bounds the shares."""

    def memory_bound(self) -> dict[int, int]:
        """Ranks whose share memory holds down, with the share their measured speed would give them: at their cap,
        below a share proportional to their samples per second of compute over the epoch."""
        if self.caps is None:
            return {}
        speeds = {rank: samples / seconds for rank, (samples, seconds) in enumerate(zip(self.samples, self.compute_s))
                  if samples > 0 and seconds > 0}
        total, speed = sum(self.shares), sum(speeds.values())
        wanted = {rank: round(total * value / speed) for rank, value in speeds.items()}
        return {rank: wanted[rank] for rank, cap in enumerate(self.caps)
                if cap is not None and rank in wanted and self.shares[rank] >= cap and wanted[rank] > cap}

    def diagnosis(self) -> str:
        """Which rank held the epoch back, and whether by computing or by communicating; which ranks memory, not
        speed, bounds; which ranks sat out, and why."""
        members = [rank for rank in range(len(self.compute_s)) if rank not in self.sat_out]
        if len(members) == 1:
            verdict = f"rank {members[0]} trains alone: no straggler, no exchange"
        else:
            verdict = diagnose_straggler([self.compute_s[r] for r in members], [self.wait_s[r] for r in members])
        verdict += "".join(f"; rank {rank} is bound by memory, not speed: its share {self.shares[rank]} is its cap, "
                           f"its speed would take {wanted}" for rank, wanted in sorted(self.memory_bound().items()))
        if self.sat_out:
            verdict += "".join(f"; rank {rank} sat out: {why}" for rank, why in sorted(self.sat_out.items()))
        return verdict


@dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """Where rank 0 writes the figures of every step and epoch, if anywhere."""

    csv: Path | str | None = None
    """A CSV file of per-step rows (step, epoch, rank, share, compute_s, wait_s); epochs go to ``<stem>_epochs.csv``."""
    tensorboard: Path | str | None = None
    """A TensorBoard log folder (needs the tensorboard package: ``pip install tensorboard``)."""
    every: int = 8
    """Steps between the gathers that bring every rank's per-step figures to all ranks."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"metrics every must be an integer >= 1 step, got {self.every!r}")

    @property
    def enabled(self) -> bool:
        return self.csv is not None or self.tensorboard is not None


class MetricsWriter:
    """Rank 0's CSV and TensorBoard output; opened lazily, so other ranks and unconfigured runs touch no file."""

    def __init__(self, config: MetricsConfig) -> None:
        self.config = config
        self._steps_file: Any = None
        self._steps_csv: Any = None
        self._epochs_path = None if config.csv is None else Path(config.csv).with_name(
            Path(config.csv).stem + "_epochs.csv")
        self._board: Any = None
        if config.tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ConfigError(
                    "metrics.tensorboard needs the tensorboard package: pip install tensorboard (from a clone of "
                    "hetdp: pip install '.[tensorboard]')"
                ) from error
            self._board = SummaryWriter(str(config.tensorboard))

    def write_steps(self, rows: Sequence[StepFigures]) -> None:
        if self.config.csv is not None:
            if self._steps_csv is None:
                path = Path(self.config.csv)
                path.parent.mkdir(parents=True, exist_ok=True)
                self._steps_file = path.open("w", newline="")
                self._steps_csv = csv.writer(self._steps_file)
                self._steps_csv.writerow(["step", "epoch", "rank", "share", "compute_s", "wait_s"])
            for row in rows:
                for rank, (share, compute_s, wait_s) in enumerate(zip(row.shares, row.compute_s, row.wait_s)):
                    self._steps_csv.writerow([row.step, row.epoch, rank, share, f"{compute_s:.6f}", f"{wait_s:.6f}"])
            self._steps_file.flush()
        if self._board is not None:
            for row in rows:
                for rank, (share, compute_s, wait_s) in enumerate(zip(row.shares, row.compute_s, row.wait_s)):
                    self._board.add_scalar(f"share/rank{rank}", share, row.step)
                    self._board.add_scalar(f"compute_s/rank{rank}", compute_s, row.step)
                    self._board.add_scalar(f"wait_s/rank{rank}", wait_s, row.step)

    def write_epoch(self, report: EpochReport) -> None:
        if self._epochs_path is not None:
            new = not self._epochs_path.exists() or report.epoch == 0
            self._epochs_path.parent.mkdir(parents=True, exist_ok=True)
            with self._epochs_path.open("w" if new else "a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(["epoch", "rank", "share", "compute_s", "wait_s", "samples", "epoch_s", "loss",
                                     "sat_out"])
                for rank in range(len(report.shares)):
                    writer.writerow([report.epoch, rank, report.shares[rank], f"{report.compute_s[rank]:.6f}",
                                     f"{report.wait_s[rank]:.6f}", report.samples[rank], f"{report.epoch_s:.6f}",
                                     "" if report.loss is None else f"{report.loss:.6g}", int(rank in report.sat_out)])
        if self._board is not None:
            self._board.add_scalar("epoch_s", report.epoch_s, report.epoch)
            self._board.add_scalar("sat_out", len(report.sat_out), report.epoch)
            if report.loss is not None:
                self._board.add_scalar("loss", report.loss, report.epoch)
            self._board.flush()

    def close(self) -> None:
        if self._steps_file is not None:
            self._steps_file.close()
            self._steps_file = self._steps_csv = None
        if self._board is not None:
            self._board.close()
            self._board = None
