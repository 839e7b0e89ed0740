"""Step checkpoints for the drop-in: a killed run resumes at the exact step it saved, on the same or another world size.

Rank 0 writes every ``every`` steps (atomically, keeping the last two) and rank 0
reads, then broadcasts, so the ranks need no shared filesystem. A newest
checkpoint that cannot be read is reported and the previous one is used. Every
rank's random state (Python, NumPy, torch, CUDA) is saved too, so that dropout
and augmentation draw after a resume what they would have drawn without the
fault.
"""

from __future__ import annotations

import abc
import logging
import re
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from hetdp.allocate.caps import within_caps
from hetdp.checkpoint.files import load_checkpoint, save_checkpoint
from hetdp.data.randomness import random_state
from hetdp.errors import CheckpointError, ConfigError, RefusedCheckpointError
from hetdp.runtime import peer_failures

if TYPE_CHECKING:
    from hetdp.figures.gather import Planner
    from hetdp.figures.tally import Epochs

log = logging.getLogger(__name__)

KEEP = 2
"""Checkpoints kept on disk: the newest, and the one to fall back on if the newest is damaged."""
_NAME = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_paths(folder: str | Path) -> list[Path]:
    """The step checkpoints in ``folder``, newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in folder.iterdir() if (match := _NAME.match(path.name))]
    return [path for _, path in sorted(found, reverse=True)]


def load_newest(folder: str | Path) -> dict[str, Any] | None:
    """The newest readable checkpoint in ``folder`` (None if none); warns about each damaged one it skips.

    Raises:
        RefusedCheckpointError: a checkpoint holds objects other than tensors and plain data. It is not skipped:
            a damaged file is what a crash leaves, but this one was written by something other than hetdp.
    """
    for path in checkpoint_paths(folder):
        try:
            return load_checkpoint(path)
        except RefusedCheckpointError:
            raise
        except CheckpointError as error:
            warnings.warn(f"skipping a damaged step checkpoint, using the previous one: {error}", stacklevel=2)
    return None


@dataclass(frozen=True)
class ResumeState:
    """What a resumed run needs beside the module and optimizer: the allocation and the position in the data."""

    allocator: dict[str, Any] | None
    """The allocator's state (its shares and what it measured), if the model allocates."""
    steps_done: int
    world_size: int
    """The ranks that saved it: on another count, the allocation starts afresh."""
    position: tuple[int, int] | None
    """(epoch, steps of it done): where the data order continues (None in a state that did not say)."""

    def to_dict(self) -> dict[str, Any]:
        return {"allocator": self.allocator, "steps_done": self.steps_done, "world_size": self.world_size,
                "position": self.position}

    @classmethod
    def of(cls, state: dict[str, Any], world_size: int) -> ResumeState:
        """Read ``to_dict()``'s dict (``world_size``: this run's, where the state does not say)."""
        position = state.get("position")
        return cls(allocator=state.get("allocator"), steps_done=int(state["steps_done"]),
                   world_size=int(state.get("world_size", world_size)),
                   position=None if position is None else (int(position[0]), int(position[1])))


class Checkpointed(Protocol):
    """What a checkpointer needs of the model it saves (``hetdp.DDP``)."""

    rank: int
    world_size: int
    step_timeout_s: float
    process_group: dist.ProcessGroup
    module: nn.Module
    steps_done: int
    resume_position: tuple[int, int]
    resume_random_state: dict[str, Any] | None

    def synchronize(self) -> None: ...
    def hetdp_state_dict(self) -> dict[str, Any]: ...
    def load_hetdp_state_dict(self, state: dict[str, Any]) -> None: ...


