"""A checkpoint's model weights as one plain state-dict file, for inference without partita.

Runs in one process without a process group: it reads every shard of the checkpoint (whatever world size
wrote it) through the same checked reader as `partita.load`, after checking every file's checksum.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from partita.checkpoint import checksums, keys
from partita.checkpoint.collective import dcp_step
from partita.checkpoint.layout import resolve
from partita.checkpoint.manifest import read_manifest
from partita.checkpoint.unpickling import UNREADABLE, CheckedReader, WeightsOnlyLoadPlanner, data_files, read_metadata
from partita.errors import CheckpointError


@dataclass(frozen=True)
class Exported:
    path: str  # the file written
    checkpoint: str  # the step-* directory it came from
    step: int
    tensors: int
    bytes: int


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Exported:
    """Write the model weights of `checkpoint` (a root or a step-* directory) to `out` as a plain state dict.

    The file holds the original names and loads with `torch.load(out, weights_only=True)` into the plain
    model: `model.load_state_dict(torch.load(out, weights_only=True))`.

    >>> import tempfile, os, torch, partita
    >>> from partita.checkpoint import export
    >>> root = tempfile.mkdtemp()
    >>> _ = partita.save(torch.nn.Linear(4, 2), None, root, step=1)
    >>> export(root, os.path.join(root, "model.pt")).tensors
    2
    """
    directory = resolve(checkpoint)
    manifest = read_manifest(directory)
    metadata = read_metadata(directory)
    checksums.check(directory, manifest, data_files(metadata))
    targets = {k: (torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None)
               for k, md in metadata.state_dict_metadata.items() if k.startswith(keys.MODEL)}
    dcp_step(lambda: dcp.load(targets, storage_reader=CheckedReader(directory, metadata),
                              planner=WeightsOnlyLoadPlanner(), no_dist=True), f"partita export {directory}",
             UNREADABLE)
    loaded = {k[len(keys.MODEL):]: v for k, v in targets.items()}
    missing = [n for n in manifest.tensors if n not in loaded]
    if missing:
        raise CheckpointError(f"{directory} is damaged: its manifest lists {len(missing)} tensors that its data "
                              f"lacks (e.g. {missing[0]}). Export an earlier checkpoint.")
    # the model's own order (the manifest's), then values that are not tensors (a module's extra state)
    state = {n: loaded[n] for n in manifest.tensors} | {n: v for n, v in loaded.items() if n not in manifest.tensors}
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{secrets.token_hex(4)}")
    torch.save(state, tmp)
    os.replace(tmp, target)
    size = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return Exported(str(target), str(directory), manifest.step, len(state), size)
