"""What building a model ran: its constructor run again on the meta device, every aten op it made recorded.

A model built on the meta device drew nothing from the random stream, and nothing in it says what its
constructor did: which modules drew their tensors in `__init__` (nn.Linear through reset_parameters(), GPT-2's
Conv1D with normal_), which only allocated them (torch.empty: Mixtral's experts and routers), which computed a
buffer, which parent drew its children's tensors again after building them (nanoGPT's
`self.apply(self._init_weights)`, Hugging Face's post_init). Building it again, as on the CPU but with every
tensor on the meta device, under a mode that records every op, says exactly that, at no memory cost;
`runtime.materialize` then runs the recorded ops for real on the CPU, in their order, so that the random stream
is drawn as building on the CPU draws it.

The constructor is called with the arguments the model keeps under their own names (a Hugging Face model's or
nanoGPT's `config`, nn.Linear's sizes; arguments with defaults may be left out); a torch container
(nn.Sequential, nn.ModuleList, nn.ModuleDict) is the construction of each of its modules, in its order. The
rebuilt model must have the same tensors, shapes, dtypes and ties as the model, or the recording is not used
(`Unrebuildable` says why).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from partita.runtime.ownership import named_state


@dataclass(frozen=True)
class Op:
    """One aten op building the model made, with the meta tensors it read and made."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    out: object


@dataclass(frozen=True)
class Construction:
    """The ops building the model made, in order, and the rebuilt model's tensors by state_dict name (the meta
    tensors those ops made; tied names share one)."""

    ops: tuple[Op, ...]
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Unrebuildable:
    """Why the model could not be built again: a sentence."""

    reason: str


class _Recorder(TorchDispatchMode):
    """Builds on the meta device while the constructor believes it builds on the CPU: what it makes (an op that
    takes a device) is made on the meta device; what it computes from constants alone (torch.tensor(...)) stays
    on the CPU, as small as the constants. Not under torch.device("meta"), nor with its constants on the meta
    device: Hugging Face skips post_init's initializations when `torch.tensor([])` lands there."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if any(a.name == "device" for a in func._schema.arguments):
            kwargs["device"] = torch.device("meta")
        out = func(*args, **kwargs)
        self.ops.append(Op(func, args, kwargs, out))
        return out


def constructor_arguments(module: nn.Module) -> dict[str, object] | Unrebuildable:
    """The keyword arguments that build `module` again: each argument of its class's `__init__` that the module
    keeps under the same name (a value, not a module, tensor or method of its own); those it does not keep must
    have defaults."""
    try:
        parameters = inspect.signature(type(module).__init__).parameters
    except (TypeError, ValueError) as e:
        return Unrebuildable(f"its __init__ has no signature partita can read ({e})")
    kwargs = {}
    for name, p in list(parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.kind == p.POSITIONAL_ONLY:
            if p.kind == p.POSITIONAL_ONLY and p.default is p.empty:
                return Unrebuildable(f"its __init__ takes '{name}' by position only")
            continue
        value = vars(module).get(name, _MISSING)
        if value is _MISSING and not hasattr(type(module), name) and getattr(module, name, _MISSING) is None:
            value = None  # a parameter or buffer registered as None: nn.Linear's bias=False
        if value is not _MISSING and not isinstance(value, (nn.Module, torch.Tensor)) and not inspect.ismethod(value):
            kwargs[name] = value
        elif p.default is p.empty:
            return Unrebuildable(f"its __init__ takes '{name}', which it does not keep as an attribute of that name")
    return kwargs


_MISSING = object()
# torch's containers: their __init__ only registers the modules it is given, built before it in its order
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def recorded_construction(module: nn.Module) -> Construction | Unrebuildable:
    """Build `module` again on the meta device from `constructor_arguments`, recording its ops (a torch container:
    each of its modules, in its order). The CPU random stream is left where it was."""
    if type(module) in _CONTAINERS:
        return _containers_construction(module)
    kwargs = constructor_arguments(module)
    if isinstance(kwargs, Unrebuildable):
        return kwargs
    state = torch.get_rng_state()
    recorder = _Recorder()
    try:
        with warnings.catch_warnings(), recorder:
            warnings.simplefilter("ignore")
            rebuilt = type(module)(**kwargs)
    except Exception as e:  # a constructor partita calls with arguments it found: any failure means "cannot"
        return Unrebuildable(f"building it again from {sorted(kwargs)} failed: {type(e).__name__}: {e}")
    finally:
        torch.set_rng_state(state)
    tensors = named_state(rebuilt)
    differs = _differences(named_state(module), tensors)
    if differs:
        return Unrebuildable(f"built again from {sorted(kwargs) or 'its defaults'}, it differs: {differs}")
    return Construction(tuple(recorder.ops), tensors)


def _containers_construction(module: nn.Module) -> Construction | Unrebuildable:
    ops: list[Op] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, child in module.named_children():
        built = recorded_construction(child)
        if isinstance(built, Unrebuildable):
            return Unrebuildable(f"its module '{name}' ({type(child).__name__}): {built.reason}")
        ops += built.ops
        tensors.update((f"{name}.{n}", t) for n, t in built.tensors.items())
    differs = _differences(named_state(module), tensors)
    return Unrebuildable(f"built again module by module, it differs: {differs}") if differs else \
        Construction(tuple(ops), tensors)


def _differences(mine: dict[str, torch.Tensor], rebuilt: dict[str, torch.Tensor]) -> str:
    """How `rebuilt` differs from `mine` in names, shapes, dtypes, ties or realness ('' when it does not)."""
    if set(mine) != set(rebuilt):
        odd = sorted(set(mine) ^ set(rebuilt))
        return f"tensors {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''} are in one and not the other"
    for name, t in mine.items():
        r = rebuilt[name]
        if (t.shape, t.dtype) != (r.shape, r.dtype):
            return f"'{name}' is {tuple(r.shape)} {r.dtype} there, {tuple(t.shape)} {t.dtype} here"

    def ties(state: dict[str, torch.Tensor]) -> set[frozenset[str]]:
        groups: dict[int, set[str]] = {}
        for n, t in state.items():
            groups.setdefault(id(t), set()).add(n)
        return {frozenset(g) for g in groups.values()}

    return "" if ties(mine) == ties(rebuilt) else "its tied weights are tied otherwise"
