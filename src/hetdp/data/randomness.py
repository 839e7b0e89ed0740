"""A process's random state, as tensors and plain data: what a step checkpoint saves of every rank, and what the
allocated loader restores as a resumed loop starts, so that dropout and augmentation draw what they would have drawn
without the fault."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def random_state() -> dict[str, Any]:
    """This process's random generators: Python's, NumPy's, torch's and (once initialized) CUDA's, as tensors and
    plain data (what a checkpoint may hold)."""
    _, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    numpy = {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position), "has_gauss": int(has_gauss),
             "cached_gaussian": float(cached_gaussian)}
    return {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def set_random_state(state: dict[str, Any]) -> None:
    """Restore what ``random_state`` returned."""
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["position"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
