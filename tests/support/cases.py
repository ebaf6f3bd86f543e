"""Test bodies that run on every rank of a pool (see pool.py). Each returns plain data for the test to check.

The reference is the same initial model trained in one process on the global batch (every rank computes
it locally, deterministically). Gradients, parameters and optimizer state come from partita's gathering
API (get_param_grad, get_param, optimizer.state_dict), so the comparison also covers those.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import math
import os
import tempfile
import time
import warnings
from unittest import mock

import torch
from torch.distributed.tensor import DTensor
import torch.utils._pytree as pytree

import partita
from partita.errors import PlanError
from partita.runtime import agreement
from partita.runtime.ownership import named_state
from partita.runtime.precision import LossScale
from partita.schedule.catalog import stages_per_rank
from support.logs import partita_log
from support.zoo import CASES, Case

RTOL, ATOL = 1e-5, 1e-6


class Diffs:
    """The worst violation of |a - b| <= atol + rtol * |b| per kind of quantity."""

    def __init__(self):
        self.worst: dict[str, tuple[float, str]] = {}
        self.count: dict[str, int] = {}
        self.relative: dict[str, float] = {}  # the largest |a - b| / (|b| + atol / rtol): within tolerance to rtol

    def add(self, kind: str, what: str, got, want) -> None:
        excess, why = _excess(got, want)
        self._record(kind, f"{what} ({why})" if why else what, excess)
        self.relative[kind] = max(self.relative.get(kind, 0.0), _relative(got, want))

    def add_exact(self, kind: str, what: str, got, want) -> None:
        """Bit for bit: any difference fails."""
        self._record(kind, what, -1.0 if got is not None and torch.equal(got, want) else math.inf)

    def fail(self, kind: str, what: str) -> None:
        """A difference that is not a number: another structure, other keys."""
        self._record(kind, what, math.inf)

    def _record(self, kind: str, what: str, excess: float) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        if kind not in self.worst or excess > self.worst[kind][0]:
            self.worst[kind] = (excess, what)

    def result(self) -> dict:
        return {k: {"excess": v[0], "worst": v[1], "checked": self.count[k], "relative": self.relative.get(k, math.nan)}
                for k, v in self.worst.items()}


def _excess(got, want) -> tuple[float, str]:
    """By how much |got - want| exceeds atol + rtol * |want| at worst (<= 0: within tolerance), and why it is
    infinite when it is."""
    if got is None or want is None:
        return (0.0, "") if (got is None) == (want is None) else (math.inf, "None on one side only")
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return math.inf, f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        # NaN compares False with everything, so it would never become the worst value: fail it here
        return math.inf, "not finite"
    if not got.numel():
        return -1.0, ""
    return float(((got - want).abs() - (ATOL + RTOL * want.abs())).max()), ""


def _relative(got, want) -> float:
    """The largest |got - want| / (|want| + atol / rtol) (inf where they cannot be compared)."""
    if got is None or want is None or got.shape != want.shape:
        return 0.0 if got is None and want is None else math.inf
    if not got.numel():
        return 0.0
    got, want = got.detach().double(), want.detach().double()
    return float(((got - want).abs() / (want.abs() + ATOL / RTOL)).max())


def _rows(tree, sl):
    return pytree.tree_map(lambda t: t[sl] if isinstance(t, torch.Tensor) else t, tree)


def _optimizer(kind: str, model: torch.nn.Module):
    if not list(model.parameters()):
        return _NoOptimizer()
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "adam":
        # Adam's step is lr * m / (sqrt(v) + eps): for a gradient entry near zero it turns the fp32 rounding
        # noise of the gradient (~4e-9 absolute where micro-batches sum in another order than one big
        # matmul; the gradients agree within tolerance) into lr * 4e-9 / (|g| + eps) of parameter noise.
        # lr=1e-4 and eps=1e-6 (BERT's) keep that under atol; a wrong or missing update (~1e-4) still shows.
        return torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-6)
    raise KeyError(kind)


class _NoOptimizer:
    """Stands in for an optimizer when the model has no parameters."""

    def step(self):
        pass

    def zero_grad(self):
        pass

    def state_dict(self):
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, sd):
        pass


def _scaled_normal(module: torch.nn.Module) -> None:
    """An init_fn as users write them: every Linear's weight drawn again, and a container that draws its last
    Linear's once more, smaller (a parent writing its child's weight, as GPT-2 scales its residual layers)."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
        last = [m for m in module if isinstance(m, torch.nn.Linear)][-1]
        torch.nn.init.normal_(last.weight, std=0.01)


INIT_FNS = {"scaled_normal": _scaled_normal}


def reporting_warnings(body):
    """`body`, whose report (a dict) also holds the warnings raised on this rank while it ran ("warnings"): tests
    fail on them (each rank's warnings reach the user's log)."""
    @functools.wraps(body)
    def run(*args, **kwargs) -> dict:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = body(*args, **kwargs)
        said = {f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught}
        return report | {"warnings": sorted(said)}
    return run


