"""Sharded checkpoints: a save killed midway leaves the last complete one named, and a checkpoint crafted to run
code is refused unread (one rank here; the distributed resume is tests/distributed/test_sharded.py's)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hetdp.checkpoint.dcp import LATEST, latest_sharded, load_sharded, packed, save_sharded, unpacked
from hetdp.checkpoint.files import RefusedCheckpointError


def _state(value: float) -> dict:
    return {"weights": torch.full((4,), value), "extra": packed({"scheduler": {"last_epoch": int(value)}})}


def test_saves_are_named_by_latest_and_the_two_newest_stay(tmp_path, one_rank):
    for step in (2, 4, 6):
        save_sharded(_state(step), tmp_path, f"step-{step:08d}", keep=2, timeout_s=30)
    assert latest_sharded(tmp_path) == tmp_path / "step-00000006"
    assert sorted(path.name for path in tmp_path.iterdir()) == [LATEST, "step-00000004", "step-00000006"]
    state = _state(0)
    load_sharded(state, latest_sharded(tmp_path))
    assert torch.equal(state["weights"], torch.full((4,), 6.0))
    assert unpacked(state["extra"], tmp_path)["scheduler"]["last_epoch"] == 6


class _DiesWriting(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError("killed while writing its shards")


def test_a_save_that_dies_midway_leaves_the_last_complete_one_named(tmp_path, one_rank, monkeypatch):
    save_sharded(_state(2), tmp_path, "step-00000002", keep=2, timeout_s=30)
    monkeypatch.setattr(dcp, "FileSystemWriter", _DiesWriting)
    with pytest.raises(BaseException, match="killed while writing"):
        save_sharded(_state(4), tmp_path, "step-00000004", keep=2, timeout_s=30)
    assert latest_sharded(tmp_path) == tmp_path / "step-00000002"
    assert not (tmp_path / "step-00000004").exists()


class RunsCode:
    """Unpickled, it would run a shell command: what a crafted checkpoint holds."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_metadata_is_refused_and_nothing_in_it_runs(tmp_path, one_rank):
    save_sharded(_state(2), tmp_path, "step-00000002", keep=2, timeout_s=30)
    marker = tmp_path / "ran"
    (tmp_path / "step-00000002" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(RefusedCheckpointError, match=r"refused checkpoint .*step-00000002: its metadata refers to "
                                                     r"posix.system"):
        load_sharded(_state(0), latest_sharded(tmp_path))
    assert not marker.exists()


@pytest.mark.parametrize("inside", [False, True])
def test_a_crafted_entry_is_refused_and_nothing_in_it_runs(tmp_path, one_rank, inside):
    # Crafted as DCP stores an entry that is not a tensor, or inside the entry hetdp packs its own state in.
    marker = tmp_path / "ran"
    crafted = packed(RunsCode(marker)) if inside else RunsCode(marker)
    save_sharded({"weights": torch.zeros(4), "extra": crafted}, tmp_path, "step-00000002", keep=2, timeout_s=30)
    with pytest.raises(RefusedCheckpointError, match="an entry holds objects other than tensors and plain data"):
        state = _state(0)
        load_sharded(state, latest_sharded(tmp_path))
        unpacked(state["extra"], tmp_path)
    assert not marker.exists()
