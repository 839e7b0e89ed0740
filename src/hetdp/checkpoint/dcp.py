"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written atomically and read without running
code or reading outside their folder.

A DCP save rewrites a folder's shard files in place, so a save killed midway
leaves a folder of mixed steps, which nothing in DCP's metadata tells from a
complete one, so it may load without an error. Here each save
goes to a fresh folder, renamed into place once every rank wrote its part, and
a ``latest`` file, replaced atomically, names the newest complete one. A save
of a step already saved goes to a folder of its own name too: at every instant
``latest`` names a complete folder. The next save removes what killed saves
left behind.

DCP reads ``.metadata`` with ``pickle`` and every entry that is not a tensor with
``torch.load(weights_only=False)``: a crafted checkpoint runs its code on every
rank that loads it. The reader here unpickles the metadata with an exact
allowlist (``_GLOBALS``: no dotted name is followed, no module imported, no state
set on anything but DCP's own records), checks that every file it names lies
inside the checkpoint's folder, and loads the other entries as plain data only;
a refusal is a ``RefusedCheckpointError`` (DCP's own ``CheckpointException``
derives from ``BaseException``, which ``except Exception`` misses).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import secrets
import shutil
from pathlib import Path, PosixPath, WindowsPath
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from hetdp.checkpoint.files import RefusedCheckpointError
from hetdp.errors import CheckpointError, ConfigError
from hetdp.files import atomic_write
from hetdp.runtime import barrier, peer_failures

LATEST = "latest"
"""The file naming the newest complete checkpoint folder of a checkpoint folder."""

_SHARED = ".shared"
"""The file rank 0 writes in a checkpoint folder to learn whether every rank sees it."""

_LEFT_BY_KILLED_SAVES = re.compile(r"\.(step-[^/]+|latest|\.shared)\.[0-9a-f]{8}\.tmp")
"""The staging folders and half-written ``latest`` files a save killed midway leaves."""

_RECORDS = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
            MetadataIndex, StorageMeta, _StorageInfo)
"""DCP's records in a ``.metadata``: the only objects whose state it may set."""

