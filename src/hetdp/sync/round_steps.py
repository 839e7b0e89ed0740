"""One optimizer step per partial round, in the user's loop: a rank that receives several rounds at once applies them
as the ranks that received them one by one.

Under partial synchronization a rank that fell behind receives, with its next
step, every round completed meanwhile. Their sum moves plain SGD as far as the
rounds one by one, but a stateful optimizer (momentum, Adam) stepped once on the
sum leaves that replica behind the others for many steps, and its next gradients
are computed elsewhere: it must step once per round. The drop-in does not own
the loop's ``optimizer.step()``, so it joins it
through torch's global optimizer hooks: before the step, the optimizer steps
once per earlier round; the loop's own step then applies the last round, and
afterwards ``.grad`` holds the step's whole gradient again, as the loop left it.
What the loop did to the gradient between backward and step (``GradScaler``'s
unscaling, clipping by norm) scales the whole; each round is scaled alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

Layout = Sequence[tuple[nn.Parameter, int]]
"""Each parameter of a flat gradient, with its offset in it."""


class RoundSteps:
    """The rounds of this rank's current step, applied by the next ``optimizer.step()`` over their parameters as
    one optimizer step each (see the module docstring).

    ``hold`` keeps them once the step's gradient is combined (the comm hook's last
    bucket); the step of an optimizer over any of those parameters then consumes
    them. A step the loop skips (``GradScaler`` on an overflow) applies nothing, as
    before; the next ``hold`` replaces what it left. A step with a closure
    (L-BFGS) re-evaluates the loss and cannot be repeated: it applies the sum.
    """

    def __init__(self) -> None:
        self._layout: list[tuple[nn.Parameter, int]] = []
        self._rounds: list[torch.Tensor] = []
        self._whole = torch.zeros(0)
        self._waiting: set[int] = set()
        """ids of the held parameters no optimizer has stepped yet."""
        self._restore: list[tuple[nn.Parameter, torch.Tensor]] = []
        """The loop's gradients, put back after its step."""
        self._busy = False
        self.extra_steps = 0
        """Optimizer steps run for earlier rounds, over the run: how often this rank caught up on several rounds."""
        handles = [register_optimizer_step_pre_hook(_weakly(self, RoundSteps._before_step)),
                   register_optimizer_step_post_hook(_weakly(self, RoundSteps._after_step))]
        self._remove = weakref.finalize(self, _remove_all, handles)

    def hold(self, layout: Layout, rounds: Sequence[torch.Tensor], whole: torch.Tensor) -> None:
        """Keep ``rounds`` (flat, oldest first, summing to ``whole``, the gradient handed to the loop) for the next
        optimizer step; a single round needs no step of its own."""
        self._drop()
        if len(rounds) < 2:
            return
        self._layout = list(layout)
        self._rounds = [part.detach().clone() for part in rounds]
        self._whole = whole.detach().clone()
        self._waiting = {id(p) for p, _ in self._layout}

    def close(self) -> None:
        """Stop taking part in optimizer steps (idempotent)."""
        self._drop()
        self._remove()

    def _drop(self) -> None:
        self._layout, self._rounds, self._waiting, self._restore = [], [], set(), []

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Step ``optimizer`` once per earlier round held for its parameters, and leave the last in ``.grad``."""
        if self._busy or not self._waiting or len(args) > 1 or "closure" in kwargs:
            return
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = [(p, offset) for p, offset in self._layout
                if id(p) in self._waiting and id(p) in stepped and p.grad is not None]
        self._waiting -= stepped
        if not mine:
            return
        now = parameters_to_vector(p.grad.detach() for p, _ in mine)
        whole, *rounds = (torch.cat([flat[offset : offset + p.numel()] for p, offset in mine]).to(now)
                          for flat in (self._whole, *self._rounds))
        norm = torch.dot(whole, whole)
        if not norm > 0:
            return
        scale = torch.dot(now, whole) / norm
        # Only the held parameters step once per round: the optimizer's others wait for the loop's own step.
        held = {id(p) for p, _ in mine}
        others = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and id(p) not in held]
        others_grads = [p.grad for p in others]
        self._restore = [(p, p.grad) for p, _ in mine]
        self._busy = True
        try:
            for p in others:
                p.grad = None
            for part in rounds[:-1]:
                _set_grads(mine, part * scale)
                optimizer.step(*args[1:], **kwargs)
                self.extra_steps += 1
        finally:
            for p, grad in zip(others, others_grads):
                p.grad = grad
            self._busy = False
        # The last round, and whatever the loop did to the gradient beyond scaling it (0 when it only scaled it).
        _set_grads(mine, rounds[-1] * scale + (now - whole * scale))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Put the loop's gradients back: after its step ``.grad`` holds the step's whole gradient, as it left it."""
        if self._busy:
            return
        for p, grad in self._restore:
            p.grad = grad
        self._restore = []


def _set_grads(layout: Layout, flat: torch.Tensor) -> None:
    """Give each parameter of ``layout`` its slice of ``flat`` (concatenated in that order) as a new ``.grad``."""
    offset = 0
    for p, _ in layout:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
        offset += p.numel()


def _weakly(steps: RoundSteps, method: Callable[..., None]) -> Callable[..., None]:
    """A global hook calling ``method`` of ``steps`` while it lives: the hook must not keep a dropped model's rounds."""
    ref = weakref.ref(steps)

    def hook(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        target = ref()
        if target is not None:
            method(target, optimizer, args, kwargs)

    return hook


def _remove_all(handles: Sequence[Any]) -> None:
    for handle in handles:
        handle.remove()
