"""Process groups a plan needs: one per pipeline replica, one per set of ranks that share gradients."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import nn

from partita import settings
from partita.plan.plan import Plan
from partita.runtime.grads import ParamGroup


class MadeGroups:
    """The process groups one runtime made, which it destroys when it is given up (`Runtime.close`): a layout
    switch, or the probes that measure partita's own costs, would otherwise leave them for the job's life,
    and under NCCL each holds GPU memory."""

    def __init__(self):
        self.groups: list[dist.ProcessGroup] = []

    def new(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        # every rank must create every group, in the same order, even the ones it is not in
        if not dist.is_initialized():
            return None
        group = dist.new_group(list(ranks), timeout=timedelta(seconds=settings.timeout_s()))
        self.groups.append(group)
        return group

    def destroy(self) -> None:
        """Collective, once nothing runs on the groups any more: every rank destroys those it is in."""
        for group in self.groups:
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        self.groups.clear()


def pipeline_groups(plan: Plan, made: MadeGroups) -> list[dist.ProcessGroup | None]:
    return [made.new(plan.replica_ranks(j)) for j in range(plan.num_replicas)]


def stage_groups(plan: Plan, made: MadeGroups) -> dict[int, dist.ProcessGroup | None]:
    """One group per stage over its replicas (for keeping their buffers identical)."""
    return {s.index: made.new(s.ranks) for s in plan.stages} if plan.num_replicas > 1 else {}


def param_ranks(plan: Plan, stage_params: dict[int, set[str]]) -> dict[str, tuple[int, ...]]:
    """For each parameter (FQN), every rank that holds it: all replicas of every stage that reads it."""
    out: dict[str, set[int]] = {}
    for stage in plan.stages:
        for fqn in stage_params.get(stage.index, ()):
            out.setdefault(fqn, set()).update(stage.ranks)
    return {fqn: tuple(sorted(r)) for fqn, r in out.items()}


def gradient_groups(plan: Plan, stage_params: dict[int, set[str]], rank: int, parameter: dict[str, nn.Parameter],
                    made: MadeGroups, sharded: set[str] = frozenset()) -> list[ParamGroup]:
    """This rank's parameters, grouped by the ranks their gradients are summed over. FSDP sums the `sharded`
    ones (`fully_sharded.py`; the same set on every rank): those this rank holds form a group of this rank
    alone, which partita only scales."""
    holders = param_ranks(plan, stage_params)
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for fqn, ranks in holders.items():
        if fqn not in sharded:
            by_ranks.setdefault(ranks, []).append(fqn)
        elif rank in ranks:
            by_ranks.setdefault((rank,), []).append(fqn)
    groups = []
    for ranks in sorted(by_ranks):
        group = made.new(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            # in module order: GradSync's buckets take them backwards, as the backward finishes them
            chosen = set(by_ranks[ranks])
            params = [p for f, p in parameter.items() if f in chosen]  # GradSync sums those that require grad
            groups.append(ParamGroup(ranks, group, params))
    return groups
