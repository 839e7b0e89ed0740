"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), written atomically and read without running
code.

A DCP save rewrites a folder's shard files in place, so a save killed midway
leaves a folder of mixed steps that may even load without an error (the sharded
spike: every tensor of a model-only state a mix of two steps). Here each save
goes to a fresh folder, renamed into place once every rank wrote its part, and
a ``latest`` file, replaced atomically, names the newest complete one.

DCP reads ``.metadata`` with ``pickle`` and every entry that is not a tensor with
``torch.load(weights_only=False)``: a crafted checkpoint runs its code on every
rank that loads it. The reader here unpickles the metadata through an allowlist
of DCP's own classes and loads those entries as plain data only; a refusal is a
``RefusedCheckpointError`` (DCP's own ``CheckpointException`` derives from
``BaseException``, which ``except Exception`` misses).
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hetdp.checkpoint.files import RefusedCheckpointError
from hetdp.errors import CheckpointError
from hetdp.files import atomic_write
from hetdp.runtime import barrier, peer_failures

LATEST = "latest"
"""The file naming the newest complete checkpoint folder of a checkpoint folder."""

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
"""The globals a DCP ``.metadata`` refers to besides DCP's metadata classes and torch's dtypes (recorded from real
checkpoints of a model, its optimizer and a scheduler, on torch 2.13)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == _METADATA_MODULE and not name.startswith("_"):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint folder ``path``, unpickled through the allowlist.

    Raises:
        RefusedCheckpointError: it refers to anything else (it may have been crafted to run code); nothing ran.
        CheckpointError: it is missing or unreadable.
    """
    try:
        with open(path / ".metadata", "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except pickle.UnpicklingError as error:
        raise RefusedCheckpointError(f"refused checkpoint {path}: its metadata refers to {error}, not to DCP's own "
                                     "classes, and loading it could run code; nothing in it was run") from None
    except (OSError, EOFError, ValueError, AttributeError) as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(error).__name__}: {error}") from error
    if not isinstance(metadata, Metadata):
        raise RefusedCheckpointError(f"refused checkpoint {path}: its metadata is a {type(metadata).__name__}")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata unpickled through the allowlist."""

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


def save_sharded(state: dict[str, Any], folder: Path, name: str, *, keep: int, timeout_s: float,
                 group: dist.ProcessGroup | None = None) -> Path:
    """Save ``state`` (collective: every rank writes its shards) to ``folder / name`` atomically: into a fresh
    folder renamed into place once every rank wrote its part, then named by ``latest``; the ``keep`` newest saves
    stay. Every rank must reach ``folder``."""
    token = [secrets.token_hex(4) if dist.get_rank(group) == 0 else None]
    with peer_failures("agreeing on a checkpoint's folder", timeout_s, group):
        dist.broadcast_object_list(token, group=group, group_src=0)
    staging, final = folder / f".{name}.{token[0]}.tmp", folder / name
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(staging), sync_files=True), process_group=group)
    barrier(group, timeout_s)  # every rank's shards are on disk
    if dist.get_rank(group) == 0:
        if final.exists():  # a save of the same step again (a run resumed before its next save): replaced whole
            shutil.rmtree(final)
        os.replace(staging, final)
        atomic_write(folder / LATEST, lambda handle: handle.write(f"{name}\n".encode()))
        _sync_folder(folder)
        for old in sorted((path for path in folder.iterdir() if path.is_dir() and path.name.startswith("step-")),
                          reverse=True)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(group, timeout_s)  # nobody reads ``latest`` before it names this save
    return final


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def latest_sharded(folder: Path) -> Path | None:
    """The newest complete checkpoint in ``folder`` (None if none)."""
    pointer = folder / LATEST
    if not pointer.is_file():
        return None
    path = folder / pointer.read_text().strip()
    if not path.is_dir() or path.parent != folder:
        raise CheckpointError(f"{pointer} names {path.name!r}, which is not a checkpoint folder in {folder}")
    return path


def load_sharded(state: dict[str, Any], path: Path, group: dist.ProcessGroup | None = None) -> None:
    """Load the entries of ``state`` from the checkpoint ``path`` in place (collective: DCP reshards to this run's
    ranks), as tensors and plain data only.

    Raises:
        RefusedCheckpointError: the checkpoint holds anything else; nothing in it ran.
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
