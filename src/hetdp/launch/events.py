"""Rank 0's event log: progress and measured rows, appended by a worker as JSON lines and shown by the launcher as
they come (``run_local(follow=...)``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV_EVENTS = "HETDP_EVENTS"
"""Path of the event log rank 0 appends JSON lines to (set only when the launch follows events)."""

Event = dict[str, Any]


class EventWriter:
    """A worker's end of the event log: one JSON object per line, flushed at once so the launcher sees it.

    Creating it tells the launcher that the workers are up (an event that advances
    nothing). A no-op when the launch does not follow events or ``enabled`` is
    false (give ``enabled=rank == 0`` so that one rank speaks for the group).
    ``path``: the log to append to instead of ``$HETDP_EVENTS`` (a launch across
    emulated hosts, followed by the process that made them).
    """

    def __init__(self, enabled: bool = True, path: str | Path | None = None) -> None:
        path = path or os.environ.get(ENV_EVENTS)
        self._path = Path(path) if enabled and path else None
        self.update(0)

    def write(self, event: Event) -> None:
        if self._path is not None:
            with self._path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(event) + "\n")

    def update(self, n: int = 1, *, row: Event | None = None) -> None:
        """Advance the launcher's progress bar by ``n``; with ``row``, also print that measured row."""
        self.write({"advance": n, **({"row": row} if row is not None else {})})


class EventReader:
    """The launcher's end of the event log: the complete lines written since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read(self) -> list[Event]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]
