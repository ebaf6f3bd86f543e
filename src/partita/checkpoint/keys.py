"""The names of things inside a checkpoint's DCP data: one flat namespace, no nesting.

Model tensors sit under "model." + their original name, so plain DCP code reads them with
`dcp.load({"model": module.state_dict()}, checkpoint_id=...)`. Optimizer state is keyed by parameter
name, never by index, so that a model split another way (or not split at all) finds its own parameters.
"""

from __future__ import annotations

MODEL = "model."
OPTIMIZER_STATE = "optim.state."
PARAM_GROUPS = "optim.param_groups"
STEP = "step"
EXTRA = "extra"
RNG = "rng."
LOSS_SCALE = "loss_scale"  # float16's, the same on every rank: rank 0 saves it


def model(name: str) -> str:
    return MODEL + name


def optimizer_state(param: str, name: str) -> str:
    return f"{OPTIMIZER_STATE}{param}.{name}"


def rng(rank: int) -> str:
    return f"{RNG}{rank}"


def split_optimizer_state(key: str) -> tuple[str, str] | None:
    """(parameter, state name) of an optimizer state key, None for other keys.

    Names of optimizer state (exp_avg, momentum_buffer, step, ...) never contain a dot, so the last dot
    separates them from the parameter's name.

    >>> split_optimizer_state("optim.state.layers.0.weight.exp_avg")
    ('layers.0.weight', 'exp_avg')
    >>> split_optimizer_state("model.layers.0.weight") is None
    True
    """
    if not key.startswith(OPTIMIZER_STATE):
        return None
    param, _, name = key[len(OPTIMIZER_STATE):].rpartition(".")
    return (param, name) if param and name else None
