"""Cases of the check that every rank starts alike (runtime/same_start.py), run on every rank of a pool."""

import torch
import torch.distributed as dist
from torch import nn

from partita.errors import PartitaError
from partita.runtime.same_start import check_same_start


def start(differing: str) -> str | None:
    """Every rank checks its start, where rank 1's `differing` part ("plan", "boundaries", "weights", "meta":
    rank 1 holds the weight on the meta device, as a pipeline rank holds another stage's) differs; the error's
    text, or None."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plan, boundaries = "plan", "boundaries"
    if rank == 1:
        if differing == "plan":
            plan = "another plan"
        elif differing == "boundaries":
            boundaries = "other boundaries"
        elif differing == "weights":
            with torch.no_grad():
                model[0].weight[2, 3] = torch.nextafter(model[0].weight[2, 3], torch.tensor(1.0))
        elif differing == "meta":
            model[0].weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    try:
        check_same_start(model, plan, boundaries)
    except PartitaError as e:
        return str(e)
    return None
