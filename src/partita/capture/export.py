"""Capture an unmodified module's graph with torch.export (non-strict).

The user's call `model(*args, **kwargs)` is flattened: tensors become the graph's inputs (their dim 0 is the
batch, captured as a dynamic dimension), everything else (numbers, None, strings) is a constant of the
capture, so a call with other constants is captured again. The result keeps the lifted graph, with
parameters and buffers as placeholders mapped to their original names, so the splitter can hand each stage
exactly the tensors it uses, the same tensor objects the user's model and optimizer hold.

Capture never reads a weight: it traces with fake stand-ins for the model's parameters and buffers (their
shapes and dtypes, on the device the model computes on). So a model built on the meta device, or one whose
weights this rank freed because other ranks hold them, captures as a model with real weights does, and
device constants in the graph (`torch.arange(n, device=x.device)`) name the real device.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx import config as fx_config
from torch.export import Dim, export
from torch.export.graph_signature import InputKind, OutputKind
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from partita.capture.shapes import meta_like, shape_at, value_dependent
from partita.errors import BatchError, CaptureError

_ROOT = "model"  # name of the user's module inside the flattening wrapper


@dataclass(frozen=True)
class CallSignature:
    """How one call's (args, kwargs) map to flat tensors, and what must match for a capture to be reused."""

    in_spec: pytree.TreeSpec
    constants: tuple[Any, ...]  # per leaf: _TENSOR or the constant value
    tensor_meta: tuple[tuple[int, torch.dtype, bool], ...]  # per tensor: (ndim, dtype, requires_grad)

    @property
    def key(self) -> tuple:
        return (str(self.in_spec), tuple(map(repr, self.constants)), self.tensor_meta)

    def unflatten(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        return pytree.tree_unflatten(leaves, self.in_spec)


@dataclass(frozen=True)
class Modes:
    """The train/eval mode of every module of a model at a call, which decides what its capture computes
    (dropout, BatchNorm's statistics): the model's own flag, and the modules whose flag differs from it (a
    frozen BatchNorm in a training model), by their place in `model.modules()`. A key, cheap to take per call:
    where the model's mode is every module's, it holds a bool and an empty tuple."""

    training: bool
    differing: tuple[int, ...] = ()

    @staticmethod
    def of(modules: list[nn.Module]) -> Modes:
        """`modules`: the model's `modules()`, listed once (walking them again per call costs more)."""
        top = modules[0].training
        return Modes(top, tuple(i for i, m in enumerate(modules) if m.training != top))


class _TensorSlot:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], CallSignature]:
    """Split a call into its tensors (batched along dim 0) and a signature that describes the rest."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise BatchError(
                f"input tensor #{i} is a 0-dim tensor; partita splits every tensor input along dim 0 "
                "(the batch). Pass a Python number instead, or give the tensor a batch dimension."
            )
    constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    meta = tuple((t.dim(), t.dtype, t.requires_grad) for t in tensors)
    return tensors, CallSignature(spec, constants, meta)


class _FlatCall(nn.Module):
    """Calls the user's module from flat tensors, so every tensor can be given a dynamic batch dim."""

    def __init__(self, model: nn.Module, signature: CallSignature):
        super().__init__()
        setattr(self, _ROOT, model)
        self.signature = signature

    def forward(self, *tensors):
        args, kwargs = self.signature.unflatten(list(tensors))
        return getattr(self, _ROOT)(*args, **kwargs)


@dataclass
class CapturedGraph:
    """The graph of the user's model in one set of modes, with parameters and buffers lifted to named inputs."""

    gm: fx.GraphModule
    modes: Modes  # every module's train/eval mode as captured
    signature: CallSignature
    user_inputs: list[str]  # placeholder names of the call's tensors, in flat order
    module: nn.Module  # the user's model, which holds the parameters and buffers
    constants: dict[str, torch.Tensor]  # placeholder name -> a tensor the model keeps outside its state
    fqn_of: dict[str, str]  # placeholder name -> original FQN (parameters and buffers)
    parameters: set[str]  # placeholder names that are parameters
    outputs: list[Any]  # user output leaves: fx.Node or a constant, in out_spec order
    out_spec: pytree.TreeSpec
    # the call's tensors the graph was traced with (the user's own, at least 2 rows): real values to measure on
    examples: list[torch.Tensor]
    buffer_updates: list[tuple[str, str]] = field(default_factory=list)  # (value node, buffer placeholder)
    requires_grad: dict[str, bool] = field(default_factory=dict)  # node name -> its tensor needs a gradient

    def node(self, name: str) -> fx.Node:
        return _node_index(self.gm)[name]

    def holds(self, name: str) -> bool:
        """Whether placeholder `name` is a tensor of the model (parameter, buffer or constant), not an input."""
        return name in self.fqn_of or name in self.constants

    def tensor(self, name: str) -> torch.Tensor:
        """The model's tensor behind placeholder `name`, as the model holds it now: looked up by name, since a
        rank materializes, frees or replaces its weights after capturing."""
        if name in self.constants:
            return self.constants[name]
        fqn = self.fqn_of[name]
        return self.module.get_parameter(fqn) if name in self.parameters else self.module.get_buffer(fqn)

    def routes_by_value(self) -> bool:
        """Whether a size depends on tensor values (the tokens routed to each expert of a mixture of experts).
        Eager code may then skip what a step does not reach (an expert without tokens), which export cannot
        capture: its parameters get no gradient on a rank, though the graph reads them."""
        return any(value_dependent(n.meta.get("val")) for n in self.gm.graph.nodes)