# Plans here come from the device preset's estimates instead of measurements, which cost seconds per model
# and world size: every fidelity test fixes the layout it checks. test_bad_input.py plans from measurements.
@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})
@reporting_warnings
def fidelity(name: str, *, style: str = "loss_fn", optimizer: str = "adam", steps: int = 3,
             accumulate: int = 1, local_batch: int = 8, input_grad: bool = False, call_kwargs: dict | None = None,
             lr_schedule: str | None = None, statistics_replicas: int = 1, roundtrip: dict | None = None,
             eval_batch: int | None = None, no_grad_batch: int | None = None, reduction: str = "mean",
             extra_rows: int = 0, build: str = "cpu", weights: str | None = None, init_fn: str | None = None,
             load_at: int | None = None, assign: bool = False, eval_modules: tuple[str, ...] = (),
             eval_from: int = 0, **plan_args) -> dict:
    """Train `steps` steps with partita and in one process; report the worst differences, the plans used and
    the global losses partita returned (as float.hex, to compare ranks bit for bit).

    call_kwargs: constant keyword arguments added to every call (output_hidden_states=True, say).
    lr_schedule: "StepLR" or "LambdaLR" on both sides, each halving the learning rate every step.
    statistics_replicas: the reference takes BatchNorm statistics per replica of the global batch and keeps
        replica 0's running statistics (DDP's rule) instead of using the whole batch.
    roundtrip: parallelize arguments of a fresh run that loads both state dicts and trains one more step.
    eval_batch, no_grad_batch: rows per rank of a call under torch.no_grad() after training, in eval mode or
        in train mode.
    reduction: the loss function's ("sum": the case's loss function summing instead of averaging; "plain sum":
        a plain function that sums, which says nothing of it).
    extra_rows: rank r passes local_batch + r * extra_rows rows (batches of different sizes).
    build: "meta" builds partita's model on the meta device (the reference on the CPU, from the same seed);
        its initial parameters must equal the reference's bit for bit ("initial").
    weights: a file path: rank 0 saves other weights there (safetensors for .safetensors, else torch.save),
        the reference loads them and partita's model gets them with weights=.
    init_fn: the name of an initialization in INIT_FNS: partita gets it as init_fn=, the reference applies it
        after building (model.apply), as a user initializing a model on the CPU does.
    load_at: before that step, both models load other weights and partita's optimizer the reference's state,
        whole state dicts through load_state_dict (see _SideBySide.load), partita's with `assign`.
    eval_modules: names of modules put in eval mode on both sides from step `eval_from` on, before its call
        ("": the whole model, trained in eval mode; "bn1": a frozen BatchNorm in a training model).
    """
    if lr_schedule and roundtrip:
        raise ValueError("lr_schedule and roundtrip do not combine: the fresh run has no scheduler")
    case = CASES[name]
    if reduction == "plain sum":
        case = dataclasses.replace(case, loss_fn=_plain_sum(case.loss_fn))
    elif reduction != "mean":
        summed = copy.copy(case.loss_fn)
        summed.reduction = reduction
        case = dataclasses.replace(case, loss_fn=summed)
    torch.manual_seed(0)
    ref = case.make()
    if init_fn is not None:
        ref.apply(INIT_FNS[init_fn])
    torch.manual_seed(0)
    with torch.device("meta" if build == "meta" else "cpu"):
        model = case.make()
    if build == "cpu":
        model.load_state_dict(ref.state_dict())
    if weights is not None:
        ref.load_state_dict(_other_weights(ref, weights))
    opt, ref_opt = _optimizer(optimizer, model), _optimizer(optimizer, ref)
    loss_fn = case.loss_fn if style == "loss_fn" else None
    pm = partita.parallelize(model, _real(opt), loss_fn=loss_fn, weights=weights,
                             init_fn=INIT_FNS[init_fn] if init_fn is not None else None, **plan_args)
    side = _SideBySide(case, style, ref, ref_opt, local_batch, accumulate, input_grad, call_kwargs or {},
                       statistics_replicas, _scheduler(lr_schedule, ref_opt), extra_rows,
                       exact_initial=build != "cpu" or weights is not None)
    sched = _scheduler(lr_schedule, opt)
    for step in range(steps):
        if step == load_at:
            side.load(pm, opt, assign)
        if step == eval_from:
            for module in eval_modules:
                model.get_submodule(module).eval()
                ref.get_submodule(module).eval()
        side.step(pm, opt, sched, f"step {step}")
    side.compare_model(pm, opt)
    full = pm.state_dict()
    for n, t in ref.state_dict().items():
        side.diffs.add("state_dict", n, full[n], t)
    report = {"plan": _summary(pm.plan), "plan_json": pm.plan.to_json(),
              "lr_factor": opt.param_groups[0]["lr"] / opt.defaults["lr"] if sched else None}
    if roundtrip is not None:
        report["reload_plan"] = _summary(_continue_in_fresh_run(side, pm, opt, optimizer, loss_fn, roundtrip))
    if eval_batch is not None:
        side.forward_only(pm, "eval", eval_batch, training=False)
    if no_grad_batch is not None:
        side.forward_only(pm, "no_grad", no_grad_batch, training=True)
    held = sorted(n for n, t in model.state_dict(keep_vars=True).items() if not t.is_meta)
    # the parameters whose optimizer state this rank keeps (the optimizer's own, not the gathered state_dict)
    kept = sorted(n for n, p in model.named_parameters() if p in getattr(opt, "state", {}))
    sharded = (sum(isinstance(p, DTensor) for p in model.parameters()),
               sum(not p.is_meta for p in model.parameters()))
    return {"diffs": side.diffs.result(), "losses": side.losses, "held": held, "optimizer_kept": kept,
            "sharded_params": sharded, **report}


def optimizer_rates() -> dict:
    """The MLP's first call with Adam, then with SGD and momentum, measured: the rate rank 0's profile holds
    for each optimizer's step (None on other ranks)."""
    rates = {}
    for name in ("adam", "sgd"):
        torch.manual_seed(0)
        model = CASES["mlp"].make()
        opt = _optimizer(name, model)
        pm = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), stages=1, micro_batches=1)
        args, _, target = CASES["mlp"].batch(8, torch.Generator().manual_seed(1))
        pm(*args, target).backward()
        rates[name] = pm.planned.profile.optimizer_bps if pm.planned.profile is not None else None
    return rates


def live_groups() -> int:
    """The process groups that exist in this process (the default one included)."""
    return len(torch.distributed.distributed_c10d._world.pg_map)


