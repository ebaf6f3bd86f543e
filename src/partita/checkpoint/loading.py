"""partita.load: every rank reads what it needs from a checkpoint saved under any world size and plan."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from partita.checkpoint import checksums, keys, optimizer as optimizer_state, rng
from partita.checkpoint.collective import dcp_step, from_rank0, together
from partita.checkpoint.holding import Holding, Partitioned, holding_of
from partita.runtime.run import first_names
from partita.checkpoint.layout import resolve
from partita.checkpoint.manifest import Manifest, read_manifest
from partita.checkpoint.unpickling import UNREADABLE, CheckedReader, WeightsOnlyLoadPlanner, data_files, read_metadata
from partita.errors import CheckpointError
from partita.plan.plan import Plan
from partita.runtime.precision import GROWTH_INTERVAL

_SHOWN = 5  # names listed in an error before "..."


@dataclass(frozen=True)
class CheckpointInfo:
    """What `partita.load` loaded."""

    path: str  # the step-* directory
    step: int
    extra: dict  # as saved (JSON values: tuples come back as lists)
    world_size: int  # of the job that saved it
    plan: Plan | None  # the plan it was saved under; None if saved before the model's first call
    saved_at: float  # seconds since the epoch
    rng_restored: bool  # False on a rank that had no counterpart in the saving job (more ranks now)


@dataclass(frozen=True)
class _Prepared:
    directory: Path
    manifest: Manifest
    metadata: Metadata
    holding: Holding
    targets: dict  # DCP key -> tensor to read into (the model's own tensors), or None for plain values
    # a partita model built on the meta device, before its first call: its weights have no memory to read into
    # yet, so it reads them as it materializes them, and the optimizer state after (`Partitioned.resume_from`)
    deferred: bool = False


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> CheckpointInfo:
    """Load a checkpoint written by `partita.save` into `model` and `optimizer`; return what was loaded.

    Collective: every rank calls it. `path` is the directory given to `save` (its latest checkpoint is
    loaded) or one of its step-* directories. The job may have another world size and the model another
    plan than when it was saved: tensors are found by their original names. Every rank's copy of the
    model gets the saved weights, and the optimizer the state of the parameters this rank trains, with
    the saved hyperparameters (lr, betas, ...). Each rank r restores rank r's saved RNG states (torch,
    CUDA, Python's `random`, numpy); ranks beyond the saving job's world size keep their own, and
    `rng_restored` says which happened. A partita model computing in float16 goes on from the saved loss scale
    (from its start where the checkpoint has none).

    Call it after `parallelize` and before or after the first call. Before the first call the plan is
    not known yet: every rank loads the whole optimizer state, as one process would, and the first call
    keeps only the state of the parameters the rank trains under the plan it makes. A model built on the
    meta device has no memory to load into before its first call: the first call reads each rank's part of
    the weights from the checkpoint as it materializes it, and then the optimizer state of the parameters
    the rank trains (the rest, step, extra and RNG, load at once).

    Nothing in the checkpoint is unpickled except through weights_only loading (plain data and tensors);
    a damaged, foreign or tampered checkpoint raises CheckpointError on every rank. Every file is checked
    against the checksum recorded when it was saved before anything is read (the ranks share the checking),
    so a file changed since leaves the model as it was; checkpoints saved without checksums load unverified.

    >>> import tempfile, torch, partita
    >>> net = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> root = tempfile.mkdtemp()
    >>> _ = partita.save(net, opt, root, step=7, extra={"batch": 12})
    >>> info = partita.load(net, opt, root)
    >>> info.step, info.extra, info.world_size
    (7, {'batch': 12}, 1)
    """
    what = f"partita.load(path={str(path)!r})"
    directory = from_rank0(lambda: resolve(path), what)
    prepared = together(lambda: _prepare(model, optimizer, directory), what)
    _read(prepared, what)
    return together(lambda: _apply(model, prepared, optimizer), what)


def load_optimizer_state(model: Partitioned, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The optimizer state of the parameters this rank trains, from the checkpoint at `path` (a step-*
    directory), once the model holds its part: a `load` deferred by a model built on the meta device.
    Collective."""
    what = f"partita.load(path={str(path)!r}) at the model's first call"
    prepared = together(lambda: _prepare(model, optimizer, path, weights=False), what)
    _read(prepared, what)
    together(lambda: optimizer_state.apply(optimizer, first_names(prepared.holding.module), prepared.targets), what)


def _read(prepared: _Prepared, what: str) -> None:
    """DCP reads the checkpoint into `prepared.targets`."""
    dcp_step(lambda: dcp.load(prepared.targets, storage_reader=CheckedReader(prepared.directory, prepared.metadata),
                              planner=WeightsOnlyLoadPlanner(), no_dist=not dist.is_initialized()), what,
             UNREADABLE)