_NODE_INDEX: dict[int, dict[str, fx.Node]] = {}


def _node_index(gm: fx.GraphModule) -> dict[str, fx.Node]:
    key = id(gm.graph)
    if key not in _NODE_INDEX:
        _NODE_INDEX[key] = {n.name: n for n in gm.graph.nodes}
    return _NODE_INDEX[key]


def _strip(fqn: str) -> str:
    return fqn[len(_ROOT) + 1:] if fqn.startswith(_ROOT + ".") else fqn


def _example_inputs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inputs for tracing with a batch of at least 2, so that export keeps the batch dim symbolic."""
    out = []
    for t in tensors:
        if t.shape[0] == 1:
            t = t.expand(2, *t.shape[1:]).contiguous()
        elif t.shape[0] == 0:
            t = t.new_zeros((2, *t.shape[1:]))
        out.append(t)
    return out


def capture(model: nn.Module, args: tuple, kwargs: dict, *, source_lines: bool = True) -> CapturedGraph:
    """Capture `model(*args, **kwargs)` in the current train/eval mode of each of the model's modules.

    With `source_lines` each graph node records the user's line that made it, which the generated code of a
    stage shows in a traceback when it fails; a capture only counted for planning skips it (it is a tenth of
    torch.export's time on GPT-3's 96 layers).
    """
    tensors, signature = flatten_call(args, kwargs)
    wrapper = _FlatCall(model, signature)
    examples = _example_inputs(tensors)
    dynamic = (tuple({0: Dim.AUTO} for _ in examples),)
    tracker = _ModuleTracker(model)
    device = examples[0].device if examples else torch.device("cpu")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with tracker, _reparametrize_module(wrapper, _stand_ins(wrapper, mode, device), tie_weights=True), \
                _stack_traces(source_lines):
            fakes = tuple(_fake(t, mode, t.device) for t in examples)
            ep = export(wrapper, fakes, dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # noqa: BLE001 - translated into an actionable CaptureError
        raise _capture_error(model, tracker, e) from e
    return _from_exported(ep, model, signature, examples)


@contextlib.contextmanager
def _stack_traces(recorded: bool):
    """torch.fx records the user's line on each node unless told not to; torch 2.11 has no such switch (2.12
    added `do_not_emit_stack_traces`) and always records them."""
    if recorded or not hasattr(fx_config, "do_not_emit_stack_traces"):
        yield
        return
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _fake(t: torch.Tensor, mode: FakeTensorMode, device: torch.device) -> torch.Tensor:
    """A tensor of `mode` shaped like `t` on `device`, whatever device `t` is on (meta included)."""
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return FakeTensor(mode, meta, device)


def _stand_ins(module: nn.Module, mode: FakeTensorMode, device: torch.device) -> dict[str, torch.Tensor]:
    """A fake stand-in for every parameter and buffer on `device`, where the rank will hold it, one per tensor
    object (tied weights stay tied)."""
    made: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if id(t) not in made:
            fake = _fake(t, mode, device)
            made[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
        out[name] = made[id(t)]
    return out


def _from_exported(ep, model: nn.Module, signature: CallSignature, examples: list[torch.Tensor]) -> CapturedGraph:
    gm = ep.graph_module
    constants: dict[str, torch.Tensor] = {}
    fqn_of: dict[str, str] = {}
    parameters: set[str] = set()
    user_inputs: list[str] = []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            user_inputs.append(name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            fqn_of[name] = _strip(spec.target)
            if spec.kind == InputKind.PARAMETER:
                parameters.add(name)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            constants[name] = ep.constants[spec.target]
        else:
            raise CaptureError(
                f"the captured graph has an input of kind {spec.kind.name} ({name}), which partita cannot "
                "place on a pipeline stage. Models with custom objects or effect tokens are not supported."
            )
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_args = list(out_node.args[0])
    outputs: list[Any] = []
    updates: list[tuple[str, str]] = []
    buffer_placeholder = {fqn: name for name, fqn in fqn_of.items() if name not in parameters}
    for spec, arg in zip(ep.graph_signature.output_specs, out_args):
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(arg)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            updates.append((arg.name, buffer_placeholder[_strip(spec.target)]))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            raise CaptureError(
                f"the model writes in place into its input '{spec.target}'. partita runs each stage on its "
                "own copy of the inputs, so the caller would not see that write. Clone the input inside "
                "forward() before changing it."
            )
        else:
            raise CaptureError(f"the captured graph has an output of kind {spec.kind.name}, not supported")
    cap = CapturedGraph(
        gm=gm, modes=Modes.of(list(model.modules())), signature=signature, user_inputs=user_inputs, module=model,
        constants=constants, fqn_of=fqn_of, parameters=parameters, outputs=outputs, out_spec=ep.call_spec.out_spec,
        examples=examples, buffer_updates=updates,
    )
    cap.requires_grad = _requires_grad(cap)
    return cap


def _requires_grad(cap: CapturedGraph) -> dict[str, bool]:
    """Which values autograd tracks, found by running the graph once on meta tensors.

    The exported graph's fake values do not record it, and pipeline stages must know it up front: only
    values that require grad get a gradient sent back.
    """
    flags = dict(zip(cap.user_inputs, (rg for _, _, rg in cap.signature.tensor_meta)))
    args = []
    for node in cap.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta["val"]
        t = torch.empty(shape_at(val, 2), dtype=val.dtype, device="meta")
        wanted = cap.tensor(node.name).requires_grad if cap.holds(node.name) else flags[node.name]
        args.append(t.requires_grad_(wanted) if t.is_floating_point() or t.is_complex() else t)
    out: dict[str, bool] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            try:
                with torch.enable_grad():  # per node: a failing op may not restore the grad mode it set
                    result = super().run_node(n)
            except Exception:  # noqa: BLE001 - an op without a meta kernel: any input needing grad -> float out does
                inputs = [a for a in pytree.tree_leaves((self.fetch_args_kwargs_from_env(n)))
                          if isinstance(a, torch.Tensor)]
                needs = any(a.requires_grad for a in inputs)
                result = pytree.tree_map(
                    lambda v: _meta_value(v, needs) if isinstance(v, torch.Tensor) else v, n.meta.get("val"))
            if isinstance(result, torch.Tensor):
                out[n.name] = result.requires_grad
            return result

    Recorder(cap.gm).run(*args)
    return out


def _meta_value(val: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    # only the flag matters here: a size that depends on tensor values (nonzero's, say) may be any size
    return meta_like(val, 2, requires_grad, estimate=True)


class _ModuleTracker:
    """Remembers which submodule was running when capture failed."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.stack: list[str] = []
        self.failed_in: list[str] | None = None
        self.handles: list = []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
            self.handles.append(mod.register_forward_hook(self._leave()))
        return self

    def _enter(self, name):
        def hook(mod, args):
            self.stack.append(name)
        return hook

    def _leave(self):
        def hook(mod, args, out):
            if self.stack:
                self.stack.pop()
        return hook

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and self.failed_in is None:
            self.failed_in = list(self.stack)
        for h in self.handles:
            h.remove()
        self.handles.clear()
        return False


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PARTITA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_line(exc: BaseException) -> tuple[str, int] | None:
    """(file, line) of the user's code that failed: from torch's own report in the message, else the traceback."""
    ours = (_TORCH_DIR, _PARTITA_DIR, "/site-packages/", "/lib/python3")
    reported = re.findall(r'File "([^"]+)", line (\d+)', str(exc))
    for filename, line in reversed(reported):
        if not any(s in filename for s in ours) and not filename.startswith("<"):
            return filename, int(line)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(s in f.filename for s in ours) and not f.filename.startswith("<")]
    return (frames[-1].filename, frames[-1].lineno) if frames else None


