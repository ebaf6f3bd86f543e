"""`parallelize`: one line from an unmodified model to a model trained across processes.

Wiring only. At the first call: capture the model's graph (`capture`), choose or load the plan, the same on
every rank (`planning`), and build this rank's part of the model under it (`runtime.build_runtime`). Every
call: agree with the other ranks on what this call is (`runtime.agreement`), then run it (`Runtime`).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from partita.capture.dtypes import InputDtype, dtype_problem, input_dtypes
from partita.capture.export import CallSignature, CapturedGraph, Modes, capture, flatten_call, misplaced
from partita.capture.model_graph import model_graph
from partita.checkpoint.collective import together
from partita.checkpoint.loading import load_optimizer_state
from partita.checkpoint.owner import release_all as release_checkpoint_dirs
from partita.checkpoint.relayout import relayout
from partita.checkpoint.weights import model_weights
from partita.errors import BatchError, PlanError
from partita.graph import ModelGraph
from partita.launch import env, watchdog
from partita.plan import Constraints, Plan
from partita.plan.choose import simulate_plan
from partita.plan.plan import check_sharding
from partita.planning import (Planned, PlanRequest, agreed_graph, agreed_plan, agreed_switch, review_step,
                              review_switch)
from partita.runtime import agreement
from partita.runtime.batch import Call, check_first_rows, local_rows, loss_of, sizes_beyond_batch, split_target
from partita.runtime.build import build_runtime
from partita.runtime.materialize import Initial, InitFn, check_devices, initial_of, loaded_weights
from partita.runtime.optim import check_optimizer_params
from partita.runtime.precision import SCALED, check_precision
from partita.runtime.run import Held, Runtime, as_trained, refuse_partial_state_dict
from partita.runtime.step_clock import Mark, StepClock, mark
from partita.sim import Trace

log = logging.getLogger("partita")


class ParallelModule(nn.Module):
    """The user's model, trained across processes. Call it like the model; see `parallelize`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn,
                 constraints: Constraints, plan: Plan | str | Path | None, initial: Initial):
        super().__init__()
        self.module = model
        model.register_state_dict_pre_hook(refuse_partial_state_dict)
        self._optimizer = optimizer
        self._initial = initial
        self._loss = loss_of(loss_fn)
        self._request = PlanRequest.of(constraints, plan, optimizer)
        self._runtime: Runtime | None = None
        self._planned: Planned | None = None
        self._graph: ModelGraph | None = None
        self._clock: StepClock | None = None
        # after a switch of layouts, the plan before it and its measured step, until the new one's are measured
        self._switched_from: tuple[Planned, float] | None = None
        self._sizes_seen: set[tuple] = set()  # the inputs' sizes beyond the batch, in the calls the clock timed
        self._capture: tuple[CapturedGraph, CallSignature] | None = None  # the first call's, and its signature
        self._input_dtypes: list[InputDtype] = []
        self._parameter_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        self._modules_listed = list(model.modules())  # for each call's modes (`Modes.of`)
        self._optimizer_state_from: Path | None = None  # a checkpoint to load it from once the model holds its part
        self._loss_scale_from: dict | None = None  # float16's, loaded before the first call made one

    @property
    def plan(self) -> Plan | None:
        """The plan in use (None until the first call, which captures and plans)."""
        return self._runtime.plan if self._runtime is not None else None

    @property
    def planned(self) -> Planned | None:
        """The plan with, on rank 0, the block costs and cluster it was made from (None until the first call)."""
        return self._planned

    @property
    def runtime(self) -> Runtime | None:
        """This rank's part of the model (None until the first call)."""
        return self._runtime

    def forward(self, *args, **kwargs):
        world = env.init()
        called = mark(world.device) if self._clock is None or not self._clock.done else None
        args, target, problem = split_target(args, kwargs, with_loss=self._loss is not None)
        tensors, signature = [], None
        try:
            tensors, signature = flatten_call(tuple(args), kwargs)
        except BatchError as e:
            problem = problem or e
        modes = Modes.of(self._modules_listed)
        call = Call(tuple(args), kwargs, tensors, signature, target, modes,
                    self._start_agreeing(tensors, target, signature, modes, problem, world.device))
        if self._runtime is None:
            self._setup(call)
        training = self.module.training and torch.is_grad_enabled()
        if not self._clock.done:
            self._sizes_seen.add(sizes_beyond_batch(call))
            self._time_step(call, training, called)
        result = self._runtime(call)
        if training and not self._clock.done:
            self._end_step_with(result)
        return result

    def _time_step(self, call: Call, training: bool, called: Mark) -> None:
        """Time the training steps: from this call to the end of its backward or its optimizer's step. Once
        enough were measured, rank 0 says how they compare with the plan's estimate (`planning.review_step`), and
        where another layout is enough faster, every rank moves to it before running this call
        (`planning.agreed_switch`, `checkpoint.relayout`). The steps after a switch are timed again, and a
        switch that made them slower is undone (`planning.review_switch`)."""
        measured_s = self._clock.called(call.rows, training, called)
        if measured_s is None:
            return
        switched_from, self._switched_from = self._switched_from, None
        if switched_from is None:
            review = lambda: review_step(self._planned, self._graph, self._request, measured_s)  # noqa: E731
        else:
            review = lambda: review_switch(*switched_from, self._runtime.plan, measured_s)  # noqa: E731
        other = agreed_switch(review, self.module, self._runtime.plan, sizes_beyond_batch(call),
                              len(self._sizes_seen) > 1)
        if other is None:
            return
        before = self._planned
        self._runtime = relayout(self, self.module, self._optimizer, self._runtime,
                                 lambda initial: self._build(other.plan, call, initial))
        if self._runtime.plan is other.plan:
            self._planned = other
            if switched_from is None:  # the new layout's steps are timed from this call on
                self._switched_from = (before, measured_s)
                self._clock = StepClock(call.rows)
                self._clock.called(call.rows, training, called)

    def _end_step_with(self, result) -> None:
        """The step under way ends, at the latest, with the backward through this call's output."""
        ended = next((t for t in torch.utils._pytree.tree_leaves(result)
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if ended is not None:
            clock, device = self._clock, env.world().device  # this step's clock, also if a switch replaces it
            # runs as the backward through this output ends (autograd's queued callbacks run last)
            ended.register_hook(lambda grad: torch.autograd.Variable._execution_engine.queue_callback(
                lambda: clock.ended(mark(device))))

    def _start_agreeing(self, tensors: list[torch.Tensor], target: torch.Tensor | None,
                        signature: CallSignature | None, modes: Modes, problem: BatchError | None,
                        device: torch.device) -> agreement.Agreement:
        """Start agreeing with every rank on this call (see runtime.agreement); `rows()` waits for them."""
        every = tensors + ([target] if target is not None else [])
        problem = problem or misplaced(every, device) or dtype_problem(self._input_dtypes, tensors)
        rows = 0
        try:
            rows = local_rows(every)
        except BatchError as e:
            problem = problem or e
        same_shapes = self._runtime is None or self._runtime.same_shapes
        description = agreement.describe_call(tensors, target, signature, same_shapes=same_shapes,
                                              modes=modes)
        return agreement.start_call(description, rows, problem, first=self._runtime is None, same_sizes=same_shapes)

    def _setup(self, call: Call) -> None:
        world = env.world()
        rows = call.rows  # every rank agrees on the call before the collectives of setting up
        check_first_rows(rows)
        with agreement.together("capturing the model"), as_trained(self.module):
            check_devices(self.module, world.device)
            cap = capture(self.module, call.args, call.kwargs)
            self._input_dtypes = input_dtypes(cap)
            graph = model_graph(cap)
        cap, graph = agreed_graph(cap, graph)
        self._planned = agreed_plan(cap, graph, rows, self._request, parallelize)
        if world.rank == 0:
            env.log_to_stderr()
            log.info("%s", self._planned.plan.explain())
        self._graph = graph
        self._clock = StepClock(rows)
        if self._optimizer is not None:
            self._optimizer.register_step_post_hook(lambda *_: self._clock.ended(mark(world.device)))
        self._capture = (cap, call.signature)
        self._build(self._planned.plan, call, self._initial)
        if self._optimizer_state_from is not None and self._optimizer is not None:
            load_optimizer_state(self, self._optimizer, self._optimizer_state_from)
        self._optimizer_state_from = None
        if self._runtime.loss_scale is not None:
            self._runtime.loss_scale.load_state_dict(self._loss_scale_from)
        self._loss_scale_from = None

    def _build(self, plan: Plan, call: Call, initial: Initial) -> Runtime:
        """This rank's part of the model under `plan`, from the first call's capture (`call`: the one under way),
        in use from now on."""
        cap, signature = self._capture
        # the capture's engine is keyed by the first call's signature; DDP settles its buckets with this call's
        first = dataclasses.replace(call, signature=signature)
        world = env.world()
        # the loss as the runtime before this one checked it (batch.checked_loss): a new layout combines it so too
        loss = self._runtime.loss if self._runtime is not None else self._loss
        self._runtime = build_runtime(self.module, cap, self._graph, plan, first, loss=loss,
                                      optimizer=self._optimizer, rank=world.rank, world_size=world.world_size,
                                      device=world.device, initial=initial)
        return self._runtime

    def adopt_plan(self, plan: Plan) -> bool:
        """Use `plan` (e.g. the one a checkpoint was saved under) at the first call instead of planning, unless
        a plan is already in use, one was given, or it contradicts a choice given to `parallelize`. True if
        adopted. The first call still checks that it fits this model and world."""
        if self._runtime is not None or self._request.given is not None or not self._request.constraints.allows(plan):
            return False
        self._request = dataclasses.replace(self._request, given=plan)
        return True

    def resume_from(self, checkpoint: Path) -> None:
        """`partita.load` before the first call of a model built on the meta device: its weights come from
        `checkpoint` (a step-* directory) as the first call materializes each rank's part, as with
        parallelize(weights=...), and the optimizer's state right after."""
        if self._runtime is not None:
            raise PlanError("resume_from is for a model before its first call; partita.load reads into it after")
        self._initial = dataclasses.replace(self._initial, weights=model_weights(checkpoint, self.module, strict=True))
        self._optimizer_state_from = checkpoint

    def loss_scale_state(self) -> dict | None:
        """float16's dynamic loss scale as a checkpoint keeps it; None in other precisions, and before the first
        call unless one was loaded (the scale starts from its start then)."""
        if self._runtime is not None:
            return self._runtime.loss_scale.state_dict() if self._runtime.loss_scale is not None else None
        return self._loss_scale_from

    def load_loss_scale_state(self, state: dict | None) -> None:
        """Go on from a loss scale a checkpoint kept (None: it kept none, and the scale starts over); at the
        first call, where none is made yet. Other precisions scale nothing and ignore it."""
        if self._request.constraints.precision not in SCALED:
            return
        if self._runtime is not None:
            self._runtime.loss_scale.load_state_dict(state)
        else:
            self._loss_scale_from = state

    def held(self) -> Held | None:
        """What a checkpoint takes from this rank (None before the first call: then rank 0's copy is current)."""
        return self._runtime.held() if self._runtime is not None else None

    def simulated_step(self) -> Trace:
        """The planner's simulation of one step under the plan in use: what each pipeline rank runs, when.
        Rank 0 only, once it made the plan (a plan given is not simulated: its measurements are not here)."""
        planned = self._planned
        if planned is None or planned.profile is None:
            raise PlanError("no simulated step: call the model once first (on rank 0, with a plan partita made "
                            "itself rather than one it was given)")
        return simulate_plan(planned.plan, self._graph, planned.profile, planned.cluster,
                             self._request.optimizer_factor)

    def timeline(self, path: str) -> str:
        """Draw the simulated step of the plan in use (rank 0; .png or .svg); returns the path."""
        from partita.sim.timeline import draw_timeline

        return str(draw_timeline(self.simulated_step(), path))

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The whole model's state under its original names, the same on every rank."""
        if self._runtime is None:
            gathered = {n: t.detach().clone() for n, t in self.module.state_dict(keep_vars=True).items()}
        else:
            gathered = self._runtime.state_dict()
        out = destination if destination is not None else {}
        out.update({prefix + n: t for n, t in gathered.items()})
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a whole-model state dict (original names): each rank copies into the tensors it holds (its shard
        of those FSDP shards over replicas). `assign=True` copies as well: the runtime, the optimizer and DDP
        hold partita's tensors, and tensors assigned in their place would be trained by none of them. Before
        the first call, a tensor on the meta device (a model built there) gets its value as the first call
        materializes it."""
        if self._runtime is not None:
            state_dict = self._runtime.as_held(state_dict)
        with warnings.catch_warnings():
            # meta tensors are other ranks' stages' or, before the first call, get their values as it makes them
            warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model, which is a no-op")
            result = self.module.load_state_dict(state_dict, strict=strict)
        if self._runtime is None:
            self._initial = dataclasses.replace(
                self._initial, weights=loaded_weights(self.module, state_dict, self._initial.weights))
        return result

    def get_param(self, name: str) -> torch.Tensor:
        """The current value of parameter `name` (original FQN), the same on every rank."""
        return self._gather_one(name, grad=False)

    def get_param_grad(self, name: str) -> torch.Tensor | None:
        """The gradient of parameter `name` (original FQN), or None, the same on every rank."""
        return self._gather_one(name, grad=True)

    def _gather_one(self, name: str, grad: bool) -> torch.Tensor | None:
        if name not in self._parameter_names:
            raise KeyError(f"no parameter named {name!r}; names are the original model's, e.g. "
                           f"{next(iter(self._parameter_names), '')!r}")
        if self._runtime is None:
            p = self.module.get_parameter(name)
            t = p.grad if grad else p
            return None if t is None else t.detach().clone()
        return self._runtime.parameter(name, grad)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their norm over the whole model (each parameter counted once)."""
        if self._runtime is None:
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)
        return self._runtime.clip_grad_norm_(max_norm, norm_type)


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, loss_fn=None,
                stages: int | None = None, replicas: int | None = None, micro_batches: int | None = None,
                schedule: str | None = None, recompute: bool | None = None, plan: Plan | str | Path | None = None,
                sharding: str | None = None, precision: str = "fp32", init_fn: InitFn | None = None,
                weights: str | Path | None = None, strict: bool = True) -> ParallelModule:
    """Wrap an unmodified model so that it trains across this job's processes.

    Each rank passes its own local batch; the global batch is the ranks' local batches concatenated in rank
    order. With `loss_fn`, `model(*inputs, target)` returns the global mean loss (the same on every rank)
    and `loss.backward()` gives the gradients of single-process training on the global batch. Without it,
    `model(*inputs)` returns this rank's rows of the output, and gradients average over ranks as with DDP.

    `stages`, `replicas`, `micro_batches`, `schedule`, `recompute` (every stage, or none) and `sharding` fix
    what the planner would choose; `plan`
    takes a saved plan (a path or a Plan). `sharding` is what the replicas of each stage split among
    themselves: `"none"`, the optimizer's state (`"optimizer"`, ZeRO-1), also the gradients (`"gradients"`,
    ZeRO-2) or also the parameters (`"parameters"`, ZeRO-3); the last two run on torch's FSDP2, and the
    model's and the optimizer's parameters are then DTensors holding this replica's shard (`get_param`,
    `state_dict()` and checkpoints give them whole). `precision="bf16"` or `"fp16"`
    computes under torch.autocast with the float32 weights and optimizer state as the master copy (outputs
    and the loss come back in the model's own dtypes); fp16 scales the loss dynamically.

    Each rank keeps only the parameters and buffers of its own stages, on its device, and frees the rest. The
    model may be built on the CPU (every rank starts from rank 0's weights) or, when it is bigger than host
    memory, on the meta device: each rank then initializes only its part with each module's
    `reset_parameters()` (or `init_fn(module)`), to the values the model built on the CPU would have had.
    The optimizer may be built on the meta parameters: it steps the materialized ones. `weights` takes the
    initial values from a file instead (a torch.save state dict, a safetensors file, a folder of safetensors
    shards with its index, or a partita checkpoint): each rank reads only its tensors. Every tensor of the
    model must be in it, in its shape; `strict=False` allows tensors the model does not have.

    >>> import torch, partita
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
    >>> model = partita.parallelize(net, opt, loss_fn=torch.nn.CrossEntropyLoss())
    >>> loss = model(torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 1, 0]))
    >>> loss.backward(); opt.step()
    >>> model.plan.num_stages
    1
    """
    world = env.init()
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize needs an nn.Module, got {type(model).__name__}")
    if sharding is not None:
        check_sharding(sharding)
    check_precision(precision, world.device)
    check_optimizer_params(optimizer, model)
    if precision in SCALED and optimizer is None:
        raise PlanError("precision='fp16' needs the optimizer passed to parallelize: partita divides the scaled "
                        "gradients in its step() and skips the step on every rank when they overflowed. Pass it "
                        "(parallelize(model, optimizer, ...)), or use precision='bf16'.")
    constraints = Constraints(stages=stages, replicas=replicas, micro_batches=micro_batches, schedule=schedule,
                              recompute=recompute, sharding=sharding, precision=precision, user_loss=loss_fn is None)
    if schedule is not None and constraints.schedule_problem(schedule):
        raise PlanError(constraints.schedule_problem(schedule))
    # from now on partita.shutdown() tells the other ranks when this one stops calling the model, and
    # partita.barrier() says where this rank is
    env.before_leaving(agreement.leave)
    env.before_barrier(agreement.at_barrier)
    agreement.tell_failures_with(watchdog.tell)  # ranks held in a collective the failing rank never joins
    env.before_leaving(release_checkpoint_dirs)  # the job's checkpoint directories are free for another job then
    # every rank reads the file's header: a rank that failed alone would leave the others a reset connection
    reader = together(lambda: model_weights(weights, model, strict=strict), f"parallelize(weights={str(weights)!r})") \
        if weights is not None else None
    return ParallelModule(model, optimizer, loss_fn, constraints, plan, initial_of(model, init_fn, reader))
