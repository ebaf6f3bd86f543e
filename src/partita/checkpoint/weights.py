"""Model weights from a file on disk, for `parallelize(..., weights=PATH)`: each rank reads only its tensors.

    weights = open_weights(path)                       # the format is found from what is at `path`
    state = module.state_dict(keep_vars=True)
    sources = match_weights(weights, state, strict=True)  # model name -> file name; raises if they do not fit
    tensors = weights.read({sources[n]: state[n].dtype for n in mine}, device)   # keyed by the file's names

PATH is a `torch.save` state dict (or a dict whose "state_dict" or "model" entry is one), a safetensors file, a
folder of shards with an index as Hugging Face writes them (`model.safetensors.index.json`,
`pytorch_model.bin.index.json`; a folder without an index and with one `.safetensors` file, or else a
`pytorch_model.bin`, is that file), or a partita checkpoint (the directory given to `partita.save`, whose
latest checkpoint is read, or one of its step-* directories: its model tensors, not its optimizer state).
Names are the model's state-dict names; no prefix is added or removed, but an error says when the file's names
and the model's differ by one. A tied weight may be in the file under any one of its names. Shapes must match
exactly; a tensor stored in another dtype than the model's is converted on read, as `load_state_dict` does.

Shapes and dtypes come from headers and metadata alone; `read` reads the named tensors and no others
(safetensors and torch.distributed.checkpoint read by offset; a `torch.save` file is memory-mapped, so only the
pages of the tensors read are loaded); a partita checkpoint's files that hold them are first checked against the
checksums in its manifest. Nothing in a file is unpickled except through weights-only loading.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from partita.checkpoint import checksums, keys
from partita.checkpoint.collective import dcp_step
from partita.checkpoint.layout import LATEST, resolve
from partita.checkpoint.manifest import MANIFEST, read_manifest
from partita.checkpoint.unpickling import (METADATA, UNREADABLE, CheckedReader, WeightsOnlyLoadPlanner, read_metadata,
                                           torch_refusal)
from partita.errors import CheckpointError
from partita.runtime.host_copies import HostCopies

_SHOWN = 5  # names listed in an error before "and N more"
_ZIP = b"PK\x03\x04"  # torch.save's format since torch 1.6 is a zip archive
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # Hugging Face's names, preferred first
_TORCH_WEIGHTS = "pytorch_model.bin"  # what Hugging Face's save_pretrained writes without safetensors or shards
_NESTED = ("state_dict", "model")  # entries that hold the state dict in common training checkpoints

# safetensors' dtype names (its format's spec), torch's dtypes for them
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorInfo":
        return cls(tuple(tensor.shape), tensor.dtype)


class WeightFile(ABC):
    """Named tensors on disk: their shapes and dtypes without their data, and the data of the ones asked for."""

    def __init__(self, path: Path):
        self.path = path

    def infos(self) -> dict[str, TensorInfo]:
        """Every tensor's name, shape and dtype, read from headers or metadata (no tensor data)."""
        return self._infos

    @cached_property
    def _infos(self) -> dict[str, TensorInfo]:
        return self._read_infos()

    @abstractmethod
    def _read_infos(self) -> dict[str, TensorInfo]:
        """infos(), read once."""

    @abstractmethod
    def _tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors as stored, on the CPU, one at a time (the caller converts each before the next)."""

    def read(self, wanted: Mapping[str, torch.dtype], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The named tensors, each on `device` and converted to the dtype given for it (as `load_state_dict`
        converts a tensor saved in another dtype); only their data is read. Each owns its memory (none is a view
        into the file). Names are the file's: see `match_weights`."""
        names = list(wanted)
        unknown = [n for n in names if n not in self._infos]
        if unknown:
            raise CheckpointError(f"{self.path} holds no tensor named {_some(unknown)}; read only names that "
                                  "match_weights returned")
        copies = HostCopies(device)
        out, not_finite = {}, []
        for n, t in self._tensors(names):
            # a safetensors file has no checksums: a damaged value is seen only as one no training makes
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                not_finite.append(n)
            out[n] = copies.to(t, wanted[n], copy=True)
        copies.finish()
        if not_finite:
            warnings.warn(f"{self.path}: {len(not_finite)} of the tensors read hold NaN or infinite values: "
                          f"{_some(not_finite)}. The model starts from them and its loss will not be finite; check "
                          "the file (a damaged copy, or saved after training diverged).", stacklevel=2)
        return out


