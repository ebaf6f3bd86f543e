"""`parallelize`: one line from an unmodified model to a model trained across processes.

On the first call partita captures the model's graph, plans (or loads a plan), and builds this rank's part.
A one-stage, one-micro-batch plan runs as torch's DistributedDataParallel; anything else runs the captured
graph, split into stages, on torch.distributed.pipelining.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from partita import settings
from partita.capture.model_graph import model_graph
from partita.capture.dtypes import InputDtype, dtype_problem, input_dtypes
from partita.capture.export import CallSignature, CapturedGraph, capture, flatten_call, misplaced
from partita.capture.split import carry_stages, check_ownership, units
from partita.errors import BatchError, PartitaError, PlanError
from partita.graph import ModelGraph
from partita.launch import env
from partita.cluster import Cluster
from partita.graph.profile import roofline_profile
from partita.plan import Constraints, choose_plan
from partita.plan.choose import user_loss_problem
from partita.plan.plan import Plan
from partita.profile import device_spec, measure
from partita.runtime import agreement
from partita.runtime.batch import global_loss, local_rows
from partita.runtime.pipelined import Engine, Place
from partita.runtime.grads import GradSync
from partita.runtime.groups import gradient_groups, param_ranks, pipeline_groups, stage_groups
from partita.runtime.optim import optimizer_state_factor, patch_optimizer
from partita.runtime.route import Replica
from partita.runtime.state import broadcast_from_owners, broadcast_tensors, gather_optimizer_state

log = logging.getLogger("partita")


def _device_memory(device: torch.device, local_world_size: int) -> int:
    """Memory one rank may plan for: the device's, or its share of host RAM, capped by PARTITA_MEMORY_LIMIT."""
    if device.type == "cuda":
        total = int(torch.cuda.mem_get_info(device)[1])
    else:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local_world_size)
    limit = settings.memory_limit()
    return int(total) if limit is None else min(int(total), limit)


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool):
    """Temporarily put every submodule in train or eval mode, restoring each one's own flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _reduction(loss_fn) -> str:
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise PlanError(f"loss_fn has reduction={reduction!r}; partita needs 'mean' or 'sum' to combine "
                        "micro-batch losses into the batch loss")
    return reduction


class ParallelModule(nn.Module):
    """The user's model, trained across processes. Call it like the model; see `parallelize`."""

    def __init__(self, model: nn.Module, optimizer, loss_fn, constraints: Constraints,
                 plan: Plan | str | Path | None):
        super().__init__()
        self.module = model
        self._optimizer = optimizer
        self._loss_fn = loss_fn
        self._reduction = _reduction(loss_fn) if loss_fn is not None else "mean"
        self._constraints = constraints
        self._given_plan = plan
        self._plan: Plan | None = None
        self._graph: ModelGraph | None = None
        self._stage_of_node: dict[str, int] = {}
        self._stage_params: dict[int, set[str]] = {}
        self._engines: dict = {}
        self._place: Place | None = None
        self._grads: GradSync | None = None
        self._ddp: nn.Module | None = None
        self._owner: dict[str, int] = {}
        self._anchor = torch.zeros((), requires_grad=True)
        self._costs: tuple = (None, None)
        self._parameter = dict(model.named_parameters(remove_duplicate=False))
        self._input_dtypes: list[InputDtype] = []

    # ---- public --------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan in use (None until the first call, which captures and plans)."""
        return self._plan

    def forward(self, *args, **kwargs):
        world = env.init()
        args, target, problem = self._split_target(args, kwargs)
        tensors, signature = [], None
        try:
            tensors, signature = flatten_call(tuple(args), kwargs)
        except BatchError as e:
            problem = problem or e
        rows = self._agree_call(tensors, target, signature, problem, world.device)
        if self._plan is None:
            self._setup(tuple(args), kwargs, tensors, signature, rows)
        if self._ddp is not None:
            return self._data_parallel_call(tuple(args), kwargs, target, rows)
        engine = self._engine(tuple(args), kwargs, signature)
        if self._loss_fn is not None and self.module.training and torch.is_grad_enabled():
            return engine.train_step(tensors, target, self._loss_fn, self._reduction, rows)
        return engine.forward(tensors, target, self._loss_fn, self._reduction, torch.is_grad_enabled(), rows)

    def _split_target(self, args: tuple, kwargs: dict) -> tuple[tuple, torch.Tensor | None, BatchError | None]:
        """(inputs, target, problem): with loss_fn, the last positional argument is the target."""
        if self._loss_fn is None:
            return args, None, None
        if not args or len(args) + len(kwargs) < 2:
            return args, None, BatchError(
                "this model was parallelized with loss_fn, so every call is model(*inputs, target) and returns "
                "the loss; to get outputs, parallelize without loss_fn")
        *inputs, target = args
        if not isinstance(target, torch.Tensor):
            return tuple(inputs), None, BatchError(
                f"the target (last positional argument) must be a tensor, got {type(target).__name__}")
        return tuple(inputs), target, None

    def _agree_call(self, tensors: list[torch.Tensor], target: torch.Tensor | None, signature: CallSignature | None,
                    problem: BatchError | None, device: torch.device) -> tuple[int, ...]:
        """Every rank's local rows, once all ranks agree on this call (one small collective): a problem found on
        one rank alone (an input on the wrong device, say) is raised on every rank, so that no rank is left
        waiting in a collective for the one that stopped; so is a rank that stopped calling. Under data
        parallelism the ranks' sizes beyond the batch may differ (each pads its own sequences, say), as with
        DDP; a pipeline's stages need the same shapes everywhere."""
        every = tensors + ([target] if target is not None else [])
        problem = problem or misplaced(every, device) or dtype_problem(self._input_dtypes, tensors)
        rows = 0
        try:
            rows = local_rows(every)
        except BatchError as e:
            problem = problem or e
        shape = (lambda t: t.dim()) if self._ddp is not None else (lambda t: tuple(t.shape[1:]))
        shapes = [(shape(t), str(t.dtype), t.requires_grad) for t in tensors]
        if target is not None:
            shapes.append(("target", shape(target), str(target.dtype)))
        structure = signature.key[:2] if signature is not None else None
        mode = f"training={self.module.training} grad={torch.is_grad_enabled()}"
        return agreement.agree_call(f"{structure} {shapes} {mode}", rows, problem)

    def adopt_plan(self, plan: Plan) -> bool:
        """Use `plan` (e.g. the one a checkpoint was saved under) at the first call instead of planning, unless
        a plan is already in use, one was given, or it contradicts a choice given to `parallelize`. True if
        adopted. The first call still checks that it fits this model and world."""
        if self._plan is not None or self._given_plan is not None:
            return False
        chosen = {"stages": plan.num_stages, "replicas": plan.num_replicas, "micro_batches": plan.micro_batches,
                  "schedule": plan.schedule}
        if any(chosen.get(key, value) != value for key, value in self._constraints.choices().items()):
            return False
        if not self._constraints.allows_schedule(plan.schedule):
            return False
        self._given_plan = plan
        return True

    def timeline(self, path: str) -> str:
        """Draw the simulated step of the plan in use (rank 0; .png or .svg); returns the path."""
        from partita.plan.choose import simulate_plan
        from partita.sim.timeline import draw_timeline

        profile, cluster = self._costs
        if self._plan is None or profile is None:
            raise PlanError("no simulated step to draw: call the model once first (on rank 0, with a plan "
                            "partita made itself rather than one it was given)")
        trace = simulate_plan(self._plan, self._graph, profile, cluster, optimizer_state_factor(self._optimizer))
        return str(draw_timeline(trace, path))

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The whole model's state under its original names, the same on every rank."""
        named = list(self.module.state_dict(keep_vars=True).items())
        if self._ddp is not None or self._place is None:
            gathered = {n: t.detach().clone() for n, t in named}
        else:
            gathered = broadcast_from_owners(named, self._owner, self._place.rank, self._place.device)
        out = destination if destination is not None else {}
        out.update({prefix + n: t for n, t in gathered.items()})
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a whole-model state dict (original names) into every rank's copy."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def get_param(self, name: str) -> torch.Tensor:
        """The current value of parameter `name` (original FQN), the same on every rank."""
        return self._gather_one(name, grad=False)

    def get_param_grad(self, name: str) -> torch.Tensor | None:
        """The gradient of parameter `name` (original FQN), or None, the same on every rank."""
        return self._gather_one(name, grad=True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their norm over the whole model (each parameter counted once)."""
        params = list({id(p): p for p in self._parameter.values()}.values())
        rank = env.get_rank()
        pipelined = self._place is not None
        owned = [p.grad for p in params if p.grad is not None and (not pipelined or self._owner_of_param(p) == rank)]
        local = torch.zeros((), device=env.world().device, dtype=torch.float64)
        for g in owned:
            local += g.detach().double().norm(norm_type) ** norm_type
        if pipelined:
            dist.all_reduce(local)
        total = local ** (1.0 / norm_type)
        coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total.float()

    # ---- setup ---------------------------------------------------------------------------------
    def _setup(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor], signature: CallSignature,
               rows: tuple[int, ...]) -> None:
        world = env.world()
        with agreement.together("capturing the model"), _mode(self.module, True):
            planned = capture(self.module, args, kwargs)
            self._input_dtypes = input_dtypes(planned)
            self._graph = model_graph(planned)
        plan = self._agreed_plan(planned, rows)
        stage_of_unit = self._graph.stage_of_unit(plan.stage_of_block())
        for group, stage in zip(units(planned), stage_of_unit):
            for node in group:
                self._stage_of_node[node.name] = stage
        self._stage_params = {s.index: self._graph.params_of(*s.blocks) for s in plan.stages}
        self._owner = {}
        for fqn, ranks in param_ranks(plan, self._stage_params).items():
            for name in self._aliases(self._parameter, fqn):
                self._owner[name] = ranks[0]
        self._owner.update(self._buffer_owners(planned, plan))
        # every rank starts from rank 0's weights, as with DDP, whatever each rank's seed was
        broadcast_tensors(list(self.module.state_dict(keep_vars=True).values()), world.device)
        self._plan = plan
        if world.rank == 0:
            env.log_to_stderr()
            log.info("%s", plan.explain())
        if plan.num_stages == 1 and plan.micro_batches == 1:
            self._ddp = self._make_ddp(planned)
            self._settle_ddp_buckets(args, kwargs)
        else:
            replicas = pipeline_groups(plan)
            j = plan.replica_of(world.rank)
            group = replicas[j] if replicas[j] is not None else dist.group.WORLD
            buffers = stage_groups(plan) if any(True for _ in self.module.buffers()) else {}
            self._place = Place(plan, world.rank, world.world_size, world.device, j,
                                Replica(plan.replica_ranks(j), group, world.rank, world.device), group, buffers)
            self._grads = GradSync(gradient_groups(plan, self._stage_params, world.rank, self._parameter))
            key = (True, signature.key, self._requires_grad_key())
            self._engines[key] = self._new_engine(planned, stage_of_unit)
        if self._optimizer is not None and self._place is not None:
            patch_optimizer(self._optimizer, self._full_optimizer_state, self._keep_local_optimizer_state)
            # state loaded before this first call (partita.load, load_state_dict) covers the whole model
            self._keep_local_optimizer_state(self._optimizer)

    def _agreed_plan(self, cap: CapturedGraph, rows: tuple[int, ...]) -> Plan:
        """Every rank measures its share (unless a plan was given or the measurements are cached), rank 0
        plans; every rank gets the same plan or the same error."""
        world = env.world()
        result: list = [None]
        profile = cluster = None
        if self._given_plan is None:
            profile, cluster = self._measure(cap, max(rows))
            self._costs = (profile, cluster)  # on rank 0, what the plan was made from (for its timeline)
        if world.rank == 0:
            try:
                # plans are for the steady state: full batches, of the largest rank's rows on every rank
                result[0] = self._make_plan(max(rows) * len(rows), profile, cluster).to_json()
            except Exception as e:  # noqa: BLE001 - every rank raises it, none waits for a plan that never comes
                result[0] = e if isinstance(e, PartitaError) else PlanError(f"rank 0 failed to plan: "
                                                                             f"{type(e).__name__}: {e}")
        if world.world_size > 1:
            dist.broadcast_object_list(result, src=0)
        if isinstance(result[0], Exception):
            raise result[0]
        plan = Plan.from_json(result[0])
        agreement.agree(f"model graph {self._graph.fingerprint}", "the model they captured (different models or inputs)")
        return plan

    def _measure(self, cap: CapturedGraph, local_batch: int):
        """(profile, cluster) on rank 0, (None, None) elsewhere: measured on this job's devices, or estimated
        from the device preset when PARTITA_PROFILE=estimate (faster, less exact)."""
        world = env.world()
        memory = _device_memory(world.device, world.local_world_size)
        if settings.profile_mode() == "estimate":
            if world.rank != 0:
                return None, None
            spec = device_spec(world.device)
            per_node = max(1, min(world.local_world_size, world.world_size))
            cluster = Cluster(spec, max(1, world.world_size // per_node), per_node, memory_bytes=memory)
            return roofline_profile(self._graph, spec), cluster
        return measure(cap, self._graph, local_batch, world.device, world.local_world_size, memory)

    def _make_plan(self, global_batch: int, profile, cluster) -> Plan:
        world = env.world()
        if self._given_plan is not None:
            plan = self._given_plan if isinstance(self._given_plan, Plan) else Plan.load(self._given_plan)
            if plan.fingerprint and plan.fingerprint != self._graph.fingerprint:
                raise PlanError(
                    f"the plan was made for another model (graph {plan.fingerprint}, this model's graph is "
                    f"{self._graph.fingerprint}, {self._graph.num_blocks} blocks). Make a new plan for this "
                    "model, or drop plan=... to let partita plan."
                )
            if not self._constraints.allows_schedule(plan.schedule):
                raise PlanError(f"the plan given runs {plan.schedule}. {user_loss_problem(plan.schedule)}")
            return plan.validate(world.world_size)
        return choose_plan(self._graph, profile, cluster, global_batch=global_batch,
                           optimizer_factor=optimizer_state_factor(self._optimizer), constraints=self._constraints)

    def _buffer_owners(self, cap: CapturedGraph, plan: Plan) -> dict[str, int]:
        """Buffers belong to the first rank of the first stage whose operations use them."""
        first_use: dict[str, int] = {}
        for node in cap.gm.graph.nodes:
            for a in node.all_input_nodes:
                if a.name in cap.fqn_of and a.name not in cap.parameters and node.name in self._stage_of_node:
                    first_use.setdefault(cap.fqn_of[a.name], self._stage_of_node[node.name])
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        return {name: plan.stages[stage].ranks[0]
                for fqn, stage in first_use.items() for name in self._aliases(buffers, fqn)}

    @staticmethod
    def _aliases(named: dict[str, torch.Tensor], fqn: str) -> list[str]:
        """Every name under which the tensor called `fqn` appears (tied weights have several)."""
        return [name for name, t in named.items() if t is named[fqn]]

    def _make_ddp(self, cap: CapturedGraph) -> nn.Module:
        if env.get_world_size() == 1:
            return self.module
        used = {cap.fqn_of[n] for n in cap.parameters}
        # routing by value (a mixture of experts): eager code may skip an expert no row of this rank reaches
        unused = cap.routes_by_value() or any(
            p.requires_grad and n not in used for n, p in self.module.named_parameters())
        return DistributedDataParallel(self.module, find_unused_parameters=unused)

    def _settle_ddp_buckets(self, args: tuple, kwargs: dict) -> None:
        """One throwaway forward and backward through DDP, whose effects are undone (gradients, buffers, random
        streams). torch's DDP sums its first backward in one bucket in parameter order, then re-buckets in the
        order the gradients became ready. Settled here, every step of every process sums in the same buckets,
        the first step after a restart from a checkpoint included: resumed training then computes bit for bit
        what uninterrupted training would have."""
        if not isinstance(self._ddp, DistributedDataParallel) or self._ddp.find_unused_parameters:
            return  # no re-bucketing then
        grads = [(p, p.grad) for p in self.module.parameters()]
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        device = env.world().device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _mode(self.module, True), \
                torch.enable_grad():
            out = self._ddp(*args, **kwargs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            if leaves:
                (sum(t.sum() for t in leaves) * 0.0).backward()
        with torch.no_grad():
            for p, grad in grads:
                p.grad = grad
            for b, value in buffers:
                b.copy_(value)

    def _new_engine(self, cap: CapturedGraph, stage_of_unit: list[int]) -> Engine:
        engine = Engine(cap, stage_of_unit, self._place, self._grads, self._anchor)
        check_ownership(engine.graphs, self._stage_params)
        return engine

    def _requires_grad_key(self) -> tuple:
        return tuple(p.requires_grad for p in self._parameter.values())

    def _engine(self, args: tuple, kwargs: dict, signature: CallSignature) -> Engine:
        key = (self.module.training, signature.key, self._requires_grad_key())
        if key not in self._engines:
            cap = capture(self.module, args, kwargs)
            stages_of_param: dict[str, set[int]] = {}
            for s, fqns in self._stage_params.items():
                for f in fqns:
                    stages_of_param.setdefault(f, set()).add(s)
            self._engines[key] = self._new_engine(cap, carry_stages(cap, self._stage_of_node, stages_of_param))
        return self._engines[key]

    # ---- data parallel -------------------------------------------------------------------------
    def _data_parallel_call(self, args: tuple, kwargs: dict, target, rows: tuple[int, ...]):
        out = self._ddp(*args, **kwargs)
        if self._loss_fn is None:
            return torch.utils._pytree.tree_map(
                lambda t: global_loss(t, "mean", rows) if isinstance(t, torch.Tensor) and t.dim() == 0 else t, out)
        return global_loss(self._loss_fn(out, target), self._reduction, rows)

    # ---- gathering -----------------------------------------------------------------------------
    def _owner_of_param(self, p: nn.Parameter) -> int:
        for name, q in self._parameter.items():
            if q is p:
                return self._owner.get(name, 0)
        return 0

    def _gather_one(self, name: str, grad: bool) -> torch.Tensor | None:
        if name not in self._parameter:
            raise KeyError(f"no parameter named {name!r}; names are the original model's, e.g. "
                           f"{next(iter(self._parameter), '')!r}")
        p = self._parameter[name]
        t = p.grad if grad else p
        if self._ddp is not None or self._place is None:
            return None if t is None else t.detach().clone()
        world = env.world()
        owner = self._owner.get(name, 0)
        flag = torch.tensor([float(t is not None)], device=world.device)
        dist.broadcast(flag, src=owner)
        if flag.item() == 0:
            return None
        value = (t.detach().clone() if t is not None else torch.empty_like(p)).to(world.device)
        dist.broadcast(value, src=owner)
        return value.to(p.device)

    def _optimizer_params(self) -> list[nn.Parameter]:
        return [p for g in self._optimizer.param_groups for p in g["params"]]

    def _full_optimizer_state(self, state_dict: dict) -> dict:
        owner = {i: self._owner_of_param(p) for i, p in enumerate(self._optimizer_params())}
        return gather_optimizer_state(state_dict, owner, env.get_rank())

    def _local_parameter_ids(self) -> set[int]:
        """ids of the parameters this rank trains (read by its stages); empty before the first call."""
        if self._plan is None:
            return set()
        return {id(self._parameter[f]) for s in self._plan.stages_of(env.get_rank()) for f in self._stage_params[s]}

    def _keep_local_optimizer_state(self, optimizer) -> None:
        local = self._local_parameter_ids()
        for p in list(optimizer.state):
            if id(p) not in local:
                del optimizer.state[p]


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, loss_fn=None,
                stages: int | None = None, replicas: int | None = None, micro_batches: int | None = None,
                schedule: str | None = None, plan: Plan | str | Path | None = None) -> ParallelModule:
    """Wrap an unmodified model so that it trains across this job's processes.

    Each rank passes its own local batch; the global batch is the ranks' local batches concatenated in rank
    order. With `loss_fn`, `model(*inputs, target)` returns the global mean loss (the same on every rank)
    and `loss.backward()` gives the gradients of single-process training on the global batch. Without it,
    `model(*inputs)` returns this rank's rows of the output, and gradients average over ranks as with DDP.

    `stages`, `replicas`, `micro_batches` and `schedule` fix what the planner would choose; `plan` takes a
    saved plan (a path or a Plan).

    >>> import torch, partita
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> model = partita.parallelize(net, opt, loss_fn=torch.nn.CrossEntropyLoss())
    >>> loss = model(torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 1, 0]))
    >>> loss.backward(); opt.step()
    >>> model.plan.num_stages
    1
    """
    env.init()
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize needs an nn.Module, got {type(model).__name__}")
    agreement.join()
    constraints = Constraints(stages=stages, replicas=replicas, micro_batches=micro_batches, schedule=schedule,
                              user_loss=loss_fn is None)
    if schedule is not None and not constraints.allows_schedule(schedule):
        raise PlanError(user_loss_problem(schedule))
    return ParallelModule(model, optimizer, loss_fn, constraints, plan)
