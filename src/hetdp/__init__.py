"""hetdp: heterogeneity-aware data-parallel training for PyTorch.

Unequal workers (fast and slow GPUs, GPUs beside CPUs, nodes that stall, sites
joined by slow links) train one model at their combined speed. Every run picks
an allocation (who computes how much: equal, static, adaptive, planned) and a
synchronization (how contributions combine: allreduce, partial, local).
"""

from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.apportion import apportion
from hetdp.allocate.planner import DevicePlan, Plan, plan
from hetdp.allocate.sampler import WeightedDistributedSampler
from hetdp.cluster.emulate import Emulation, Link
from hetdp.cluster.probe import ProbeConfig, probe_cluster
from hetdp.cluster.spec import ClusterSpec, DeviceSpec
from hetdp.collectives.partial import PartialAllreduce, PartialConfig, PartialResult
from hetdp.errors import CheckpointError, ConfigError, HetDPError, PeerTimeoutError
from hetdp.runtime import Timeouts, init_distributed
from hetdp.train.allocation import AllocatedTrainer, AllocationConfig, EpochReport
from hetdp.train.cadp import CadpConfig, CadpResult, train_cadp
from hetdp.train.eager import EagerSGD

__all__ = [
    "AdaptiveAllocator",
    "AllocatedTrainer",
    "AllocationConfig",
    "CadpConfig",
    "CadpResult",
    "CheckpointError",
    "ClusterSpec",
    "ConfigError",
    "DevicePlan",
    "DeviceSpec",
    "EagerSGD",
    "Emulation",
    "EpochReport",
    "HetDPError",
    "Link",
    "PartialAllreduce",
    "PartialConfig",
    "PartialResult",
    "PeerTimeoutError",
    "Plan",
    "ProbeConfig",
    "Timeouts",
    "WeightedDistributedSampler",
    "apportion",
    "init_distributed",
    "plan",
    "probe_cluster",
    "train_cadp",
]
