"""When a rank's step computed and when its gradients came back: the figures allocation and diagnosis run on."""

from __future__ import annotations

import time

import torch

from hetdp.cluster.emulate import Pacer
from hetdp.runtime import synchronize


class StepClock:
    """Time one rank's steps: compute (first forward to last gradient bucket ready) and wait (until synchronized).

    Compute excludes waiting for others, which is what the adaptive rule needs,
    also in a step that synchronizes more than one backward (a GAN's
    discriminator, two losses backpropagated apart): the wait that ends each
    backward but the last counts as wait, not as compute of the next one;
    on CUDA it comes from events on the device's timeline, since the host only
    queues kernels. Emulated slowness (``Pacer``) is slept inside the compute: a
    straggler delay and a lead at ``start``, the rest at the last bucket, after
    the step's real compute, so the real work of ranks sharing a few cores
    overlaps with the sleeps of others instead of delaying the exchange.
    """

    def __init__(self, device: torch.device, pacer: Pacer) -> None:
        self.device = device
        self.pacer = pacer
        self.events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None
        )
        self.started_at = self.ready_at = self.synced_at = 0.0
        self._waited_s = 0.0
        """Waits that ended the started step's earlier backwards."""
        self._backward_ended = False
        """The last bucket of a backward is ready: a bucket after it belongs to another backward of the step."""
        self._paced: tuple[int, float] | None = None
        """(step, work) of the started step until its padding has run."""
        self.forwards = 0
        """Forwards (micro-batches) of the started step so far; the model counts them, emulation prices them."""

    def start(self, step: int, samples: float) -> None:
        """The step's first forward begins (``samples``: its work, in samples or cost units)."""
        self.started_at = self.ready_at = self.synced_at = time.perf_counter()
        self._waited_s = 0.0
        self._backward_ended = False
        self._paced = (step, samples)
        self.forwards = 0
        if self.events:
            self.events[0].record()
        self.pacer.start(step, samples)

    def mark_ready(self, last_bucket: bool) -> None:
        """A gradient bucket is ready; after the last one, pad the compute to the emulated device's."""
        if self._backward_ended:  # another backward of the step: the previous one ended waiting for its exchange
            self._waited_s += self._exchange_wait_s()
            self._backward_ended = False
        if last_bucket and self._paced is not None:
            step, samples = self._paced
            self._paced = None
            synchronize(self.device)
            self.pacer.finish(step, samples, time.perf_counter() - self.started_at, max(self.forwards, 1))
        self.ready_at = time.perf_counter()
        self._backward_ended = last_bucket
        if self.events:
            self.events[1].record()

    def mark_synced(self) -> None:
        """The step's gradients are combined."""
        self.synced_at = time.perf_counter()

    def compute_s(self) -> float:
        """Seconds from ``start`` to the last ``mark_ready``, less the waits of earlier backwards; call after
        synchronizing the device."""
        if self.events:
            elapsed_s = self.events[0].elapsed_time(self.events[1]) / 1000.0
        else:
            elapsed_s = self.ready_at - self.started_at
        return max(elapsed_s - self._waited_s, 0.0)

    def wait_s(self) -> float:
        """Seconds from each backward's last bucket ready to its gradients combined, summed over the step's
        backwards: waiting for others plus the exchange."""
        return self._waited_s + self._exchange_wait_s()

    def _exchange_wait_s(self) -> float:
        """The latest backward's wait: from its last bucket ready to its gradients combined."""
        return max(self.synced_at - self.ready_at, 0.0)
