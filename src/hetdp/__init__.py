"""hetdp: heterogeneity-aware data-parallel training for PyTorch.

Unequal workers (fast and slow GPUs, GPUs beside CPUs, nodes that stall, sites
joined by slow links) train one model at their combined speed. Every run picks
an allocation (who computes how much: equal, static, adaptive, planned) and a
synchronization (how contributions combine: allreduce, partial, local).
"""

from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.apportion import apportion
from hetdp.allocate.sampler import WeightedDistributedSampler
from hetdp.cluster.emulate import Emulation, Link
from hetdp.errors import CheckpointError, ConfigError, HetDPError, PeerTimeoutError
from hetdp.runtime import Timeouts, init_distributed

__all__ = [
    "AdaptiveAllocator",
    "CheckpointError",
    "ConfigError",
    "Emulation",
    "HetDPError",
    "Link",
    "PeerTimeoutError",
    "Timeouts",
    "WeightedDistributedSampler",
    "apportion",
    "init_distributed",
]
