"""Reading DCP files without running code from them.

torch 2.13's FileSystemReader reads `.metadata` with plain `pickle.load`, and DefaultLoadPlanner reads every
non-tensor item with `torch.load(weights_only=False)`: a crafted checkpoint runs any code it likes. torch's
own safe path does not fit `.metadata` (its weights-only unpickler rejects pickle protocol 4, which DCP
writes, and `torch.load` expects its own container format), so `.metadata` goes through a restricted
unpickler that admits only DCP's metadata classes, dtypes and sizes; non-tensor items go through
`torch.load(weights_only=True)`. Tensors were already read with weights_only=True by DCP.

Unpickling admits only the right classes, not the right values in them: a crafted `.metadata` can hold a number
where a file name belongs. Every field DCP reads is checked before DCP reads it, so that such a file is a
CheckpointError that names it, not a TypeError from deep inside DCP (or no error at all).
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import ReadItem

from partita.checkpoint.manifest import is_file_name
from partita.errors import CheckpointError

METADATA = ".metadata"
UNREADABLE = "The checkpoint's data could not be read: a data file was changed or damaged. Load an earlier checkpoint"

_ALLOWED = {(c.__module__, c.__qualname__): c for c in (
    dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta,
    dcp_metadata.TensorStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.BytesStorageMetadata, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo,
    torch.Size, torch.serialization._get_layout,  # layouts by name, from torch's own fixed table
    pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath,  # DCP records the path
)}


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """pickle, but the only callables a file can reach are the classes in _ALLOWED and torch's dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):  # no getattr: no lazy imports
            return torch.__dict__[name]
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _RefusedGlobal(f"persistent id {pid!r}")


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of a checkpoint, read without running code, with its data files checked to exist."""
    path = Path(directory) / METADATA
    if path.exists() and not path.is_file():  # a FIFO or a device (/dev/zero) would block the read or never end
        raise CheckpointError(f"{path} is not a regular file; the checkpoint is damaged or crafted. Load an earlier "
                              "checkpoint, or one you trust.")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no {METADATA}: the checkpoint is incomplete or damaged (a file was "
                              "deleted, or it was copied while being written). Load an earlier checkpoint.") from None
    except _RefusedGlobal as e:
        raise CheckpointError(
            f"refused to load {path}: it asks to run or build {e}, which is not part of DCP's metadata. partita "
            "never runs code from a checkpoint; this file was not written by torch.distributed.checkpoint or was "
            "tampered with. Delete the checkpoint and load one you trust.") from None
    except Exception as e:  # noqa: BLE001 - any failure to parse is the same problem for the user
        raise CheckpointError(f"{path} is corrupt ({type(e).__name__}: {e}); the checkpoint is damaged. Load an "
                              "earlier checkpoint.") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; the checkpoint is "
                              "damaged or foreign. Load another checkpoint.")
    try:
        _check_structure(metadata)
    except _Malformed as e:
        raise CheckpointError(f"{path} is malformed: {e}. partita.save never writes this: the file was damaged or "
                              "tampered with. Load another checkpoint.") from None
    _check_data_files(Path(directory), metadata)
    return metadata


class _Malformed(ValueError):
    pass


_ABSENT = object()


def _field(obj, name: str, fits, what: str, expected: str):
    """obj.name, if `fits` it."""
    value = getattr(obj, name, _ABSENT)
    if value is _ABSENT:
        raise _Malformed(f"{what} has no {name}")
    if not fits(value):
        raise _Malformed(f"{what} has {name} {value!r}, not {expected}")
    return value


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_shape(value) -> bool:
    return isinstance(value, torch.Size) and all(d >= 0 for d in value)


def _check_structure(metadata: Metadata) -> None:
    """Every field that DCP and partita read has the type (and range) DCP writes."""
    items = _field(metadata, "state_dict_metadata", lambda v: isinstance(v, dict), "the metadata", "a dict")
    storage = _field(metadata, "storage_data", lambda v: isinstance(v, dict), "the metadata", "a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
            raise _Malformed(f"an item of its storage_data is named {getattr(index, 'fqn', index)!r}, not by a "
                             "string")
        what = f"the storage of item {index.fqn!r}"
        _field(index, "offset", lambda v: v is None or _is_shape(v), what, "an offset (torch.Size)")
        if not isinstance(info, _StorageInfo):
            raise _Malformed(f"{what} is {info!r}, not a _StorageInfo")
        path = getattr(info, "relative_path", _ABSENT)
        if path is _ABSENT:
            raise _Malformed(f"{what} has no file path")
        if not isinstance(path, str):
            raise _Malformed(f"{what} has file path {path!r}, not a file name")
        _field(info, "offset", _is_count, what, "a byte offset")
        _field(info, "length", _is_count, what, "a length in bytes")
        _field(info, "transform_descriptors", lambda v: v is None or (isinstance(v, (list, tuple)) and all(
            isinstance(d, str) for d in v)), what, "a list of names")
    for key, md in items.items():
        if not isinstance(key, str):
            raise _Malformed(f"an item of its state_dict_metadata is named {key!r}, not by a string")
        if isinstance(md, BytesStorageMetadata):
            if MetadataIndex(key) not in storage:
                raise _Malformed(f"item {key!r} has no storage (no entry in storage_data)")
        elif isinstance(md, TensorStorageMetadata):
            _check_tensor(key, md, storage)
        else:
            raise _Malformed(f"item {key!r} is {md!r}, not a tensor's or bytes' metadata")


def _check_tensor(key: str, md: TensorStorageMetadata, storage: dict) -> None:
    what = f"item {key!r}"
    properties = _field(md, "properties", lambda v: isinstance(v, TensorProperties), what, "TensorProperties")
    _field(properties, "dtype", lambda v: isinstance(v, torch.dtype), what, "a torch.dtype")
    size = _field(md, "size", _is_shape, what, "a shape (torch.Size of sizes >= 0)")
    chunks = _field(md, "chunks", lambda v: isinstance(v, list), what, "a list of chunks")
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise _Malformed(f"{what} has chunk {chunk!r}, not a ChunkStorageMetadata")
        offsets = _field(chunk, "offsets", _is_shape, f"a chunk of {what}", "offsets (torch.Size)")
        sizes = _field(chunk, "sizes", _is_shape, f"a chunk of {what}", "sizes (torch.Size)")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise _Malformed(f"{what} has a chunk at {list(offsets)} of {list(sizes)}, outside its size {list(size)}")
        if MetadataIndex(key, offsets) not in storage:
            raise _Malformed(f"{what} has a chunk at {list(offsets)} with no storage (no entry in storage_data)")


def _check_data_files(directory: Path, metadata: Metadata) -> None:
    """Every item lies inside a file of this directory, and within that file's length."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        if not is_file_name(info.relative_path):
            raise CheckpointError(f"{directory / METADATA} points outside the checkpoint ({info!r}); it was "
                                  "tampered with. Delete the checkpoint and load one you trust.")
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{directory} is incomplete: its data file {name} is missing. Load an earlier "
                                  "checkpoint.")
        if file.stat().st_size < end:
            raise CheckpointError(f"{directory} is incomplete: its data file {name} has {file.stat().st_size} bytes, "
                                  f"the metadata says at least {end}. Load an earlier checkpoint.")


