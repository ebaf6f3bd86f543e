"""manifest.json: what a checkpoint holds, readable without torch (and without trusting any pickle).

Its presence is what makes a directory a complete partita checkpoint: it is the last file written into
the temporary directory before that directory is renamed into place.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from partita.errors import CheckpointError

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
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> "Manifest":
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, not {FORMAT!r}")
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('format_version')} is not {FORMAT_VERSION}; this "
                                 "partita reads only its own format version")
            tensors = {n: TensorEntry(tuple(e["shape"]), e["dtype"]) for n, e in data["tensors"].items()}
            groups = tuple(tuple(g) for g in data.get("param_groups", ()))
            return cls(**{**data, "tensors": tensors, "param_groups": groups})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where} is not a readable partita manifest ({e}). The checkpoint is damaged "
                                  "or was not written by partita.save; load another checkpoint.") from e


def plan_summary(plan: dict) -> str:
    """'2 stages x 2 replicas, 1F1B, 4 micro-batches, world 4' from a plan's JSON form."""
    stages = plan["stages"]
    return (f"{len(stages)} stages x {len(stages[0]['ranks'])} replicas, {plan['schedule']}, "
            f"{plan['num_microbatches']} micro-batches, world {plan['world_size']}")


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
