"""hetdp: heterogeneity-aware data-parallel training for PyTorch.

Unequal workers (fast and slow GPUs, GPUs beside CPUs, nodes that stall, sites
joined by slow links) train one model at their combined speed. Every run picks
an allocation (who computes how much: equal, static, adaptive, planned) and a
synchronization (how contributions combine: allreduce, partial, local).
"""

import importlib
import warnings
from typing import TYPE_CHECKING

import hetdp.floor  # noqa: F401  (first: an older torch fails here, in one line)
from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.apportion import apportion, apportion_min_max
from hetdp.allocate.minmax import min_max_shares
from hetdp.allocate.pack import CostBalance
from hetdp.allocate.planner import DevicePlan, Plan, plan
from hetdp.allocate.policy import Adaptive, Equal, Planned, Static
from hetdp.checkpoint.checkpointer import Checkpointer
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation, Link
from hetdp.cluster.probe import ProbeConfig, probe_cluster
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.collectives.partial import Partial, PartialAllreduce, PartialResult
from hetdp.data.distribute import distribute
from hetdp.ddp.model import DDP, DistributedDataParallel
from hetdp.errors import CheckpointError, ConfigError, HetDPError, PeerTimeoutError, RefusedCheckpointError
from hetdp.figures.metrics import EpochReport, MetricsConfig, StepFigures
from hetdp.runtime import Timeouts, init_distributed
from hetdp.sync.policy import Allreduce, LocalAveraging

if TYPE_CHECKING:  # imported where first used (``_LAZY``); seen here by type checkers and the API reference
    from hetdp.fsdp.shard import fully_shard

__all__ = [
    "Adaptive",
    "AdaptiveAllocator",
    "Allreduce",
    "CheckpointError",
    "Checkpointer",
    "ClusterSpec",
    "ConfigError",
    "CostBalance",
    "DDP",
    "DeviceModel",
    "DevicePlan",
    "DeviceSpec",
    "DistributedDataParallel",
    "Emulation",
    "EpochReport",
    "Equal",
    "HetDPError",
    "Link",
    "LocalAveraging",
    "MetricsConfig",
    "Partial",
    "PartialAllreduce",
    "PartialResult",
    "PeerTimeoutError",
    "Plan",
    "Planned",
    "ProbeConfig",
    "RefusedCheckpointError",
    "Static",
    "StepFigures",
    "Timeouts",
    "apportion",
    "apportion_min_max",
    "distribute",
    "fully_shard",
    "init_distributed",
    "min_max_shares",
    "plan",
    "probe_cluster",
]
_DEPRECATED = {
    "PartialConfig": ("hetdp.collectives.partial", "hetdp.Partial(...), whose grace=0.0 and bypass=False are the "
                      "paper's round rules (its own defaults are the drop-in's)"),
}
"""Names that left the public API, with their module and their replacement: they keep working, with a warning,
through 0.1.0 (not yet released). (``AllocatedTrainer``, ``EagerSGD``, ``train_cadp`` and
``WeightedDistributedSampler``, deprecated earlier in 0.1.0's development, are gone: every technique is a pairing on
``hetdp.DDP``.)"""


_LAZY = {"fully_shard": "hetdp.fsdp.shard"}
"""Public names whose module imports FSDP2 and torch.distributed.checkpoint (about a second, more than the rest of
hetdp): imported where first used, so that a script of hetdp.DDP does not pay for them."""


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name not in _DEPRECATED:
        raise AttributeError(f"module 'hetdp' has no attribute {name!r}")
    module, replacement = _DEPRECATED[name]
    warnings.warn(f"hetdp.{name} is deprecated and goes after 0.1.0; use {replacement}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(module), name)
