"""Many tensors moved as a few messages: one flat tensor per dtype, broadcast or relayed rank to rank, and copied back
in place. A model of many small tensors would otherwise pay a collective's latency for each."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hetdp.runtime import wait_for

RELAY_TAG = 2**30
"""The tag of a relayed message's first part (one per dtype, tagged on from there): apart from the gradient
exchange's tags (steps x buckets)."""


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, each group in its first tensor's order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())


def flatten(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None,
            device: torch.device | None = None) -> torch.Tensor:
    """``tensors`` as one vector: joined where they lie, then cast to ``dtype`` and moved to ``device`` (None: as they
    are) in one copy, so that a GPU waits once, not once per tensor."""
    return torch.cat([tensor.detach().reshape(-1) for tensor in tensors]).to(device=device, dtype=dtype)


def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` back into ``tensors`` (the inverse of ``flatten``), moved to their device in
    one copy first."""
    flat = flat.to(tensors[0].device)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def message_device(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> torch.device:
    """Where a message of ``tensors`` travels from: the host under gloo (whose point-to-point sends, and a group
    that mixes devices, take host memory), else the tensors' device."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else tensors[0].device


def broadcast_in_place(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    """Give every rank of ``group`` the values of ``tensors`` on global rank ``src``, one message per dtype."""
    for alike in by_dtype(tensors):
        flat = flatten(alike, device=message_device(alike, group))
        dist.broadcast(flat, src, group=group)
        if dist.get_rank() != src:
            unflatten_into(alike, flat)


def relay(tensors: Sequence[torch.Tensor], order: Sequence[int], rank: int, group: dist.ProcessGroup,
          timeout_s: float) -> list[tuple[torch.Tensor, dist.Work]]:
    """Pass ``tensors`` along ``order`` (ranks of ``group``; the first holds them), one message per dtype, each rank
    sending on what it received; return the first rank's sends, still in flight (the others wait for theirs).

    Raises:
        PeerTimeoutError: a rank's message did not come within ``timeout_s``.
    """
    place = order.index(rank)
    sending = []
    for tag, alike in enumerate(by_dtype(tensors), start=RELAY_TAG):
        device = message_device(alike, group)
        if place == 0:
            flat = flatten(alike, device=device)
        else:
            flat = torch.empty(sum(tensor.numel() for tensor in alike), dtype=alike[0].dtype, device=device)
            wait_for(group.recv([flat], order[place - 1], tag), "receiving the model", timeout_s, group)
        if place + 1 < len(order):
            sending.append((flat, group.send([flat], order[place + 1], tag)))
        if place > 0:
            unflatten_into(alike, flat)
    if place == 0:
        return sending
    for _, work in sending:
        wait_for(work, "relaying the model", timeout_s, group)
    return []