@mock.patch("partita.profile.overheads.STEPS", 2)
@mock.patch("partita.profile.overheads.ROUNDS", 1)
def groups_around_measuring_overheads() -> dict:
    """The process groups before and after partita times its probes (two steps each) under plans of every
    shape it probes: each probe's runtime made some."""
    from partita.cluster import DEVICES, Cluster
    from partita.profile.overheads import measure_overheads

    before = live_groups()
    cluster = Cluster(DEVICES["cpu"], 1, partita.get_world_size()) if partita.get_rank() == 0 else None
    overheads = measure_overheads(cluster, torch.device("cpu"), partita.parallelize)
    return {"before": before, "after": live_groups(), "fitted": overheads is not None}


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})
def what_the_loss_sees(precision: str, **plan_args) -> dict:
    """One step of the GPT computing in `precision` with a loss that notes the dtype of the logits it gets,
    whether autocast is on around it and whether gradients are; and the dtype of the outputs a call without
    loss_fn returns."""
    case = CASES["gpt"]
    torch.manual_seed(0)
    seen = []

    def loss_fn(logits, target):
        seen.append((str(logits.dtype), torch.is_autocast_enabled(logits.device.type), torch.is_grad_enabled()))
        return case.loss_fn(logits, target)

    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args, kwargs, target = case.batch(8, torch.Generator().manual_seed(1))
    pm = partita.parallelize(model, opt, loss_fn=loss_fn, precision=precision, **plan_args)
    pm(*args, target, **kwargs).backward()
    plain = partita.parallelize(case.make(), precision=precision, **plan_args)  # the first holds only its part
    out = plain(*args, **kwargs)
    return {"seen": seen, "outputs": str(out.dtype) if isinstance(out, torch.Tensor) else None,
            "plan": _summary(pm.plan)}


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})
def precision_losses(name: str, precision: str, *, steps: int = 5, local_batch: int = 8, **plan_args) -> dict:
    """Train `steps` steps with partita computing in `precision` and, in one process on the global batch, the
    same model under torch.autocast in that precision (the user's own loop) and in float32; the global
    losses of each (partita's as float.hex on every rank, to compare ranks bit for bit)."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make()
    low, full = copy.deepcopy(model), copy.deepcopy(model)
    opts = [_optimizer("sgd", m) for m in (model, low, full)]
    pm = partita.parallelize(model, opts[0], loss_fn=case.loss_fn, precision=precision, **plan_args)
    rank, world = partita.get_rank(), partita.get_world_size()
    gen = torch.Generator().manual_seed(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # float16 in one process: torch's own loss scaling, with partita's starting scale
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, enabled=precision == "fp16")
    losses: dict[str, list] = {"partita": [], "autocast": [], "fp32": []}
    for _ in range(steps):
        args, kwargs, target = case.batch(world * local_batch, gen)
        mine = slice(rank * local_batch, (rank + 1) * local_batch)
        loss = pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine))
        loss.backward()
        losses["partita"].append(float(loss.detach()).hex())
        opts[0].step()
        for kind, ref, opt in (("autocast", low, opts[1]), ("fp32", full, opts[2])):
            with torch.autocast("cpu", dtype=dtype, enabled=kind == "autocast"):
                ref_loss = case.loss_fn(ref(*args, **kwargs), target)
            losses[kind].append(float(ref_loss.detach()))
            if kind == "autocast":
                scaler.scale(ref_loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                ref_loss.backward()
                opt.step()
        for opt in opts:
            opt.zero_grad()
    return {**losses, "plan": _summary(pm.plan), "precision": pm.plan.precision}


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})
def hf_on_meta(name: str, steps: int = 3, **plan_args) -> dict:
    """A Hugging Face model built on the meta device, initialized by its own _init_weights (init_fn), trained;
    and the same model built on the CPU from the same seed, trained the same way. What this rank holds, the
    tensors it holds whose initial values differ from the CPU-built model's (bit for bit), whether every tensor
    it holds is finite after training, and the global losses of both runs (as float.hex)."""
    case = CASES[name]
    torch.manual_seed(0)
    built = case.make()
    want = {n: t.clone() for n, t in named_state(built).items()}
    torch.manual_seed(0)
    with torch.device("meta"):
        model = case.make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pm = partita.parallelize(model, opt, loss_fn=case.loss_fn, init_fn=model._init_weights, **plan_args)
    losses, initial = _train_hf(pm, opt, model, case, steps)
    state = named_state(model)
    cpu_opt = torch.optim.Adam(built.parameters(), lr=1e-3)
    cpu_pm = partita.parallelize(built, cpu_opt, loss_fn=case.loss_fn, **plan_args)
    cpu_losses, _ = _train_hf(cpu_pm, cpu_opt, built, case, steps)
    return {"losses": losses, "cpu_losses": cpu_losses, "held": sorted(initial), "every": sorted(state),
            "differ": [n for n, t in initial.items() if not torch.equal(t, want[n])],
            "finite": all(bool(torch.isfinite(state[n]).all()) for n in initial if state[n].is_floating_point())}


def _train_hf(pm, opt, model: torch.nn.Module, case: Case, steps: int) -> tuple[list[str], dict[str, torch.Tensor]]:
    """`steps` steps on batches of 4 rows per rank from generator seed 1: the global losses as float.hex, and
    the tensors this rank holds as they were before the first step (materialized at the first call)."""
    gen = torch.Generator().manual_seed(1)
    rank, world, rows = partita.get_rank(), partita.get_world_size(), 4
    losses, initial = [], {}
    for _ in range(steps):
        args, kwargs, target = case.batch(world * rows, gen)
        mine = slice(rank * rows, (rank + 1) * rows)
        loss = pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine))
        loss.backward()
        initial = initial or {n: t.detach().clone() for n, t in named_state(model).items() if not t.is_meta}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()).hex())
    return losses, initial


def _mlp_beside_one_process(**plan_args):
    """The MLP parallelized with SGD, and the same initial model with its own SGD to train in one process:
    (case, reference, its optimizer, the parallelized model, its optimizer)."""
    case = CASES["mlp"]
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer("sgd", model), _optimizer("sgd", ref)
    return case, ref, ref_opt, partita.parallelize(model, opt, loss_fn=case.loss_fn, **plan_args), opt


def clipped(norm_type: float, **plan_args) -> dict:
    """Three steps of the MLP with clip_grad_norm_ between backward and step, against one process clipping with
    torch.nn.utils.clip_grad_norm_: the norms returned and the largest difference of the clipped gradients."""
    case, ref, ref_opt, pm, opt = _mlp_beside_one_process(**plan_args)
    rank, world, local_batch = partita.get_rank(), partita.get_world_size(), 4
    norms, worst = [], 0.0
    for step in range(3):
        args, kwargs, target = case.batch(world * local_batch, torch.Generator().manual_seed(step))
        mine = slice(rank * local_batch, (rank + 1) * local_batch)
        pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine)).backward()
        case.loss_fn(ref(*args, **kwargs), target).backward()
        max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type))
        norms.append((float(pm.clip_grad_norm_(max_norm, norm_type)),
                      float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type))))
        worst = max([worst] + [float((pm.get_param_grad(n) - p.grad).abs().max()) for n, p in ref.named_parameters()])
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {"norms": norms, "worst": worst, "plan": _summary(pm.plan)}


def unfrozen(**plan_args) -> dict:
    """The MLP with its first layer frozen when parallelized and unfrozen at step 2 (a fine-tuning that
    unfreezes layers), against one process doing the same: per step, the largest difference of any gradient
    and parameter."""
    case = CASES["mlp"]
    torch.manual_seed(0)
    model = case.make()
    first = next(model.parameters())
    first.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer("sgd", model), _optimizer("sgd", ref)
    pm = partita.parallelize(model, opt, loss_fn=case.loss_fn, **plan_args)
    rank, world, local_batch = partita.get_rank(), partita.get_world_size(), 4
    name = next(n for n, _ in ref.named_parameters())
    worst = []
    for step in range(4):
        if step == 2:
            for m in (model, ref):
                m.get_parameter(name).requires_grad_(True)
        args, kwargs, target = case.batch(world * local_batch, torch.Generator().manual_seed(step))
        mine = slice(rank * local_batch, (rank + 1) * local_batch)
        pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine)).backward()
        case.loss_fn(ref(*args, **kwargs), target).backward()
        for o in (opt, ref_opt):
            o.step()
        grads = [(pm.get_param_grad(n), p.grad) for n, p in ref.named_parameters()]
        worst.append(max([float((a - b).abs().max()) for a, b in grads if a is not None and b is not None]
                         + [float((pm.get_param(n) - p).abs().max()) for n, p in ref.named_parameters()]
                         + [0.0 if (a is None) == (b is None) else math.inf for a, b in grads]))
        for o in (opt, ref_opt):
            o.zero_grad()
    return {"worst": worst, "plan": _summary(pm.plan), "sharding": [s.sharding for s in pm.plan.stages]}


def losses_read_late(**plan_args) -> dict:
    """Five steps of the MLP where rank 0 alone reads each loss after its optimizer step, and every rank reads
    them all after the last step (stacked), against one process's losses: a read is no collective, so one rank
    reading must neither wait for the others nor see its own rows' loss."""
    case, ref, ref_opt, pm, opt = _mlp_beside_one_process(**plan_args)
    rank, world, local_batch = partita.get_rank(), partita.get_world_size(), 4
    losses, early, want = [], [], []
    for step in range(5):
        args, kwargs, target = case.batch(world * local_batch, torch.Generator().manual_seed(step))
        mine = slice(rank * local_batch, (rank + 1) * local_batch)
        loss = pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine))
        loss.backward()
        ref_loss = case.loss_fn(ref(*args, **kwargs), target)
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if rank == 0:
            early.append(loss.item())
        losses.append(loss)
        want.append(ref_loss.item())
    late = torch.stack(losses)
    return {"early": early, "late": late.tolist(), "late_type": type(late).__name__, "want": want,
            "plan": _summary(pm.plan)}


