"""Synchronous gradient combination: every rank's gradient weighted by its share of the step's samples, then summed.

The one implementation of the allreduce synchronization: the drop-in's DDP comm
hook calls it per bucket, and every convenience trainer runs through the drop-in.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetdp.collectives import doubling
from hetdp.collectives.paths import Paths
from hetdp.runtime import peer_failures
from hetdp.sync.base import Synchronizer

MAX_BUCKETS = 1024
"""Gradient buckets a step may have: the tags of a step's exchanges are its count of steps x this + the bucket's."""


class GradientSum(Synchronizer):
    """Sum gradient buckets over a group, each rank's scaled by ``samples / total`` first.

    With every rank's gradient the mean loss over its own ``samples`` of a step of
    ``total`` samples, the sum is exactly the mean over the step (task-allocation
    paper: unequal shares, one allreduce), where plain DDP's average over ranks is
    wrong once ranks hold unequal batches. The last bucket has no backward left to
    overlap with, so only its latency counts: over gloo, when it is small, it goes
    by recursive doubling (log2 P exchanges) instead of gloo's ring (2(P - 1) hops,
    each waiting for a process to be scheduled). Earlier buckets go asynchronously.

    Ranks that sit out a step (``Route``) leave its exchange: the members sum among
    themselves by recursive doubling over the group's point-to-point sends (a process
    group of their own would have to be created alike on every rank, members or not),
    a rank alone sums nothing, and a rank out of the step contributes nothing and
    receives nothing (the drop-in brings it current later).

    The last bucket's path is one decision for the whole group, taken from the
    backend alone: every rank must run the same collective, and a rank whose
    gradient lives on a GPU reaches the doubling's point-to-point sends through a
    host copy (gloo sends host memory), where choosing by the device let a GPU rank
    run the ring while its CPU peers waited in the doubling.
    """

    meets_every_step = True

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, paths: Paths | None = None) -> None:
        world_size = dist.get_world_size(group)
        # Alone in the group, a rank has nothing to exchange: no collective at all (torch's DDP still runs one).
        self.route = Route(group if world_size > 1 else None, dist.get_rank(group), world_size)
        self.point_to_point = paths.point_to_point if paths is not None else dist.get_backend(group) == "gloo"
        self.timeout_s = timeout_s
        self.rounds = 0

    def reduce(self, bucket: dist.GradBucket, samples: int, total: int, meets: bool = False
               ) -> torch.futures.Future[torch.Tensor]:
        """Weight and sum one bucket in place; the future holds the summed bucket.

        Raises (through the future, or at once for the last bucket):
            PeerTimeoutError: a peer died or did not join within ``timeout_s``.
        """
        buffer = bucket.buffer()
        route = self.route
        tag = self.rounds * MAX_BUCKETS + bucket.index()  # the same on every rank, whatever its route
        if bucket.is_last():
            self.rounds += 1
        weight = samples / total if route.world_size else 0.0
        if weight != 1.0:  # alone in a step of its own samples, the gradient is already the step's
            buffer.mul_(weight)
        if route.group is None:  # out of the step (weight 0, nothing to receive) or alone in it (nothing to add)
            return _done(buffer)
        doubles = route.peers is not None or (bucket.is_last() and doubling.is_latency_bound(buffer))
        if not (self.point_to_point and doubles) and route.peers is None:
            with self._peer_failures():  # an NCCL group its watchdog aborted refuses the call itself
                work = dist.all_reduce(buffer, group=route.group, async_op=True)
            return work.get_future().then(self._unwrap)
        host = buffer if buffer.device.type == "cpu" or not self.point_to_point else buffer.cpu()
        with self._peer_failures():
            doubling.allreduce(route.group, host, route.rank, route.world_size, tag, time.monotonic() + self.timeout_s,
                               route.peers)
        if host is not buffer:
            buffer.copy_(host)
        return _done(buffer)

    def _unwrap(self, future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        with self._peer_failures():
            return future.value()[0]

    def _peer_failures(self) -> contextlib.AbstractContextManager[None]:
        return peer_failures("the gradient allreduce", self.timeout_s, self.route.group, rank=self.route.rank)


@dataclass(frozen=True)
class Route:
    """Where one rank's gradient goes in a step: summed over ``group`` or the ``peers`` of it that are the step's
    members, or, with no group, nowhere: alone in the step (``world_size`` 1) or out of it (``world_size`` 0)."""

    group: dist.ProcessGroup | None
    rank: int
    """This rank's place among the ranks that sum."""
    world_size: int
    peers: tuple[int, ...] | None = None
    """The ranks of ``group`` that sum, by place, where only some of them do (None: all of ``group``)."""


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(tensor)
    return done
