"""A private name (`_name`) of partita is used only in the module that defines it.

Three uses count, anywhere in src/partita (inside functions too):
- `from partita.x import _name` (or a relative import) in another module;
- `x._name` where `x` is a partita module imported here (`from partita.x import x`, `import partita.x as x`,
  `partita.x._name`);
- `obj._name` where no class or module-level code of this module defines `_name` (a `def`, class attribute,
  module-level assignment, or `something._name = ...`) and another partita module does: the attribute of a
  class of that module, reached from outside it.
`getattr(obj, "_name")` and `hasattr` count as `obj._name`, `setattr(obj, "_name", v)` as defining it.
Dunders are Python's, and private names that no partita module defines (torch's own internals, such as
`stage._prepare_forward_infra` of torch.distributed.pipelining) are not partita's business here.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `support`, when run as a script
from support.source import absolute, module_name, modules, parse, relative, source_files  # noqa: E402

# Cross-module uses of private names being removed: (file, name). Each must still be there; delete it once gone.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scopes(tree: ast.Module):
    """The module body and every class body in it (nested classes too), statement by statement."""
    yield from tree.body
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            yield from node.body


def _targets(node: ast.AST):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)


def _named_attribute(node: ast.AST, functions: tuple[str, ...]) -> bool:
    """Is `node` a call like setattr(obj, "_x", ...) of one of `functions`, with a constant name?"""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))


@cache
def defined(path: Path) -> frozenset[str]:
    """Private names a module defines as something reachable from outside: module-level and class-level
    functions, classes and assignments, and attributes it assigns (`self._x = ...`, `obj._x = ...`)."""
    tree = parse(path)
    names: set[str] = set()
    for stmt in _scopes(tree):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                names.update(_targets(target))
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(stmt.target))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in stmt.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif _named_attribute(node, ("setattr",)):
            names.add(node.args[1].value)
    return frozenset(n for n in names if private(n))


@cache
def definers() -> dict[str, frozenset[str]]:
    """private name -> the modules that define it."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in source_files():
        for name in defined(path):
            out[name].add(module_name(path))
    return {name: frozenset(ms) for name, ms in out.items()}


def _module_aliases(path: Path, tree: ast.Module, me: str) -> dict[str, str]:
    """Local name -> partita module, for names this file binds to partita modules by importing them."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "partita":
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases["partita"] = "partita"
        elif isinstance(node, ast.ImportFrom):
            source = absolute(node, path, me)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules():
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def _module_of(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The partita module an expression names (`env`, `partita.launch.env`), if it names one."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _module_of(node.value, aliases)
        if base is not None and f"{base}.{node.attr}" in modules():
            return f"{base}.{node.attr}"
    return None


def uses(path: Path, module: str | None = None) -> list[tuple[int, str, str]]:
    """(line, name, how) for every cross-module use of a partita private name in one file (of module `module`,
    for a file outside src/partita)."""
    tree = parse(path)
    me = module or module_name(path)
    mine = defined(path)
    aliases = _module_aliases(path, tree, me)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = absolute(node, path, me)
            if source.split(".")[0] == "partita" and source != me:
                out += [(node.lineno, a.name, f"from {source} import {a.name}") for a in node.names if private(a.name)]
        else:
            if isinstance(node, ast.Attribute):
                obj, name = node.value, node.attr
            elif _named_attribute(node, ("getattr", "hasattr")):
                obj, name = node.args[0], node.args[1].value
            else:
                continue
            if not private(name):
                continue
            module = _module_of(obj, aliases)
            if module is not None:
                if module != me:
                    out.append((node.lineno, name, f"{module}.{name}"))
            elif name not in mine and name in definers():
                out.append((node.lineno, name, f".{name}, defined in {', '.join(sorted(definers()[name]))}"))
    return sorted(out)


def violations() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in source_files():
        for line, name, how in uses(path):
            found[relative(path), name].append(f"{relative(path)}:{line}: {how}")
    return found


def test_no_private_name_is_used_outside_its_module():
    found = violations()
    new = [where for key in sorted(set(found) - KNOWN_VIOLATIONS) for where in found[key]]
    assert not new, "private names used outside the module that defines them (make them public, or move the use):\n" \
                    + "\n".join(new)
    fixed = KNOWN_VIOLATIONS - set(found)
    assert not fixed, f"fixed, delete from KNOWN_VIOLATIONS: {sorted(fixed)}"


def test_checker_sees_each_kind_of_use(tmp_path, monkeypatch):
    path = tmp_path / "probe.py"
    path.write_text("from partita.plan.cost import _x\nfrom partita.plan import cost\nimport partita.launch.env\n"
                    "from . import search\n"
                    "def f(stage, engine, _own):\n"
                    "    cost._y; partita.launch.env._z; search._v; stage._prepare_forward_infra; engine.__dict__\n"
                    "    engine._own = 1; engine._own; hasattr(engine, '_w'); return engine._w\n")
    monkeypatch.setattr(sys.modules[__name__], "definers", lambda: {"_w": {"partita.runtime.x"}, "_own": {"partita.x"}})
    assert [(line, name) for line, name, _ in uses(path, module="partita.plan.probe")] == \
        [(1, "_x"), (6, "_v"), (6, "_y"), (6, "_z"), (7, "_w"), (7, "_w")]


if __name__ == "__main__":
    for key, wheres in sorted(violations().items()):
        print("\n".join(wheres))
