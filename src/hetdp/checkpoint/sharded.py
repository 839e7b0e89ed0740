"""Step checkpoints of the sharded drop-in: every rank saves its shards through torch.distributed.checkpoint, and a
killed run resumes at the exact step it saved, on the same or another number of ranks (DCP reshards).

The state is ``get_state_dict``'s model and optimizer (sharded: each rank writes
its part), the scheduler's and scaler's, hetdp's allocation and position in the
data, and each rank's random state under its own key. Saves and loads go through
``hetdp.checkpoint.dcp``: atomic, and read as tensors and plain data only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hetdp.checkpoint.checkpointer import KEEP, StepCheckpointer
from hetdp.checkpoint.dcp import check_shared, latest_sharded, load_sharded, packed, save_sharded, unpacked
from hetdp.data.randomness import random_state
from hetdp.errors import CheckpointError
from hetdp.runtime import peer_failures

log = logging.getLogger(__name__)


class ShardedModel(Protocol):
    """What a sharded checkpointer needs of the drop-in it saves (``hetdp.fsdp.dropin.ShardedDropIn``)."""

    rank: int
    world_size: int
    step_timeout_s: float
    module: nn.Module
    steps_done: int
    resume_position: tuple[int, int]
    resume_random_state: dict[str, Any] | None
    _group: dist.ProcessGroup | None

    def hetdp_state_dict(self) -> dict[str, Any]: ...
    def load_hetdp_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardedCheckpointer(StepCheckpointer):
    """Saves the sharded training state every ``every`` steps and resumes from the newest complete save.

    Made by ``model.checkpointer(folder, optimizer, every=K)`` after ``model.allocate(loader)``; call ``resume()``
    before the loop and start the epochs at ``ckpt.epoch``. At most ``every`` steps of work are lost to a failure.

    Warning:
        Saving and resuming are collective, and every rank writes and reads ``folder``: it must be one folder that
        every rank reaches (a shared filesystem across machines).
    """

    model: ShardedModel
    _folder_checked = False
    """Whether a save checked that every rank sees ``folder`` (the first save does)."""

    def meets_after(self, steps_done: int) -> bool:
        """A step-end listener's question: sharded ranks hold one model at every step, so no save needs a meeting."""
        return False

    def save(self) -> Path:
        """Write the state now (collective); keeps the last ``KEEP`` saves.

        Raises:
            ConfigError: (at the first save, on every rank) some ranks do not see the folder rank 0 sees; the error
                names them.
        """
        model = self.model
        model_state, optimizer_state = get_state_dict(model.module, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "extra": packed(self._extra()),
                 f"random.{model.rank}": packed(random_state())}
        if model.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        if not self._folder_checked:
            check_shared(self.folder, model.step_timeout_s, model._group)
            self._folder_checked = True
        return save_sharded(state, self.folder, f"step-{model.steps_done:08d}", keep=KEEP,
                            timeout_s=model.step_timeout_s, group=model._group)

    def _extra(self) -> dict[str, Any]:
        return {**self._schedule_state(), "hetdp": self.model.hetdp_state_dict()}

    def resume(self) -> bool:
        """Load the newest complete save on every rank (collective); return whether there was one.

        On another number of ranks than saved it, DCP reshards the model and optimizer, the allocation starts
        afresh and the epoch goes on at the saved step; the ranks' random states come back only on as many ranks.
        """
        model = self.model
        found: list[Any] = [None]
        if model.rank == 0:
            try:
                found[0] = latest_sharded(self.folder)
            except CheckpointError as error:  # raised on every rank below, none waits for rank 0
                found[0] = error
        with peer_failures("agreeing on the checkpoint to resume", model.step_timeout_s, model._group):
            dist.broadcast_object_list(found, group=model._group, group_src=0)
        path = found[0]
        if isinstance(path, CheckpointError):
            raise path
        if path is None:
            return False
        extra: dict[str, Any] = {"extra": b""}
        load_sharded(extra, path, model._group)
        saved = unpacked(extra["extra"], path)
        same_ranks = int(saved["hetdp"].get("world_size", model.world_size)) == model.world_size
        model_state, optimizer_state = get_state_dict(model.module, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
        random_key = f"random.{model.rank}"
        if same_ranks:  # on another count of ranks, the ranks' draws cannot map
            state[random_key] = b""
        load_sharded(state, path, model._group)
        set_state_dict(model.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self._load_schedule_state(saved)
        model.load_hetdp_state_dict(saved["hetdp"])
        if same_ranks:
            model.resume_random_state = unpacked(state[random_key], path)
        self.epoch = model.resume_position[0]
        log.info("rank %d: resumed at step %d (epoch %d, step %d of it) from %s", model.rank, model.steps_done,
                 *model.resume_position, path)
        return True
