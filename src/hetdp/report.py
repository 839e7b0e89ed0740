"""Plain-text tables and PNG plots for the CLI, the demo and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


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
    world_size = len(next(iter(runs.values()))[0]["shares"])
    ranks = range(world_size)

    shares_figure = Figure(figsize=(6, 4), layout="tight")
    axes = shares_figure.subplots()
    for policy, rows in runs.items():
        epochs, shares = share_history(rows)
        for rank in ranks:
            axes.step(epochs, [s[rank] for s in shares], where="post", label=f"{policy}, rank {rank}",
                      linestyle="-" if policy == "adaptive" else ":")
    axes.set(xlabel="epoch", ylabel="samples per step", title="Share of each rank")
    axes.legend(fontsize="small", ncol=2)

    time_figure = Figure(figsize=(6, 4), layout="tight")
    axes = time_figure.subplots()
    width = 0.8 / len(runs)
    for number, (policy, rows) in enumerate(runs.items()):
        compute = [sum(row["compute_s"][rank] for row in rows) / len(rows) for rank in ranks]
        wait = [sum(row["wait_s"][rank] for row in rows) / len(rows) for rank in ranks]
        positions = [rank + number * width for rank in ranks]
        axes.bar(positions, compute, width, label=f"{policy}: compute")
        axes.bar(positions, wait, width, bottom=compute, label=f"{policy}: wait", alpha=0.5)
    axes.set_xticks([rank + (len(runs) - 1) * width / 2 for rank in ranks], [f"rank {rank}" for rank in ranks])
    axes.set(ylabel="seconds per epoch", title="Compute vs wait per rank")
    axes.legend(fontsize="small")

    accuracy_figure = Figure(figsize=(6, 4), layout="tight")
    axes = accuracy_figure.subplots()
    for policy, rows in runs.items():
        axes.plot([row["wall_s"] for row in rows], [row["accuracy"] for row in rows], marker="o", label=policy)
    axes.set(xlabel="training wall-clock seconds", ylabel="test accuracy", title="Accuracy vs wall-clock")
    axes.legend()

    paths = [folder / "shares.png", folder / "compute_wait.png", folder / "accuracy.png"]
    for figure, path in zip((shares_figure, time_figure, accuracy_figure), paths):
        figure.savefig(path, dpi=110)
    return paths
