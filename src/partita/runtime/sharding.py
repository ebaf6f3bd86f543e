"""ZeRO inside each stage's replicas: what the replicas of a stage split among themselves (the plan's
`sharding` per stage).

"optimizer" (ZeRO-1): the replicas sum their gradients as without sharding, so every replica holds them
whole (`get_param_grad`, `clip_grad_norm_` and the user's own code see what they would in one process), but
each parameter's optimizer state lives on one replica only, its keeper; keepers are chosen so that the
replicas keep equal bytes. At the user's `optimizer.step()` the other replicas hide the parameter's gradient
from the optimizer, which then neither steps it nor creates state for it; after the step each keeper sends
the new values of its parameters to the stage's other replicas (one broadcast per keeper and bucket).

Why partita's own rather than torch's ZeroRedundancyOptimizer: that one builds an optimizer of its own from a
class and the parameters, while partita keeps the user's optimizer object working (its state_dict, param
groups, LR schedulers); and it knows one process group, while partita's ranks hold different stages with
different replica groups. A tied weight read by several stages has its gradient summed over the union of
their ranks; it is not sharded (every holder keeps its state).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from partita.plan.plan import Plan
from partita.runtime.route import buckets
from partita.runtime.state import broadcast_tensors

BROADCAST_BUCKET_BYTES = 32 * 2**20


def state_keepers(plan: Plan, stage_params: dict[int, set[str]], params: dict[str, nn.Parameter]) -> dict[str, int]:
    """For each parameter of a stage whose replicas shard their optimizer state: the rank that keeps it. The
    largest parameters go first, each to the replica keeping the fewest bytes so far (the same on every rank:
    shapes are known everywhere, meta or not)."""
    readers: dict[str, int] = {}
    for names in stage_params.values():
        for name in names:
            readers[name] = readers.get(name, 0) + 1
    keepers: dict[str, int] = {}
    for stage in plan.stages:
        if stage.sharding != "optimizer" or len(stage.ranks) == 1:  # FSDP's levels shard the state by themselves
            continue
        mine = [n for n in stage_params.get(stage.index, ()) if readers[n] == 1 and params[n].requires_grad]
        kept = {r: 0 for r in stage.ranks}
        for name in sorted(mine, key=lambda n: (-_nbytes(params[n]), n)):
            rank = min(kept, key=lambda r: (kept[r], r))
            keepers[name] = rank
            kept[rank] += _nbytes(params[name])
    return keepers


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


class OptimizerSharding:
    """The step hooks that make the user's optimizer step only the parameters this rank keeps, and spread
    the new values to the replicas that do not."""

    def __init__(self, optimizer: torch.optim.Optimizer, keepers: dict[str, int], params: dict[str, nn.Parameter],
                 plan: Plan, stage_params: dict[int, set[str]], stage_groups: dict[int, dist.ProcessGroup | None],
                 rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.hidden_from_optimizer = {id(params[n]) for n, keeper in keepers.items() if keeper != rank}
        # (group, keeper, its parameters), in the same order on every rank of each group
        self.sends: list[tuple[dist.ProcessGroup | None, int, list[nn.Parameter]]] = []
        for stage in plan.stages:
            if rank not in stage.ranks:
                continue
            for keeper in stage.ranks:
                names = sorted(n for n in stage_params.get(stage.index, ()) if keepers.get(n) == keeper)
                if names:
                    self.sends.append((stage_groups.get(stage.index), keeper, [params[n] for n in names]))
        self._hidden: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.hooks = [optimizer.register_step_pre_hook(self._before_step),
                      optimizer.register_step_post_hook(self._after_step)]

    def remove(self) -> None:
        """The optimizer steps as it did before (another runtime takes the model)."""
        for hook in self.hooks:
            hook.remove()

    def _before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self.hidden_from_optimizer and p.grad is not None:
                    self._hidden.append((p, p.grad))
                    p.grad = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        for p, grad in self._hidden:
            p.grad = grad
        self._hidden = []
        for group, keeper, params in self.sends:
            for bucket in buckets(params, BROADCAST_BUCKET_BYTES):
                broadcast_tensors(bucket, self.device, src=keeper, group=group)