def data_files(metadata: Metadata) -> set[str]:
    """The names of the files that hold the checkpoint's items (checked by `read_metadata`)."""
    return {info.relative_path for info in metadata.storage_data.values()}


class CheckedReader(FileSystemReader):
    """DCP's file reader, given metadata already read by `read_metadata` instead of unpickling it again."""

    def __init__(self, directory: Path, metadata: Metadata):
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self._metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner for flat state dicts, reading non-tensor items with weights_only=True."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever torch refused, the item cannot be trusted
            raise CheckpointError(
                f"refused to load the checkpoint's item {key!r}: it is not plain data ({torch_refusal(e)}). partita "
                "reads only tensors and plain values (numbers, strings, lists, dicts) from a checkpoint and never "
                "runs code from one: it was damaged or tampered with. Load a checkpoint you trust.") from None


# torch's sentences that advise loading anyway (weights_only=False, allowlisting globals): partita offers no way
# around its refusal, and a user must not be invited to turn the protection off
_ADVICE = re.compile(r"weights_only|trust|safe_globals|file an issue|documentation|can still be loaded", re.I)
_SENTENCE_END = re.compile(r"(?<=[.:])\s+|\n+")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def torch_refusal(error: Exception) -> str:
    """What torch's weights-only unpickler refused and why ("Trying to load unsupported GLOBAL posix.system ..."),
    without its advice on how to load the file regardless."""
    sentences = _SENTENCE_END.split(_ANSI.sub("", str(error)))
    kept = " ".join(s.strip() for s in sentences if s.strip() and not _ADVICE.search(s))
    return f"{type(error).__name__}: {kept}" if kept else type(error).__name__
