"""Each rank holds only the weights of its own stages, whichever way the model came.

- Built on the CPU (RaNNC's way): every rank takes rank 0's values (as DDP does, whatever each rank's seed
  was), keeps the tensors its stages read, on its device, and frees the rest. Rank 0's values go out in
  buckets, so that no rank ever holds a second copy of the model.
- Built on the meta device (no memory at all): every rank replays rank 0's random stream, as it was when
  `parallelize` was called, through the ops building the model made (`construction`: the model built again on
  the meta device, recorded), or where it cannot be built again through the initializations partita can see
  (reset_parameters(), init_fn, a Hugging Face model's as Hugging Face runs them), so that the values are those
  the model built on the CPU in one process would have had. A tensor the rank does not keep exists only while
  the ops that make and read it run; then it is dropped. The random stream is then put back where it was.
- With `weights=`: each rank reads only the tensors it keeps from the file; the tensors a file does not hold
  (buffers that are not in a state dict) come from the model as above.

A tensor is kept or freed as an object: every module that holds it (tied weights), the optimizer's parameter
groups and its state are pointed at the new object, so no reference to a freed tensor is left behind and the
optimizer the user built (on meta parameters, perhaps) steps the materialized ones. A freed tensor becomes a
meta tensor of the same shape: names, shapes and `state_dict()` keys stay whole on every rank.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from partita.errors import ModelError
from partita.runtime import agreement
from partita.runtime.construction import Construction, Op, Unrebuildable, recorded_construction
from partita.runtime.host_copies import HostCopies
from partita.runtime.optim import repoint_optimizer
from partita.runtime.ownership import named_state
from partita.runtime.route import buckets
from partita.runtime.state import broadcast_packed

InitFn = Callable[[nn.Module], None]

# rank 0's weights are broadcast in pieces of about this size: the most any rank holds beyond its own part
BROADCAST_BUCKET_BYTES = 64 * 2**20
_SHOWN = 5


class WeightReader(Protocol):
    """Tensors by the model's state_dict names, read from a file (`checkpoint.weights.ModelWeights`)."""

    def names(self) -> frozenset[str]:
        """The model's state_dict names whose values the file holds."""
        ...

    def read(self, names: list[str], device: torch.device) -> dict[str, torch.Tensor]: ...