_GLOBALS: dict[tuple[str, str], Any] = {
    **{(value.__module__, value.__qualname__): value
       for value in (*_RECORDS, _MEM_FORMAT_ENCODING, torch.Size, torch.serialization._get_layout,
                     PosixPath, WindowsPath)},
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
"""Every global a DCP ``.metadata`` may name, as the exact ``(module, qualified name)`` pickle writes, and the object
it stands for: DCP's records, the memory format's encoding, shapes, layouts (by name), dtypes, and the path of the
folder it was saved to (recorded from real checkpoints of a model, its optimizer and hetdp's entries, torch 2.13)."""


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that builds nothing but ``_GLOBALS`` and plain data.

    Python's pure unpickler, so that its BUILD can be replaced: the stock one sets any state on anything, classes
    included. Every callable a pickle can reach is one of ``_GLOBALS``; persistent ids are refused by the base.
    """

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _GLOBALS[module, name]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name}") from None

    def _build(self) -> None:
        state = self.stack.pop()
        record = self.stack[-1]
        kind = type(record)
        if kind not in _RECORDS:
            raise pickle.UnpicklingError(f"state set on {_named(record)}")
        if "__setstate__" in vars(kind):  # TensorProperties: a tuple, its memory format encoded
            if not isinstance(state, tuple):
                raise pickle.UnpicklingError(f"a {kind.__name__} of state {_named(state)}")
            record.__setstate__(state)
            return
        fields = {field.name for field in dataclasses.fields(kind)}
        if not isinstance(state, dict) or not set(state) <= fields:
            raise pickle.UnpicklingError(f"a {kind.__name__} of state {_named(state)}")
        record.__dict__.update(state)

    dispatch[pickle.BUILD[0]] = _build


def _named(value: Any) -> str:
    """What ``value`` is, in a refusal: a class by its name, anything else by its type's."""
    kind = value if isinstance(value, type) else type(value)
    return f"{'the class ' if isinstance(value, type) else 'a '}{kind.__module__}.{kind.__qualname__}"


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint folder ``path``, unpickled through the allowlist, every file it names
    checked to lie inside ``path``.

    Raises:
        RefusedCheckpointError: it refers to anything else (it may have been crafted to run code), or names a file
            outside ``path``; nothing in it was run.
        CheckpointError: it is missing or unreadable.
    """
    _inside(path / ".metadata", path, path)
    try:
        with open(path / ".metadata", "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as error:
        raise RefusedCheckpointError(f"refused checkpoint {path}: its metadata refers to {error}, not to DCP's own "
                                     "records, and loading it could run code; nothing in it was run") from None
    except Exception as error:  # a crafted or damaged pickle fails in any way; nothing of it was called
        raise CheckpointError(f"cannot read checkpoint {path}: {type(error).__name__}: {error}") from error
    if not isinstance(metadata, Metadata):
        raise RefusedCheckpointError(f"refused checkpoint {path}: its metadata is {_named(metadata)}")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"cannot read checkpoint {path}: its metadata names no files")
    for index, stored in metadata.storage_data.items():
        relative = getattr(stored, "relative_path", None)
        if not isinstance(relative, str):
            raise CheckpointError(f"cannot read checkpoint {path}: its metadata names no file for {index}")
        _inside(path / relative, path, path)
    return metadata


def _inside(target: Path, root: Path, checkpoint: Path) -> Path:
    """``target`` resolved (links followed), which must lie inside ``root`` resolved.

    Raises:
        RefusedCheckpointError: it does not; the error names ``checkpoint``, ``target`` and where it leads.
    """
    resolved = target.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise RefusedCheckpointError(f"refused checkpoint {checkpoint}: {target} leads to {resolved}, outside "
                                     f"{root}; a checkpoint reads nothing outside its folder")
    return resolved


class _SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata unpickled through the allowlist and its files checked."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner, with every entry that is not a tensor loaded as plain data only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def packed(value: Any) -> bytes:
    """``value`` (tensors and plain data) as one opaque entry of a checkpoint: DCP flattens nested dicts into keys and
    loads only the keys the loading state has, so a part whose shape may differ between the saving run and the
    resuming one (a scheduler's state, or none) travels whole. ``unpacked`` reads it back."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpacked(entry: bytes, path: Path) -> Any:
    """Read back what ``packed`` made, as tensors and plain data only.

    Raises:
        RefusedCheckpointError: it holds anything else (it may have been crafted to run code); nothing in it ran.
    """
    try:
        return torch.load(io.BytesIO(entry), weights_only=True)
    except pickle.UnpicklingError:
        raise RefusedCheckpointError(f"refused checkpoint {path}: an entry holds objects other than tensors and plain "
                                     "data, and loading them could run code; nothing in it was run") from None


def check_shared(folder: Path, timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
    """Check that every rank of ``group`` sees the same ``folder`` (collective): rank 0 writes a fresh nonce in it and
    every rank reads it back.

    Raises:
        ConfigError: (on every rank) some ranks read no such nonce there: the error names them.
    """
    rank = dist.get_rank(group)
    nonce = [secrets.token_hex(8) if rank == 0 else None]
    with peer_failures("checking that every rank sees the checkpoint folder", timeout_s, group):
        dist.broadcast_object_list(nonce, group=group, group_src=0)
        if rank == 0:
            atomic_write(folder / _SHARED, lambda handle: handle.write(nonce[0].encode()))
        barrier(group, timeout_s)
        try:
            sees = (folder / _SHARED).read_text() == nonce[0]
        except OSError:
            sees = False
        seen: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, sees, group=group)
    if rank == 0:
        (folder / _SHARED).unlink(missing_ok=True)
    blind = [str(other) for other, sees in enumerate(seen) if not sees]
    if blind:
        raise ConfigError(f"checkpoint folder {folder} is not one folder on every rank: rank{'s' * (len(blind) > 1)} "
                          f"{', '.join(blind)} cannot read what rank 0 wrote there (a folder local to each machine?); "
                          "give a folder on a filesystem that every rank shares")


def save_sharded(state: dict[str, Any], folder: Path, name: str, *, keep: int, timeout_s: float,
                 group: dist.ProcessGroup | None = None) -> Path:
    """Save ``state`` (collective: every rank writes its shards) to ``folder / name`` atomically: into a fresh
    folder renamed into place once every rank wrote its part, then named by ``latest``; the ``keep`` newest saves
    stay, and what killed saves left goes. A save of a step already saved goes to ``name.TOKEN`` and replaces the
    old one once ``latest`` names it. Every rank must reach ``folder``; returns the folder saved to."""
    chosen: list[Any] = [None]
    if dist.get_rank(group) == 0:
        token = secrets.token_hex(4)
        chosen[0] = (token, f"{name}.{token}" if (folder / name).exists() else name)
    with peer_failures("agreeing on a checkpoint's folder", timeout_s, group):
        dist.broadcast_object_list(chosen, group=group, group_src=0)
    token, final_name = chosen[0]
    staging, final = folder / f".{name}.{token}.tmp", folder / final_name
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging), sync_files=True), process_group=group)
    barrier(group, timeout_s)  # every rank's shards are on disk
    if dist.get_rank(group) == 0:
        os.replace(staging, final)  # a name no folder has: ``latest`` still names the previous complete save
        _sync_folder(folder)
        atomic_write(folder / LATEST, lambda handle: handle.write(f"{final_name}\n".encode()))
        _sync_folder(folder)
        _prune(folder, final, keep)
    barrier(group, timeout_s)  # nobody reads ``latest`` before it names this save
    return final


