"""partita.save: every rank writes its share of a checkpoint; the checkpoint appears whole or not at all."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from partita.checkpoint import keys, layout, optimizer as optimizer_state, owner, rng
from partita.checkpoint.checksums import checksums_of
from partita.checkpoint.collective import dcp_step, every_rank, from_rank0, together
from partita.checkpoint.holding import Holding, Partitioned, holding_of
from partita.runtime.run import first_names
from partita.checkpoint.manifest import Manifest, TensorEntry, plan_summary, write_manifest
from partita.checkpoint.unpickling import METADATA, torch_refusal
from partita.errors import CheckpointError


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *, step: int,
         extra: dict | None = None, keep: int = 3) -> str:
    """Save model, optimizer, step, RNG states, float16's loss scale and `extra` as checkpoint `path/step-<step>`;
    return its path.

    Collective: every rank calls it with the same arguments. Each rank writes a share of the tensors it
    trains (torch.distributed.checkpoint; replicas split the writing), under the model's original names,
    so that any world size and plan can load it (`partita.load`). `extra` is a dict of plain JSON values
    (the data loader's position, an LR scheduler's state_dict(), ...), with string keys only (JSON's: another
    key is an error, since it would come back as a string; tuples come back as lists). The checkpoint is written
    into a temporary directory and renamed into place when complete, then `path/latest` names it; unfinished
    saves never count, and the oldest checkpoints beyond the last `keep` are deleted. `path` must be on a
    filesystem every rank sees. A directory holds one training run: `keep` and `latest` count whichever job
    saved there, but no save removes another's save in progress (`layout.remove_unfinished`), and the directory
    belongs to the job that saves there until it ends: another job's save is refused (`owner.claim`).

    >>> import tempfile, torch, partita
    >>> net = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.Adam(net.parameters())
    >>> root = tempfile.mkdtemp()
    >>> partita.save(net, opt, root, step=100, extra={"epoch": 3}).endswith("step-000100")
    True
    >>> partita.load(net, opt, root).extra
    {'epoch': 3}
    """
    what = f"partita.save(path={str(path)!r}, step={step!r})"
    root = Path(path)
    holding, state = together(lambda: _local_state(model, optimizer, step, extra, keep), what)
    lock = layout.SaveLock()  # rank 0's, until the save ends either way
    try:
        tmp = from_rank0(lambda: _start(root, step, lock), what)
        together(lambda: _check_visible(tmp), what)
        planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False,
                                     dedup_save_to_lowest_rank=False)  # one writer per tensor, balanced by bytes
        writer = _NamingWriter(tmp)
        dcp_step(lambda: dcp.save(state, storage_writer=writer, planner=planner, no_dist=not dist.is_initialized()),
                 what, "Writing the checkpoint failed (is the disk full, or the path not writable?); the last "
                 "complete checkpoint is untouched")
        # each rank checksums the files it wrote, while they are still in the page cache
        written = every_rank(lambda: checksums_of(tmp, writer.written), what)
        checksums = {name: digest for part in written for name, digest in part.items()}
        final = from_rank0(lambda: _finish(root, tmp, lock, holding, optimizer, step, extra or {}, keep, checksums),
                           what)
    finally:
        lock.release()
    if not dist.is_initialized():
        owner.release_after_save(root)
    return str(final)


class _NamingWriter(FileSystemWriter):
    """DCP's file writer, noting the names of the data files this rank wrote."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.written: set[str] = set()

    def write_data(self, plan, planner):
        results = super().write_data(plan, planner)
        self.written.update(r.storage_data.relative_path for r in results.wait())
        return results


def _check_arguments(model, optimizer, step, extra, keep) -> None:
    if not isinstance(model, nn.Module):
        raise CheckpointError(f"model must be an nn.Module (a partita model, a DDP module or a plain module), "
                              f"got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a whole number >= 0 (the training step), got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep must be a whole number >= 1 (checkpoints to keep), got {keep!r}")
    if extra is not None:
        if not isinstance(extra, dict):
            raise CheckpointError(f"extra must be a dict of plain JSON values, got {type(extra).__name__}")
        _check_keys(extra, "extra")
        try:
            json.dumps(extra, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"extra must hold plain JSON values (dict, list, str, int, float, bool, None): "
                                  f"{e}. Convert tensors with .tolist() and other objects to such values.") from None