def _prepare(model, optimizer, directory: Path, weights: bool = True) -> _Prepared:
    """Check that the checkpoint fits the model and optimizer; name what DCP reads into, before reading
    (`weights`: the model's tensors and the plain values besides the optimizer's; without them, the files were
    checked against their checksums by the `load` that deferred this)."""
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"model must be an nn.Module (a partita model, a DDP module or a plain module), "
                              f"got {type(model).__name__}")
    manifest = read_manifest(directory)
    metadata = read_metadata(directory)
    holding = holding_of(model)
    if weights:  # before anything is read into the model: a damaged checkpoint leaves it as it was
        checksums.check(directory, manifest, data_files(metadata), rank=holding.rank, world_size=holding.world_size)
    current = holding.module.state_dict(keep_vars=True)
    _check_model(current, metadata, directory)
    deferred = weights and isinstance(model, Partitioned) and model.held() is None and any(
        map(_is_meta, current.values()))
    targets: dict = {}
    if weights:
        targets = {keys.model(n): (t.detach() if isinstance(t, torch.Tensor) else None)
                   for n, t in current.items() if n in holding.reads and not (deferred and _is_meta(t))}
    if optimizer is not None:
        names = first_names(holding.module)
        optimizer_state.check_fits(optimizer, names, manifest.optimizer, manifest.param_groups, str(directory))
        if not deferred:
            targets.update(optimizer_state.targets(metadata, optimizer, names, holding.trains))
    if weights:
        targets[keys.STEP] = targets[keys.EXTRA] = None
        if keys.rng(holding.rank) in metadata.state_dict_metadata:
            targets[keys.rng(holding.rank)] = None
        if isinstance(model, Partitioned) and keys.LOSS_SCALE in metadata.state_dict_metadata:
            targets[keys.LOSS_SCALE] = None
    return _Prepared(directory, manifest, metadata, holding, targets, deferred)


def _is_meta(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _check_model(current: dict, metadata: Metadata, directory: Path) -> None:
    saved = {k[len(keys.MODEL):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(keys.MODEL)}
    missing = [n for n in current if n not in saved]
    unexpected = [n for n in saved if n not in current]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's tensors are not in it ({_some(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} of its tensors are not in the model ({_some(unexpected)})")
        raise CheckpointError(f"{directory} does not fit this model: {'; '.join(parts)}. It was saved from another "
                              "model (or another version of it): load it into the model it was saved from, or "
                              "export it (partita export) and map the names yourself.")
    wrong = [f"{n}: {list(md.size)} saved, {list(current[n].shape)} here" for n, md in saved.items()
             if isinstance(md, TensorStorageMetadata) and isinstance(current[n], torch.Tensor)
             and tuple(md.size) != tuple(current[n].shape)]
    if wrong:
        raise CheckpointError(f"{directory} does not fit this model: {len(wrong)} tensors have other shapes "
                              f"({_some(wrong)}). Build the model with the configuration it was saved with.")


def _some(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def _apply(model, prepared: _Prepared, optimizer) -> CheckpointInfo:
    """After DCP has read: model values that are not tensors, the optimizer, this rank's RNG; the info."""
    loaded, holding, manifest = prepared.targets, prepared.holding, prepared.manifest
    loss_scale = _checked_loss_scale(loaded.get(keys.LOSS_SCALE), prepared.directory)
    plain = {k[len(keys.MODEL):]: v for k, v in loaded.items()
             if k.startswith(keys.MODEL) and not isinstance(v, torch.Tensor)}
    if plain:  # a module's get_extra_state(); tensors were read in place
        holding.module.load_state_dict(plain, strict=False)
    if prepared.deferred:
        model.resume_from(prepared.directory)
    elif optimizer is not None:
        optimizer_state.apply(optimizer, first_names(holding.module), loaded)
    if isinstance(model, Partitioned):  # a checkpoint without one (saved before partita kept it) starts it over
        model.load_loss_scale_state(loss_scale)
    rng_key = keys.rng(holding.rank)
    if rng_key in loaded:
        rng.restore(loaded[rng_key])
    return CheckpointInfo(
        path=str(prepared.directory), step=int(loaded[keys.STEP]), extra=json.loads(loaded[keys.EXTRA]),
        world_size=manifest.world_size, plan=Plan.from_dict(manifest.plan) if manifest.plan else None,
        saved_at=manifest.saved_at, rng_restored=rng_key in loaded)


def _checked_loss_scale(value, directory: Path) -> dict | None:
    """float16's loss scale as saved (`LossScale.state_dict`), checked before the optimizer's state and the RNG
    are applied."""
    if value is None:
        return None
    scale, clean = (value.get("scale"), value.get("clean_steps")) if isinstance(value, dict) else (None, None)
    if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0 and isinstance(clean, int)
            and not isinstance(clean, bool) and 0 <= clean < GROWTH_INTERVAL):
        raise CheckpointError(f"{directory} is malformed: its {keys.LOSS_SCALE!r} is {value!r}, not a float16 loss "
                              f"scale (a scale > 0 and 0 to {GROWTH_INTERVAL - 1} clean steps). Load another "
                              "checkpoint.")
    return value