class LoadedWeights:
    """Values that load_state_dict got before the first call for tensors still on the meta device, which have no
    memory to copy into yet: the first call takes them as it materializes each rank's part, converted to the
    model's dtypes as a copy converts them, and the other names from `under` (weights=, an earlier load)."""

    def __init__(self, values: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], under: WeightReader | None):
        self.values, self.dtypes, self.under = values, dtypes, under

    def names(self) -> frozenset[str]:
        return frozenset(self.values) | (self.under.names() if self.under is not None else frozenset())

    def read(self, names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        rest = [n for n in names if n not in self.values]
        out = self.under.read(rest, device) if rest else {}
        out.update((n, self.values[n].detach().to(device=device, dtype=self.dtypes[n], copy=True))
                   for n in names if n in self.values)
        return out


def loaded_weights(module: nn.Module, state_dict, under: WeightReader | None) -> WeightReader | None:
    """What the first call reads its initial values from once `state_dict` was loaded into `module` before it:
    `state_dict`'s values of the module's meta tensors, over `under`."""
    held = module.state_dict(keep_vars=True)
    meta = {n: v for n, v in state_dict.items()
            if isinstance(v, torch.Tensor) and isinstance(held.get(n), torch.Tensor) and held[n].is_meta}
    if not meta:
        return under
    return LoadedWeights(meta, {n: held[n].dtype for n in meta}, under)


@dataclass(frozen=True)
class Initial:
    """Where a model's initial values come from, besides the tensors it holds."""

    init_fn: InitFn | None = None  # applied to every module with meta tensors, as model.apply(init_fn) would
    weights: WeightReader | None = None
    # the CPU random generator's state when parallelize was called: a meta model is initialized from rank 0's
    random_state: torch.Tensor | None = field(default=None, repr=False)


def initial_of(module: nn.Module, init_fn: InitFn | None, weights: WeightReader | None) -> Initial:
    """Called by parallelize, right after the user built the model: the random stream that building it on the
    CPU would have consumed next."""
    meta = any(t.is_meta for t in _tensors(module))
    return Initial(init_fn, weights, torch.get_rng_state() if meta else None)


@dataclass(eq=False)
class _Place:
    """One tensor of the model and every name it has (several when tied), in module order."""

    tensor: torch.Tensor
    names: list[str]
    value: torch.Tensor | None = None  # its initial value on this rank, when kept


def materialize(module: nn.Module, optimizer: torch.optim.Optimizer | None, keep: set[str], *,
                device: torch.device, initial: Initial = Initial()) -> None:
    """Make this rank hold exactly the tensors named in `keep` (state_dict names, every alias of a tied
    weight), on `device`, with their initial values; every other tensor becomes meta. Collective (every rank
    calls it, with its own `keep`)."""
    places = _places(module)
    _agree_on_meta(places)
    kept = [p for p in places if keep.intersection(p.names)]
    in_file = initial.weights.names() if initial.weights is not None else frozenset()
    from_file = [p for p in kept if in_file.intersection(p.names)]
    rest = [p for p in places if not in_file.intersection(p.names)]
    if initial.weights is not None:
        # every rank takes part, those that read nothing from the file too: a failed read anywhere stops all
        named = [(next(n for n in p.names if n in in_file), p) for p in from_file]
        with agreement.together("reading weights="):
            values = initial.weights.read([n for n, _ in named], device) if named else {}
        for name, p in named:
            p.value = values[name]
    _broadcast_kept([p for p in rest if not p.tensor.is_meta], keep, device)
    meta = [p for p in rest if p.tensor.is_meta]
    if meta:
        _initialize(module, meta, keep, initial)
    replaced = {}
    copies = HostCopies(device)
    for p in places:
        t = _placed(p, p in kept, copies)
        _set(module, p.names, t)
        if t is not p.tensor:
            replaced[id(p.tensor)] = t
    copies.finish()
    repoint_optimizer(optimizer, replaced, lambda value, new: value.to(new.device))
    del places, kept, from_file, rest, replaced
    release_freed_memory()


def unmaterialize(module: nn.Module, optimizer: torch.optim.Optimizer | None, values: dict[str, torch.Tensor]) -> None:
    """Before another plan's `materialize`: every tensor of the module becomes a new meta tensor of its shape, except
    those named in `values`, which hold those values. New objects, so that nothing a runtime attached to the old
    ones (DDP's gradient hooks, FSDP's shards) reaches the next. The optimizer's parameter groups follow; its state
    is dropped."""
    replaced = {}
    for p in _places(module):
        t = p.tensor
        value = next((values[n] for n in p.names if n in values), None)
        new = _like(t, value.detach() if value is not None else torch.empty(t.shape, dtype=t.dtype, device="meta"))
        _set(module, p.names, new)
        replaced[id(t)] = new
    repoint_optimizer(optimizer, replaced, lambda value, new: value)
    del replaced
    release_freed_memory()


def release_freed_memory() -> None:
    """Give the memory of the tensors this rank dropped back to the system. Every rank went through the whole
    model (broadcast buckets, initializations); glibc's malloc keeps freed blocks below its mmap threshold, which
    rises to 32 MiB after freeing a big one, in its heap, still resident, though the rank keeps only its part."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, or the allocator returns memory itself
        pass


def foreign_devices(devices: Iterable[torch.device], device: torch.device) -> list[str]:
    """Those of `devices` a rank computing on `device` does not take a model's tensors from: a model arrives on
    the CPU or the meta device (or on the rank's own device), and the rank moves or materializes its part on
    `device`; one on another GPU (another rank's) would be copied silently.

    >>> foreign_devices([torch.device("cpu"), torch.device("cuda", 1)], torch.device("cuda", 0))
    ['cuda:1']
    """
    return sorted({str(d) for d in devices if d.type not in ("cpu", "meta") and d != device})


def check_devices(module: nn.Module, device: torch.device) -> None:
    """A model whose tensors are on another rank's GPU is an error (`foreign_devices`)."""
    elsewhere = foreign_devices((t.device for t in _tensors(module)), device)
    if elsewhere:
        raise ModelError(f"the model has tensors on {', '.join(elsewhere)}, but this rank computes on {device}. "
                         "Build the model on the CPU or on the meta device on every rank (partita moves each "
                         "rank's part to its device), or on this rank's own device.")


# ---- what holds each tensor ------------------------------------------------------------------------------

def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _places(module: nn.Module) -> list[_Place]:
    out: dict[int, _Place] = {}
    for name, t in named_state(module).items():
        out.setdefault(id(t), _Place(t, [])).names.append(name)
    return list(out.values())


def _agree_on_meta(places: list[_Place]) -> None:
    """Every rank must bring the model the same way: a rank that initializes while another broadcasts would
    wait forever."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    n = sum(p.tensor.is_meta for p in places)
    extremes = torch.tensor([n, -n], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=agreement.cpu_group())
    most, fewest = int(extremes[0]), -int(extremes[1])
    if most != fewest:
        raise ModelError(f"the ranks built the model differently: {fewest} of its tensors are on the meta device "
                         f"on one rank and {most} on another (this one: {n}). Build it the same way on every rank "
                         "(all on the CPU, or all under torch.device('meta')).")


def _set(module: nn.Module, names: list[str], value: torch.Tensor) -> None:
    for name in names:
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, value)


def _like(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """`data` as what `t` is: a Parameter (with t's requires_grad) if `t` is one."""
    return nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data


def _placed(p: _Place, kept: bool, copies: HostCopies) -> torch.Tensor:
    """The tensor this rank holds for `p`: the original object where it can stay (kept, on the device, written
    in place), else a new one on the device, or meta when not kept."""
    t = p.tensor
    if not kept:
        return t if t.is_meta else _like(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))
    value = p.value if p.value is not None else t
    if t.is_meta or t.device != copies.device:
        return _like(t, copies.to(value.detach(), t.dtype))
    if value is not t:
        with torch.no_grad():
            t.copy_(value)
    return t


# ---- values: rank 0's, or initialized -------------------------------------------------------------------------

def _broadcast_kept(places: list[_Place], keep: set[str], device: torch.device) -> None:
    """Rank 0's values of `places`, bucket by bucket; each rank takes the ones it keeps."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not places:
        return
    for bucket in buckets(places, BROADCAST_BUCKET_BYTES, lambda p: p.tensor):
        for p, value in zip(bucket, broadcast_packed([p.tensor for p in bucket], 0, device)):
            if keep.intersection(p.names):
                p.value = value.clone()


def _initialize(module: nn.Module, meta: list[_Place], keep: set[str], initial: Initial) -> None:
    """Give the meta tensors the values building the model on the CPU would have, on rank 0's random stream as
    it was when parallelize was called.

    When the model can be built again (`construction.recorded_construction`), the ops building it made are run
    again for real on the CPU, in their order (`_replay`): every draw, every module's and every parent's, a
    Hugging Face model's post_init included; then a user's `init_fn` as model.apply(init_fn) runs it. Otherwise
    partita runs the initializations it can see (`_steps`), and warns about the modules whose `__init__` it
    cannot see.

    Every rank runs every initialization, kept or not, so that its stream stays where rank 0's is, and checks
    every tensor, so that all raise the same error. A tensor the rank does not keep lives only while an
    initialization that touches it runs: what it draws is the same whatever the tensor held before, and its
    value is never used. Keeping it from its first initialization to its last would hold the whole model at
    once: building draws every weight before post_init or model.apply(init_fn) draws them again. Values are
    computed on the CPU, where the random stream is the same on every machine, and moved to the device
    afterwards."""
    placed = {id(p.tensor): p for p in meta}
    own = {m: [(attr, t) for attr, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
               if id(t) in placed] for m in module.modules()}
    built = recorded_construction(module)
    was_set: set[int] = set()  # the tensors dropped with a value some initialization had set
    others = _OthersMadeReal(meta)
    saved = torch.get_rng_state()
    rank0 = _rank0_random_state(initial.random_state)
    torch.set_rng_state(rank0)
    try:
        if isinstance(built, Construction):
            try:
                was_set = _replay(built, meta, keep)
            except _CannotReplay as e:
                built = Unrebuildable(str(e))
                torch.set_rng_state(rank0)
        if isinstance(built, Construction):
            steps = [] if initial.init_fn is None or _hugging_face_model_class(initial.init_fn) is not None else [
                _Step(m, initial.init_fn, frozenset(id(t) for _, t in own[m])) for m in _applied(module)]
        else:
            _check_initializable(module, [m for m in own if own[m]], initial.init_fn)
            _warn_unseen(module, own, built)
            steps = _steps(module, own, initial.init_fn)
        for step in steps:
            for p in _run_init(step, own[step.module], placed, others):
                if not keep.intersection(p.names):
                    if not _is_unset(p.value):
                        was_set.add(id(p.tensor))
                    p.value = None
    finally:
        torch.set_rng_state(saved)
    unset = [p.names[0] for p in meta if id(p.tensor) not in was_set and (p.value is None or _is_unset(p.value))]
    if unset:
        raise ModelError(f"the model is on the meta device, and nothing initialized {len(unset)} of its tensors: "
                         f"{', '.join(unset[:_SHOWN])}{' ...' if len(unset) > _SHOWN else ''} (no reset_parameters() "
                         "of their modules sets them, and no init_fn given does). Pass init_fn= to parallelize (a "
                         "function that sets them, e.g. a Hugging Face model's _init_weights), or load them with "
                         "weights=.")


def _warn_unseen(module: nn.Module, own: dict[nn.Module, list[tuple[str, torch.Tensor]]],
                 why: Unrebuildable) -> None:
    """What partita cannot see when it cannot build the model again: what the modules without
    reset_parameters() drew in __init__ (taken to be what init_fn draws), and the parents whose __init__ draws or
    writes their children's tensors again (found by the names their code calls)."""
    unseen = [_shown_name(module, n) for n, m in module.named_modules()
              if own.get(m) and not callable(getattr(m, "reset_parameters", None))]
    rewriting = {_shown_name(module, n): calls for n, m in module.named_modules() if (calls := _rewriting_calls(m))}
    if not unseen and not rewriting:
        return
    ifs = []
    if rewriting:
        ifs.append("the __init__ of " + ", ".join(f"{n} (calling {', '.join(sorted(c))})"
                                                  for n, c in list(rewriting.items())[:_SHOWN])
                   + " draws or writes its submodules' tensors again after building them")
    if unseen:
        ifs.append(f"{', '.join(unseen[:_SHOWN])}{' ...' if len(unseen) > _SHOWN else ''} (without "
                   "reset_parameters(), taken to draw in __init__ as init_fn does) drew otherwise (torch.empty draws "
                   "nothing)")
    warnings.warn(
        f"partita cannot build {type(module).__name__} again on the meta device to see what building it did "
        f"({why.reason}). It initializes each module by its reset_parameters() and init_fn, so the model starts from "
        f"other values than the model built on the CPU if {', or if '.join(ifs)}. Keep the model's constructor "
        "arguments as attributes of the same names, load its values with weights=, or build it on the CPU.",
        stacklevel=3)


def _shown_name(module: nn.Module, name: str) -> str:
    return f"'{name or '(the model)'}' ({type(module.get_submodule(name)).__name__})"


# what an __init__ calls to draw or write tensors after building them (nanoGPT's self.apply(self._init_weights))
_REWRITING_CALLS = frozenset({"apply", "normal_", "uniform_", "zero_", "zeros_", "fill_", "ones_", "constant_",
                              "copy_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                              "kaiming_normal_", "orthogonal_", "_init_weights", "init_weights"})


def _rewriting_calls(m: nn.Module) -> set[str]:
    """Of _REWRITING_CALLS, those the __init__ of `m`'s classes (not torch's own) names, when `m` has children."""
    if next(m.children(), None) is None:
        return set()
    inits = [vars(c)["__init__"] for c in type(m).__mro__
             if "__init__" in vars(c) and not c.__module__.startswith("torch.")]
    return set().union(*(_names_in(f.__code__) for f in inits if hasattr(f, "__code__"))) & _REWRITING_CALLS


def _names_in(code: types.CodeType) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' (comprehensions) included."""
    return set(code.co_names).union(*(_names_in(c) for c in code.co_consts if isinstance(c, types.CodeType)))


# in-place ops whose result does not depend on what the tensor they write held
_OVERWRITES = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "exponential_", "bernoulli_",
                         "cauchy_", "log_normal_", "geometric_"})
_ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})


class _CannotReplay(Exception):
    pass


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _op_name(op: Op) -> str:
    return op.func._schema.name.split("::")[-1]


def _whole(t: torch.Tensor) -> bool:
    """Whether `t` covers its storage."""
    return t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _reads(ops: tuple[Op, ...]) -> list[set[StorageWeakRef]]:
    """Per op, the meta storages whose values it reads: every one among its arguments, except the tensor an
    in-place overwrite writes whole."""
    def storages(tree) -> set[StorageWeakRef]:
        return {_storage(t) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_meta}

    return [storages((op.args[1:], op.kwargs)) if _op_name(op) in _OVERWRITES and op.args and _whole(op.args[0])
            else storages((op.args, op.kwargs)) for op in ops]


def _replay(built: Construction, meta: list[_Place], keep: set[str]) -> set[int]:
    """Run the ops building the model made, on the CPU, in their order, from the random stream as it is: the
    meta places get the values they end with; those this rank does not keep live only from an op that makes or
    reads them to the last op that reads them before another overwrites them. The ids of the tensors dropped
    with a value some op had set."""
    final = {id(p): built.tensors[p.names[0]] for p in meta}
    kept_storages = {_storage(final[id(p)]) for p in meta if keep.intersection(p.names)}
    places_in = {}
    for p in meta:
        places_in.setdefault(_storage(final[id(p)]), []).append(p)
    ops = built.ops
    reads = _reads(ops)
    touched = [{_storage(t) for t in pytree.tree_leaves((op.args, op.kwargs, op.out))
                if isinstance(t, torch.Tensor) and t.is_meta} for op in ops]
    # after each op, the storages touched there whose values no later op reads before overwriting them whole
    needed: set[StorageWeakRef] = set(kept_storages)
    done_after: list[set[StorageWeakRef]] = [set()] * len(ops)
    for i in reversed(range(len(ops))):
        done_after[i] = touched[i] - needed
        needed = (needed - touched[i]) | reads[i] | kept_storages
    bases: dict[StorageWeakRef, torch.Tensor] = {}
    was_set: set[int] = set()

    def real(t):
        if isinstance(t, torch.device):
            return _cpu_for_meta(t)
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        base = bases.get(_storage(t))
        if base is None:  # made before: a value an overwrite replaces whole
            base = bases[_storage(t)] = _unset(torch.empty(t.untyped_storage().nbytes() // t.element_size(),
                                                            dtype=t.dtype, device="meta"))
        if base.dtype != t.dtype:
            base = base.view(t.dtype)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    def drop(s: StorageWeakRef) -> None:
        for p in places_in.get(s, []):
            if not _is_unset(real(final[id(p)])):
                was_set.add(id(p.tensor))
        del bases[s]

    with torch.no_grad():
        for i, op in enumerate(ops):
            if reads[i] - bases.keys():
                raise _CannotReplay(f"{op.func} reads a meta tensor the constructor did not make")
            args, kwargs = pytree.tree_map(real, (op.args, op.kwargs))
            try:
                out = op.func(*args, **kwargs)
            except Exception as e:  # an op of the constructor's that runs on meta tensors only
                raise _CannotReplay(f"{op.func} fails on the CPU ({type(e).__name__}: {e})") from e
            if _op_name(op) in _ALLOCATIONS:
                out.copy_(_unset(out))
            for probe, value in zip(pytree.tree_leaves(op.out), pytree.tree_leaves(out)):
                if isinstance(probe, torch.Tensor) and probe.is_meta and _storage(probe) not in bases:
                    if (value.stride(), value.storage_offset()) != (probe.stride(), probe.storage_offset()):
                        raise _CannotReplay(f"{op.func} lays its result out otherwise on the CPU")
                    bases[_storage(probe)] = torch.empty(0, dtype=value.dtype).set_(value.untyped_storage())
            for s in done_after[i]:
                if s in bases:
                    drop(s)
    for p in meta:
        constant = not final[id(p)].is_meta  # computed on the CPU from constants
        if constant:
            was_set.add(id(p.tensor))
        if keep.intersection(p.names):
            value = real(final[id(p)])
            p.value = value if _whole(value) and not constant else value.clone()
    return was_set


@dataclass(frozen=True)
class _Step:
    """One initialization that building the model ran: `init(module)`. It sets the module's own tensors in
    `writes` (ids; the others it may touch are scratch) and may write tensors of other modules too (a parent's
    init its children's, as Hugging Face's do)."""

    module: nn.Module
    init: InitFn
    writes: frozenset[int]


def _steps(module: nn.Module, own: dict[nn.Module, list[tuple[str, torch.Tensor]]],
           init_fn: InitFn | None) -> list[_Step]:
    """The initializations building `module` on the CPU ran, in their order.

    Building: each module's reset_parameters() in module order (parents before children, the order they are
    built in); a module without one is taken to have initialized its tensors in __init__ as `init_fn` does
    (Hugging Face's Conv1D draws its weight there, as _init_weights does again). A tied weight takes the
    initialization of the first module that holds it; the later ones run on scratch copies, as building them
    did before they were tied.

    Then `init_fn` on every module as model.apply(init_fn) runs it (children before parents, in their order),
    on the model as it is: a tied weight takes the last write. But when `init_fn` is a Hugging Face model's
    _init_weights, the model is initialized as Hugging Face builds it: each PreTrainedModel, once its
    submodules are built, runs its own _init_weights on each of its modules that no model nested in it
    initialized already, children first (post_init, smart_apply), and ties weights only afterwards."""
    first_holder: dict[int, nn.Module] = {}
    for m, tensors in own.items():
        for _, t in tensors:
            first_holder.setdefault(id(t), m)

    def held_first(m: nn.Module) -> frozenset[int]:
        return frozenset(id(t) for _, t in own[m] if first_holder[id(t)] is m)

    hugging_face = _hugging_face_model_class(init_fn)
    steps: list[_Step] = []
    built: set[nn.Module] = set()
    initialized: set[nn.Module] = set()

    def build(m: nn.Module, init: InitFn | None) -> None:
        if m in built:  # a module registered twice was built once
            return
        built.add(m)
        post_init = hugging_face is not None and isinstance(m, hugging_face)
        if post_init:
            init = m._init_weights
        if own[m] and callable(getattr(m, "reset_parameters", None)):
            steps.append(_Step(m, type(m).reset_parameters, held_first(m)))
        elif own[m] and init is not None:
            steps.append(_Step(m, init, held_first(m)))
        for child in m.children():
            build(child, init)
        if post_init:
            for d in _applied(m):
                if d not in initialized:
                    initialized.add(d)
                    steps.append(_Step(d, m._init_weights, held_first(d)))

    build(module, init_fn)
    if init_fn is not None and hugging_face is None:
        steps += [_Step(m, init_fn, frozenset(id(t) for _, t in own[m])) for m in _applied(module)]
    return steps


def _applied(module: nn.Module) -> Iterable[nn.Module]:
    """The modules in the order module.apply(fn) calls fn on them."""
    for child in module.children():
        yield from _applied(child)
    yield module


def _hugging_face_model_class(init_fn: InitFn | None) -> type | None:
    """transformers' PreTrainedModel when `init_fn` is the _init_weights of one (transformers is imported then)."""
    owner = getattr(init_fn, "__self__", None)
    transformers = sys.modules.get("transformers")
    if owner is None or transformers is None or getattr(init_fn, "__name__", None) != "_init_weights":
        return None
    return transformers.PreTrainedModel if isinstance(owner, transformers.PreTrainedModel) else None


def _run_init(step: _Step, tensors: list[tuple[str, torch.Tensor]], placed: dict[int, _Place],
              others: _OthersMadeReal) -> list[_Place]:
    """Run `step` with its module's meta tensors made real on the CPU: those it writes hold their value so far
    (first: an unset value, so that a tensor no initialization writes is found), the others scratch; the meta
    tensors of other modules it touches are made real as it touches them. The places whose values are real
    now."""
    m = step.module
    made_real = {}
    for attr, t in tensors:
        if id(t) not in step.writes:
            setattr(m, attr, _like(t, torch.empty(t.shape, dtype=t.dtype)))
            continue
        p = placed[id(t)]
        if p.value is None:
            p.value = _unset(t)
        setattr(m, attr, _like(t, p.value))
        made_real[id(t)] = p
    with torch.no_grad(), others:
        step.init(m)
    for attr, t in tensors:
        if id(t) in step.writes:
            # the module may have replaced the tensor instead of writing into it
            placed[id(t)].value = getattr(m, attr).detach()
        setattr(m, attr, t)
    return [*made_real.values(), *(p for p in others.take_touched() if id(p.tensor) not in made_real)]


class _OthersMadeReal(TorchDispatchMode):
    """While an initialization runs, any meta tensor of the model it touches besides its module's own (a parent's
    init writing its child's weight) is replaced by its real value on the CPU, a view of it for a view, made
    when first touched. So an init writes the tensors it writes, as on the CPU, and draws from the random
    stream as there, yet only the tensors it touches become real: a rank never holds the whole model because a
    parent's init could write all of it. Tensors are found by their storage, which their views share."""

    def __init__(self, meta: list[_Place]):
        super().__init__()
        self._by_storage = {StorageWeakRef(p.tensor.untyped_storage()): p for p in meta}
        self._touched: dict[int, _Place] = {}

    def take_touched(self) -> list[_Place]:
        """The places made real since the last call."""
        touched, self._touched = list(self._touched.values()), {}
        return touched

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(torch.Tensor, self._real, (args, kwargs or {}))
        # a tensor made on a meta tensor's .device (Mamba's init_mamba_weights) is made where the init runs
        args, kwargs = pytree.tree_map_only(torch.device, _cpu_for_meta, (args, kwargs))
        return func(*args, **kwargs)

    def _real(self, t: torch.Tensor) -> torch.Tensor:
        p = self._by_storage.get(StorageWeakRef(t.untyped_storage())) if t.is_meta else None
        if p is None:
            return t
        if p.value is None:
            p.value = _unset(p.tensor)
        self._touched[id(p.tensor)] = p
        base, value = p.tensor, p.value
        if (t.shape, t.stride(), t.storage_offset()) == (base.shape, base.stride(), base.storage_offset()):
            return value
        if value.stride() != base.stride():
            raise ModelError(f"an initialization wrote part of '{p.names[0]}' through a view, and its value is laid "
                             "out unlike the tensor: partita cannot find that part.")
        return value.as_strided(t.shape, t.stride(), value.storage_offset() + t.storage_offset()
                                - base.storage_offset())


def _cpu_for_meta(device: torch.device) -> torch.device:
    return torch.device("cpu") if device.type == "meta" else device


def _unset(t: torch.Tensor) -> torch.Tensor:
    """A value no initialization writes: NaN, or the lowest integer."""
    if t.is_floating_point() or t.is_complex():
        return torch.full(t.shape, float("nan"), dtype=t.dtype)
    if t.dtype == torch.bool:
        return torch.zeros(t.shape, dtype=t.dtype)
    return torch.full(t.shape, torch.iinfo(t.dtype).min, dtype=t.dtype)


def _is_unset(value: torch.Tensor) -> bool:
    if not value.numel() or value.dtype == torch.bool:
        return False
    if value.is_floating_point() or value.is_complex():
        return bool(value.isnan().all())
    return bool((value == torch.iinfo(value.dtype).min).all())


def _check_initializable(module: nn.Module, to_init: list[nn.Module], init_fn: InitFn | None) -> None:
    if init_fn is not None:
        return
    ids = {id(m) for m in to_init}
    cannot = [name for name, m in module.named_modules() if id(m) in ids
              and not callable(getattr(m, "reset_parameters", None))]
    if cannot:
        shown = ", ".join(f"'{n or '(the model)'}' ({type(module.get_submodule(n)).__name__})" for n in cannot[:_SHOWN])
        raise ModelError(f"the model is on the meta device, and {len(cannot)} of its modules with parameters or "
                         f"buffers have no reset_parameters() to initialize them: {shown}"
                         f"{' ...' if len(cannot) > _SHOWN else ''}. Pass init_fn= to parallelize (a function "
                         "applied to each module, e.g. a Hugging Face model's _init_weights), or give those "
                         "modules a reset_parameters().")


def _rank0_random_state(mine: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's random state when parallelize was called (this rank's own where there is no other)."""
    state = [mine if mine is not None else torch.get_rng_state()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(state, src=0)
    return state[0]
