"""Checkpoint test bodies that run on every rank of a pool (see pool.py); each returns plain data.

Training uses a fixed global batch per step (the same rows whatever the world size), so a run resumed on
another world size and plan must continue with the losses of the run that saved.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from unittest import mock

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

import partita
from partita.checkpoint.holding import holding_of
from partita.errors import CheckpointError
from support.cases import _optimizer, _rows, reporting_warnings
from support.zoo import CASES

GLOBAL_BATCH = 16


def _loud(batch):
    def louder(n, g):
        args, kwargs, target = batch(n, g)
        return args, kwargs, 300 * target
    return louder


# the MLP with targets 300 times larger: under float16 its gradients overflow at the first loss scales, so the
# scale moves in the first steps, and a run that started it over would skip steps the saving run took
MODELS = {**CASES, "loud_mlp": dataclasses.replace(CASES["mlp"], batch=_loud(CASES["mlp"].batch))}


def estimated_costs(case):
    """Plan from the device preset instead of measuring: every test here fixes the plan, and measuring
    costs seconds per model and world size. Restored after the case, for the tests that share the pool."""
    return mock.patch.dict(os.environ, {"PARTITA_PROFILE": "estimate"})(case)


def _batch(case, step: int):
    """This rank's rows of global batch number `step`: positional inputs, target, keyword inputs."""
    rank, world = partita.get_rank(), partita.get_world_size()
    args, kwargs, target = case.batch(GLOBAL_BATCH, torch.Generator().manual_seed(1000 + step))
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return _rows(args, rows), target[rows], _rows(kwargs, rows)