_HINTS = (
    ("data-dependent", "control flow or shapes depend on tensor values (e.g. `if x.sum() > 0` or "
     "`x[x > 0]`). Rewrite it with torch.where / torch.cond, or move it out of forward()."),
    ("DynamicCache", "the model returns a cache object; build it with use_cache=False for training."),
    ("Constraints violated", "the model fixes the batch size in its code (e.g. `x.view(64, -1)`). Use "
     "x.shape[0] or -1 for the batch dimension."),
    ("specialized", "the model fixes the batch size in its code (e.g. `x.view(64, -1)`). Use "
     "x.shape[0] or -1 for the batch dimension."),
    ("pytree", "the model takes or returns a custom class. Register it with "
     "torch.utils._pytree.register_pytree_node, or return tensors, tuples and dicts."),
)


def _capture_error(model: nn.Module, tracker: _ModuleTracker, e: BaseException) -> CaptureError:
    stack = tracker.failed_in or []
    where = stack[-1] if stack else ""
    mod = model.get_submodule(where) if where else model
    label = f"'{where}' ({type(mod).__name__})" if where else f"the root module ({type(mod).__name__})"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    found = _user_line(e)
    line = ""
    if found is not None:
        line = f" at {found[0]}:{found[1]}: `{linecache.getline(*found).strip()}`"
    text = str(e)
    hint = next((h for k, h in _HINTS if k in text), "simplify that line so torch.export can trace it, "
                "or report the model and this message.")
    return CaptureError(
        f"partita could not capture {type(model).__name__}: in module {label}{line}: "
        f"{type(e).__name__}: {first}. What to do: {hint}"
    )


def misplaced(tensors: list[torch.Tensor], device: torch.device) -> BatchError | None:
    """The error for the first input that is not on this rank's device, if any."""
    for i, t in enumerate(tensors):
        if t.device != device:
            return BatchError(
                f"input tensor #{i} (shape {tuple(t.shape)}) is on {t.device}, but this rank computes on "
                f"{device}. Move inputs with .to({str(device)!r}) before calling the model."
            )
    return None
