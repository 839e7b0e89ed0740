"""Loops that fetch a window of batches and then train them with no fetch between: where each batch's step begins.

The allocated loader pairs a step with each batch it yields, and a loop that asks for its next batch closes the
open step (``StepCoordinator.loader_resumed``). A loop that fetched several batches first (gradient accumulation
recipes that pre-fetch, ``itertools.islice`` chunks) asks for none between them, so a model tells that the loop
moved on to the next batch it fetched by what the loop did since the open step's last backward (``StepProgress``):
its batch is done once that backward left its gradients waiting (``no_sync``: each batch a step of its own, unless
the loop runs a batch as micro-batches) or the update was taken: an optimizer over the model's parameters stepped,
or, where a ``GradScaler`` skipped that step, the gradients were cleared with no optimizer step and no parameter
changed. The next forward with gradients then begins the next batch's step, unless another model's output feeds it
(it is part of the step under way: a GAN's discriminator on the generator's output).

Everything here is what the loop does on every rank alike (the same forwards, backwards, ``no_sync`` and optimizer
steps), never data, so every rank begins the same steps at the same forwards. Counting a forward's samples
(``batch_samples``) would tell micro-batches from batches, but a count is data: it only ever words a warning.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class StepProgress:
    """What the loop did in the open step since its last backward: whether the batch it trains is done."""

    def __init__(self) -> None:
        self.samples = 0
        """Samples the step's forwards took, as their first argument tells (``batch_samples``): for warnings only."""
        self.synchronizing = True
        """Whether the last forward's backward synchronizes gradients (outside ``no_sync``)."""
        self.backward = False
        """Whether a backward through the step's forwards ran."""
        self.waiting = False
        """Whether the last backward left its gradients waiting (``no_sync``, ``set_requires_gradient_sync(False)``)."""
        self.updated = False
        """Whether an optimizer over the model's parameters stepped after the last backward."""
        self.stepped_other = False
        """Whether an optimizer over none of them stepped after it (a GAN's other model's)."""
        self._probe: weakref.ref[torch.Tensor] | None = None
        """A parameter the last backward left a gradient on, and its version then (``_skipped``)."""
        self._version = 0

    def forward(self, samples: int | None, synchronizing: bool) -> None:
        """A forward with gradients of the step began (``samples``: as its first argument tells, if it does)."""
        self.samples += samples or 0
        self.synchronizing = synchronizing

    def backward_ended(self, parameters: Iterable[torch.Tensor], waiting: bool) -> None:
        """A backward through the step's forwards ran; ``parameters``: the model's, whose gradients it left."""
        self.backward, self.waiting = True, waiting
        self.updated = self.stepped_other = False
        probe = next((p for p in parameters if p.grad is not None), None)
        self._probe = None if probe is None else weakref.ref(probe)
        self._version = 0 if probe is None else probe._version

    def optimizer_stepped(self, holds_parameters: bool) -> None:
        """An optimizer stepped; ``holds_parameters``: it holds some of the model's parameters."""
        if self.backward:
            self.updated |= holds_parameters
            self.stepped_other |= not holds_parameters

    def done(self, accumulates: bool) -> bool:
        """Whether the step's batch is done: its backward ran, then its gradients wait (unless ``accumulates``: the
        loop runs a batch as micro-batches, which wait too) or its update was taken."""
        if not self.backward:
            return False
        if self.updated or (self.waiting and not accumulates):
            return True
        return not self.stepped_other and self._skipped()

    def _skipped(self) -> bool:
        """Whether the update was skipped and its gradients cleared: a ``GradScaler`` that found an inf calls no
        optimizer step, and ``zero_grad`` follows. Two backwards of one step leave their gradients; a sharpness-aware
        first step (SAM) clears them but moves the parameters."""
        probe = None if self._probe is None else self._probe()
        return probe is not None and probe.grad is None and probe._version == self._version


def fed_by_a_model(inputs: Any) -> bool:
    """Whether a forward's arguments hold a tensor that requires gradients: another model's output, which makes the
    forward part of the step under way, never a batch of its own (a batch is data)."""
    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves(inputs))


def batch_samples(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The samples a forward takes as its first argument tells: a tensor's leading dimension, a list's length (a list
    of images), a mapping's first tensor's leading dimension; None where it does not tell. A guess (a sequence-first
    tensor tells its length): only for warnings."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, Mapping):
        first = next((value for value in first.values() if isinstance(value, torch.Tensor)), None)
    if isinstance(first, torch.Tensor):
        return first.shape[0] if first.dim() else None
    return len(first) if isinstance(first, (list, tuple)) else None


def split_batch(progress: StepProgress, samples: int) -> str | None:
    """The warning due where a backward whose gradients wait ended a batch of ``samples`` before its forwards took
    them all (under ``accumulates=False``): the loop runs a batch as micro-batches without saying so."""
    if not (progress.waiting and not progress.updated and 0 < progress.samples < samples):
        return None
    return (f"a forward after a backward under no_sync began the next batch's step (the loop fetched batches ahead), "
            f"but the step's forwards took {progress.samples} of its {samples} samples (as their first arguments' "
            "leading dimension tells): a loop that runs a batch as several forwards (micro-batches) says so with "
            "model.allocate(..., accumulates=True); else each micro-batch after the first trains under a later "
            "batch's step")


def accumulated_window(progress: StepProgress, samples: int) -> str | None:
    """The warning due where, under ``accumulates=True``, a forward follows a backward whose gradients wait after the
    step's forwards took all its ``samples``: the loop may be training the next batch it fetched, which nothing the
    loop does tells from one more micro-batch."""
    if not (progress.backward and progress.waiting and 0 < samples <= progress.samples):
        return None
    return (f"under model.allocate(..., accumulates=True) a forward followed a backward under no_sync after the "
            f"step's forwards took its {samples} samples, in a loop that fetched batches ahead: a loop that trains a "
            "window of fetched batches and accumulates across them with no optimizer.step() between them cannot be "
            "told from micro-batches of one batch, and trains the window under its first batch's step. Step the "
            "optimizer after each batch, fetch each batch as it trains (one at a time, or through a prefetcher), or "
            "allocate with accumulates=False (a batch is one forward)")


class BackwardEnd:
    """Calls ``ended`` once each backward through a watched output has run, after the autograd engine's callbacks
    queued before it (torch DDP's reducer finalizes its buckets there)."""

    def __init__(self, ended: Callable[[], None]) -> None:
        self._ended = ended
        self._queued = False

    def watch(self, output: Any) -> None:
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._started)

    def _started(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._queued = False
        self._ended()
