"""Checkpoint files: written atomically, read without running code.

A checkpoint is read with ``torch.load(weights_only=True)``: tensors and plain
data (numbers, strings, lists, tuples, dicts) come back, and anything else a file
holds is refused before it is built. A folder someone else can write to must
not be a way to run their code on every rank that resumes. ``save_checkpoint``
reads its file back the same way before it replaces the previous one, so a
state that could not be resumed fails where it is saved, not at the resume.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from hetdp.errors import CheckpointError, RefusedCheckpointError
from hetdp.files import atomic_write


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` with ``torch.save`` to a temporary file, check that it loads as plain data, then rename it over
    ``path``.

    Raises:
        RefusedCheckpointError: ``state`` holds an object that a checkpoint cannot carry; ``path`` is untouched.
    """
    path = Path(path)
    return atomic_write(path, lambda handle: torch.save(state, handle),
                        check=lambda written: _load(written, path, mmap=True))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint``, as tensors and plain data only.

    Raises:
        RefusedCheckpointError: the file holds other objects (it may have been crafted to run code on load).
        CheckpointError: the file is missing or is not a readable checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    return _load(path, path)


def _load(source: Path, named: Path, mmap: bool = False) -> dict[str, Any]:
    """Load ``source`` as plain data; errors name ``named`` (the checkpoint ``source`` is or will be). ``mmap``: map
    the tensors' bytes instead of reading them (a check of what the file holds)."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        message = str(error)
        if not message.startswith("Weights only load failed"):
            raise CheckpointError(f"cannot read checkpoint {named}: {_line(message)}") from error
        refused = _line(message, containing="GLOBAL")
        raise RefusedCheckpointError(
            f"refused checkpoint {named}: it holds objects other than tensors and plain data ({refused}), and "
            "loading them could run code; nothing in it was run") from None
    except Exception as error:
        raise CheckpointError(f"cannot read checkpoint {named}: {_line(str(error))}") from error


def _line(message: str, containing: str = "") -> str:
    """The first line of ``message`` (that holds ``containing``), without torch's advice to load unsafely."""
    lines = [line.strip() for line in message.splitlines() if line.strip() and containing in line]
    return lines[0] if lines else "unreadable"
