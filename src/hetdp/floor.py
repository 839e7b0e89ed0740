"""The oldest torch and framework each path of hetdp runs on: the package's torch floor, checked once at import (an
older torch fails there, in one line), the sharded path's, and each integration's framework's, checked where first
used (one ``ConfigError`` naming the version needed).

| path | floor | checked |
| --- | --- | --- |
| ``hetdp.DDP`` | torch 2.6 (``group_src`` / ``group_dst``) | ``import hetdp`` |
| ``hetdp.fully_shard``, the Lightning FSDP2 strategy | torch 2.13 (FSDP2's methods below) | ``fully_shard``, ``allocate`` |
| Lightning (``strategy="hetdp"``, ``"hetdp_fsdp"``) | lightning 2.6 | ``import hetdp.integrations.lightning`` |
| Accelerate | accelerate 1.15 | ``import hetdp.integrations.accelerate`` |
| transformers' ``Trainer`` | transformers 5, accelerate 1.15 | ``import hetdp.integrations.transformers`` |
| Ray Train | ray 2.60 | ``hetdp.init_distributed()`` in a Ray Train worker |
"""

from __future__ import annotations

import warnings

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


FRAMEWORKS = {"lightning": ("2.6", "2.7"), "accelerate": ("1.15", "2"), "transformers": ("5", "6"),
              "ray": ("2.60", "3")}
"""Each integration's framework: (the oldest version hetdp runs on, the first it was not tested with), as
pyproject.toml's extras of the same names pin them. The integrations reach into the frameworks' loops (Lightning's
strategies and callbacks, Accelerate's data loaders and state, the Trainer's token counts), which change between
releases."""


def check_framework(name: str, version: str, *, user: str) -> None:
    """Raise ConfigError if ``version`` of the framework ``name`` (a key of ``FRAMEWORKS``) is below its floor; warn
    where it is past the versions tested. ``user``: what needs it, as the message names it."""
    floor, untested = FRAMEWORKS[name]
    if TorchVersion(version) < floor:
        raise ConfigError(f"{user} needs {name} >= {floor}, found {version}: pip install 'hetdp[{name}]' "
                          f"('{name}>={floor},<{untested}')")
    if TorchVersion(version) >= untested:
        warnings.warn(f"{user} was tested with {name} >= {floor}, < {untested}, found {version}: its adapter reaches "
                      f"into {name}'s internals, which may have changed", stacklevel=3)


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
