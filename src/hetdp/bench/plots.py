"""PNG plots of allocation runs: each rank's share over the run, compute against wait, accuracy against time.

Apart from the tables in ``report``, because matplotlib takes a worker a third of a second to import, and only the
commands that draw need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


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