def stop_asked(asked_on: list[int]) -> dict:
    """partita.elastic's check for a stop with a stop asked on the ranks `asked_on` only (a signal that reached
    some ranks): what every rank decides."""
    from partita.checkpoint.collective import stop_asked_anywhere

    return {"stop": stop_asked_anywhere(partita.get_rank() in asked_on)}


def state_after_training(name: str, **plan_args) -> dict:
    """Two training steps, each rank with its own rows; then state_dict(), as float.hex per value, on every
    rank (to compare the ranks')."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make()
    opt = _optimizer("sgd", model)
    pm = partita.parallelize(model, opt, loss_fn=case.loss_fn, **plan_args)
    rank, world, local_batch = partita.get_rank(), partita.get_world_size(), 4
    for step in range(2):
        args, kwargs, target = case.batch(world * local_batch, torch.Generator().manual_seed(step))
        mine = slice(rank * local_batch, (rank + 1) * local_batch)
        pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine)).backward()
        opt.step()
        opt.zero_grad()
    state = {n: [float(v).hex() for v in t.detach().double().flatten().tolist()] for n, t in pm.state_dict().items()}
    return {"state": state, "plan": _summary(pm.plan)}


def fp16_gradients(calls: int = 1, **plan_args) -> dict:
    """float16 gradients as partita gives them (get_param_grad, clip_grad_norm_'s norm) after each of `calls`
    backwards that accumulate before one optimizer step, and that step's updates, against one process under
    torch.autocast with torch.amp.GradScaler: every parameter's relative difference, the worst over the reads."""
    case = CASES["gpt"]
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer("sgd", model), _optimizer("sgd", ref)
    pm = partita.parallelize(model, opt, loss_fn=case.loss_fn, precision="fp16", **plan_args)
    rank, world, local_batch = partita.get_rank(), partita.get_world_size(), 8
    mine = slice(rank * local_batch, (rank + 1) * local_batch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    differences: dict[str, float] = {}
    norms = []
    for k in range(calls):
        args, kwargs, target = case.batch(world * local_batch, torch.Generator().manual_seed(1 + k))
        (pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine)) / calls).backward()
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = case.loss_fn(ref(*args, **kwargs), target)
        scaler.scale(ref_loss / calls).backward()
        # what GradScaler's unscale_ would give now; it unscales once a step, so the reference reads without it
        want = {name: p.grad / scaler.get_scale() for name, p in ref.named_parameters()}
        for name, w in want.items():
            got = pm.get_param_grad(name)
            differences[name] = max(differences.get(name, 0.0), float((got - w).norm() / w.norm()))
        norms.append((float(pm.clip_grad_norm_(1e9)), float(torch.nn.utils.get_total_norm(list(want.values())))))
    before = {name: p.detach().clone() for name, p in ref.named_parameters()}
    opt.step()
    scaler.step(ref_opt)
    for name, p in ref.named_parameters():
        want = p.detach() - before[name]
        differences["update of " + name] = float((pm.get_param(name) - before[name] - want).norm() / want.norm())
    return {"differences": differences, "norms": norms, "plan": _summary(pm.plan),
            "sharding": [s.sharding for s in pm.plan.stages]}


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})
def fp16_overflow(**plan_args) -> dict:
    """float16 with a loss scale so high that the first step's gradients overflow: that step must be skipped on
    every rank (the parameters stay) and the scale halve; a later step at a sane scale trains."""
    torch.manual_seed(0)
    model = CASES["mlp"].make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mock.patch("partita.runtime.precision.INITIAL_LOSS_SCALE", 2.0 ** 60):
        pm = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), precision="fp16", **plan_args)
        x, y = torch.randn(8, 32), torch.randn(8, 32)
        pm(x, y).backward()
    before = {n: pm.get_param(n) for n, _ in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    kept = all(torch.equal(pm.get_param(n), v) for n, v in before.items())
    scale = pm.runtime.loss_scale.scale
    # an overflow on one rank only (in a gradient only it holds): every rank must skip that step
    pm.runtime.loss_scale.scale = 2.0 ** 8
    pm(x, y).backward()
    if partita.get_rank() == 1:
        next(p for p in model.parameters() if not p.is_meta and p.grad is not None).grad[0] = float("inf")
    opt.step()
    opt.zero_grad()
    kept_after_one_rank = all(torch.equal(pm.get_param(n), v) for n, v in before.items())
    pm.runtime.loss_scale.scale = 2.0 ** 8
    pm(x, y).backward()
    grads_finite = all(bool(torch.isfinite(pm.get_param_grad(n)).all()) for n in before)
    opt.step()
    moved = any(not torch.equal(pm.get_param(n), v) for n, v in before.items())
    return {"kept_after_overflow": kept, "scale_after_overflow": scale, "grads_finite": grads_finite,
            "moved_after": moved, "kept_after_one_rank_overflowed": kept_after_one_rank}


def _other_weights(model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Weights unlike `model`'s own (every tensor moved), written to `path` by rank 0; every rank gets them."""
    state = {n: t + torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) if t.is_floating_point()
             else t + 2 for n, t in model.state_dict().items()}
    if partita.get_rank() == 0:
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file({n: t.contiguous() for n, t in state.items()
                       if n != "proj.weight"}, path)  # a tied weight saved once, as Hugging Face saves it
        else:
            torch.save(state, path)
    partita.barrier()
    return state


def _real(optimizer):
    """The optimizer to give parallelize: none for a model without parameters."""
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _scheduler(kind: str | None, optimizer):
    if kind is None:
        return None
    if kind == "StepLR":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    if kind == "LambdaLR":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    raise KeyError(kind)


def _summary(plan) -> tuple:
    return plan.num_stages, plan.num_replicas, plan.micro_batches, plan.schedule


def _through_bytes(state: dict) -> dict:
    """The state as a file would give it back: saved, loaded, sharing no tensor with the original."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _continue_in_fresh_run(side: "_SideBySide", pm, opt, optimizer: str, loss_fn, plan_args: dict):
    """Load the model's and the optimizer's state dicts into a fresh model, optimizer and parallelize call
    (other initial weights, other plan arguments); its next step must continue the reference. Returns its plan."""
    model_state, optimizer_state = _through_bytes(pm.state_dict()), _through_bytes(opt.state_dict())
    torch.manual_seed(123)
    fresh = side.case.make()
    fresh_opt = _optimizer(optimizer, fresh)
    fresh_pm = partita.parallelize(fresh, _real(fresh_opt), loss_fn=loss_fn, **plan_args)
    fresh_pm.load_state_dict(model_state)
    fresh_opt.load_state_dict(optimizer_state)
    side.step(fresh_pm, fresh_opt, None, "after reload")
    side.compare_model(fresh_pm, fresh_opt, "reload ")
    return fresh_pm.plan


class _Scale(torch.nn.Module):
    """A module with a parameter of its own and no reset_parameters(): nothing can initialize it on meta."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.gain


class _FailsOnRank(torch.nn.Module):
    """A model whose forward raises on one rank only (a rank-dependent bug in user code)."""

    def __init__(self, rank: int, inner: torch.nn.Module):
        super().__init__()
        self.rank, self.inner = rank, inner

    def forward(self, x):
        if partita.get_rank() == self.rank:
            raise ValueError(f"bad data on rank {self.rank}")
        return self.inner(x)


class _SideBySide:
    """partita's model and the one-process reference, called on the same global batches. Differences go to
    `diffs`; the global losses partita returns (every rank must get the same bits) to `losses`."""

    def __init__(self, case: Case, style: str, ref: torch.nn.Module, ref_opt, local_batch: int, accumulate: int,
                 input_grad: bool, call_kwargs: dict, statistics_replicas: int, ref_sched, extra_rows: int = 0,
                 exact_initial: bool = False):
        self.case, self.style, self.ref, self.ref_opt, self.ref_sched = case, style, ref, ref_opt, ref_sched
        self.local_batch, self.accumulate, self.input_grad = local_batch, accumulate, input_grad
        self.call_kwargs, self.statistics_replicas, self.extra_rows = call_kwargs, statistics_replicas, extra_rows
        self.rank, self.world = partita.get_rank(), partita.get_world_size()
        self.names = list(dict(ref.named_parameters()))
        self.gen = torch.Generator().manual_seed(1)
        self.diffs = Diffs()
        self.losses: list[str] = []
        self.exact_initial = exact_initial  # compare the initial parameters bit for bit at the first step

    def _batch(self, rows_per_rank: int) -> tuple[tuple, dict, torch.Tensor, slice]:
        """A global batch and this rank's rows of it."""
        args, kwargs, target = self.case.batch(self._rank_rows(rows_per_rank)[-1].stop, self.gen)
        return args, {**kwargs, **self.call_kwargs}, target, self._rank_rows(rows_per_rank)[self.rank]

    def _global_loss(self, kind: str, label: str, loss: torch.Tensor, want: torch.Tensor) -> None:
        self.diffs.add(kind, label, loss, want)
        self.losses.append(float(loss.detach()).hex())

    def step(self, pm, opt, sched, label: str) -> None:
        """One optimizer step on both sides (`accumulate` forward/backward calls first); compares losses,
        outputs, input gradients and every parameter's gradient."""
        for _ in range(self.accumulate):
            self._forward_backward(pm, label)
        for n in self.names:
            self.diffs.add("grad", f"{label} {n}", pm.get_param_grad(n), self.ref.get_parameter(n).grad)
            if self.exact_initial:
                self.diffs.add_exact("initial", n, pm.get_param(n), self.ref.get_parameter(n))
        self.exact_initial = False
        opt.step()
        self.ref_opt.step()
        if sched is not None:
            sched.step()
            self.ref_sched.step()
        opt.zero_grad()
        self.ref_opt.zero_grad()

    def _forward_backward(self, pm, label: str) -> None:
        args, kwargs, target, mine = self._batch(self.local_batch)
        if self.input_grad:
            args = tuple(t.requires_grad_() for t in args)
        largs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in _rows(args, mine))
        lkwargs, ltarget = _rows(kwargs, mine), target[mine]
        ref_out = self._reference(args, kwargs)
        if self.style == "loss_fn":
            loss, ref_loss = pm(*largs, ltarget, **lkwargs), self.case.loss_fn(ref_out, target)
            self._global_loss("loss", label, loss, ref_loss)
        elif torch.is_tensor(ref_out) and ref_out.dim() == 0:  # the model returns its own loss: a global mean
            loss, ref_loss = pm(*largs, **lkwargs), ref_out
            self._global_loss("loss", label, loss, ref_loss)
        else:
            out = pm(*largs, **lkwargs)
            self._compare_outputs("output", label, out, _rows(ref_out, mine))
            loss = self.case.user_loss(out, ltarget)
            self.diffs.add("loss", label, loss, self.case.user_loss(_rows(ref_out, mine), ltarget))
            # as with DDP: each rank's own loss, gradients averaged over ranks
            ref_loss = sum(self.case.user_loss(_rows(ref_out, rows), target[rows])
                           for rows in self._rank_rows(self.local_batch)) / self.world
        loss.backward()
        ref_loss.backward()
        if self.input_grad:
            for k, (x, rx) in enumerate(zip(largs, args)):
                # with loss_fn the global mean's gradient; without, the rank's own loss (as DDP)
                want = rx.grad[mine] * (1 if self.style == "loss_fn" else self.world)
                self.diffs.add("input_grad", f"{label} input {k}", x.grad, want)
                rx.grad = None

    def _rank_rows(self, rows_per_rank: int) -> list[slice]:
        """Each rank's rows of the global batch: rows_per_rank, and extra_rows more for each rank before it."""
        sizes = [rows_per_rank + r * self.extra_rows for r in range(self.world)]
        starts = [sum(sizes[:r]) for r in range(self.world)]
        return [slice(start, start + size) for start, size in zip(starts, sizes)]

    def _reference(self, args: tuple, kwargs: dict):
        """The one-process forward on the global batch; with statistics_replicas, as DDP computes it: each
        replica's rows normalized by their own batch statistics, only replica 0's running statistics kept
        (every replica takes them before each call)."""
        if self.statistics_replicas == 1:
            return self.ref(*args, **kwargs)
        per_replica = self.world // self.statistics_replicas * self.local_batch
        outs = []
        for j in range(self.statistics_replicas):
            rows = slice(j * per_replica, (j + 1) * per_replica)
            a, k = _rows(args, rows), _rows(kwargs, rows)
            if j == 0:
                outs.append(self.ref(*a, **k))
            else:
                scratch = {n: b.clone() for n, b in self.ref.named_buffers()}
                outs.append(torch.func.functional_call(self.ref, scratch, a, k))
        return pytree.tree_map(lambda *parts: torch.cat(parts), *outs)

    def _compare_outputs(self, kind: str, label: str, got, want) -> None:
        """The same structure (types, keys, nesting) and every tensor within tolerance."""
        got_leaves, got_spec = pytree.tree_flatten_with_path(got)
        want_leaves, want_spec = pytree.tree_flatten_with_path(want)
        if got_spec != want_spec:
            self.diffs.fail(kind, f"{label}: structure {got_spec}, want {want_spec}")
            return
        for (path, g), (_, w) in zip(got_leaves, want_leaves):
            if torch.is_tensor(w):
                self.diffs.add(kind, f"{label} {pytree.keystr(path)}", g, w)
            elif g != w:
                self.diffs.fail(kind, f"{label} {pytree.keystr(path)}: {g!r}, want {w!r}")

    def load(self, pm, opt, assign: bool) -> None:
        """The model's weights from another build of it into both models, and the reference optimizer's state
        into partita's, each state dict whole as a file gives it back (load_state_dict). A model built on the
        meta device holds its loaded values from its first call on, where the first step compares them."""
        torch.manual_seed(123)
        weights = _through_bytes(self.case.make().state_dict())
        pm.load_state_dict(weights, assign=assign)
        self.ref.load_state_dict(weights)
        opt.load_state_dict(_through_bytes(self.ref_opt.state_dict()))
        if pm.plan is not None or not any(p.is_meta for p in pm.module.parameters()):
            self.compare_model(pm, opt, "loaded ")

    def compare_model(self, pm, opt, prefix: str = "") -> None:
        """Parameters and optimizer state, gathered by partita, against the reference's."""
        for n in self.names:
            self.diffs.add(f"{prefix}param", n, pm.get_param(n), self.ref.get_parameter(n))
        _compare_state(self.diffs, f"{prefix}optimizer", opt.state_dict(), self.ref_opt.state_dict())

    def forward_only(self, pm, kind: str, rows_per_rank: int, training: bool) -> None:
        """One call under torch.no_grad(), in train or eval mode, on both sides; partita must not plan again."""
        args, kwargs, target, mine = self._batch(rows_per_rank)
        plan = pm.plan
        pm.train(training)
        self.ref.train(training)
        with torch.no_grad():
            if self.style == "loss_fn":
                self._global_loss(kind, "loss", pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine)),
                                  self.case.loss_fn(self.ref(*args, **kwargs), target))
            else:
                out, ref_out = pm(*_rows(args, mine), **_rows(kwargs, mine)), self.ref(*args, **kwargs)
                scalar = torch.is_tensor(ref_out) and ref_out.dim() == 0
                self._compare_outputs(kind, "output", out, ref_out if scalar else _rows(ref_out, mine))
                if any(torch.is_tensor(t) and t.requires_grad for t in pytree.tree_leaves(out)):
                    self.diffs.fail(kind, "an output requires grad under torch.no_grad()")
        if pm.plan is not plan:
            self.diffs.fail(kind, "planned again")
        pm.train()
        self.ref.train()