def _check_keys(value, where: str) -> None:
    """JSON turns every dict key into a string: an int key would come back as another key, and `.get(0)` would
    silently find nothing."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(
                    f"{where} has the key {key!r} ({type(key).__name__}): extra is saved as JSON, whose keys are "
                    f"strings, so the key would not come back as it is (after loading, a lookup of {key!r} finds "
                    f"nothing). Use string keys ({where}[{str(key)!r}]), or a list of pairs for a mapping from other "
                    "values.")
            _check_keys(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_keys(item, f"{where}[{i}]")


def _check_plain(value, what: str) -> None:
    """A non-tensor item must load under weights_only, or the checkpoint would be written but refused later."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch refuses
        raise CheckpointError(f"{what} holds a value that loads only by running pickled code ({torch_refusal(e)}); "
                              "checkpoints hold plain data (tensors, numbers, strings, lists, tuples, dicts), so "
                              "that loading one never runs code.") from None


def _local_state(model, optimizer, step, extra, keep) -> tuple[Holding, dict]:
    """What this rank hands to DCP: the tensors it holds current, its RNG, and (rank 0) the shared values."""
    _check_arguments(model, optimizer, step, extra, keep)
    holding = holding_of(model)
    state: dict = {keys.rng(holding.rank): rng.capture()}
    names = first_names(holding.module)
    for name, value in holding.module.state_dict(keep_vars=True).items():
        if name in holding.writes:
            state[keys.model(name)] = value.detach() if isinstance(value, torch.Tensor) else value
    if optimizer is not None:
        state.update(optimizer_state.state_entries(optimizer, names, holding.writes))
    if holding.rank == 0:
        state[keys.STEP] = step
        state[keys.EXTRA] = json.dumps(extra or {})
        if optimizer is not None:
            state[keys.PARAM_GROUPS] = optimizer_state.param_groups_entry(optimizer, names)
        # without it a resumed float16 run would start its scale over and skip steps the saving run took
        loss_scale = model.loss_scale_state() if isinstance(model, Partitioned) else None
        if loss_scale is not None:
            state[keys.LOSS_SCALE] = loss_scale
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise CheckpointError(
                f"{key} is on the meta device: a model built there gets its values at its first call (from "
                "weights=, init_fn, or a partita.load made before it), so there is nothing to save yet. Save after "
                "the model's first call")
        if not isinstance(value, torch.Tensor) and key != keys.EXTRA:
            _check_plain(value, key)
    return holding, state


def _start(root: Path, step: int, lock: layout.SaveLock) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    owner.claim(root)
    layout.remove_unfinished(root)
    tmp = layout.temporary_dir(root, step)
    tmp.mkdir()
    lock.take(tmp)
    return tmp


def _check_visible(tmp: Path) -> None:
    if not tmp.is_dir():
        raise CheckpointError(f"cannot see {tmp}, which rank 0 just created: a checkpoint path must be on a "
                              "filesystem every rank shares (NFS, Lustre, a local disk on one node)")


def _finish(root: Path, tmp: Path, lock: layout.SaveLock, holding: Holding, optimizer, step: int, extra: dict,
            keep: int, checksums: dict[str, str]) -> Path:
    """Rank 0, after every rank's data and DCP's metadata are written: manifest (with the data files' checksums
    and that of `.metadata`), rename, `latest`, prune."""
    from partita import __version__

    tensors = {n: TensorEntry(tuple(t.shape), str(t.dtype).removeprefix("torch."))
               for n, t in holding.module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    plan = holding.plan.to_dict() if holding.plan is not None else None
    names = first_names(holding.module)
    manifest = Manifest(
        step=step, world_size=holding.world_size, saved_at=time.time(), partita_version=__version__,
        torch_version=torch.__version__, tensors=tensors, plan=plan,
        **({"plan_summary": plan_summary(plan)} if plan is not None else {}),
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        param_groups=optimizer_state.group_names(optimizer, names) if optimizer is not None else (), extra=extra,
        checksums=checksums | checksums_of(tmp, [METADATA]))
    write_manifest(tmp, manifest)
    lock.drop_file()
    layout.fsync_dir(tmp)
    final = root / layout.step_name(step)
    layout.commit(tmp, final)
    layout.prune(root, keep, final)
    return final
