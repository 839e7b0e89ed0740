"""Checkpoints written atomically: an interrupted save leaves the previous checkpoint intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hetdp.errors import CheckpointError
from hetdp.files import atomic_write


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` with ``torch.save`` to a temporary file, then rename it over ``path``."""
    return atomic_write(path, lambda handle: torch.save(state, handle))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint``.

    Raises:
        CheckpointError: the file is missing or is not a readable checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from error
