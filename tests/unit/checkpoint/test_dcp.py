"""Sharded checkpoints: a save killed midway leaves the last complete one named, and a checkpoint crafted to run
code is refused unread (one rank here; the distributed resume is tests/distributed/test_sharded.py's)."""

from __future__ import annotations

import logging
import operator
import os
import pickle
import shutil
import struct
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hetdp.checkpoint.dcp import (
    LATEST,
    check_shared,
    latest_sharded,
    load_sharded,
    packed,
    read_metadata,
    save_sharded,
    unpacked,
)
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


def _text(value: str) -> bytes:
    data = value.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _calling(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle that asks for ``module``'s ``name`` and calls it on ``args``."""
    return (pickle.PROTO + b"\x04" + _text(module) + _text(name) + pickle.STACK_GLOBAL + pickle.MARK
            + b"".join(map(_text, args)) + pickle.TUPLE + pickle.REDUCE + pickle.STOP)


METADATA = "torch.distributed.checkpoint.metadata"


def _library_making(marker, folder) -> str:
    """A shared library, in ``folder``, whose constructor creates ``marker`` when it is loaded."""
    source = folder / "crafted.c"
    source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void ran(void) '
                      f'{{ fclose(fopen("{marker}", "w")); }}\n')
    library = folder / "crafted.so"
    subprocess.run([shutil.which("cc"), "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return str(library)


@pytest.mark.parametrize("kind", ["system", "file_handler", "library"])
def test_a_crafted_metadata_that_walks_a_dotted_name_to_a_callable_type_runs_nothing(tmp_path, one_rank, kind):
    # The old allowlist admitted any name of DCP's metadata module that resolved to a type, and pickle walks
    # dotted names from it: torch.ctypes.CDLL loads a library (it may travel inside the checkpoint folder),
    # torch._utils.logging.FileHandler creates a file.
    save_sharded(_state(2), tmp_path, "step-00000002", keep=2, timeout_s=30)
    folder, marker = tmp_path / "step-00000002", tmp_path / "ran"
    if kind == "system":
        crafted = _calling("os", "system", f"touch {marker}")
    elif kind == "file_handler":
        assert operator.attrgetter("torch._utils.logging.FileHandler")(dcp_metadata) is logging.FileHandler
        crafted = _calling(METADATA, "torch._utils.logging.FileHandler", str(marker))
    else:
        if shutil.which("cc") is None:
            pytest.skip("no C compiler to build the crafted library")
        crafted = _calling(METADATA, "torch.ctypes.CDLL", _library_making(marker, folder))
    (folder / ".metadata").write_bytes(crafted)
    with pytest.raises(RefusedCheckpointError, match=r"refused checkpoint .*step-00000002: its metadata refers to "
                                                     r".*, not to DCP's own records.* nothing in it was run"):
        load_sharded(_state(0), latest_sharded(tmp_path))
    assert not marker.exists()


def test_a_crafted_metadata_cannot_set_state_on_a_class(tmp_path, one_rank, monkeypatch):
    # BUILD with a slot state on the class itself would set its attributes for the whole process.
    monkeypatch.setattr(dcp_metadata.Metadata, "version", None)  # put back after the test, whatever it finds
    save_sharded(_state(2), tmp_path, "step-00000002", keep=2, timeout_s=30)
    crafted = (pickle.PROTO + b"\x04" + _text(METADATA) + _text("Metadata") + pickle.STACK_GLOBAL + pickle.NONE
               + pickle.EMPTY_DICT + _text("version") + _text("crafted") + pickle.SETITEM + pickle.TUPLE2
               + pickle.BUILD + pickle.STOP)
    (tmp_path / "step-00000002" / ".metadata").write_bytes(crafted)
    with pytest.raises(RefusedCheckpointError, match="state set on the class"):
        load_sharded(_state(0), latest_sharded(tmp_path))
    assert dcp_metadata.Metadata.version is None


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_a_real_model_and_optimizer_checkpoint_loads_through_the_allowlist(tmp_path, one_rank):
    # Sharded parameters of several dtypes and layers, an optimizer's state, a buffer of int64, packed entries.
    torch.manual_seed(0)

    def make():
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv2d(2, 2, 1), torch.nn.BatchNorm1d(3))
        model[1].to(torch.float64)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        optimizer.step()
        return model, optimizer

    saved, saved_optimizer = make()
    model_state, optimizer_state = get_state_dict(saved, saved_optimizer)
    save_sharded({"model": model_state, "optimizer": optimizer_state, **_state(3)}, tmp_path, "step-00000003",
                 keep=2, timeout_s=30)
    torch.manual_seed(1)
    loaded, loaded_optimizer = make()
    model_state, optimizer_state = get_state_dict(loaded, loaded_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, **_state(0)}
    load_sharded(state, latest_sharded(tmp_path))
    def whole(tensor):
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    for name, tensor in get_state_dict(saved, saved_optimizer)[0].items():
        assert torch.equal(whole(state["model"][name]), whole(tensor)), name
    assert torch.equal(whole(state["optimizer"]["state"]["0.weight"]["exp_avg"]),
                       whole(saved_optimizer.state[saved[0].weight]["exp_avg"]))
    assert unpacked(state["extra"], tmp_path)["scheduler"]["last_epoch"] == 3


def _move_a_shard(checkpoint, outside, how: str) -> None:
    """Put the checkpoint's shard file in ``outside`` and make its metadata (or a link) lead there."""
    outside.mkdir()
    shard = next(checkpoint.glob("*.distcp"))
    moved = outside / shard.name
    shutil.move(shard, moved)
    if how == "link":
        shard.symlink_to(moved)
        return
    metadata = read_metadata(checkpoint)
    for stored in metadata.storage_data.values():
        stored.relative_path = str(moved) if how == "absolute" else f"../{outside.name}/{shard.name}"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "link"])
