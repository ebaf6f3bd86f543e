"""What partita needs to know about, and do to, the user's optimizer."""

from __future__ import annotations

import types

import torch

from partita.errors import PlanError
from partita.runtime import agreement


def optimizer_state_factor(optimizer: torch.optim.Optimizer | None) -> float:
    """Copies of the parameters the optimizer keeps as state (Adam: 2, SGD with momentum: 1, SGD: 0)."""
    if optimizer is None:
        return 0.0
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    name = type(optimizer).__name__
    if name == "SGD":
        return 1.0 if group.get("momentum", 0) else 0.0
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
        return 3.0 if group.get("amsgrad") else 2.0
    if name in ("Adagrad", "Adadelta"):
        return 1.0 if name == "Adagrad" else 2.0
    if name == "RMSprop":
        return 1.0 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    return 2.0  # unknown: assume Adam-like


def check_optimizer_params(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module) -> None:
    """The optimizer steps the model's parameters: one built over another model's (a copy made before
    parallelize, a second instance) would train nothing, silently, and one with parameters beyond the model's
    would step those without partita summing their gradients over ranks. Every rank raises at once."""
    problem = _foreign_params(optimizer, model) if optimizer is not None else None
    failed = [e for e in agreement.state_step("parallelize: the optimizer's parameters", problem) if e is not None]
    if failed:
        raise PlanError(failed[0].message)


def _foreign_params(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> PlanError | None:
    own = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in params if id(p) not in own]
    if not foreign:
        return None
    fix = (f"Build the optimizer over the parameters of the model you parallelize "
           f"(torch.optim.{type(optimizer).__name__}(model.parameters(), ...), with that model)")
    if len(foreign) == len(params):
        return PlanError(f"none of the optimizer's {len(params)} parameters are the model's: it was built over "
                         "another model's parameters, so optimizer.step() would train nothing. " + fix)
    return PlanError(f"{len(foreign)} of the optimizer's {len(params)} parameters are not the model's (e.g. one of "
                     f"shape {tuple(foreign[0].shape)}): partita computes only the model's gradients across ranks, so "
                     "the optimizer would step those others with this rank's gradients alone. " + fix + "; train "
                     "other parameters (a learnable loss) inside the model")


def patch_optimizer(optimizer: torch.optim.Optimizer, full_state_dict, keep_local) -> None:
    """Make the optimizer's state_dict whole on every rank, and its load_state_dict keep only local state.

    The instance's own methods are wrapped (not the class), so step, zero_grad, param_groups and LR
    schedulers work exactly as before.
    """
    if getattr(optimizer, "_partita_patched", False):
        return
    own_state_dict = optimizer.state_dict
    own_load = optimizer.load_state_dict

    def state_dict(self):
        return full_state_dict(own_state_dict())

    def load_state_dict(self, state_dict):
        own_load(state_dict)
        keep_local(self)

    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    optimizer._partita_patched = True


def unpatch_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Undo `patch_optimizer`: its state_dict and load_state_dict are the class's again (another runtime, which
    patches them anew, takes the model)."""
    if getattr(optimizer, "_partita_patched", False):
        del optimizer.state_dict, optimizer.load_state_dict, optimizer._partita_patched


def repoint_optimizer(optimizer: torch.optim.Optimizer | None, replaced: dict[int, torch.Tensor],
                      convert) -> None:
    """The optimizer steps the new tensors: its parameter groups and state follow the modules; a state tensor
    becomes `convert(value, new parameter)`."""
    if optimizer is None or not replaced:
        return
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    for p in [p for p in optimizer.state if id(p) in replaced]:
        state, new = optimizer.state.pop(p), replaced[id(p)]
        if not new.is_meta:
            optimizer.state[new] = converted_state(state, new, convert)


def converted_state(state: dict, param: torch.Tensor, convert) -> dict:
    """A parameter's optimizer state with each tensor of its own (not a scalar such as Adam's step) as
    `convert(value, param)` makes it."""
    return {k: convert(v, param) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in state.items()}