def _compare_state(d: Diffs, kind: str, got: dict, want: dict) -> None:
    if set(got["state"]) != set(want["state"]):
        d.fail(kind, f"state keys {sorted(got['state'])} vs {sorted(want['state'])}")
        return
    for i, state in want["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                d.add(kind, f"param {i} {k}", got["state"][i][k], v)


def bad_input(scenario: str, plan_path: str | None = None) -> dict:
    """Run one kind of bad input; return the error each rank saw (type name and message)."""
    rank, world = partita.get_rank(), partita.get_world_size()
    torch.manual_seed(0)
    model = CASES["mlp"].make()
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    try:
        if scenario == "indivisible":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2, micro_batches=4)
            pm(x[:3], y[:3])
        elif scenario == "indivisible_later":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2, micro_batches=4)
            pm(x, y).backward()
            pm(x[:3], y[:3])
        elif scenario.startswith("loss_says_mean_but_sums"):
            liar = _plain_sum(torch.nn.MSELoss())
            liar.reduction = "mean"
            stages = 1 if "data_parallel" in scenario else 2
            pm = partita.parallelize(model, loss_fn=liar, stages=stages, micro_batches=2 if stages == 2 else 1)
            if "retried" in scenario:  # caught, and the call made again: refused again
                try:
                    pm(x, y).backward()
                except PlanError:
                    pass
            pm(x, y).backward()
        elif scenario == "wrong_device":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x.to("meta") if rank == 1 else x, y)
        elif scenario == "wrong_device_later":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y).backward()
            pm(x.to("meta") if rank == 1 else x, y)
        elif scenario == "two_calls_then_the_first_ones_backward":
            pm = partita.parallelize(model, stages=2, micro_batches=2)
            first = pm(x)
            pm(x * 2)  # e.g. a second call kept for a metric
            first.pow(2).mean().backward()
        elif scenario == "too_many_stages":
            tiny = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
            pm = partita.parallelize(tiny, loss_fn=torch.nn.MSELoss(), stages=world)
            pm(x, y)
        elif scenario == "world_not_multiple":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=3)
            pm(x, y)
        elif scenario == "schedule_needs_loss_fn":
            partita.parallelize(model, stages=2, micro_batches=4, schedule="1F1B")
        elif scenario == "save_plan":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y).backward()
            if rank == 0:
                pm.plan.save(plan_path)
            partita.barrier()
            return {"error": None, "plan": pm.plan.to_dict()}
        elif scenario == "use_plan":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), plan=plan_path)
            pm(x, y).backward()
            return {"error": None, "plan": pm.plan.to_dict()}
        elif scenario == "plan_in_other_precision":
            pm = partita.parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=torch.nn.MSELoss(),
                                     plan=plan_path, precision="bf16")
            pm(x, y)
        elif scenario == "plan_for_other_model":
            other = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
            pm = partita.parallelize(other, loss_fn=torch.nn.MSELoss(), plan=plan_path)
            pm(x, y)
        elif scenario == "ranks_disagree":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y).backward()
            pm(x[:4] if rank == 1 else x, y[:4] if rank == 1 else y)
        elif scenario == "features_disagree":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y).backward()
            pm(x[:, :16] if rank == 1 else x, y)
        elif scenario == "structure_disagrees_data_parallel":  # the user's loss, no scalar output: no loss sum
            pm = partita.parallelize(model, stages=1)
            torch.nn.functional.mse_loss(pm(x), y).backward()
            pm(x.requires_grad_() if rank == 1 else x)
        elif scenario in ("sequence_lengths_differ", "sequence_lengths_differ_sharded"):
            seq = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 32))
            # fine under DDP; data parallelism under FSDP's levels, or over several micro-batches, runs as a
            # pipeline, which needs the same sizes on every rank (and measured costs may choose it for this model:
            # DDP is pinned where wanted)
            pm = partita.parallelize(seq, loss_fn=torch.nn.MSELoss(), stages=1, micro_batches=1,
                                     sharding="gradients" if scenario.endswith("sharded") else "none")
            pm(torch.randn(4, 5, 32), torch.randn(4, 5, 32)).backward()
            length = 5 if rank == 0 else 7
            loss = pm(torch.randn(4, length, 32), torch.randn(4, length, 32))
            loss.backward()
            return {"error": None, "loss": float(loss)}
        elif scenario in ("float64", "float64_later"):
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=world if "later" in scenario else 1)
            if "later" in scenario:
                pm(x, y).backward()
            pm(x.double(), y)
        elif scenario == "profiling_fails_on_one_rank":
            # a model of its own, so that its blocks are measured now (links come from the session's cache)
            odd = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Tanh(), torch.nn.Linear(24, 32))
            pm = partita.parallelize(odd, loss_fn=torch.nn.MSELoss(), stages=2)
            with mock.patch("partita.profile.block_times._measure_stage", side_effect=RuntimeError("injected fault"))\
                    if rank == 1 else contextlib.nullcontext():
                pm(x, y)
        elif scenario == "capture_fails_on_one_rank":
            pm = partita.parallelize(_FailsOnRank(1, model), loss_fn=torch.nn.MSELoss())
            pm(x, y)
        elif scenario == "meta_without_init":  # a module with its own parameter and no reset_parameters()
            with torch.device("meta"):
                scaled = torch.nn.Sequential(torch.nn.Linear(32, 32), _Scale(32))
            pm = partita.parallelize(scaled, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y)
        elif scenario == "fp16_without_optimizer":
            partita.parallelize(model, loss_fn=torch.nn.MSELoss(), precision="fp16")
        elif scenario == "meta_on_one_rank":
            with torch.device("meta" if rank == 1 else "cpu"):
                mixed = CASES["mlp"].make()
            pm = partita.parallelize(mixed, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y)
        elif scenario == "weights_missing":
            if rank == 0:
                torch.save({n: t for n, t in model.state_dict().items() if n != "layers.1.bias"}, plan_path)
            partita.barrier()
            partita.parallelize(model, loss_fn=torch.nn.MSELoss(), weights=plan_path)
        elif scenario == "one_rank_stops_early":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=int(plan_path))
            for _ in range(3 if rank == 0 else 2):
                pm(x, y).backward()
            if rank != 0:
                return {"error": None, "all_left": agreement.leave()}
        else:
            raise KeyError(scenario)
    except partita.PartitaError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def executed_actions(schedule: str, stages: int, micro_batches: int, style: str) -> dict:
    """One training step of the MLP under (schedule, stages, micro_batches) in call style `style`: the compute
    actions this rank's stages ran, in order, and (rank 0) the orders the planner's simulation used."""
    torch.manual_seed(0)
    case = CASES["mlp"]
    model = case.make()
    loss_fn = case.loss_fn if style == "loss_fn" else None
    pm = partita.parallelize(model, loss_fn=loss_fn, stages=stages, micro_batches=micro_batches, schedule=schedule)
    args, kwargs, target = case.batch(8, torch.Generator().manual_seed(partita.get_rank()))
    if style == "loss_fn":
        pm(*args, target, **kwargs).backward()
    else:
        case.user_loss(pm(*args, **kwargs), target).backward()
    plan = pm.plan
    replica = plan.replica_ranks(plan.replica_of(partita.get_rank()))
    return {"executed": [str(a) for a in pm.runtime.executed()], "position": replica.index(partita.get_rank()),
            "schedule": plan.schedule,
            "simulated": [[str(a) for a in order] for order in pm.simulated_step().orders]
            if partita.get_rank() == 0 else None}


