"""The oldest torch hetdp runs on, checked once at import: an older one fails there, in one line, not later."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

TORCH_FLOOR = "2.6"
"""torch 2.6 added ``group_src`` / ``group_dst`` to torch.distributed's collectives, which hetdp passes."""


def check_torch(version: str = torch.__version__) -> None:
    """Raise ImportError if ``version`` is older than ``TORCH_FLOOR``."""
    if TorchVersion(version) < TORCH_FLOOR:
        raise ImportError(f"hetdp needs torch >= {TORCH_FLOOR} (torch.distributed's group_src/group_dst), found "
                          f"{version}: pip install 'torch>={TORCH_FLOOR}'")


check_torch()
