"""What the user sees of a run: tables (whole, or a row at a time), a progress bar over launched workers, PNG plots."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from matplotlib.figure import Figure
from tqdm import tqdm


def format_value(value: Any) -> str:
    """Render one table cell: floats to 4 significant digits, sequences comma-joined."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(item) for item in value)
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """Align ``rows`` (dicts) under ``columns`` (default: the first row's keys) as monospace text."""
    if not rows:
        return title or ""
    columns = list(columns or rows[0].keys())
    cells = [[format_value(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(column.rjust(width) for column, width in zip(columns, widths)))
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    return "\n".join(lines)


class StreamingTable:
    """A table printed a row at a time, as rows are measured: the header and the first row set the widths.

    Example::

        >>> table = StreamingTable(["epoch", "epoch s"])
        >>> print(table.format({"epoch": 0, "epoch s": 1.25}))   # the header, its rule, then the row
        >>> print(table.format({"epoch": 1, "epoch s": 1.5}))    # the row alone
    """

    def __init__(self, columns: Sequence[str], title: str | None = None, widths: dict[str, int] | None = None) -> None:
        """``widths``: the least width of some columns, for values wider than the first row's (``"adaptive"``)."""
        self.columns = list(columns)
        self.title = title
        self._least = widths or {}
        self._widths: list[int] | None = None

    def format(self, row: dict[str, Any]) -> str:
        cells = [format_value(row.get(column, "")) for column in self.columns]
        lines = []
        if self._widths is None:
            self._widths = [
                max(len(column), len(cell), self._least.get(column, 0)) for column, cell in zip(self.columns, cells)
            ]
            lines += [self.title] if self.title else []
            lines.append("  ".join(column.rjust(width) for column, width in zip(self.columns, self._widths)))
            lines.append("  ".join("-" * width for width in self._widths))
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(cells, self._widths)))
        return "\n".join(lines)


def print_above_progress(text: str) -> None:
    """Print ``text`` to stdout above any progress bar on the terminal, which is redrawn below it."""
    tqdm.write(text, file=sys.stdout)


class LaunchProgress:
    """The launcher's progress bar over the events of its workers (``hetdp.launch.run_local(follow=...)``).

    It reads "starting N ranks" from the launch until rank 0's first event (starting a few
    processes that import torch takes seconds on a small machine), then ``description``.
    An event advances it by its ``advance``; its ``row``, if any, goes to ``on_row``. Drawn
    on stderr, and only on a terminal.
    """

    def __init__(
        self, total: int, description: str, *, nproc: int, unit: str, on_row: Callable[[dict], None] | None = None
    ) -> None:
        self.description = description
        self.on_row = on_row
        self._started = False
        self._bar = tqdm(total=total, desc=f"starting {nproc} ranks", unit=unit, file=sys.stderr, disable=None,
                         dynamic_ncols=True, leave=False)

    def __call__(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            if not self._started:
                self._started = True
                self._bar.set_description_str(self.description, refresh=False)
            if event.get("row") is not None and self.on_row is not None:
                self.on_row(event["row"])
            self._bar.update(event.get("advance", 0))
        self._bar.refresh()  # the elapsed time moves even while no event comes

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def share_history(rows: Sequence[dict[str, Any]]) -> tuple[list[float], list[list[int]]]:
    """(fractional epoch, shares) at the start of a run and after each of its re-plans."""
    epochs, shares = [0.0], [list(rows[0]["start_shares"])]
    for row in rows:
        for step, new in row["replans"]:
            epochs.append(row["epoch"] + step / row["steps"])
            shares.append(list(new))
    epochs.append(float(len(rows)))
    shares.append(shares[-1])
    return epochs, shares


def write_allocation_plots(runs: dict[str, list[dict[str, Any]]], folder: str | Path) -> list[Path]:
    """Write shares.png, compute_wait.png and accuracy.png for allocation runs (policy -> epoch rows)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figures = {
        "shares.png": shares_figure(runs),
        "compute_wait.png": compute_wait_figure(runs),
        "accuracy.png": accuracy_figure(runs),
    }
    paths = []
    for name, figure in figures.items():
        figure.savefig(folder / name, dpi=110)
        paths.append(folder / name)
    return paths


def shares_figure(runs: dict[str, list[dict[str, Any]]]) -> Figure:
    """One panel per policy, each rank's share stacked on the others': ranks with equal shares stay visible."""
    figure = Figure(figsize=(4 + 2.5 * len(runs), 4), layout="constrained")
    panels = figure.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for axes, (policy, rows) in zip(panels, runs.items()):
        epochs, shares = share_history(rows)
        per_rank = list(zip(*shares))
        axes.stackplot(epochs, per_rank, step="post", labels=[f"rank {rank}" for rank in range(len(per_rank))],
                       edgecolor="white", linewidth=0.8)
        bottom = 0
        for rank, band in enumerate(per_rank):  # name each band where it ends, with its final share
            axes.text(epochs[-1] * 0.98, bottom + band[-1] / 2, f"rank {rank}: {band[-1]}", ha="right", va="center",
                      fontsize="small")
            bottom += band[-1]
        axes.set(title=policy, xlabel="epoch", xlim=(0, epochs[-1]), ylim=(0, sum(shares[0])))
    panels[0].set_ylabel(f"samples per step, stacked by rank (global batch {sum(shares[0])})")
    figure.suptitle("Share of each rank in every step")
    return figure


def compute_wait_figure(runs: dict[str, list[dict[str, Any]]]) -> Figure:
    """Per rank and policy, seconds of compute with the wait stacked on top, as means over all epochs."""
    world_size = len(next(iter(runs.values()))[0]["shares"])
    ranks = range(world_size)
    epochs = len(next(iter(runs.values())))
    figure = Figure(figsize=(6.5, 4.5), layout="constrained")
    axes = figure.subplots()
    width = 0.8 / len(runs)
    for number, (policy, rows) in enumerate(runs.items()):
        compute = [sum(row["compute_s"][rank] for row in rows) / len(rows) for rank in ranks]
        wait = [sum(row["wait_s"][rank] for row in rows) / len(rows) for rank in ranks]
        positions = [rank + number * width for rank in ranks]
        axes.bar(positions, compute, width, label=f"{policy}: compute")
        axes.bar(positions, wait, width, bottom=compute, label=f"{policy}: wait", alpha=0.5)
    axes.set_xticks([rank + (len(runs) - 1) * width / 2 for rank in ranks], [f"rank {rank}" for rank in ranks])
    axes.set(ylabel="seconds per epoch", title=f"Compute and wait per rank: mean over all {epochs} epochs")
    figure.legend(loc="outside lower center", ncol=len(runs) * 2, fontsize="small")  # below the plot: hides no bar
    return figure


def accuracy_figure(runs: dict[str, list[dict[str, Any]]]) -> Figure:
    """Test accuracy after each epoch against the training wall-clock, one line per policy."""
    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.subplots()
    for policy, rows in runs.items():
        axes.plot([row["wall_s"] for row in rows], [row["accuracy"] for row in rows], marker="o", label=policy)
    axes.set(xlabel="training wall-clock seconds", ylabel="test accuracy", title="Accuracy vs wall-clock")
    axes.legend()
    return figure
