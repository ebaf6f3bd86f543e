"""Optimizer state in a checkpoint: keyed by parameter name, read from this rank's own state.

partita wraps the optimizer's `state_dict()` to gather every parameter's state onto every rank; a checkpoint
must not pay for that gather, so it reads `optimizer.state` directly (each rank holds the state of the
parameters it trains). Loading builds an ordinary index-keyed state dict for the parameters this rank
needs and hands it to `optimizer.load_state_dict`, which casts values to each parameter's device and dtype
as it always does.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from partita.checkpoint import keys
from partita.errors import CheckpointError


def _name(p: torch.nn.Parameter, names: dict[int, str]) -> str:
    if id(p) not in names:
        raise CheckpointError("the optimizer holds a parameter that is not in the model; pass the optimizer "
                              "made from this model's parameters")
    return names[id(p)]


def _named(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(_name(p, names), p) for g in optimizer.param_groups for p in g["params"]]


def group_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[tuple[str, ...], ...]:
    """The parameter names of each param group, in order."""
    return tuple(tuple(_name(p, names) for p in g["params"]) for g in optimizer.param_groups)


def state_entries(optimizer: torch.optim.Optimizer, names: dict[int, str], writes: frozenset[str]) -> dict:
    """This rank's share of the optimizer state: the state of the parameters whose copy it writes."""
    out = {}
    for name, p in _named(optimizer, names):
        if name in writes:
            for key, value in optimizer.state.get(p, {}).items():
                out[keys.optimizer_state(name, key)] = value.detach() if isinstance(value, torch.Tensor) else value
    return out


def param_groups_entry(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict]:
    """Hyperparameters of each group (lr, betas, ...), with parameter names in place of indices."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(params)}
            for g, params in zip(optimizer.param_groups, group_names(optimizer, names))]


def check_fits(optimizer: torch.optim.Optimizer, names: dict[int, str], saved_type: str | None,
               saved_groups: tuple[tuple[str, ...], ...], where: str) -> None:
    """Raise unless the saved state (the manifest's account of it) fits this optimizer."""
    if saved_type is None:
        raise CheckpointError(f"{where} holds no optimizer state (it was saved with optimizer=None); load it with "
                              "optimizer=None, or save one with the optimizer")
    if saved_type != type(optimizer).__name__:
        raise CheckpointError(f"{where} holds {saved_type} state, but the optimizer is {type(optimizer).__name__}; "
                              f"make a {saved_type} with the same param groups, or load with optimizer=None")
    mine = group_names(optimizer, names)
    if [sorted(g) for g in mine] != [sorted(g) for g in saved_groups]:
        raise CheckpointError(
            f"the optimizer's param groups do not match {where}: {len(mine)} groups of "
            f"{[len(g) for g in mine]} parameters here, {len(saved_groups)} groups of "
            f"{[len(g) for g in saved_groups]} saved. Build the optimizer's groups from the same parameters.")


def targets(metadata: Metadata, optimizer: torch.optim.Optimizer, names: dict[int, str],
            trains: frozenset[str] | None) -> dict:
    """Where DCP reads this rank's optimizer state into: empty tensors shaped as saved, None for other values."""
    wanted = {name for name, _ in _named(optimizer, names) if trains is None or name in trains}
    out: dict = {keys.PARAM_GROUPS: None}
    for key, md in metadata.state_dict_metadata.items():
        split = keys.split_optimizer_state(key)
        if split is not None and split[0] in wanted:
            tensor = isinstance(md, TensorStorageMetadata)
            out[key] = torch.empty(md.size, dtype=md.properties.dtype) if tensor else None
    return out


def apply(optimizer: torch.optim.Optimizer, names: dict[int, str], loaded: dict) -> None:
    """Give the optimizer the state and hyperparameters that DCP read into `loaded` (from `targets`)."""
    index = {name: i for i, (name, _) in enumerate(_named(optimizer, names))}
    state: dict[int, dict] = {}
    for key, value in loaded.items():
        split = keys.split_optimizer_state(key)
        if split is not None:
            state.setdefault(index[split[0]], {})[split[1]] = value
    # torch matches saved and current parameters by position within each group: list them in current order
    current = group_names(optimizer, names)
    groups = [{**saved, "params": [index[n] for n in names_here]}
              for saved, names_here in zip(loaded[keys.PARAM_GROUPS], current)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
