"""Ray Train workers (TorchTrainer): Ray has created the process group already, so partita adopts it.

Ray also sets torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) in its workers; detecting Ray first keeps
partita from creating a second group on top of Ray's.
"""

from __future__ import annotations

import sys

from partita.launch.detected import Join, Placement, nodes_for


def detect(environ: dict) -> Placement | None:
    """This Ray Train worker's place from Ray's train context, or None outside Ray Train."""
    # a Train worker has imported ray.train before it runs the user's function; importing Ray here would cost
    # every other launcher seconds
    if "ray.train" not in sys.modules:
        return None
    import ray.train

    try:
        context = ray.train.get_context()
    except RuntimeError:  # the driver, or a Ray task that Ray Train did not start
        return None
    world_size, local_world_size = context.get_world_size(), context.get_local_world_size()
    return Placement("ray", context.get_world_rank(), world_size, context.get_local_rank(), local_world_size,
                     nodes_for(world_size, local_world_size), Join.ADOPT,
                     detail=f"Ray Train run {context.get_experiment_name()}")
