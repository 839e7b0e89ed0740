"""The data owner's one-time delivery: every rank receives its own disjoint share of the dataset.

C-ADP (paper, section 3): before training, the data owner sends device i its D_i
samples, which takes b D_i / B_0i seconds (eq. 2). The samples travel over
torch.distributed, or, when every rank already reads the same storage, only
their indices do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from hetdp.errors import ConfigError
from hetdp.runtime import global_rank, local_device, wait_for

log = logging.getLogger(__name__)

Transport = Literal["samples", "indices"]


def partition(samples: Sequence[int], *, seed: int = 0) -> list[np.ndarray]:
    """Split ``range(sum(samples))`` into disjoint index arrays of the given sizes, from one seeded permutation.

    Raises:
        ConfigError: a count is negative.
    """
    counts = [int(n) for n in samples]
    if any(n < 0 for n in counts):
        raise ConfigError(f"sample counts must be >= 0, got {counts}")
    order = np.random.default_rng(seed).permutation(sum(counts))
    return np.split(order, np.cumsum(counts)[:-1])


@dataclass(frozen=True)
class LocalData:
    """What one rank holds after the delivery."""

    indices: torch.Tensor
    """Positions of its samples in the owner's dataset (int64, CPU), in delivery order."""
    data: TensorDataset
    """Its samples, on this rank's compute device."""


def distribute(
    dataset: TensorDataset | None,
    samples: Sequence[int],
    *,
    transport: Transport = "samples",
    transfer_s: Sequence[float] | None = None,
    seed: int = 0,
    owner: int = 0,
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 60.0,
) -> LocalData:
    """Deliver ``samples[r]`` samples of the owner's ``dataset`` to every rank r; return this rank's share.

    The shares are the consecutive pieces of one seeded permutation (``partition``):
    disjoint, and together the whole dataset. ``transport="samples"`` sends the
    samples themselves (other ranks pass ``dataset=None``); ``"indices"`` sends only
    their positions, and every rank passes the same dataset (shared storage).

    Args:
        dataset: the owner's dataset (a TensorDataset); None on other ranks with ``"samples"``.
        samples: one count per rank of the group, summing to ``len(dataset)``.
        transport: what travels over the network.
        transfer_s: emulated seconds each rank's delivery lasts (e.g. ``Link.transfer_s``
            of its bytes); a rank sleeps until that many seconds have passed since the
            delivery began. None: no emulation.
        seed: seed of the permutation.
        owner: the rank that holds the dataset.
        group: the process group (None: the default group).
        timeout_s: longest wait for one real transfer; past it, PeerTimeoutError.

    Warning:
        Collective: every rank of ``group`` calls it with the same ``samples``,
        ``transport`` and ``seed``.

    Raises:
        ConfigError: on every rank, when the counts do not match the group or the owner's dataset.
        PeerTimeoutError: a transfer did not finish within ``timeout_s``.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    counts = [int(n) for n in samples]
    if len(counts) != world_size or any(n < 0 for n in counts):
        raise ConfigError(f"samples must give one count >= 0 per rank ({world_size}), got {counts}")
    if transfer_s is not None and len(transfer_s) != world_size:
        raise ConfigError(f"transfer_s gives {len(transfer_s)} values for {world_size} ranks")
    if transport not in ("samples", "indices"):
        raise ConfigError(f"transport must be 'samples' or 'indices', got {transport!r}")
    if transport == "indices" and dataset is None:
        raise ConfigError(f"rank {rank}: transport 'indices' needs the dataset on every rank (shared storage)")
    layout = _owner_layout(dataset, counts, rank == owner, owner, group)
    started = time.perf_counter()
    shares = partition(counts, seed=seed)
    device = local_device()
    mine = torch.from_numpy(shares[rank]).long()
    if rank == owner:
        works = []
        for dst, share in enumerate(shares):
            if dst == owner or not len(share):
                continue
            payload = [torch.from_numpy(share).long()]
            if transport == "samples":
                payload += [tensor[payload[0]] for tensor in dataset.tensors]
            peer = global_rank(dst, group)
            works += [dist.isend(t.to(device), peer, group=group, tag=k) for k, t in enumerate(payload)]
        for work in works:
            wait_for(work, f"sending the data from owner rank {owner}", timeout_s)
        tensors = tuple(tensor[mine].to(device) for tensor in dataset.tensors)
    else:
        if counts[rank]:
            buffers = [torch.empty(counts[rank], dtype=torch.long, device=device)]
            if transport == "samples":
                buffers += [torch.empty((counts[rank], *shape), dtype=dtype, device=device) for shape, dtype in layout]
            works = [dist.irecv(b, global_rank(owner, group), group=group, tag=k) for k, b in enumerate(buffers)]
            for work in works:
                wait_for(work, f"receiving the data from owner rank {owner}", timeout_s)
            mine = buffers[0].cpu()
            received = buffers[1:]
        else:
            received = [torch.empty((0, *shape), dtype=dtype, device=device) for shape, dtype in layout]
        tensors = tuple(received) if transport == "samples" else tuple(t[mine].to(device) for t in dataset.tensors)
    if transfer_s is not None:
        remaining = transfer_s[rank] - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
    log.debug("rank %d holds %d samples (%s)", rank, len(mine), transport)
    return LocalData(indices=mine, data=TensorDataset(*tensors))


def _owner_layout(
    dataset: TensorDataset | None, counts: list[int], is_owner: bool, owner: int, group: dist.ProcessGroup | None
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Broadcast the per-sample shape and dtype of each dataset tensor, or the owner's objection to ``counts``."""
    message: list[object] = [None]
    if is_owner:
        if not isinstance(dataset, TensorDataset):
            message[0] = f"the owner's dataset must be a TensorDataset, got {type(dataset).__name__}"
        elif sum(counts) != len(dataset):
            message[0] = f"samples sum to {sum(counts)} but the owner's dataset has {len(dataset)}; they must match"
        else:
            message[0] = [(tuple(t.shape[1:]), t.dtype) for t in dataset.tensors]
    # The object collective waits under the group's own timeout (set when the group was created).
    dist.broadcast_object_list(message, src=global_rank(owner, group), group=group)
    if isinstance(message[0], str):
        raise ConfigError(message[0])
    return message[0]