def open_weights(path: str | Path) -> WeightFile:
    """The weights at `path`, in whichever format they are (see the module's docstring)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"weights={str(path)!r}: the path does not exist. Pass a torch.save file, a safetensors "
                              "file, a folder of safetensors shards with its index, or a partita checkpoint.")
    if p.is_dir():
        return _open_folder(p)
    return _open_file(p)


def match_weights(weights: WeightFile, model_state: Mapping[str, object], *, strict: bool) -> dict[str, str]:
    """For each of the model's tensors, the name of the file's tensor that holds its value.

    `model_state` is `module.state_dict(keep_vars=True)`: names that are one tensor in the model (tied weights)
    are filled from whichever of them the file holds (Hugging Face saves a tied weight once). Values that are not
    tensors (a module's `get_extra_state()`) are not weights and are skipped.

    Raises CheckpointError naming the model's tensors the file lacks, those it holds in another shape, and, when
    `strict`, the file's tensors the model does not have. A dtype may differ: `read` converts.
    """
    infos = weights.infos()
    tensors = {n: t for n, t in model_state.items() if isinstance(t, torch.Tensor)}
    tied: dict[int, list[str]] = {}  # a tensor of the model -> its names (several when tied)
    for name, tensor in tensors.items():
        tied.setdefault(id(tensor), []).append(name)
    sources: dict[str, str] = {}
    missing: list[list[str]] = []  # the names of each tensor the file lacks
    for names in tied.values():
        found = [n for n in names if n in infos]
        if found:
            sources.update(dict.fromkeys(names, found[0]))
        else:
            missing.append(names)
    wrong = [f"{n} ({list(infos[n].shape)} in the file, {list(tensors[n].shape)} in the model)" for n in tensors
             if n in infos and infos[n].shape != tuple(tensors[n].shape)]
    extra = [n for n in infos if n not in tensors]
    problems = []
    if missing:
        lacked = [" or ".join(names) for names in missing]
        problems.append(f"{len(missing)} of the model's tensors are not in it ({_some(lacked)})")
    if wrong:
        problems.append(f"{len(wrong)} {'has' if len(wrong) == 1 else 'have'} another shape: {_some(wrong)}")
    if extra and strict:
        problems.append(f"{len(extra)} of its tensors are not in the model ({_some(extra)}); pass strict=False to "
                        "ignore tensors the model does not have")
    if problems:
        fix = _prefix_hint(missing, extra) or "Pass the weights saved from this model (the same configuration)."
        raise CheckpointError(f"{weights.path} does not fit this model: {'; '.join(problems)}. {fix}")
    return sources


@dataclass(frozen=True)
class ModelWeights:
    """A weight file's tensors under the model's names, for `runtime.materialize` (its WeightReader)."""

    file: WeightFile
    sources: dict[str, str]  # the model's state_dict name -> the file's name for its value
    dtypes: dict[str, torch.dtype]  # the model's state_dict name -> the model's dtype for it

    def names(self) -> frozenset[str]:
        return frozenset(self.sources)

    def read(self, names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The named tensors (the model's names), in the model's dtypes, on `device`; only their data is read."""
        values = self.file.read({self.sources[n]: self.dtypes[n] for n in names}, device)
        return {n: values[self.sources[n]] for n in names}


def model_weights(path: str | Path, module: torch.nn.Module, *, strict: bool) -> ModelWeights:
    """The weights at `path` matched to `module` (see match_weights: raises when they do not fit). Reads headers
    and metadata only."""
    state = module.state_dict(keep_vars=True)
    weights = open_weights(path)
    sources = match_weights(weights, state, strict=strict)
    return ModelWeights(weights, sources, {n: state[n].dtype for n in sources})


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return f"{shown} and {len(names) - _SHOWN} more" if len(names) > _SHOWN else shown


def _prefix_hint(missing: list[list[str]], extra: list[str]) -> str | None:
    """What to do when every missing tensor is in the file under its name with one prefix added or removed."""
    others = set(extra)
    for name in missing[0] if missing else ():
        for other in extra:
            if other.endswith("." + name):  # the file's names have a prefix the model's lack
                prefix, added = other[:-len(name)], True
            elif name.endswith("." + other):  # the model's names have a prefix the file's lack
                prefix, added = name[:-len(other)], False
            else:
                continue
            if all(any((prefix + n if added else n.removeprefix(prefix)) in others
                       for n in names if added or n.startswith(prefix)) for names in missing):
                return _prefix_fix(prefix, added, name, other)
    return None


def _prefix_fix(prefix: str, added: bool, name: str, other: str) -> str:
    if added:
        return (f"The file's names start with {prefix!r} where the model's do not (e.g. {other} for {name}): pass "
                f"the model that holds this one as its {prefix[:-1]!r}, or save the weights with the prefix removed "
                f"({{k.removeprefix({prefix!r}): v for k, v in state.items()}}).")
    return (f"The model's names start with {prefix!r} where the file's do not (e.g. {name} for {other}): pass the "
            f"module it holds as {prefix[:-1]!r}, or save the weights with the prefix added "
            f"({{{prefix!r} + k: v for k, v in state.items()}}).")


def _open_file(path: Path) -> WeightFile:
    with open(path, "rb") as f:
        head = f.read(9)
    if head.startswith(_ZIP):
        return _TorchFile(path)
    # safetensors: an 8-byte little-endian header length, then the JSON header
    if path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{"):
        return _SafetensorsFile(path)
    raise CheckpointError(f"{path} is neither a torch.save file nor a safetensors file. Pass a state dict saved with "
                          "torch.save (torch 1.6 or later; an older file: load it and save it again) or a "
                          ".safetensors file.")


def _open_folder(path: Path) -> WeightFile:
    if (path / MANIFEST).is_file() or (path / LATEST).exists() or any(path.glob("step-*")):
        return _PartitaCheckpoint(resolve(path))
    indexes = [path / n for n in _INDEXES if (path / n).is_file()] or sorted(path.glob("*.index.json"))
    if len(indexes) == 1 or (indexes and indexes[0].name in _INDEXES):
        return _ShardedFolder(indexes[0])
    if indexes:
        raise CheckpointError(f"{path} holds several shard indexes ({', '.join(i.name for i in indexes)}): pass the "
                              "one to read (its path).")
    files = sorted(path.glob("*.safetensors")) or [f for f in [path / _TORCH_WEIGHTS] if f.is_file()]
    if len(files) == 1:
        return _open_file(files[0])
    found = f"{len(files)} .safetensors files and no index" if files else "no weights partita reads"
    raise CheckpointError(f"{path} holds {found}. Pass a file (torch.save or safetensors), a folder with a shard "
                          f"index ({' or '.join(_INDEXES)}), or a directory written by partita.save.")


class _TorchFile(WeightFile):
    """A `torch.save` file, memory-mapped: unpickling it reads no tensor data."""

    @cached_property
    def _state(self) -> dict[str, torch.Tensor]:
        try:
            loaded = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - whatever torch refused, the file cannot be read as weights
            raise CheckpointError(f"cannot read {self.path} as weights ({torch_refusal(e)}). partita reads only "
                                  "tensors and plain values from a torch.save file and never runs code from one: "
                                  "save the model's state_dict() alone.") from None
        state = _state_dict_in(loaded)
        if state is None:
            what = f"a dict with entries {_some([repr(k) for k in loaded])}" if isinstance(loaded, dict) else \
                f"a {type(loaded).__name__}"
            raise CheckpointError(f"{self.path} holds {what}, not a state dict: pass a file saved with "
                                  "torch.save(model.state_dict(), path), or a dict whose 'state_dict' or 'model' "
                                  "entry is one.")
        return {n: t for n, t in state.items() if isinstance(t, torch.Tensor)}

    def _read_infos(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo.of(t) for n, t in self._state.items()}

    def _tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, self._state[n]) for n in names)


