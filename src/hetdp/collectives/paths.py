"""Which collective paths a group's devices allow, agreed once at construction by every rank.

A group may mix devices: a GPU rank beside CPU ranks over gloo. Every rank must run
the same collective for the same bucket, so a path cannot be chosen by the rank's
own device (a GPU rank once ran gloo's ring while its CPU peers waited in the
recursive doubling, until the step timed out). The drop-in gathers the ranks'
device types once, and every rank derives the same ``Paths`` from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetdp.errors import ConfigError
from hetdp.runtime import peer_failures


@dataclass(frozen=True)
class Paths:
    """The collective paths of one group, the same on every rank."""

    point_to_point: bool
    """Whether the last small bucket goes by recursive doubling over send / recv (gloo), not the backend's ring."""
    host_copies: bool
    """Whether a rank's CUDA tensors reach the point-to-point sends through host copies (gloo with a GPU rank)."""
    mixed: bool
    """Whether the ranks' devices differ (some CUDA, some CPU)."""


def agree(backend: str, device_types: Sequence[str]) -> Paths:
    """The paths every rank takes, from the backend and every rank's device type (``"cpu"``, ``"cuda"``, ...).

    Raises:
        ConfigError: NCCL with a rank whose model is not on a GPU (NCCL moves GPU memory only: use gloo).
    """
    kinds = set(device_types)
    if backend == "nccl" and kinds != {"cuda"}:
        cpu_ranks = [rank for rank, kind in enumerate(device_types) if kind != "cuda"]
        raise ConfigError(f"NCCL needs every rank's model on a GPU, got {list(device_types)} (ranks {cpu_ranks} are "
                          "not): mix GPUs and CPUs over gloo (init_process_group('gloo'))")
    gloo = backend == "gloo"
    return Paths(point_to_point=gloo, host_copies=gloo and "cuda" in kinds, mixed=len(kinds) > 1)


def agree_in_group(device: torch.device, group: dist.ProcessGroup, timeout_s: float) -> Paths:
    """Collective: gather every rank's device type over ``group`` and ``agree`` on the paths."""
    kinds: list[str | None] = [None] * dist.get_world_size(group)
    with peer_failures("agreeing on the group's devices", timeout_s, group):
        dist.all_gather_object(kinds, device.type, group=group)
    return agree(dist.get_backend(group), [str(kind) for kind in kinds])
