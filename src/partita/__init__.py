"""partita: train an unmodified PyTorch model across processes, partitioned automatically.

>>> import torch, partita
>>> model = partita.parallelize(torch.nn.Linear(4, 2), loss_fn=torch.nn.MSELoss())
>>> loss = model(torch.randn(8, 4), torch.randn(8, 2))
>>> loss.backward()

The planner (`partita.plan`, `partita.Plan`) is pure Python: importing it does not import torch.
"""

from importlib import import_module

from partita.errors import BatchError, PartitaError
from partita.plan.plan import Plan

# Names that need torch load on first use, so that planning-only code (and `partita plan`) stays light.
_LAZY = {
    "parallelize": "partita.api", "ParallelModule": "partita.api",
    "init": "partita.launch.env", "get_rank": "partita.launch.env", "get_world_size": "partita.launch.env",
    "barrier": "partita.launch.env", "shutdown": "partita.launch.env",
    "save": "partita.checkpoint.saving", "load": "partita.checkpoint.loading",
    "latest_checkpoint": "partita.checkpoint.layout",
    "elastic": "partita.elasticity.loop",
}

# What a training script uses every day; the rest lives in its module.
__all__ = sorted(["BatchError", "PartitaError", "Plan", *_LAZY])
__version__ = "0.1.0"

# Names this package once had, and the module that has them, for the error that says so.
_ELSEWHERE = {
    "CaptureError": "partita.errors", "CheckpointError": "partita.errors", "LaunchError": "partita.errors",
    "PlanError": "partita.errors", "SettingsError": "partita.errors", "StagePlan": "partita.plan",
    "Elastic": "partita.elasticity.loop", "RESUME_EXIT_CODE": "partita.elasticity.stop",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _ELSEWHERE:
        raise AttributeError(f"module 'partita' has no attribute {name!r}: it is {_ELSEWHERE[name]}.{name} "
                             f"(from {_ELSEWHERE[name]} import {name})")
    raise AttributeError(f"module 'partita' has no attribute {name!r}")


def __dir__():
    return __all__