def _state_dict_in(loaded) -> dict | None:
    """The state dict in what torch.load returned: itself, or its "state_dict" or "model" entry."""
    if not isinstance(loaded, dict):
        return None
    if any(isinstance(v, torch.Tensor) for v in loaded.values()):
        return loaded
    return next((loaded[k] for k in _NESTED if isinstance(loaded.get(k), dict)
                 and any(isinstance(v, torch.Tensor) for v in loaded[k].values())), None)


def _safe_open(path: Path):
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError(f"{path} is a safetensors file, and this Python has no safetensors package to read "
                              "it: pip install safetensors") from None
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}). It is damaged "
                              "or in another format: pass a complete .safetensors file.") from None


class _SafetensorsFile(WeightFile):
    """A safetensors file: its JSON header holds every tensor's shape, dtype and byte range."""

    def _read_infos(self) -> dict[str, TensorInfo]:
        infos = {}
        with _safe_open(self.path) as f:
            for name in f.keys():
                piece = f.get_slice(name)
                dtype = piece.get_dtype()
                if dtype not in _SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{self.path}: tensor {name} has dtype {dtype}, which partita does not "
                                          "read; convert it to a torch dtype (float32, bfloat16, ...)")
                infos[name] = TensorInfo(tuple(piece.get_shape()), _SAFETENSORS_DTYPES[dtype])
        return infos

    def _tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        with _safe_open(self.path) as f:
            for name in names:
                yield name, f.get_tensor(name)