class StepCheckpointer(abc.ABC):
    """What the checkpointers of both drop-ins share: their settings, which steps save, and the scheduler's and
    scaler's state. ``save`` and ``resume`` are each drop-in's own (one file from rank 0, or every rank's shards)."""

    def __init__(self, model: Any, folder: str | Path, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                 scaler: Any = None, every: int = 100) -> None:
        if every < 1:
            raise ConfigError(f"a checkpoint every {every} steps: give every >= 1")
        # Weakly: the model holds its checkpointer, and a cycle would leave the model to a garbage collection that may
        # run in a forked DataLoader worker, whose copy of the process groups then crashes tearing down.
        self.model = weakref.proxy(model)
        self.folder = Path(folder)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.every = every
        self.epoch = 0
        """The epoch the loop starts at (the saved one after a resume)."""

    def saves_after(self, steps_done: int) -> bool:
        """Whether the step that makes the count ``steps_done`` ends in a save (a multiple of ``every``)."""
        return steps_done % self.every == 0

    def step_ended(self, steps_done: int) -> None:
        """A step-end listener: save when the step count reaches a multiple of ``every``."""
        if self.saves_after(steps_done):
            self.save()

    @abc.abstractmethod
    def save(self) -> Path | None:
        """Write the state now (collective)."""

    @abc.abstractmethod
    def resume(self) -> bool:
        """Load the newest checkpoint on every rank (collective); return whether there was one."""

    def _schedule_state(self) -> dict[str, Any]:
        return {"scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def _load_schedule_state(self, saved: dict[str, Any]) -> None:
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved["scaler"] is not None:
            self.scaler.load_state_dict(saved["scaler"])


class Checkpointer(StepCheckpointer):
    """Saves the training state every ``every`` steps and resumes from the newest checkpoint.

    Made by ``model.checkpointer(folder, optimizer, every=K)`` after ``model.allocate(loader)``; call ``resume()``
    before the loop and start the epochs at ``ckpt.epoch``. The model's step hook saves; at most ``every`` steps of
    work are lost to a failure.
    """

    model: Checkpointed

    # --- saving ------------------------------------------------------------------------------------------------

    def meets_after(self, steps_done: int) -> bool:
        """A step-end listener's question: whether the step that makes the count ``steps_done`` needs the ranks'
        replicas to be one (it saves)."""
        return self.saves_after(steps_done)

    def save(self) -> Path | None:
        """Write the state now (collective: the ranks meet if their synchronization does, so that the file holds
        the one model they share; rank 0 gathers the random states and writes, the others return None); keeps the
        last ``KEEP`` checkpoints."""
        self.model.synchronize()
        random_states: list[Any] | None = [None] * self.model.world_size if self.model.rank == 0 else None
        with peer_failures("gathering the random states to checkpoint", self.model.step_timeout_s,
                           self.model.process_group):
            dist.gather_object(random_state(), random_states, group=self.model.process_group, group_dst=0)
        if self.model.rank != 0:
            return None
        state = {
            "random": random_states,
            "module": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self._schedule_state(),
            "hetdp": self.model.hetdp_state_dict(),
        }
        self.folder.mkdir(parents=True, exist_ok=True)
        path = save_checkpoint(self.folder / f"step-{self.model.steps_done:08d}.pt", state)
        for old in checkpoint_paths(self.folder)[KEEP:]:
            old.unlink(missing_ok=True)
        return path

    # --- resuming ----------------------------------------------------------------------------------------------

    def resume(self) -> bool:
        """Load the newest valid checkpoint on every rank (collective: rank 0 reads, then broadcasts).

        Returns whether a checkpoint was found. The allocated loader's next ``set_epoch(ckpt.epoch)`` starts at
        the saved step, so the rest of the epoch's order continues exactly. On as many ranks as saved it, each
        rank's random state comes back as the loop starts (on another count of ranks, the ranks' draws cannot
        map, and the generators keep the seeds the script gave them).
        """
        found: list[Any] = [None]
        if self.model.rank == 0:
            try:
                found[0] = load_newest(self.folder)
            except CheckpointError as error:  # every rank raises it, none waits for rank 0 until its timeout
                found[0] = error
        if self.model.world_size > 1:
            with peer_failures("broadcasting the checkpoint to resume", self.model.step_timeout_s,
                               self.model.process_group):
                dist.broadcast_object_list(found, group=self.model.process_group, group_src=0)
        state = found[0]
        if isinstance(state, CheckpointError):
            raise state
        if state is None:
            return False
        self.model.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_schedule_state(state)
        self.model.load_hetdp_state_dict(state["hetdp"])
        random_states = state.get("random")
        if random_states is not None and len(random_states) == self.model.world_size:
            self.model.resume_random_state = random_states[self.model.rank]
        self.epoch = self.model.resume_position[0]
        log.info("rank %d: resumed at step %d (epoch %d, step %d of it)", self.model.rank, self.model.steps_done,
                 *self.model.resume_position)
        return True


class CheckpointState:
    """``hetdp.DDP``'s checkpoint side (a mixin: the model sets the attributes declared here): its step
    checkpointer, and the state a resumed run needs beside the module and optimizer."""

    world_size: int
    resume_position: tuple[int, int]
    _planner: Planner
    _epochs: Epochs
    _listeners: list[Any]
    """Told at every step's end (``StepListener``): a checkpointer is one."""

    def checkpointer(self, folder: str | Path, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                     scaler: Any = None, every: int = 100) -> Checkpointer:
        """Save the training state to ``folder`` every ``every`` steps; ``resume()`` it before the loop.

        Call after ``allocate``: the checkpoint holds the position in the epoch's order, and a resumed
        run continues the epoch at the saved step, also on another number of ranks.
        """
        checkpointer = Checkpointer(self, folder, optimizer, scheduler=scheduler, scaler=scaler, every=every)
        self._listeners = [*(old for old in self._listeners if not isinstance(old, Checkpointer)), checkpointer]
        return checkpointer

    def hetdp_state_dict(self) -> dict[str, Any]:
        """What a resumed run needs beside the module and optimizer: the allocation, the steps done and the
        position in the data, as plain data (what ``load_hetdp_state_dict`` takes)."""
        self._planner.settle()
        steps_done, allocator = self._planner.steps_done, self._planner.allocator
        return ResumeState(allocator=None if allocator is None else allocator.state_dict(),
                           steps_done=steps_done, world_size=self.world_size,
                           position=self._epochs.position(steps_done)).to_dict()

    def load_hetdp_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``hetdp_state_dict``; call ``allocate`` first, so that the shares have a global batch and caps.

        Saved by another number of ranks, the allocation starts afresh for this one (adaptive allocation
        re-learns the shares) and the epoch continues at the saved step: the steps keep their samples,
        only the split among ranks changes. So it is where a saved share exceeds its rank's memory cap in this
        run (another card, less free memory, another ``max_batch``): the shares are split again within the caps
        (``within_caps``), with a warning, and the run goes on.
        """
        saved = ResumeState.of(state, self.world_size)
        self._planner.restore(saved.steps_done, saved.allocator, saved.world_size)
        self._fit_caps(saved.steps_done)
        self.resume_position = saved.position if saved.position is not None else (0, 0)
        self._epochs.next = self.resume_position[0]
        loader = self._planner.loader() if self._planner.loader is not None else None
        if loader is not None and saved.position is not None:
            loader.sampler.resume_at(*saved.position)

    def _fit_caps(self, steps_done: int) -> None:
        """Bring the restored shares within this run's memory caps, from the resumed step on. The shares say how a
        step is split, not what it trains (its samples, their order and the gradient are the same for any split), so
        a resume under smaller caps goes on where a refusal would leave the checkpoint unusable on that card."""
        allocator = self._planner.allocator
        if allocator is None:
            return
        fitted = within_caps(allocator.shares, allocator.caps, allocator.minimum)
        if fitted == allocator.shares:
            return
        if self._planner.rank == 0:
            log.warning("the checkpoint's shares %s exceed this run's memory caps %s: split again within them as %s",
                        allocator.shares, allocator.caps, fitted)
        why_out = dict(allocator.sat_out)
        self._planner.force(steps_done, fitted)
        allocator.sat_out = {rank: why_out.get(rank, why) for rank, why in allocator.sat_out.items()}
