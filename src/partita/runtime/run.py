"""`Runtime`: this rank's part of the model under a plan, and what the parallelized model asks of it.

`build.py` makes one; `data_parallel.py` and `pipeline_parallel.py` are the two kinds today. What they share
is here: the whole-model views (state, one parameter, gradient norm) that follow the plan's ownership, and
`held`, what a checkpoint writes and reads on this rank.
"""

from __future__ import annotations

import math
import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from partita.errors import PartitaError
from partita.plan.plan import Plan
from partita.runtime import agreement
from partita.runtime.batch import Call, Loss
from partita.runtime.groups import MadeGroups
from partita.runtime.optim import converted_state, patch_optimizer, unpatch_optimizer
from partita.runtime.ownership import Ownership, aliases, named_state
from partita.runtime.precision import LossScale
from partita.runtime.sharding import OptimizerSharding, state_keepers
from partita.runtime.state import (broadcast_from_owners, full_value, gather_optimizer_state, landing, local_part,
                                   shard_like)


@dataclass(frozen=True)
class Held:
    """What a checkpoint takes from this rank."""

    writes: frozenset[str]  # state_dict names this rank's copy is current for
    trains: frozenset[str]  # parameters (by their first name) whose optimizer state lives on this rank
    reads: frozenset[str]  # state_dict names this rank holds (the others are meta here)


