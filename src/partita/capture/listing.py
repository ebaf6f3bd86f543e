"""A captured graph as text, one line per node, and its digest: what every rank must have captured alike.

Two ranks that capture the same model must hold the same graph: the runtime exchanges values between them by
node name. A model whose Python control flow depends on the process (iterating over a `set` of strings, whose
order follows the interpreter's hash seed, PYTHONHASHSEED) captures the same operations in another order on
each rank, so one name stands for different values. The listing names everything a node computes: its place in
the order, its name, operation, target, arguments (other nodes by name, constants by value), the shapes and
dtypes of its result and the module it belongs to, recursively into the subgraphs of higher-order operations.
A device is named by its type: each rank computes on its own GPU.

>>> import torch
>>> from torch import fx
>>> gm = fx.symbolic_trace(torch.nn.Linear(2, 3))
>>> node_lines(gm)[3]
'linear = call_function <built-in function linear>(input_1, weight, bias) -> ?'
"""

from __future__ import annotations

import hashlib

import torch
from torch import fx

from partita.capture.shapes import concrete


def shape_text(val) -> str:
    """A value's dtype and shape at batch 1 and 2 (the batch is symbolic in a capture); its type otherwise."""
    if isinstance(val, (list, tuple)):
        return f"({','.join(shape_text(v) for v in val)})"
    if not isinstance(val, torch.Tensor):
        return type(val).__name__
    return f"{val.dtype}{[concrete(d, 1, True) for d in val.shape]}{[concrete(d, 2, True) for d in val.shape]}"


def _argument(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, tuple):
        return f"({', '.join(map(_argument, a))})"
    if isinstance(a, list):
        return f"[{', '.join(map(_argument, a))}]"
    if isinstance(a, dict):
        return f"{{{', '.join(f'{k!r}: {_argument(v)}' for k, v in a.items())}}}"
    if isinstance(a, torch.device):
        return repr(torch.device(a.type))
    return repr(a)


def module_of(node: fx.Node) -> str:
    """The user's module a node belongs to ("" for the root module)."""
    stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values() if not path.startswith("_empty")]
    if not stack:
        return ""
    path = stack[-1]
    return path[len("model."):] if path.startswith("model.") else ("" if path == "model" else path)


def node_lines(gm: fx.GraphModule, prefix: str = "") -> list[str]:
    """One line per node of `gm`, in order; a subgraph's lines follow the node that names it, indented."""
    out = []
    for node in gm.graph.nodes:
        positional = ", ".join(map(_argument, node.args))
        named = "".join(f", {k}={_argument(v)}" for k, v in node.kwargs.items())
        val = node.meta.get("val")
        result = shape_text(val) if val is not None else "?"
        module = module_of(node)
        out.append(f"{prefix}{node.name} = {node.op} {node.target}({positional}{named}) -> {result}"
                   + (f" in {module}" if module else ""))
        sub = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            out += node_lines(sub, prefix + "  ")
    return out


def digest(lines: list[str]) -> str:
    """The digest of a listing: equal for equal graphs, different for any difference of one line."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def first_difference(mine: list[str], theirs: list[str]) -> tuple[int, str, str]:
    """Where two listings first differ: (the line's index, this one's line, the other's; "" past the end)."""
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else ""
        b = theirs[i] if i < len(theirs) else ""
        if a != b:
            return i, a, b
    return -1, "", ""


def hash_seed_text(seed: str | None) -> str:
    """How a process hashes strings, as its PYTHONHASHSEED (None: not set) says."""
    if seed is None or seed == "random":
        return "no PYTHONHASHSEED (a random hash seed of its own)"
    return f"PYTHONHASHSEED={seed}"


def different_graphs(every: list[tuple[str | None, list[str]]]) -> str:
    """What differs between the ranks' captures, given each rank's (PYTHONHASHSEED, listing), and what to do;
    the same text on every rank."""
    groups: dict[str, list[int]] = {}
    for rank, (_, lines) in enumerate(every):
        groups.setdefault(digest(lines), []).append(rank)
    seeds = {seed for seed, _ in every}
    reference = every[0][1]
    found = []
    for ranks in groups.values():
        if ranks[0] == 0:
            continue
        index, mine, theirs = first_difference(every[ranks[0]][1], reference)
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        found.append(f"{who} captured a graph that first differs from rank 0's at operation {index}: rank 0 has "
                     f"`{theirs or '(nothing: its graph ends)'}`, {who} `{mine or '(nothing: its graph ends)'}`")
    started = "; ".join(f"rank {r} runs with {hash_seed_text(seed)}" for r, (seed, _) in enumerate(every))
    cause = ("Likely cause: Python code of the model whose order depends on the process, such as a loop over a "
             "set of strings (`for kind in set(config.layer_types)` in Hugging Face's Gemma 3), whose order follows "
             "each process's hash seed: ")
    cause += (f"{started}, so the ranks iterate in different orders. " if len(seeds) > 1 or None in seeds
              or "random" in seeds else f"{started}, so the cause is elsewhere: the environment, the rank, or "
              "different models or inputs. ")
    return (f"the ranks captured different graphs of the model: {'; '.join(found)}. The same operation names would "
            f"stand for different values on different ranks, and training would be silently wrong. {cause}Fix: "
            "start every rank with the same PYTHONHASHSEED (`partita run` sets PYTHONHASHSEED=0 for every rank "
            "unless it is set; with torchrun, srun or mpirun export PYTHONHASHSEED=0 before launching), or make the "
            "model's forward independent of the process (`sorted(set(...))`), and build the same model on every "
            "rank.")