def gradient_sums(schedule: str, style: str, bucket_bytes: int, overlap: str = "on") -> dict:
    """One training step of the MLP on 2 stages x 2 replicas under `schedule`, in call style `style`, with
    gradient buckets of `bucket_bytes` and PARTITA_OVERLAP=`overlap`: when each bucket's sum started (the stage
    whose last backward ran, or None for after the pipeline), and the parameters whose summed gradients differ
    from one process's on the global batch."""
    torch.manual_seed(0)
    case = CASES["mlp"]
    model, reference = case.make(), case.make()
    reference.load_state_dict(model.state_dict())
    loss_fn = case.loss_fn if style == "loss_fn" else None
    rank, world, rows = partita.get_rank(), partita.get_world_size(), 8
    args, _, target = case.batch(world * rows, torch.Generator().manual_seed(1))
    mine = slice(rank * rows, (rank + 1) * rows)
    with mock.patch("partita.runtime.grads.BUCKET_BYTES", bucket_bytes), \
            mock.patch.dict(os.environ, {"PARTITA_OVERLAP": overlap}):
        pm = partita.parallelize(model, loss_fn=loss_fn, stages=2 * stages_per_rank(schedule), micro_batches=4,
                                 schedule=schedule)
        if style == "loss_fn":
            pm(args[0][mine], target[mine]).backward()
        else:
            case.user_loss(pm(args[0][mine]), target[mine]).backward()
    case.loss_fn(reference(*args), target).backward()
    far = [n for n, p in reference.named_parameters()
           if not torch.allclose(pm.get_param_grad(n), p.grad, rtol=1e-5, atol=1e-7)]
    return {"started_during": pm.runtime.grads.started_during, "held": sorted(pm.plan.stages_of(rank)), "far": far}


