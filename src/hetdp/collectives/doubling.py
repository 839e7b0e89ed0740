"""Recursive-doubling allreduce over point-to-point sends: log2(P) exchanges instead of a ring's 2(P - 1) hops.

Partial-allreduce rounds and the last gradient bucket of a synchronous step are
latency-bound for small payloads, and a ring's hops each wait for a process to
be scheduled; the eager-SGD paper runs its rounds with recursive doubling too
(section 4.1). Every rank ends with the same bits: each exchange adds two
partial sums that both partners hold, and IEEE addition is commutative. Ranks
beyond the largest power of two fold their data into a partner first and
receive the result last.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

MAX_BYTES = 1 << 20
"""Payloads up to this size are latency-bound: doubling's log2(P) exchanges beat a ring's 2(P - 1) hops. Larger
ones are bandwidth-bound, where the backend's ring (each byte sent twice, not log2(P) times) wins."""


def is_latency_bound(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is small enough to allreduce by doubling rather than by the backend's ring."""
    return tensor.numel() * tensor.element_size() <= MAX_BYTES


STEPS_PER_ROUND = 64
"""Tags per round: at most 2 + log2(P) exchanges, so rounds never share a tag."""


def exchanges(rank: int, world_size: int) -> list[tuple[str, int, int]]:
    """The schedule of ``rank``: (kind, peer, tag offset) steps, in order; both ends of an exchange share its tag.

    ``fold``: receive the data of a rank beyond the power of two and add it;
    ``swap``: send this rank's partial sum to the peer and add the peer's;
    ``unfold``: send the sum back to the folded rank. A folded rank only
    ``send``-s its data, then ``recv``-s the sum.
    """
    core = 1 << (world_size.bit_length() - 1)
    last = STEPS_PER_ROUND - 1
    if rank >= core:
        return [("send", rank - core, 0), ("recv", rank - core, last)]
    folds = rank + core < world_size
    steps = [("fold", rank + core, 0)] if folds else []
    distance, level = 1, 1
    while distance < core:
        steps.append(("swap", rank ^ distance, level))
        distance, level = distance * 2, level + 1
    if folds:
        steps.append(("unfold", rank + core, last))
    return steps


def allreduce(
    group: dist.ProcessGroup, tensor: torch.Tensor, rank: int, world_size: int, tag: int, deadline: float,
    peers: Sequence[int] | None = None,
) -> None:
    """Sum ``tensor`` over ``group`` (or some of its ranks) in place by recursive doubling, failing past ``deadline``.

    Args:
        group: a backend with ``send`` / ``recv`` (a ProcessGroupGloo).
        tensor: this rank's contribution; the sum on return, bitwise identical on every rank.
        rank, world_size: this rank's place among the ranks that sum, and their number.
        tag: distinct per call (a round's index): messages of two calls never match each other.
        deadline: ``time.monotonic()`` by which the whole reduction must end; past it the backend raises.
        peers: the ranks in ``group`` that sum, by place (None: all of ``group``); the others take no part, so
            that a subset sums without a process group of its own (which every rank would have to create alike).
    """
    base = (tag % (2**31 // STEPS_PER_ROUND)) * STEPS_PER_ROUND
    incoming = torch.empty_like(tensor)

    def wait(work: dist.Work) -> None:
        # A gloo send or receive cannot be re-waited after a timed-out wait: wait once, up to the deadline.
        work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))

    for kind, place, offset in exchanges(rank, world_size):
        peer = place if peers is None else peers[place]
        if kind in ("send", "unfold"):
            wait(group.send([tensor], peer, base + offset))
        elif kind == "recv":
            wait(group.recv([tensor], peer, base + offset))
        elif kind == "fold":
            wait(group.recv([incoming], peer, base + offset))
            tensor.add_(incoming)
        else:
            sent = group.send([tensor], peer, base + offset)
            received = group.recv([incoming], peer, base + offset)
            wait(sent)
            wait(received)
            tensor.add_(incoming)
