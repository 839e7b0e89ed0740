"""What the user sees of a run: tables (whole, or a row at a time), a progress bar over launched workers."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

from tqdm import tqdm


def decimals_for(values: Sequence[Any]) -> int:
    """The decimals that show a column's floats alike: four significant digits of its largest (at most four
    decimals, never an exponent), so that one column never mixes 2.93, 2.966 and 6.269e+05."""
    floats = [abs(number) for number in _numbers(values) if isinstance(number, float) and math.isfinite(number)]
    largest = max(floats, default=0.0)
    return 3 if largest == 0 else min(4, max(0, 3 - math.floor(math.log10(largest))))


def _numbers(values: Sequence[Any]) -> list[Any]:
    return [item for value in values for item in (value if isinstance(value, (list, tuple)) else [value])]


def format_value(value: Any, decimals: int = 3) -> str:
    """Render one table cell: floats to ``decimals`` places, sequences comma-joined."""
    if isinstance(value, float):
        return f"{value:.{decimals}f}"
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(item, decimals) for item in value)
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """Align ``rows`` (dicts) under ``columns`` (default: the first row's keys) as monospace text, each column's
    floats to the same decimals."""
    if not rows:
        return title or ""
    columns = list(columns or rows[0].keys())
    decimals = [decimals_for([row.get(column) for row in rows]) for column in columns]
    cells = [[format_value(row.get(column, ""), places) for column, places in zip(columns, decimals)] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(column.rjust(width) for column, width in zip(columns, widths)))
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    return "\n".join(lines)


class StreamingTable:
    """A table printed a row at a time, as rows are measured: the header and the first row set the widths.

    Examples:
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
        self._decimals: list[int] | None = None

    def format(self, row: dict[str, Any]) -> str:
        if self._decimals is None:  # the first row sets each column's decimals, as it sets the widths
            self._decimals = [decimals_for([row.get(column)]) for column in self.columns]
        cells = [format_value(row.get(column, ""), places) for column, places in zip(self.columns, self._decimals)]
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
