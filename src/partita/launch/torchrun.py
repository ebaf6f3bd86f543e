"""Processes started by torchrun / `partita run` / torch.distributed.launch, or with torch's variables set by hand.

>>> detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).launcher
'env'
"""

from __future__ import annotations

from partita.errors import LaunchError
from partita.launch.detected import Address, Join, Placement, integer, nodes_for


def detect(environ: dict) -> Placement | None:
    """torch's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), or None."""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    rank, world_size = integer(environ, "RANK"), integer(environ, "WORLD_SIZE")
    local_rank = integer(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
    local_world_size = integer(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world_size
    elastic = "TORCHELASTIC_RUN_ID" in environ
    # torchrun's agent on each node (GROUP_WORLD_SIZE of them) serves or joins the store itself
    if elastic and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return Placement("torchrun", rank, world_size, local_rank, local_world_size,
                         integer(environ, "GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in environ else 1, Join.AGENT,
                         _master(environ, rank, world_size))
    return Placement("torchrun" if elastic else "env", rank, world_size, local_rank, local_world_size,
                     nodes_for(world_size, local_world_size), Join.STORE, _master(environ, rank, world_size))


def _master(environ: dict, rank: int, world_size: int) -> Address:
    """The store's address: torchrun's agent serves it there, or rank 0 does (agent store off, or set by hand)."""
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in environ:
            raise LaunchError(
                f"{var} is not set, but RANK/WORLD_SIZE say this is rank {rank} of {world_size}. "
                "Launch with `partita run -n N script.py` or `torchrun --nproc-per-node N script.py`, "
                "which set it for you."
            )
    return Address(environ["MASTER_ADDR"], integer(environ, "MASTER_PORT"))