def first_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name (tied weights have several): the name its optimizer state goes under."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def refuse_partial_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A state_dict pre-hook on the user's model (`model.module`): DDP's saving idiom, `if rank == 0:
    torch.save(model.module.state_dict(), path)`, would save the meta tensors of other ranks' stages or this
    replica's shards, a file that fails only when loaded. partita's own reads keep the variables (keep_vars=True)."""
    if keep_vars:
        return
    tensors = [*module.parameters(), *module.buffers()]
    meta = sum(1 for t in tensors if t.is_meta)
    shards = sum(1 for t in tensors if isinstance(t, DTensor))
    if not meta and not shards:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    parts = ([f"{meta} of its tensors are on the meta device (another stage's, or not made yet)"] if meta else []) + \
        ([f"{shards} are this replica's shards of tensors its replicas split"] if shards else [])
    raise PartitaError(
        f"model.module.state_dict() on rank {rank}: this rank holds only its part of the model ({'; '.join(parts)}), "
        "so a file saved from it would fail when loaded. Call model.state_dict() on every rank instead (it gathers "
        "the whole model, the same on every rank; save it from rank 0), or partita.save(model, optimizer, path, "
        "step=...) on every rank")


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Temporarily put every submodule in train or eval mode, restoring each one's own flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def as_trained(model: nn.Module) -> Iterator[None]:
    """The modes a training step runs the model in, for what plans and prepares training: the modules' own
    while the model trains (a submodule the user put in eval mode, a frozen BatchNorm, stays in it), else
    every module in train mode (the model is planned for training whatever mode its first call is in)."""
    if model.training:
        yield
        return
    with in_mode(model, True):
        yield


class Runtime:
    """Runs calls of the model under `plan` on this rank. Subclasses implement `__call__`."""

    # whether every rank must pass the same shapes beyond the batch dimension (a pipeline's stages are built
    # for static shapes; data parallelism lets each rank pad its own sequences)
    same_shapes = True
    # whether gradients of different parameters live on different ranks (so a norm sums over ranks)
    split_gradients = True

    def __init__(self, module: nn.Module, plan: Plan, ownership: Ownership, rank: int, device: torch.device,
                 made: MadeGroups):
        self.module = module
        self.made = made  # the process groups built for it, destroyed by `close`
        self.plan = plan
        self.ownership = ownership
        self.rank = rank
        self.device = device
        self.parameters = dict(module.named_parameters(remove_duplicate=False))
        self.optimizer: torch.optim.Optimizer | None = None
        # parameter (every name) -> the replica of its stage that keeps its optimizer state, where sharded
        self.keepers: dict[str, int] = {}
        self.loss_scale: LossScale | None = None  # float16's (precision.py)
        self.loss: Loss | None = None  # partita's loss (loss_fn), as checked on the first call (batch.checked_loss)
        self.sharding: OptimizerSharding | None = None  # ZeRO-1's step hooks, where the plan shards optimizer state

    def __call__(self, call: Call):
        raise NotImplementedError

    def owner_of(self, name: str) -> int:
        return self.ownership.owner.get(name, 0)

    def stage_boundaries(self) -> str:
        """Which operations, parameters and buffers each stage gets and which rank owns each tensor, as text that
        every rank must have alike."""
        o = self.ownership
        return repr((o.stage_of_unit, sorted((s, sorted(p)) for s, p in o.stage_params.items()),
                     sorted((s, sorted(b)) for s, b in o.stage_buffers.items()), sorted(o.owner.items())))

    def trained_here(self) -> set[int]:
        """ids of the parameters whose optimizer state lives on this rank: those its stages read, less those
        another replica of its stage keeps (sharding)."""
        return {id(self.parameters[f]) for f in self.ownership.trained_by(self.rank)
                if self.keepers.get(f, self.rank) == self.rank}

    def state_keeper(self, name: str) -> int:
        """The rank whose optimizer state for parameter `name` (its first name) is current."""
        return self.keepers.get(name, self.owner_of(name))

    def keep_optimizer_state_here(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state_dict() whole on every rank (gathered from the ranks that keep each part) and
        its load_state_dict() keeping only this rank's part; state loaded before the first call (partita.load,
        load_state_dict) covers the whole model and is cut to this rank's part now."""
        patch_optimizer(optimizer, self._whole_optimizer_state, self._keep_local_optimizer_state)
        self._keep_local_optimizer_state(optimizer)

    def _whole_optimizer_state(self, state_dict: dict) -> dict:
        first = first_names(self.module)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        keeper = {i: self.state_keeper(first[id(p)]) if id(p) in first else 0 for i, p in enumerate(params)}
        return gather_optimizer_state(state_dict, keeper, self.rank)

    def _keep_local_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        local = self.trained_here()
        for p in list(optimizer.state):
            if id(p) not in local:
                del optimizer.state[p]
            else:  # state loaded whole, of a parameter FSDP shards: this replica's shard of it
                optimizer.state[p] = converted_state(optimizer.state[p], p, shard_like)

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, stage_groups: dict) -> None:
        """Where the plan shards optimizer state (ZeRO-1), each replica of a stage keeps its share of it."""
        # under every name of a tied weight, as the ownership's owners: the graph knows it by one of them (HF GPT-2's
        # embedding as lm_head.weight), the user's optimizer state by its first (transformer.wte.weight)
        self.keepers = {alias: keeper for name, keeper in state_keepers(self.plan, self.ownership.stage_params,
                                                                          self.parameters).items()
                        for alias in aliases(self.parameters, name)}
        if not self.keepers:
            return
        self.optimizer = optimizer
        self.sharding = OptimizerSharding(optimizer, self.keepers, self.parameters, self.plan,
                                          self.ownership.stage_params, stage_groups, self.rank, self.device)
        self.keep_optimizer_state_here(optimizer)

    def scale_loss(self, optimizer: torch.optim.Optimizer) -> None:
        """float16: the backward runs on the scaled loss, and `optimizer.step()` unscales, or skips on every rank
        when gradients overflowed anywhere (precision.LossScale)."""
        # every gradient this rank holds, also of parameters whose optimizer state another replica keeps
        # (sharding "optimizer"): get_param_grad and clip_grad_norm_ read those too
        held = {id(p): p for p in (self.parameters[f] for f in self.ownership.trained_by(self.rank))}
        self.loss_scale = LossScale(list(held.values()), self.device)
        self.loss_scale.take_over_step(optimizer)

    def _unscaled(self, value: torch.Tensor) -> torch.Tensor:
        """`value`, read off the gradients held now, as the loss gives it (float16 keeps them scaled until the
        optimizer's step: a later backward may still add to them)."""
        return self.loss_scale.unscaled(value) if self.loss_scale is not None else value

    def held(self) -> Held:
        local = self.trained_here()
        named = self.module.state_dict(keep_vars=True)
        writes = frozenset(n for n, t in named.items() if id(t) in local or self.owner_of(n) == self.rank)
        names = first_names(self.module)
        reads = frozenset(n for n, t in named.items() if isinstance(t, torch.Tensor) and not t.is_meta)
        return Held(writes, frozenset(names[i] for i in local), reads)

    def release(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Undo what this runtime set on the user's optimizer, before another runtime takes the model."""
        if optimizer is not None:
            unpatch_optimizer(optimizer)
        if self.loss_scale is not None:
            self.loss_scale.give_back_step()
        if self.sharding is not None:
            self.sharding.remove()

    def close(self) -> None:
        """Collective, once another runtime took the model (or none will run it again): destroy the process
        groups this runtime made. It cannot run after."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # NCCL's last operations on them are done, not just posted
        if dist.is_initialized():
            dist.barrier(group=agreement.cpu_group())  # nothing is under way on any rank's groups
        self.made.destroy()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state under its original names, the same on every rank."""
        _every_rank_in("model.state_dict()")
        return self._whole(self.module.state_dict(keep_vars=True).items())

    def as_held(self, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """A whole-model state dict as this rank's module holds it, for its load_state_dict: each tensor FSDP
        shards cut to this replica's shard (every replica cuts its own, without communication)."""
        held = self.module.state_dict(keep_vars=True)
        out = OrderedDict((n, shard_like(v, held[n]) if isinstance(held.get(n), DTensor) and isinstance(v, torch.Tensor)
                           else v) for n, v in state_dict.items())
        if hasattr(state_dict, "_metadata"):  # module versions, which load_state_dict reads
            out._metadata = state_dict._metadata
        return out

    def unsaved_state(self) -> dict[str, torch.Tensor]:
        """The tensors no state_dict holds (buffers registered with persistent=False), whole on every rank."""
        saved = self.module.state_dict(keep_vars=True)
        return self._whole((n, t) for n, t in named_state(self.module).items() if n not in saved)

    def _whole(self, items) -> dict[str, torch.Tensor]:
        items = list(items)
        named = [(n, full_value(t)) for n, t in items]
        if not self.split_gradients:
            # DDP: every rank's parameters are the same, its buffers (BatchNorm statistics) its own, of which
            # DDP takes rank 0's before each forward: those, from their owner
            params = {id(p) for p in self.module.parameters()}
            buffers = {n for n, t in items if id(t) not in params}
            taken = broadcast_from_owners([(n, t) for n, t in named if n in buffers], self.ownership.owner,
                                          self.device)
            return {n: taken[n] if n in taken else t.detach().clone() for n, t in named}
        return dict(broadcast_from_owners(named, self.ownership.owner, self.device))

    def parameter(self, name: str, grad: bool) -> torch.Tensor | None:
        """Parameter `name` (or its gradient), the same on every rank."""
        _every_rank_in(f"model.{'get_param_grad' if grad else 'get_param'}({name!r})")
        p = self.parameters[name]
        t = full_value(p.grad if grad else p)
        if grad and t is not None:
            t = self._unscaled(t)
        if not self.split_gradients:
            return None if t is None else t.detach().clone()
        owner = self.owner_of(name)
        flag = torch.tensor([float(t is not None)], device=self.device)
        dist.broadcast(flag, src=owner)
        if flag.item() == 0:
            return None
        # only the owner's copy holds the value: the others may hold this parameter as meta
        value = (t.detach().to(self.device, copy=True) if owner == self.rank
                 else torch.empty(p.shape, dtype=p.dtype, device=self.device))
        dist.broadcast(value, src=owner)
        return value.to(landing(p))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their norm over the whole model (each parameter counted once, on its owner)."""
        _every_rank_in(f"model.clip_grad_norm_({max_norm!r}, {norm_type!r})")
        first = first_names(self.module)
        params = [self.parameters[name] for name in first.values()]
        # a sharded gradient counts its shard on each replica; any other, on its owner
        counted = [local_part(p.grad) for p, name in zip(params, first.values())
                   if p.grad is not None and (not self.split_gradients or self.owner_of(name) == self.rank
                                              or local_part(p.grad) is not p.grad)]
        local = torch.zeros((), device=self.device, dtype=torch.float64)
        largest = math.isinf(norm_type)  # the infinity norm: the largest magnitude, not a sum of powers
        for g in counted:
            if largest:
                local = torch.maximum(local, g.detach().double().abs().max()) if g.numel() else local
            else:
                local += g.detach().double().norm(norm_type) ** norm_type
        if self.split_gradients:
            dist.all_reduce(local, op=dist.ReduceOp.MAX if largest else dist.ReduceOp.SUM)
        total = self._unscaled(local if largest else local ** (1.0 / norm_type))
        coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total.float()


def _every_rank_in(call: str) -> None:
    """These reads gather from the ranks that hold the values, in some layouts, and so are collective in all: a
    rank that reads while another calls the model (`if rank == 0: model.state_dict()`, torch's idiom for DDP)
    gets the same error on every rank at once, in every layout, instead of a wait under the ones that gather."""
    agreement.state_step(call, None)
