"""Plain-text tables and PNG plots for the CLI, the demo and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
