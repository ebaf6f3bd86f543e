"""Test bodies that run on every rank of a pool (see pool.py). Each returns plain data for the test to check.

The reference is the same initial model trained in one process on the global batch (every rank computes
it locally, deterministically). Gradients, parameters and optimizer state come from partita's gathering
API (get_param_grad, get_param, optimizer.state_dict), so the comparison also covers those.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.utils._pytree as pytree

import partita
from support.zoo import CASES

RTOL, ATOL = 1e-5, 1e-6


class Diffs:
    """The worst violation of |a - b| <= atol + rtol * |b| per kind of quantity."""

    def __init__(self):
        self.worst: dict[str, tuple[float, str]] = {}
        self.count: dict[str, int] = {}

    def add(self, kind: str, what: str, got, want) -> None:
        excess, why = _excess(got, want)
        self._record(kind, f"{what} ({why})" if why else what, excess)

    def fail(self, kind: str, what: str) -> None:
        """A difference that is not a number: another structure, other keys."""
        self._record(kind, what, math.inf)

    def _record(self, kind: str, what: str, excess: float) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        if kind not in self.worst or excess > self.worst[kind][0]:
            self.worst[kind] = (excess, what)

    def result(self) -> dict:
        return {k: {"excess": v[0], "worst": v[1], "checked": self.count[k]} for k, v in self.worst.items()}


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


def _rows(tree, sl):
    return pytree.tree_map(lambda t: t[sl] if isinstance(t, torch.Tensor) else t, tree)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


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


def fidelity(name: str, *, style: str = "loss_fn", optimizer: str = "adam", steps: int = 3,
             accumulate: int = 1, local_batch: int = 8, input_grad: bool = False, roundtrip: dict | None = None,
             eval_batch: int | None = None, **plan_args) -> dict:
    """Train `steps` steps with partita and in one process; report the worst differences."""
    rank, world = partita.get_rank(), partita.get_world_size()
    case = CASES[name]
    torch.manual_seed(0)
    model = case.make()
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer(optimizer, model), _optimizer(optimizer, ref)
    loss_fn = case.loss_fn if style == "loss_fn" else None
    pm = partita.parallelize(model, opt if isinstance(opt, torch.optim.Optimizer) else None, loss_fn=loss_fn,
                             **plan_args)
    d = Diffs()
    gen = torch.Generator().manual_seed(1)
    names = list(dict(ref.named_parameters()))
    mine = slice(rank * local_batch, (rank + 1) * local_batch)

    def train(pm, opt, label):
        for a in range(accumulate):
            args, kwargs, target = case.batch(world * local_batch, gen)
            if input_grad:
                args = tuple(t.requires_grad_() for t in args)
            largs = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in _rows(args, mine))
            lkwargs, ltarget = _rows(kwargs, mine), target[mine]
            if style == "loss_fn":
                loss = pm(*largs, ltarget, **lkwargs)
                ref_loss = case.loss_fn(ref(*args, **kwargs), target)
                d.add("loss", label, loss, ref_loss)
            else:
                out = pm(*largs, **lkwargs)
                ref_out = ref(*args, **kwargs)
                if torch.is_tensor(ref_out) and ref_out.dim() == 0:  # the model returns its own loss
                    loss, ref_loss = out, ref_out
                    d.add("loss", label, loss, ref_loss)
                else:
                    d.add("output", label, _logits(out), _logits(ref_out)[mine])
                    loss = case.user_loss(out, ltarget)
                    ref_loss = sum(case.user_loss(_rows(ref_out, slice(r * local_batch, (r + 1) * local_batch)),
                                                  target[r * local_batch:(r + 1) * local_batch])
                                   for r in range(world)) / world
                    d.add("loss", label, loss, case.user_loss(_rows(ref_out, mine), ltarget))
            loss.backward()
            ref_loss.backward()
            if input_grad:
                for k, (x, rx) in enumerate(zip(largs, args)):
                    # with loss_fn the global mean's gradient; without, the rank's own loss (as DDP)
                    want = rx.grad[mine] * (1 if style == "loss_fn" else world)
                    d.add("input_grad", f"{label} input {k}", x.grad, want)
                    rx.grad = None
        for n in names:
            d.add("grad", f"{label} {n}", pm.get_param_grad(n), ref.get_parameter(n).grad)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()

    for step in range(steps):
        train(pm, opt, f"step {step}")
    for n in names:
        d.add("param", n, pm.get_param(n), ref.get_parameter(n))
    _compare_state(d, opt.state_dict(), ref_opt.state_dict())
    full = pm.state_dict()
    for n, t in ref.state_dict().items():
        d.add("state_dict", n, full[n], t)

    if roundtrip is not None:
        osd = opt.state_dict()
        torch.manual_seed(123)
        fresh = case.make()
        fresh_opt = _optimizer(optimizer, fresh)
        pm = partita.parallelize(fresh, fresh_opt if isinstance(fresh_opt, torch.optim.Optimizer) else None,
                                 loss_fn=loss_fn, **roundtrip)
        pm.load_state_dict(full)
        fresh_opt.load_state_dict(osd)
        train(pm, fresh_opt, "after reload")
        for n in names:
            d.add("param", f"after reload {n}", pm.get_param(n), ref.get_parameter(n))

    if eval_batch is not None:
        pm.eval()
        ref.eval()
        args, kwargs, target = case.batch(world * eval_batch, gen)
        rows = slice(rank * eval_batch, (rank + 1) * eval_batch)
        with torch.no_grad():
            if style == "loss_fn":
                d.add("eval", "loss", pm(*_rows(args, rows), target[rows], **_rows(kwargs, rows)),
                      case.loss_fn(ref(*args, **kwargs), target))
            else:
                out = pm(*_rows(args, rows), **_rows(kwargs, rows))
                ref_out = ref(*args, **kwargs)
                want = ref_out if torch.is_tensor(ref_out) and ref_out.dim() == 0 else _logits(ref_out)[rows]
                d.add("eval", "output", _logits(out), want)
        pm.train()
    plan = pm.plan
    return {"diffs": d.result(), "plan": (plan.num_stages, plan.num_replicas, plan.num_microbatches, plan.schedule)}


def _compare_state(d: Diffs, got: dict, want: dict) -> None:
    if set(got["state"]) != set(want["state"]):
        d.fail("optimizer", f"state keys {sorted(got['state'])} vs {sorted(want['state'])}")
        return
    for i, state in want["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                d.add("optimizer", f"param {i} {k}", got["state"][i][k], v)


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
        elif scenario == "wrong_device":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x.to("meta") if rank == 1 else x, y)
        elif scenario == "wrong_device_later":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y).backward()
            pm(x.to("meta") if rank == 1 else x, y)
        elif scenario == "too_many_stages":
            tiny = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
            pm = partita.parallelize(tiny, loss_fn=torch.nn.MSELoss(), stages=world)
            pm(x, y)
        elif scenario == "world_not_multiple":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=3)
            pm(x, y)
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
        elif scenario == "plan_for_other_model":
            other = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
            pm = partita.parallelize(other, loss_fn=torch.nn.MSELoss(), plan=plan_path)
            pm(x, y)
        elif scenario == "ranks_disagree":
            pm = partita.parallelize(model, loss_fn=torch.nn.MSELoss(), stages=2)
            pm(x, y).backward()
            pm(x[:4] if rank == 1 else x, y[:4] if rank == 1 else y)
        else:
            raise KeyError(scenario)
    except partita.PartitaError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def batchnorm_replicas(stages: int) -> dict:
    """Train BatchNorm with several replicas; eval must use the same statistics state_dict() reports."""
    rank, world = partita.get_rank(), partita.get_world_size()
    case = CASES["batchnorm"]
    torch.manual_seed(0)
    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pm = partita.parallelize(model, opt, stages=stages, replicas=partita.get_world_size() // stages)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        (x,), _, y = case.batch(8, gen)
        opt.zero_grad()
        case.user_loss(pm(x), y).backward()
        opt.step()
    plain = case.make()
    plain.load_state_dict(pm.state_dict())
    pm.eval()
    plain.eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(99 + rank))
    with torch.no_grad():
        got, want = pm(x), plain(x)
    return {"max_diff": float((got - want).abs().max()), "replicas": pm.plan.num_replicas,
            "stats_moved": float(plain.bn1.running_mean.abs().max())}
