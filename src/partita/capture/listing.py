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

import dataclasses
import hashlib
from dataclasses import dataclass

import torch
from torch import fx

from partita.capture.export import CapturedGraph
from partita.capture.shapes import concrete


def shape_text(val) -> str:
    """A value's dtype and shape at batch 1 and 2 (the batch is symbolic in a capture); its type otherwise."""
    if isinstance(val, (list, tuple)):
        return f"({','.join(shape_text(v) for v in val)})"
    if not isinstance(val, torch.Tensor):
        return type(val).__name__
    return f"{val.dtype}{[concrete(d, 1, True) for d in val.shape]}{[concrete(d, 2, True) for d in val.shape]}"


def _argument(a, name) -> str:
    """An argument as text; a node as `name(node)` says."""
    if isinstance(a, fx.Node):
        return name(a)
    if isinstance(a, tuple):
        return f"({', '.join(_argument(x, name) for x in a)})"
    if isinstance(a, list):
        return f"[{', '.join(_argument(x, name) for x in a)}]"
    if isinstance(a, dict):
        return f"{{{', '.join(f'{k!r}: {_argument(v, name)}' for k, v in a.items())}}}"
    if isinstance(a, torch.device):
        return repr(torch.device(a.type))
    return repr(a)


def _call_text(node: fx.Node, name) -> str:
    positional = ", ".join(_argument(a, name) for a in node.args)
    named = "".join(f", {k}={_argument(v, name)}" for k, v in node.kwargs.items())
    return f"{node.op} {node.target}({positional}{named})"


def module_of(node: fx.Node) -> str:
    """The user's module a node belongs to ("" for the root module)."""
    stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values() if not path.startswith("_empty")]
    if not stack:
        return ""
    path = stack[-1]
    return path[len("model."):] if path.startswith("model.") else ("" if path == "model" else path)


def _subgraph(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The subgraph (of a higher-order operation: autocast, no_grad) that a get_attr node names, if it names one."""
    sub = getattr(gm, node.target, None) if node.op == "get_attr" else None
    return sub if isinstance(sub, fx.GraphModule) else None


def node_lines(gm: fx.GraphModule, prefix: str = "") -> list[str]:
    """One line per node of `gm`, in order; a subgraph's lines follow the node that names it, indented."""
    out = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        result = shape_text(val) if val is not None else "?"
        module = module_of(node)
        sub = _subgraph(gm, node)
        # a subgraph's attribute is numbered in the order of capture: it is known by its lines
        call = "get_attr <subgraph>" if sub is not None else _call_text(node, lambda a: a.name)
        out.append(f"{prefix}{node.name} = {call} -> {result}" + (f" in {module}" if module else ""))
        if sub is not None:
            out += node_lines(sub, prefix + "  ")
    return out


def node_keys(gm: fx.GraphModule) -> list[str]:
    """Per node, in order, a key of what it computes whatever the graph's order and names: its operation and
    module, with each node argument replaced by that node's key (placeholders and attributes by name, which
    the model's structure fixes). Two captures of the same computation in another order have the same keys."""
    key_of: dict[str, str] = {}
    for node in gm.graph.nodes:
        sub = _subgraph(gm, node)
        if sub is not None:  # numbered in the order of capture (submod_1, ...): known by what it computes
            text = f"subgraph {' '.join(node_keys(sub))}"
        elif node.op in ("placeholder", "get_attr"):
            text = f"{node.op} {node.target}"
        else:
            text = f"{_call_text(node, lambda a: key_of[a.name])} in {module_of(node)}"
        key_of[node.name] = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]
    return list(key_of.values())


@dataclass(frozen=True)
class Order:
    """A capture's nodes in order, as another rank needs them to rebuild its own capture so: what each computes
    (`node_keys`), its name, and the names of the nodes it reads, in the order torch.fx.map_arg visits them."""

    keys: tuple[str, ...]
    names: tuple[str, ...]
    inputs: tuple[tuple[str, ...], ...]

    @staticmethod
    def of(gm: fx.GraphModule) -> Order:
        def read(node: fx.Node) -> tuple[str, ...]:
            names: list[str] = []
            fx.map_arg((node.args, node.kwargs), lambda a: names.append(a.name))
            return tuple(names)

        nodes = list(gm.graph.nodes)
        return Order(tuple(node_keys(gm)), tuple(n.name for n in nodes), tuple(read(n) for n in nodes))


def in_order_of(gm: fx.GraphModule, order: Order) -> tuple[fx.GraphModule, dict[str, str]] | None:
    """`gm`'s graph rebuilt in another capture's order and names, with the map of this graph's node names to the
    new ones; None where the two do not compute the same nodes. Nodes with one key compute the same (the same
    operation on equal inputs, as `position_ids.float()` once per kind of layer), so each new node reads the
    nodes the other capture's reads, by their names."""
    if sorted(node_keys(gm)) != sorted(order.keys):
        return None
    waiting: dict[str, list[fx.Node]] = {}
    for node, key in zip(gm.graph.nodes, node_keys(gm)):
        waiting.setdefault(key, []).append(node)
    graph = fx.Graph()
    made: dict[str, fx.Node] = {}
    renamed: dict[str, str] = {}
    for key, name, inputs in zip(order.keys, order.names, order.inputs):
        node = waiting[key].pop(0)
        read = iter(inputs)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: made[next(read)])
        new = graph.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
        new.meta = dict(node.meta)
        made[name], renamed[node.name] = new, name
    if tuple(n.name for n in graph.nodes) != order.names:
        return None
    return fx.GraphModule(gm, graph), renamed


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


def hash_seeds_text(seeds: list[str | None]) -> str:
    """Each rank's hash seed (its PYTHONHASHSEED, or None), in words."""
    return "; ".join(f"rank {r} runs with {hash_seed_text(seed)}" for r, seed in enumerate(seeds))


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
    started = hash_seeds_text([seed for seed, _ in every])
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


def reordered(cap: CapturedGraph, order: Order) -> CapturedGraph | None:
    """`cap` in another capture's order and names (see `in_order_of`), every name it records renamed; None where
    the two do not compute the same nodes."""
    rebuilt = in_order_of(cap.gm, order)
    if rebuilt is None:
        return None
    gm, renamed = rebuilt
    # the model's outputs and buffer updates are what the output node returns, at the same places
    returned: dict[str, fx.Node] = {}
    for old, new in zip(_returned(cap.gm), _returned(gm)):
        if isinstance(old, fx.Node):
            returned.setdefault(old.name, new)
    return dataclasses.replace(
        cap, gm=gm,
        user_inputs=[renamed[n] for n in cap.user_inputs],
        constants={renamed[n]: t for n, t in cap.constants.items()},
        fqn_of={renamed[n]: fqn for n, fqn in cap.fqn_of.items()},
        parameters={renamed[n] for n in cap.parameters},
        outputs=[returned[o.name] if isinstance(o, fx.Node) else o for o in cap.outputs],
        buffer_updates=[(returned[v].name, renamed[b]) for v, b in cap.buffer_updates],
        requires_grad={renamed[n]: flag for n, flag in cap.requires_grad.items()})


def _returned(gm: fx.GraphModule) -> list:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