def _prune(folder: Path, final: Path, keep: int) -> None:
    """Remove from ``folder`` all but the ``keep`` newest saves (``final`` the newest of its step) and what killed
    saves left."""
    def step(entry: Path) -> str:
        return entry.name.partition(".")[0]

    saves = [entry for entry in folder.iterdir() if entry.name.startswith("step-") and entry.is_dir()]
    newest: dict[str, Path] = {}  # one a step: ``final``, else the last written (a killed re-save leaves two)
    for entry in sorted(saves, key=lambda entry: (step(entry), entry == final, entry.stat().st_mtime)):
        newest[step(entry)] = entry
    kept = {final, *(newest[name] for name in sorted(newest, reverse=True)[:keep])}
    for entry in saves:
        if entry not in kept:
            shutil.rmtree(entry, ignore_errors=True)
    for entry in folder.iterdir():
        if _LEFT_BY_KILLED_SAVES.fullmatch(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def latest_sharded(folder: Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (None if none).

    Raises:
        RefusedCheckpointError: ``latest`` or the folder it names leads outside ``folder``.
        CheckpointError: ``latest`` names no folder.
    """
    pointer = folder / LATEST
    if not pointer.is_file():
        return None
    _inside(pointer, folder, folder)
    named = pointer.read_text().strip()
    path, resolved = folder / named, (folder / named).resolve()
    if resolved.parent != folder.resolve():
        raise RefusedCheckpointError(f"refused checkpoint {folder}: {pointer} names {named!r}, which leads to "
                                     f"{resolved}, not to a checkpoint folder inside {folder}")
    if not resolved.is_dir():
        raise CheckpointError(f"{pointer} names {path.name!r}, which is not a checkpoint folder in {folder}")
    return path


def load_sharded(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None = None) -> None:
    """Load the entries of ``state`` from the checkpoint ``path`` in place (collective: DCP reshards to this run's
    ranks), as tensors and plain data only, from files inside ``path`` only.

    Raises:
        RefusedCheckpointError: the checkpoint holds anything else, or names files outside ``path``; nothing in it
            ran.
        CheckpointError: it cannot be read, or lacks an entry of ``state``.
    """
    read_metadata(path)  # refused here, on every rank, before DCP unpickles anything
    try:
        dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_PlainDataPlanner(), process_group=group)
    except CheckpointException as error:
        failures = [wrapped[0] for wrapped in error.failures.values()]  # (exception, traceback) per failed rank
        cause = failures[0] if failures else error
        text = (str(cause).splitlines() or [type(cause).__name__])[0]
        if "Weights only load failed" in str(cause):
            raise RefusedCheckpointError(f"refused checkpoint {path}: an entry holds objects other than tensors and "
                                         "plain data, and loading them could run code; nothing in it was "
                                         "run") from None
        raise CheckpointError(f"cannot read checkpoint {path}: {text}") from None
