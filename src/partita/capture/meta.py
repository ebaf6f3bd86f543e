"""Models built on the meta device, for planning hardware you don't have: no memory, no compute.

`meta_graph("pkg.module:factory", ["5000", "128:int64"])` imports the factory (a module name or a .py
path), builds the model under `torch.device("meta")`, captures it with one meta tensor per input (each
`--input` describes one sample of one positional input: a shape, and optionally a dtype), and counts its
blocks. The counted graph is cached on disk, keyed by the factory's source file, the inputs and torch's
version, so a second plan of the same model skips building and capturing it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import torch

from partita.capture.model_graph import model_graph
from partita.capture.export import capture
from partita.errors import CaptureError
from partita.graph import ModelGraph
from partita.graph.graph import Block, Fit
from partita import cache

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
           "bool": torch.bool}


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """'5000' -> ((5000,), float32); '128:int64' -> ((128,), int64); '3x224x224' -> ((3, 224, 224), float32)."""
    shape_text, _, dtype_text = text.partition(":")
    try:
        shape = tuple(int(d) for d in shape_text.lower().split("x")) if shape_text else ()
    except ValueError:
        raise CaptureError(f"cannot read input {text!r}: write one sample's shape like 5000, 3x224x224 or 128:int64")
    if dtype_text and dtype_text not in _DTYPES:
        raise CaptureError(f"unknown dtype {dtype_text!r} in --input {text}; use one of {', '.join(_DTYPES)}")
    return shape, _DTYPES[dtype_text or "float32"]


def load_factory(target: str):
    """'module:callable' or 'path/to/file.py:callable' -> (the callable, the file that defines it)."""
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise CaptureError(f"{target!r}: write MODULE:FACTORY, e.g. mypkg.models:build or model.py:make_model")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.exists():
            raise CaptureError(f"no such file: {module_name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent))
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise CaptureError(f"cannot import {module_name}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CaptureError(f"{module_name} has no callable {attr!r}")
    return factory, Path(getattr(module, "__file__", module_name))


# what _graph_to_json writes (2: the outputs' bytes, 3: the whole graph's digest); part of the cache key
_GRAPH_FORMAT = 3


def _graph_to_json(graph: ModelGraph) -> str:
    data = {"blocks": [{**b.__dict__, "fwd_flops": b.fwd_flops.lines, "fwd_bytes": b.fwd_bytes.lines,
                        "activation_bytes": b.activation_bytes.lines} for b in graph.blocks],
            "param_bytes": graph.param_bytes, "boundary_bytes": [f.lines for f in graph.boundary_bytes],
            "input_bytes": graph.input_bytes.lines, "fingerprint": graph.fingerprint,
            "output_bytes": graph.output_bytes.lines, "digest": graph.digest}
    return json.dumps(data)


def _graph_from_json(text: str) -> ModelGraph:
    data = json.loads(text)
    fit = lambda lines: Fit(tuple(tuple(x) for x in lines))  # noqa: E731
    blocks = tuple(Block(**{**b, "units": tuple(b["units"]), "params": tuple(b["params"]),
                            "fwd_flops": fit(b["fwd_flops"]), "fwd_bytes": fit(b["fwd_bytes"]),
                            "activation_bytes": fit(b["activation_bytes"])}) for b in data["blocks"])
    return ModelGraph(blocks, data["param_bytes"], tuple(fit(f) for f in data["boundary_bytes"]),
                      fit(data["input_bytes"]), data["fingerprint"], fit(data["output_bytes"]), data["digest"])


def meta_graph(target: str, inputs: list[str], dtype: str = "float32") -> tuple[ModelGraph, bool]:
    """The counted graph of the factory's model with its floating-point weights in `dtype`, and whether it
    came from the cache."""
    factory, source = load_factory(target)
    try:
        text = source.read_text()
    except OSError:
        text = target
    name = cache.key(_GRAPH_FORMAT, hashlib.sha256(text.encode()).hexdigest(), target, inputs, dtype,
                     torch.__version__)
    cached = cache.load("graph", name)
    if cached is not None:
        return _graph_from_json(cached), True
    specs = [parse_input(i) for i in inputs]
    weights = _DTYPES[dtype]
    with torch.device("meta"):
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise CaptureError(f"{target} returned {type(model).__name__}, not an nn.Module")
        model = model.to(weights)
        args = tuple(torch.empty((2, *shape), dtype=weights if t.is_floating_point else t) if t.is_floating_point
                     else torch.zeros((2, *shape), dtype=t) for shape, t in specs)
    graph = model_graph(capture(model.train(), args, {}, source_lines=False))
    cache.store("graph", name, _graph_to_json(graph))
    return graph, False
