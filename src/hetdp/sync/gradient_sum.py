"""Synchronous gradient combination: every rank's gradient weighted by its share of the step's samples, then summed.

The one implementation of the allreduce synchronization: the drop-in's DDP comm
hook calls it per bucket, and every convenience trainer runs through the drop-in.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from hetdp.collectives import doubling
from hetdp.runtime import peer_failures
from hetdp.sync.base import Synchronizer


class GradientSum(Synchronizer):
    """Sum gradient buckets over a group, each rank's scaled by ``samples / total`` first.

    With every rank's gradient the mean loss over its own ``samples`` of a step of
    ``total`` samples, the sum is exactly the mean over the step (task-allocation
    paper: unequal shares, one allreduce), where plain DDP's average over ranks is
    wrong once ranks hold unequal batches. The last bucket has no backward left to
    overlap with, so only its latency counts: over gloo, when it is small, it goes
    by recursive doubling (log2 P exchanges) instead of gloo's ring (2(P - 1) hops,
    each waiting for a process to be scheduled). Earlier buckets go asynchronously.
    """

    meets_every_step = True
    forward_sync_buffers = True

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.point_to_point = dist.get_backend(group) == "gloo"
        self.timeout_s = timeout_s
        self.rounds = 0

    def reduce(self, bucket: dist.GradBucket, samples: int, total: int, meets: bool = False
               ) -> torch.futures.Future[torch.Tensor]:
        """Weight and sum one bucket in place; the future holds the summed bucket.

        Raises (through the future, or at once for the last bucket):
            PeerTimeoutError: a peer died or did not join within ``timeout_s``.
        """
        buffer = bucket.buffer()
        buffer.mul_(samples / total)
        if not (bucket.is_last() and self.point_to_point and buffer.device.type == "cpu"
                and doubling.is_latency_bound(buffer)):
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            return work.get_future().then(self._unwrap)
        self.rounds += 1
        with self._peer_failures():
            doubling.allreduce(self.group, buffer, self.rank, self.world_size, self.rounds,
                               time.monotonic() + self.timeout_s)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    def _unwrap(self, future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        with self._peer_failures():
            return future.value()[0]

    def _peer_failures(self) -> contextlib.AbstractContextManager[None]:
        return peer_failures("the gradient allreduce", self.timeout_s, self.group, rank=self.rank)
