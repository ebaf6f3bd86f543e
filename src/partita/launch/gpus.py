"""Which GPU a rank computes on: local rank r takes the node's r-th visible GPU, so a node needs a visible GPU per
rank. Under Slurm's `--gpus-per-task`, each task sees only GPUs of its own (Slurm binds them per task): a rank
then computes on the first GPU it sees. Checked before CUDA is touched, on every rank of the node alike (each
compares its node's rank count, not its own index), so that every rank stops with the same error: CUDA's own,
"invalid device ordinal", names neither number, and two ranks on one GPU would get through to NCCL, which
refuses to join them.

Pure: the counts and CUDA_VISIBLE_DEVICES are given, so the decision is tested without a GPU.
"""

from __future__ import annotations

from partita.errors import LaunchError


def gpu_of(local_rank: int, local_world_size: int, visible_gpus: int, cuda_visible_devices: str | None,
           gpus_per_task: str | None = None) -> int:
    """The index, among the visible GPUs, of the GPU local rank `local_rank` of `local_world_size` computes on.
    `gpus_per_task`: Slurm's SLURM_GPUS_PER_TASK, set when the job asked for GPUs per task.

    >>> gpu_of(1, 2, 8, None)
    1
    >>> gpu_of(1, 2, 1, "1", gpus_per_task="1")
    0
    """
    if local_world_size <= visible_gpus:
        return local_rank  # every GPU of the node visible (also under --gpus-per-task with --gpu-bind=none)
    if gpus_per_task and visible_gpus >= 1:
        return 0
    shown = "unset: every GPU of the node" if cuda_visible_devices is None else repr(cuda_visible_devices)
    raise LaunchError(
        f"this node runs {local_world_size} ranks but only {visible_gpus} GPU{'s' if visible_gpus != 1 else ''} "
        f"{'is' if visible_gpus == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES {shown}); each rank needs a GPU "
        f"of its own (local rank r computes on the r-th visible GPU, and NCCL refuses two ranks on one GPU). "
        f"Start at most {visible_gpus} rank{'s' if visible_gpus != 1 else ''} per node (`partita run -n "
        f"{visible_gpus}`, or your launcher's ranks per node), make {local_world_size} GPUs visible to each "
        "rank, or under Slurm give each task its own with --gpus-per-task.")