def test_a_storage_path_leading_outside_the_checkpoint_is_refused(tmp_path, one_rank, how):
    folder = tmp_path / "ckpt"
    save_sharded(_state(2), folder, "step-00000002", keep=2, timeout_s=30)
    _move_a_shard(folder / "step-00000002", tmp_path / "elsewhere", how)
    with pytest.raises(RefusedCheckpointError, match=r"refused checkpoint .*step-00000002: .*distcp leads to "
                                                     r".*elsewhere.*distcp, outside"):
        load_sharded(_state(0), latest_sharded(folder))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "linked_folder", "linked_latest"])
def test_a_latest_leading_outside_the_folder_is_refused(tmp_path, one_rank, how):
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    save_sharded(_state(2), elsewhere, "step-00000002", keep=2, timeout_s=30)  # a complete checkpoint, outside
    save_sharded(_state(4), folder, "step-00000004", keep=2, timeout_s=30)
    if how == "dotdot":
        (folder / LATEST).write_text("../elsewhere/step-00000002\n")
    elif how == "absolute":
        (folder / LATEST).write_text(f"{elsewhere / 'step-00000002'}\n")
    elif how == "linked_folder":
        (folder / "step-00000009").symlink_to(elsewhere / "step-00000002")
        (folder / LATEST).write_text("step-00000009\n")
    else:
        (folder / LATEST).unlink()
        (folder / LATEST).symlink_to(elsewhere / LATEST)
    with pytest.raises(RefusedCheckpointError, match=r"refused checkpoint .*ckpt: .*latest (names|leads to) .*"
                                                     r"elsewhere"):
        latest_sharded(folder)


@pytest.mark.parametrize("dies_at", [1, 2])
def test_a_re_save_killed_between_its_renames_resumes_from_a_complete_checkpoint(tmp_path, one_rank, monkeypatch,
                                                                                dies_at):
    # The same step saved again (a run resumed from an older save): the old code removed the folder before it
    # renamed the new one into place, and ``latest`` named nothing in between.
    save_sharded(_state(2), tmp_path, "step-00000002", keep=2, timeout_s=30)
    save_sharded(_state(4), tmp_path, "step-00000004", keep=2, timeout_s=30)
    replace, calls = os.replace, []

    def dies(source, target):
        calls.append(target)
        if len(calls) == dies_at:
            raise KeyboardInterrupt("killed between the renames")
        replace(source, target)

    monkeypatch.setattr(os, "replace", dies)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(_state(40), tmp_path, "step-00000004", keep=2, timeout_s=30)
    monkeypatch.setattr(os, "replace", replace)
    state = _state(0)
    load_sharded(state, latest_sharded(tmp_path))
    assert state["weights"][0].item() in (4.0, 40.0)
    save_sharded(_state(6), tmp_path, "step-00000006", keep=2, timeout_s=30)  # and the next save leaves one of each
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names[0] == LATEST and names[1].startswith("step-00000004") and names[2:] == ["step-00000006"]


def test_a_re_save_is_named_by_latest_and_replaces_the_old_folder(tmp_path, one_rank):
    save_sharded(_state(4), tmp_path, "step-00000004", keep=2, timeout_s=30)
    final = save_sharded(_state(40), tmp_path, "step-00000004", keep=2, timeout_s=30)
    assert latest_sharded(tmp_path) == final and final.name.startswith("step-00000004.")
    assert sorted(path.name for path in tmp_path.iterdir()) == [LATEST, final.name]
    state = _state(0)
    load_sharded(state, final)
    assert torch.equal(state["weights"], torch.full((4,), 40.0))


def test_what_killed_saves_left_goes_at_the_next_save(tmp_path, one_rank):
    save_sharded(_state(2), tmp_path, "step-00000002", keep=2, timeout_s=30)
    (tmp_path / ".step-00000004.0badf00d.tmp").mkdir()
    (tmp_path / ".step-00000004.0badf00d.tmp" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".latest.deadbeef.tmp").write_bytes(b"step-")
    save_sharded(_state(6), tmp_path, "step-00000006", keep=2, timeout_s=30)
    assert sorted(path.name for path in tmp_path.iterdir()) == [LATEST, "step-00000002", "step-00000006"]


def test_one_rank_sees_its_own_folder(tmp_path, one_rank):
    check_shared(tmp_path, 30)
    assert list(tmp_path.iterdir()) == []
