"""Reading DCP files without running code from them.

torch 2.13's FileSystemReader reads `.metadata` with plain `pickle.load`, and DefaultLoadPlanner reads every
non-tensor item with `torch.load(weights_only=False)`: a crafted checkpoint runs any code it likes. torch's
own safe path does not fit `.metadata` (its weights-only unpickler rejects pickle protocol 4, which DCP
writes, and `torch.load` expects its own container format), so `.metadata` goes through a restricted
unpickler that admits only DCP's metadata classes, dtypes and sizes; non-tensor items go through
`torch.load(weights_only=True)`. Tensors were already read with weights_only=True by DCP.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

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
    _check_data_files(Path(directory), metadata)
    return metadata


def _check_data_files(directory: Path, metadata: Metadata) -> None:
    """Every item lies inside a file of this directory, and within that file's length."""
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        if not isinstance(info, _StorageInfo) or Path(info.relative_path).name != info.relative_path \
                or info.relative_path in ("", ".", ".."):
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
                f"refused to load the checkpoint's item {key!r}: it is not plain data ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). partita loads with weights_only semantics and never "
                "runs code from a checkpoint; it was damaged or tampered with. Load a checkpoint you trust.") from None