def step_review(steps: int = 10) -> dict:
    """Train the MLP for `steps` steps with its optimizer: what partita said about the measured step."""
    torch.manual_seed(0)
    case = CASES["mlp"]
    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with partita_log() as said:
        pm = partita.parallelize(model, opt, loss_fn=case.loss_fn, stages=2, micro_batches=2)
        args, _, target = case.batch(8, torch.Generator().manual_seed(partita.get_rank()))
        walls = []
        for _ in range(steps):
            start = time.perf_counter()
            opt.zero_grad()
            pm(*args, target).backward()
            opt.step()
            walls.append(time.perf_counter() - start)
    return {"said": [s for s in said if "a training step takes" in s], "estimate_s": pm.plan.estimate.step_s,
            "walls_s": walls}


def _plain_sum(loss_fn: torch.nn.Module):
    """`loss_fn` summing over rows, as a plain function without `reduction`."""
    summed = copy.copy(loss_fn)
    summed.reduction = "sum"
    return lambda out, target: summed(out, target)


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})
def plain_sum_evaluated_first(**plan_args) -> dict:
    """A plain summing loss function whose first call is an evaluation (under torch.no_grad()): the global batch's
    loss on every rank, and one process's on the global batch."""
    rank, world = partita.get_rank(), partita.get_world_size()
    case = CASES["mlp"]
    loss_fn = _plain_sum(case.loss_fn)
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    batches = [case.batch(8, torch.Generator().manual_seed(r)) for r in range(world)]
    pm = partita.parallelize(model, loss_fn=loss_fn, **plan_args)
    args, _, target = batches[rank]
    with torch.no_grad():
        got = pm(*args, target)
        whole = loss_fn(ref(*(torch.cat(parts) for parts in zip(*(b[0] for b in batches)))),
                        torch.cat([b[2] for b in batches]))
    return {"loss": float(got), "one_process": float(whole), "plan": _summary(pm.plan)}