class _ShardedFolder(WeightFile):
    """Shards and an index whose weight_map names each tensor's shard; a shard is opened when it is needed."""

    def __init__(self, index: Path):
        super().__init__(index.parent)
        self.index = index
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(n, str) and isinstance(s, str)
                                                           for n, s in weight_map.items()):
                raise ValueError("its weight_map is not an object of names to file names")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a readable shard index ({type(e).__name__}: {e}). It is damaged "
                                  "or not an index: pass the folder that save_pretrained wrote.") from None
        outside = [s for s in weight_map.values() if Path(s).name != s or s in ("", ".", "..")]
        if outside:
            raise CheckpointError(f"{index} names shard {outside[0]!r}, which is not a file of its folder; the index "
                                  "is damaged or was tampered with.")
        self.shard_of: dict[str, str] = weight_map

    @cached_property
    def _shards(self) -> dict[str, WeightFile]:
        shards = {}
        for name in sorted(set(self.shard_of.values())):
            if not (self.path / name).is_file():
                raise CheckpointError(f"{self.path} is incomplete: its shard {name}, named in {self.index.name}, is "
                                      "missing. Download or copy the whole folder again.")
            shards[name] = _open_file(self.path / name)
        return shards

    def _read_infos(self) -> dict[str, TensorInfo]:
        infos = {}
        for tensor, shard in self.shard_of.items():
            held = self._shards[shard].infos()
            if tensor not in held:
                raise CheckpointError(f"{self.index} says tensor {tensor} is in {shard}, which does not hold it: the "
                                      "folder is damaged or mixes files of two saves. Download or copy it again.")
            infos[tensor] = held[tensor]
        return infos

    def _tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        by_shard: dict[str, list[str]] = {}
        for name in names:
            by_shard.setdefault(self.shard_of[name], []).append(name)
        for shard, held in by_shard.items():
            yield from self._shards[shard]._tensors(held)


class _PartitaCheckpoint(WeightFile):
    """A checkpoint written by partita.save: its model tensors (not optimizer state), read without a process group.
    The files that hold them are checked against the manifest's checksums first, and only those files."""

    def __init__(self, directory: Path):
        super().__init__(directory)
        self.manifest = read_manifest(directory)
        self.metadata = read_metadata(directory)

    def _read_infos(self) -> dict[str, TensorInfo]:
        return {k[len(keys.MODEL):]: TensorInfo(tuple(md.size), md.properties.dtype)
                for k, md in self.metadata.state_dict_metadata.items()
                if k.startswith(keys.MODEL) and isinstance(md, TensorStorageMetadata)}

    def _tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        targets = {keys.model(n): torch.empty(self._infos[n].shape, dtype=self._infos[n].dtype) for n in names}
        files = {s.relative_path for i, s in self.metadata.storage_data.items() if i.fqn in targets}
        # check only what this read touches: each rank hashes the files it reads, not the whole checkpoint
        recorded = {f: c for f, c in self.manifest.checksums.items() if f in files or f == METADATA}
        checksums.check(self.path, dataclasses.replace(self.manifest, checksums=recorded), files)
        dcp_step(lambda: dcp.load(targets, storage_reader=CheckedReader(self.path, self.metadata),
                                  planner=WeightsOnlyLoadPlanner(), no_dist=True), f"weights={str(self.path)!r}",
                 UNREADABLE)
        return ((n, targets[keys.model(n)]) for n in names)