def _train_step(pm, opt, case, step: int) -> float:
    args, target, kwargs = _batch(case, step)
    opt.zero_grad()
    loss = pm(*args, target, **kwargs)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _draws() -> list[float]:
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _snapshot(pm, opt) -> dict:
    """The whole model and optimizer state, as numpy arrays (the same on every rank)."""
    model = {n: t.detach().numpy().copy() for n, t in pm.state_dict().items()}
    osd = opt.state_dict()
    optim = {f"{i}.{k}": (v.detach().numpy().copy() if torch.is_tensor(v) else v)
             for i, s in osd["state"].items() for k, v in s.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    return {"model": model, "optim": optim, "groups": groups}


def _loss_scale(pm) -> tuple[float, int] | None:
    """float16's loss scale in use and its clean steps (None before the first call, and in other precisions)."""
    scale = pm.runtime.loss_scale if pm.runtime is not None else None
    return None if scale is None else (scale.scale, scale.clean_steps)


def _model(name: str, plan: dict, seed: int, build: str = "cpu", precision: str = "fp32"):
    case = MODELS[name]
    torch.manual_seed(seed)
    with torch.device(build):
        model = case.make()
    opt = _optimizer("adam", model)
    return case, partita.parallelize(model, opt, loss_fn=case.loss_fn, precision=precision, **plan), opt


@estimated_costs
@reporting_warnings
def train_and_save(name: str, root: str, plan: dict, steps: int = 2, more: int = 2,
                   precision: str = "fp32") -> dict:
    """Train `steps` steps, save, and go on for `more` steps: what a resumed run must reproduce."""
    rank = partita.get_rank()
    case, pm, opt = _model(name, plan, seed=0, precision=precision)
    for step in range(steps):
        _train_step(pm, opt, case, step)
    torch.manual_seed(100 + rank)  # every rank its own streams, so that restoring the wrong one shows
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    path = partita.save(pm, opt, root, step=steps, extra={"epoch": 1, "batch": steps, "files": ["a", "b"]})
    draws = _draws()
    snapshot, loss_scale = _snapshot(pm, opt), _loss_scale(pm)
    losses = [_train_step(pm, opt, case, step) for step in range(steps, steps + more)]
    return {"path": path, "snapshot": snapshot, "draws": draws, "losses": losses, "final": _snapshot(pm, opt),
            "loss_scales": [loss_scale, _loss_scale(pm)], "writes": sorted(holding_of(pm).writes),
            "plan": (pm.plan.num_stages, pm.plan.num_replicas)}


@estimated_costs
@reporting_warnings
def load_and_continue(name: str, root: str, plan: dict, more: int = 2, after_first_call: bool = False,
                      build: str = "cpu", precision: str = "fp32") -> dict:
    """A fresh model (other initial weights, or none: built on the meta device) and optimizer, loaded from
    `root`, then trained `more` steps."""
    case, pm, opt = _model(name, plan, seed=123, build=build, precision=precision)
    if after_first_call:
        _train_step(pm, opt, case, 99)  # the plan is made and the optimizer has state, all to be replaced
    info = partita.load(pm, opt, root)
    draws = _draws()
    if build == "meta":  # its weights exist from the first call on: one that changes nothing
        args, target, kwargs = _batch(case, 0)
        with torch.no_grad():
            pm(*args, target, **kwargs)
    snapshot, loss_scale = _snapshot(pm, opt), _loss_scale(pm)
    losses = [_train_step(pm, opt, case, step) for step in range(info.step, info.step + more)]
    names = {id(p): n for n, p in pm.module.named_parameters()}
    local = sorted(pm.held().trains)
    return {"info": {"step": info.step, "extra": info.extra, "world_size": info.world_size,
                     "plan": (info.plan.num_stages, info.plan.num_replicas) if info.plan else None,
                     "rng_restored": info.rng_restored, "path": info.path},
            "snapshot": snapshot, "draws": draws, "losses": losses, "final": _snapshot(pm, opt),
            "loss_scales": [loss_scale, _loss_scale(pm)],
            "optimizer_state_of": sorted(names[id(p)] for p in opt.state), "trains": local,
            "plan": (pm.plan.num_stages, pm.plan.num_replicas)}


def plain_ddp_save(root: str) -> dict:
    """torch's own DDP (no partita model): BatchNorm statistics differ between ranks after a step."""
    rank = partita.get_rank()
    case = CASES["batchnorm"]
    torch.manual_seed(0)
    model = case.make()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    (x,), _, y = case.batch(8, torch.Generator().manual_seed(rank))
    case.user_loss(ddp(x), y).backward()
    opt.step()
    path = partita.save(ddp, opt, root, step=1)
    return {"path": path, "state": {n: t.numpy().copy() for n, t in model.state_dict().items()},
            "momentum": [opt.state[p]["momentum_buffer"].numpy().copy() for p in model.parameters()]}


@estimated_costs
def save_steps(name: str, root: str, steps: list[int], keep: int) -> list[str]:
    """Save at each of `steps` (one training step between saves); return the paths written."""
    case, pm, opt = _model(name, {"stages": 2}, seed=0)
    paths = []
    for step in steps:
        _train_step(pm, opt, case, step)
        paths.append(partita.save(pm, opt, root, step=step, keep=keep))
    return paths


@estimated_costs
def load_latest(name: str, root: str) -> int:
    case, pm, opt = _model(name, {"stages": 2}, seed=0)
    return partita.load(pm, opt, root).step


@estimated_costs
def failures(scenario: str, root: str) -> dict:
    """Run a failing checkpoint call; return the error this rank raised (every rank must raise one)."""
    rank = partita.get_rank()
    try:
        if scenario == "foreign_model":  # root holds a checkpoint of another model
            case, pm, opt = _model("gpt", {"stages": 2}, seed=0)
            partita.load(pm, opt, root)
        elif scenario == "bad_extra_on_one_rank":
            case, pm, opt = _model("mlp", {"stages": 2}, seed=0)
            _train_step(pm, opt, case, 0)
            partita.save(pm, opt, root, step=1, extra={"x": object() if rank == 1 else 1})
        elif scenario == "damaged":  # root holds a checkpoint with a data file deleted
            case, pm, opt = _model("mlp", {"stages": 2}, seed=0)
            partita.load(pm, opt, root)
        else:
            raise KeyError(scenario)
    except CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def trained(seed: int = 0):
    """A tied embedding / LM head after one Adam step."""
    case = CASES["tied_embedding"]
    torch.manual_seed(seed)
    model = case.make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    args, _, target = case.batch(4, torch.Generator().manual_seed(1))
    case.loss_fn(model(*args), target).backward()
    opt.step()
    return model, opt


@estimated_costs
def on_rank0_only(call: str, root: str, plan: dict) -> dict:
    """torch's idiom `if rank == 0: torch.save(...)` applied to partita.save, partita.load, partita.barrier or
    the model's state_dict() or get_param() (`call`), while
    rank 1 goes on to its next call of the model; the error this rank raised and how long it took."""
    from partita.runtime import agreement

    rank = partita.get_rank()
    case, pm, opt = _model("mlp", plan, seed=0)
    _train_step(pm, opt, case, 0)
    if call == "load":
        partita.save(pm, opt, root, step=1)
    started = time.monotonic()
    try:
        if rank == 0 and call in ("save", "save_then_shutdown"):
            partita.save(pm, opt, root, step=2)
        elif rank == 0 and call == "load":
            partita.load(pm, opt, root)
        elif rank == 0 and call == "state_dict":
            pm.state_dict()
        elif rank == 0 and call == "get_param":
            pm.get_param("layers.0.weight")
        elif rank == 0 and call == "barrier":
            partita.barrier()
        elif call == "save_then_shutdown":
            return {"all_left": agreement.leave(), "seconds": time.monotonic() - started}
        else:
            _train_step(pm, opt, case, 1)
    except partita.PartitaError as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
    return {"error": None}