class _SlowLoss(torch.nn.Module):
    """A loss that takes `delay_s` longer than it computes: the job's steps measure far above the estimate of a
    data-parallel plan, whose refitted cost per step then makes a pipelined one faster (planning.agreed_switch)."""

    def __init__(self, loss: torch.nn.Module, delay_s: float):
        super().__init__()
        self.loss, self.delay_s, self.reduction = loss, delay_s, loss.reduction

    def forward(self, out, target):
        time.sleep(self.delay_s)
        return self.loss(out, target)


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})
def layout_switch(optimizer: str, steps: int = 12, switch: str = "on", delay_s: float = 0.05,
                  fail_on_rank: int | None = None, tmp: str | None = None, **plan_args) -> dict:
    """Train the MLP `steps` steps with a loss that sleeps `delay_s` (its steps measure far above the plan's
    estimate) under PARTITA_SWITCH_LAYOUT=`switch`, and in one process; the plans before and after, what rank 0
    said, the worst differences. `fail_on_rank`: that rank fails while dropping its part of the model.
    `tmp`: the directory temporary files go to. `plan_args`: constraints given to parallelize (and so to planning
    again)."""
    case = CASES["mlp"]
    torch.manual_seed(0)
    ref = case.make()
    model = case.make()
    model.load_state_dict(ref.state_dict())
    opt, ref_opt = _optimizer(optimizer, model), _optimizer(optimizer, ref)
    failing = (mock.patch("partita.checkpoint.relayout.unmaterialize", side_effect=OSError("no memory left"))
               if partita.get_rank() == fail_on_rank else contextlib.nullcontext())
    plans, error, before = [], None, live_groups()
    with partita_log() as said, mock.patch.dict(os.environ, {"PARTITA_SWITCH_LAYOUT": switch}), failing, \
            mock.patch.object(tempfile, "tempdir", tmp or tempfile.gettempdir()):
        try:
            pm = partita.parallelize(model, opt, loss_fn=_SlowLoss(case.loss_fn, delay_s), **plan_args)
            side = _SideBySide(case, "loss_fn", ref, ref_opt, 8, 1, False, {}, 1, None)
            for step in range(steps):
                side.step(pm, opt, None, f"step {step}")
                if not plans or plans[-1] != pm.plan.to_json():
                    plans.append(pm.plan.to_json())
            side.compare_model(pm, opt)
        except partita.PartitaError as e:
            error = f"{type(e).__name__}: {e}"
    if error is not None:
        return {"error": error}
    held = sorted(n for n, t in model.state_dict(keep_vars=True).items() if not t.is_meta)
    return {"diffs": side.diffs.result(), "plans": plans, "held": held,
            "said": [s for s in said if "a training step takes" in s or s.startswith("partita: ")],
            "groups": {"before": before, "after": live_groups(), "in use": sum(
                g != torch.distributed.GroupMember.NON_GROUP_MEMBER for g in pm.runtime.made.groups)}}


@mock.patch.dict(os.environ, {"PARTITA_SWITCH_LAYOUT": "on"})
def layout_switch_fp16(steps: int = 12) -> dict:
    """The MLP in float16 with a slow loss (as layout_switch): per step, the plan and the loss scale's state."""
    case = CASES["mlp"]
    torch.manual_seed(0)
    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pm = partita.parallelize(model, opt, loss_fn=_SlowLoss(case.loss_fn, 0.05), precision="fp16", sharding="none")
    rank, world, local_batch = partita.get_rank(), partita.get_world_size(), 8
    plans, scales, checks = [], [], []
    checked = mock.patch.object(LossScale, "_overflowed", autospec=True, side_effect=LossScale._overflowed)
    with checked as overflowed:
        for step in range(steps):
            args, kwargs, target = case.batch(world * local_batch, torch.Generator().manual_seed(step))
            mine = slice(rank * local_batch, (rank + 1) * local_batch)
            opt.zero_grad()
            pm(*_rows(args, mine), target[mine], **_rows(kwargs, mine)).backward()
            before = overflowed.call_count
            opt.step()
            checks.append(overflowed.call_count - before)  # the loss scales in the step's chain
            plans.append(pm.plan.to_json())
            scales.append(pm.loss_scale_state())
    return {"plans": plans, "scales": scales, "checks": checks}


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate", "PARTITA_SWITCH_LAYOUT": "on"})
def layout_switch_with_varying_sizes(steps: int = 10) -> dict:
    """The embedding model under DDP with a slow loss (as layout_switch), its sequences 5 and 7 tokens long in
    turn: the plans it ran under and what rank 0 said."""
    torch.manual_seed(0)
    case = CASES["embedding"]
    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plans = []
    with partita_log() as said:
        pm = partita.parallelize(model, opt, loss_fn=_SlowLoss(case.loss_fn, 0.05), micro_batches=1)
        for step in range(steps):
            ids = torch.randint(0, 40, (8, 5 + 2 * (step % 2)), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            pm(ids, torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(step))).backward()
            opt.step()
            if not plans or plans[-1] != pm.plan.to_json():
                plans.append(pm.plan.to_json())
    return {"plans": plans, "said": [s for s in said if "a training step takes" in s]}
