"""The oldest torch each path of hetdp runs on: the package's floor, checked once at import (an older torch fails
there, in one line), and the sharded path's, checked where it is first used.

| path | floor | why |
| --- | --- | --- |
| ``hetdp.DDP`` and its integrations (Lightning's, Accelerate's and transformers' DDP) | 2.6 | ``group_src`` / ``group_dst`` |
| ``hetdp.fully_shard`` and the Lightning FSDP2 strategy | 2.13 (the version tested) | FSDP2's hooks below |
"""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from hetdp.errors import ConfigError

TORCH_FLOOR = "2.6"
"""torch 2.6 added ``group_src`` / ``group_dst`` to torch.distributed's collectives, which hetdp passes."""

SHARDED_FLOOR = "2.13"
"""The sharded path's floor: the torch it is tested with. It calls these methods of FSDP2's ``FSDPModule``
(``SHARDED_METHODS``), some of them added after 2.6 in releases hetdp does not test, so an older torch that has them
all is let through and one that lacks any is refused."""

SHARDED_METHODS = ("set_custom_all_gather", "set_custom_reduce_scatter", "set_force_sum_reduction_for_comms",
                   "set_gradient_divide_factor", "set_reduce_scatter_unused_params", "set_requires_gradient_sync")
"""What ``hetdp.fsdp`` calls on every unit: the timed and weighed collectives, a SUM with no divide, zero gradients
for unused parameters (ranks that use different parameters), and gradients that wait."""


def check_torch(version: str = torch.__version__) -> None:
    """Raise ImportError if ``version`` is older than ``TORCH_FLOOR``."""
    if TorchVersion(version) < TORCH_FLOOR:
        raise ImportError(f"hetdp needs torch >= {TORCH_FLOOR} (torch.distributed's group_src/group_dst), found "
                          f"{version}: pip install 'torch>={TORCH_FLOOR}'")


def check_sharded(version: str = torch.__version__) -> None:
    """Raise ConfigError if this torch's FSDP2 lacks a method the sharded drop-in calls (``SHARDED_METHODS``)."""
    from torch.distributed.fsdp import FSDPModule

    missing = [name for name in SHARDED_METHODS if not hasattr(FSDPModule, name)]
    if missing:
        raise ConfigError(f"hetdp.fully_shard needs torch >= {SHARDED_FLOOR} (FSDP2's {', '.join(missing)}), found "
                          f"{version}: pip install 'torch>={SHARDED_FLOOR}', or use hetdp.DDP (torch >= "
                          f"{TORCH_FLOOR})")


check_torch()
