"""partita's source as data, for the tests that enforce its structure (test_layering, test_private_names).

Every function reads files with `ast` only: nothing of partita is imported, so a broken import cannot hide
an edge and the checks run without torch.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "partita"


def source_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """src/partita/plan/search.py -> partita.plan.search; src/partita/plan/__init__.py -> partita.plan."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> frozenset[str]:
    return frozenset(module_name(p) for p in source_files())


@cache
def parse(path: Path) -> ast.Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child._parent = node  # type: ignore[attr-defined]
    return tree


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def unit(module: str) -> str:
    """The package (or top-level module) a partita module belongs to: partita.plan.search -> plan.
    The top-level package itself (partita/__init__.py) is `partita`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "partita"


def longest_module(dotted: str) -> str | None:
    """The partita module a dotted name lives in: partita.plan.plan.Plan -> partita.plan.plan."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules():
            return ".".join(parts[:n])
    return None


def absolute(node: ast.ImportFrom, path: Path, module: str | None = None) -> str:
    """The module an ImportFrom in `path` (module `module`, by default its own) names, relative imports made
    absolute."""
    if not node.level:
        return node.module or ""
    package = (module or module_name(path)).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


@cache
def root_names() -> dict[str, str]:
    """What `partita.<name>` means: name -> the module that defines it, from the top-level package's own
    imports and its lazy map (`_LAZY = {"name": "partita.module"}`)."""
    path = SRC / "__init__.py"
    names: dict[str, str] = {}
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom) and absolute(node, path).startswith("partita"):
            for alias in node.names:
                names[alias.asname or alias.name] = absolute(node, path)
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
              and isinstance(node.value, ast.Dict)):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                    names[key.value] = value.value
    return names


def resolve(dotted: str) -> str | None:
    """The partita module that using `dotted` loads: a module, or the module of a name imported from one.
    `partita.<name>` is the module that defines <name> for the top-level package; None for names of the
    top-level package itself (`__version__`), which every import of partita loads anyway."""
    if dotted != "partita" and not dotted.startswith("partita."):
        return None
    module = longest_module(dotted)
    if module == "partita":
        rest = dotted.split(".")[1:]
        if not rest or rest[0] not in root_names():
            return None
        return longest_module(root_names()[rest[0]] + "." + ".".join(rest[1:])) if rest[1:] else root_names()[rest[0]]
    return module


@dataclass(frozen=True)
class Use:
    """One place where a file loads a partita module."""

    path: Path
    line: int
    target: str  # the module loaded, e.g. partita.launch.env
    how: str  # the source text that loads it

    def __str__(self) -> str:
        return f"{relative(self.path)}:{self.line}: {self.how}"


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def partita_uses(path: Path, module: str | None = None) -> list[Use]:
    """Every way a file loads another partita module, anywhere in it (inside functions too):
    - `import partita.x`, `from partita.x import y`, `from . import y` (y a module or a name in one);
    - a string that is a partita module's name (`importlib.import_module("partita.x")`,
      `sys.modules.get("partita.x")`, the values of a lazy map) or an f-string that starts with one;
    - `partita.<name>` where `partita` was imported: the module that defines <name> (`partita.parallelize`
      is partita.api).
    `module` is the file's module name, for a file outside src/partita."""
    uses: list[Use] = []
    tree = parse(path)
    imports_partita = False

    def add(node: ast.AST, dotted: str, how: str) -> None:
        target = resolve(dotted)
        if target is not None:
            uses.append(Use(path, node.lineno, target, how))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "partita":
                    imports_partita = imports_partita or alias.asname is None
                    add(node, alias.name, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            source = absolute(node, path, module)
            for alias in node.names:
                add(node, f"{source}.{alias.name}", f"from {source} import {alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules():
            add(node, node.value, repr(node.value))
        elif (isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant)
              and str(node.values[0].value).rstrip(".") in modules()):
            add(node, str(node.values[0].value).rstrip("."), f"f{str(node.values[0].value)!r}...")
    if imports_partita:
        for node in ast.walk(tree):
            # the outermost partita.a.b... chain only: partita.launch.env.timeout, not also partita.launch
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent", None), ast.Attribute):
                dotted = _dotted(node)
                if dotted and dotted.startswith("partita."):
                    add(node, dotted, dotted)
    return uses

