"""manifest.json: what a checkpoint holds, readable without torch (and without trusting any pickle).

Its presence is what makes a directory a complete partita checkpoint: it is the last file written into
the temporary directory before that directory is renamed into place.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from partita.errors import CheckpointError
from partita.plan.plan import upgrade

MANIFEST = "manifest.json"
FORMAT = "partita-checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str  # "float32", as torch names it without the "torch." prefix


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    saved_at: float  # seconds since the epoch; orders checkpoints for `latest` and pruning
    partita_version: str
    torch_version: str
    tensors: dict[str, TensorEntry]  # every model tensor, under its original name
    plan: dict | None = None  # Plan.to_dict() of the plan in use, None before the model's first call
    plan_summary: str = "no plan (saved before the model's first call, or not a partita model)"
    optimizer: str | None = None  # the optimizer's class name; None when saved without one
    param_groups: tuple[tuple[str, ...], ...] = ()  # parameter names of each optimizer param group
    extra: dict = field(default_factory=dict)
    # file name -> "<algorithm>:<hex digest>" of its bytes (xxh3_64, or crc32 where xxhash is not installed), for
    # every file DCP wrote (.metadata included); empty in checkpoints saved before partita recorded them, which
    # load only where PARTITA_UNVERIFIED_CHECKPOINTS=on
    checksums: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> "Manifest":
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError(f"it holds a {type(data).__name__}, not an object")
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {FORMAT!r}")
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('format_version')} is not {FORMAT_VERSION}; this "
                                 "partita reads only its own format version")
            _check_types(data)
            tensors = {n: TensorEntry(tuple(e["shape"]), e["dtype"]) for n, e in data["tensors"].items()}
            groups = tuple(tuple(g) for g in data.get("param_groups", ()))
            return cls(**{**data, "tensors": tensors, "param_groups": groups})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where} is not a readable partita manifest ({e}). The checkpoint is damaged "
                                  "or was not written by partita.save; load another checkpoint.") from e


_CHECKSUM = re.compile(r"(xxh3_64:[0-9a-f]{16}|crc32:[0-9a-f]{8})")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_list_of(kind):
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) for x in v)


# what each field of manifest.json holds, as json.loads returns it; anything else is a damaged manifest (it would
# fail later, far from the file: a saved_at that is text cannot be ordered against the others' times)
_FIELD_TYPES = {
    "step": _is_int,
    "world_size": _is_int,
    "saved_at": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "partita_version": lambda v: isinstance(v, str),
    "torch_version": lambda v: isinstance(v, str),
    "tensors": lambda v: isinstance(v, dict) and all(
        isinstance(e, dict) and _is_list_of(int)(e.get("shape")) and isinstance(e.get("dtype"), str)
        for e in v.values()),
    "plan": lambda v: v is None or isinstance(v, dict),
    "plan_summary": lambda v: isinstance(v, str),
    "optimizer": lambda v: v is None or isinstance(v, str),
    "param_groups": lambda v: isinstance(v, list) and all(_is_list_of(str)(g) for g in v),
    "extra": lambda v: isinstance(v, dict),
    "checksums": lambda v: isinstance(v, dict) and all(isinstance(c, str) and _CHECKSUM.fullmatch(c)
                                                       for c in v.values()),
}


def _check_types(data: dict) -> None:
    for name, fits in _FIELD_TYPES.items():
        if name in data and not fits(data[name]):
            raise ValueError(f"its {name} is {data[name]!r}, which is not what partita.save writes there")
    for name in data.get("checksums", {}):
        if not is_file_name(name):
            raise ValueError(f"its checksums name {name}, which is not a file of the checkpoint (a name in its "
                             "directory)")


def is_file_name(name: str) -> bool:
    """Whether `name` names an entry of a checkpoint's own directory (no path: nothing outside it is ever read)."""
    return Path(name).name == name and name not in ("", ".", "..")


def plan_summary(plan: dict) -> str:
    """'2 stages x 2 replicas, 1F1B, 4 micro-batches, world 4' from a plan's JSON form."""
    plan = upgrade(plan)
    stages = plan["stages"]
    return (f"{len(stages)} stages x {len(stages[0]['ranks'])} replicas, {plan['schedule']}, "
            f"{plan['micro_batches']} micro-batches, world {plan['world_size']}")


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write and fsync manifest.json, so that a directory renamed into place later is complete on disk."""
    path = directory / MANIFEST
    with open(path, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a partita checkpoint: it has no {MANIFEST}. Pass a directory "
                              "written by partita.save (a step-* directory, or the directory that holds them)."
                              ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path} ({e}); the checkpoint is damaged, load another one") from e
    return Manifest.from_json(text, path)
