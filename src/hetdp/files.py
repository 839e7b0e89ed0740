"""Atomic file writes: a crash mid-write leaves the previous file whole, never half a new one."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None],
                 check: Callable[[Path], None] | None = None) -> Path:
    """Call ``write`` on a temporary file beside ``path``, flush it to disk, then rename it over ``path``; ``check``
    (given the temporary file's path) may refuse the file first by raising, which leaves ``path`` as it was.

    The file gets the permissions ``open(path, "w")`` would give a new file (0666 less the umask),
    not the owner-only 0600 of a ``tempfile.mkstemp`` file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = _create_beside(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if check is not None:
            check(Path(tmp_name))
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


def _create_beside(path: Path) -> tuple[int, str]:
    """Create a new, uniquely named hidden file in ``path``'s folder; the kernel applies the umask to 0666."""
    while True:
        name = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), name
        except FileExistsError:
            continue


def write_json(path: str | Path, value: Any) -> Path:
    """Write ``value`` as indented JSON, atomically."""
    text = json.dumps(value, indent=2, sort_keys=False) + "\n"
    return atomic_write(path, lambda handle: handle.write(text.encode()))
