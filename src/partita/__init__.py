"""partita: train an unmodified PyTorch model across processes, partitioned automatically.

>>> import torch, partita
>>> model = partita.parallelize(torch.nn.Linear(4, 2), loss_fn=torch.nn.MSELoss())
>>> loss = model(torch.randn(8, 4), torch.randn(8, 2))
>>> loss.backward()
"""

from partita.api import ParallelModule, parallelize
from partita.errors import BatchError, CaptureError, LaunchError, PartitaError, PlanError
from partita.launch.env import barrier, get_rank, get_world_size, init, shutdown
from partita.plan.plan import Plan, StagePlan

__all__ = [
    "BatchError", "CaptureError", "LaunchError", "ParallelModule", "PartitaError", "Plan", "PlanError",
    "StagePlan", "barrier", "get_rank", "get_world_size", "init", "parallelize", "shutdown",
]
__version__ = "0.1.0"
