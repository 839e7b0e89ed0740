"""hetdp: heterogeneity-aware data-parallel training for PyTorch.

Unequal workers (fast and slow GPUs, GPUs beside CPUs, nodes that stall, sites
joined by slow links) train one model at their combined speed. Every run picks
an allocation (who computes how much: equal, static, adaptive, planned) and a
synchronization (how contributions combine: allreduce, partial, local).
"""

import hetdp.floor  # noqa: F401  (first: an older torch fails here, in one line)
from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.apportion import apportion
from hetdp.allocate.minmax import min_max_shares
from hetdp.allocate.pack import CostBalance
from hetdp.allocate.planner import DevicePlan, Plan, plan
from hetdp.allocate.policy import Adaptive, Equal, Planned, Static
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation, Link
from hetdp.cluster.probe import ProbeConfig, probe_cluster
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.collectives.partial import PartialAllreduce, PartialConfig, PartialResult
from hetdp.errors import CheckpointError, ConfigError, HetDPError, PeerTimeoutError
from hetdp.runtime import Timeouts, init_distributed
from hetdp.sync.policy import Allreduce, LocalAveraging, Partial
from hetdp.train.ddp import DDP, DistributedDataParallel
from hetdp.train.distribute import distribute
from hetdp.train.metrics import EpochReport, MetricsConfig, StepFigures
from hetdp.train.stepcheckpoint import Checkpointer

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
    "PartialConfig",
    "PartialResult",
    "PeerTimeoutError",
    "Plan",
    "Planned",
    "ProbeConfig",
    "Static",
    "StepFigures",
    "Timeouts",
    "apportion",
    "distribute",
    "init_distributed",
    "min_max_shares",
    "plan",
    "probe_cluster",
]
