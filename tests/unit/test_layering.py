"""partita's packages import each other only along the arrows declared in ARROWS; the planner side is pure.

Every import in src/partita counts, wherever it is (inside functions too), and so do the other ways a module
gets loaded: a string naming a module (`importlib.import_module("partita.x")`, `sys.modules.get("partita.x")`,
the lazy `_LAZY` maps) and `partita.<name>` on the top-level package (`partita.parallelize` is partita.api).
See tests/support/source.py.

The picture in docs/design.md ("Packages") is drawn from ARROWS by `diagram()`; after changing ARROWS run
`.venv/bin/python tests/unit/test_layering.py --write` to redraw it.
"""

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `support`, when run as a script
from support.source import ROOT, SRC, module_name, modules, partita_uses, relative, source_files, unit  # noqa: E402

# The declared graph: package (or top-level module) -> the packages it may import directly. What a package may
# import is everything its arrows reach, directly or through other packages. `launch.env` names one module of
# a package: the arrow allows that module, not the rest of the package. `partita` is partita/__init__.py.
ARROWS: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    # top: what users import
    "partita": {"api", "elasticity"},  # lazily, by name (_LAZY); eagerly only errors and plan
    "cli": {"api", "elasticity", "ray"},
    "api": {"checkpoint", "launch", "planning"},
    "planning": {"launch", "profile", "runtime"},  # this job's plan: measured, chosen on rank 0, agreed
    "elasticity": {"checkpoint", "launch"},
    "ray": {"launch"},  # the user-facing Ray helper
    "checkpoint": {"runtime"},
    "runtime": {"capture"},  # no launcher: the API registers what shutdown() tells the other ranks
    "profile": {"capture"},
    "capture": {"plan", "cache"},
    "launch": {"settings"},
    # pure: no torch, and none of the packages above
    "plan": {"graph", "cluster", "sim"},
    "sim": {"schedule"},
    "graph": {"errors"},
    "cluster": {"errors"},
    "schedule": {"errors"},
    # base
    "cache": {"settings"},
    "settings": {"errors"},
    "errors": set(),
}.items()}

PURE = ("graph", "cluster", "schedule", "sim", "plan")
BASE = ("errors", "settings", "cache")
TORCH_SIDE = ("capture", "profile", "runtime", "planning", "launch", "checkpoint", "elasticity", "cli", "api", "ray")

# Imports that break ARROWS and are being removed; each entry must still be there (delete it once it is gone).
# (file, module it loads), e.g. ("src/partita/checkpoint/holding.py", "partita.api")
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def _node(target: str) -> str:
    """An arrow's target as a package: launch.env -> launch."""
    return target.split(".")[0]


@cache
def reach(package: str) -> frozenset[str]:
    """What `package` may import: everything its arrows reach (a target like launch.env stays a module)."""
    out: set[str] = set()
    for target in ARROWS[package]:
        out.add(target)
        out |= reach(_node(target))
    return frozenset(out)


def allowed(package: str, module: str) -> bool:
    """May `package` load partita module `module` (e.g. partita.launch.env)?"""
    parts = module.split(".")[1:]
    if not parts or parts[0] == package or package not in ARROWS:  # undeclared: test_every_package_is_declared
        return True
    return any(".".join(parts[:n]) in reach(package) for n in range(1, len(parts) + 1))


def violations() -> set[tuple[str, str]]:
    """(file, module) for every load of a partita module that ARROWS does not allow, with where it happens."""
    return {(relative(p), use.target) for p in source_files() for use in partita_uses(p)
            if not allowed(unit(module_name(p)), use.target)}


def test_every_package_is_declared():
    found = {unit(m) for m in modules()}
    assert found == set(ARROWS), f"declare these in ARROWS: {sorted(found - set(ARROWS))}; " \
                                 f"gone, remove: {sorted(set(ARROWS) - found)}"
    for package, targets in ARROWS.items():
        for target in targets:
            assert f"partita.{target}" in modules(), f"{package} -> {target}: no such module"


def test_declared_graph_is_a_layering():
    for package in ARROWS:
        assert package not in {_node(t) for t in reach(package)}, f"{package} reaches itself: a cycle"
    for package in PURE:
        assert not reach(package) & {*TORCH_SIDE, "partita"}, f"pure {package} may reach {reach(package)}"
    assert {p for p in ARROWS if "api" in reach(p)} == {"partita", "cli"}, "only partita/__init__ and cli use api"
    runtime_launch = {t for t in reach("runtime") if _node(t) == "launch"}
    assert not runtime_launch, f"the runtime may use no launcher: {runtime_launch}"
    assert "launch" not in {_node(t) for p in PURE + ("capture", "profile") for t in reach(p)}


def test_imports_follow_declared_graph():
    found = violations()
    new = sorted(f"{use}  ({unit(module_name(p))} may not load {use.target})" for p in source_files()
                 for use in partita_uses(p) if (relative(p), use.target) in found - KNOWN_VIOLATIONS)
    assert not new, "imports outside the declared graph (ARROWS in tests/unit/test_layering.py):\n" + "\n".join(new)
    fixed = KNOWN_VIOLATIONS - found
    assert not fixed, f"fixed, delete from KNOWN_VIOLATIONS: {sorted(fixed)}"


def test_checker_sees_every_kind_of_import(tmp_path):
    """The import walker finds imports in functions, relative ones, strings naming modules and partita.<name>."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    import importlib, partita\n    from partita.launch import env\n"
                    "    from ..runtime.groups import x\n    from . import search\n"
                    "    importlib.import_module('partita.capture.split')\n"
                    "    return partita.parallelize, partita.Plan\n")
    targets = {u.target for u in partita_uses(path, module="partita.plan.probe")}
    assert targets == {"partita.launch.env", "partita.runtime.groups", "partita.plan.search", "partita.capture.split",
                       "partita.api", "partita.plan.plan"}, targets
    assert not allowed("plan", "partita.launch.env") and allowed("api", "partita.launch.env")
    assert not allowed("runtime", "partita.launch.agent") and allowed("api", "partita.launch.agent")


def test_pure_packages_import_no_torch():
    for package in PURE:
        for path in (SRC / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                for name in names:
                    assert name.split(".")[0] not in ("torch", "numpy"), \
                        f"{relative(path)}:{node.lineno} imports {name}"


def test_pure_packages_load_without_torch():
    pure = sorted(m for m in modules() if unit(m) in PURE)
    code = "import sys; sys.modules['torch'] = None\n" + "".join(f"import {m}\n" for m in pure) + \
           "import partita; print(sorted(n for n, m in sys.modules.items() if n.startswith('torch') and m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC.parent)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_planner_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "from partita.plan import choose_plan; from partita.graph import Block, BlockCost, ModelGraph, Profile; "
            "from partita.graph.graph import Fit; f = Fit.line(0, 1); "
            "g = ModelGraph((Block(0, 'l', (0, 1), 'a', 'a', 's', 1, f, f, f, ('p',)),), {'p': 4}, (), f); "
            "from partita.cluster import parse_cluster; p = Profile('t', (BlockCost(f, f, f),)); "
            "print(choose_plan(g, p, parse_cluster('1xA100-40GB'), global_batch=1, optimizer_factor=0).num_stages)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC.parent)})
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr


# --- the picture in docs/design.md -------------------------------------------------------------------------

DESIGN = ROOT / "docs" / "design.md"
BEGIN = "<!-- packages: drawn by tests/unit/test_layering.py from ARROWS; do not edit by hand -->"
END = "<!-- end packages -->"


@cache
def _level(package: str) -> int:
    return 1 + max((_level(_node(t)) for t in ARROWS[package]), default=-1)


def diagram() -> str:
    """ARROWS as text: one row per package, highest layer first, its arrows to the right."""
    sections = [("", [p for p in ARROWS if p not in PURE + BASE]),
                ("pure: no torch, none of the above", list(PURE)),
                ("base", list(BASE))]
    shown = {p: "partita/__init__" if p == "partita" else p for p in ARROWS}
    width = max(map(len, shown.values()))
    lines = []
    for title, packages in sections:
        if title:
            lines.append((f"- - - {title} " + "- " * ((48 - len(title)) // 2)).rstrip())
        for p in sorted(packages, key=lambda p: (-_level(p), p)):
            name = shown[p]
            targets = sorted(ARROWS[p], key=lambda t: (-_level(_node(t)), t))
            lines.append(f"{name} {'-' * (width + 2 - len(name))}> {', '.join(targets)}" if targets
                         else f"{name}{' ' * (width + 5 - len(name))}(imports nothing of partita)")
    return "\n".join(lines)


def design_section() -> str:
    return f"{BEGIN}\n```\n{diagram()}\n```\n{END}"


def test_design_picture_is_current():
    text = DESIGN.read_text()
    assert BEGIN in text and END in text, f"{DESIGN} lost its markers; put back:\n{design_section()}"
    current = text[text.index(BEGIN): text.index(END) + len(END)]
    assert current == design_section(), "docs/design.md's package picture is stale: " \
                                        "run .venv/bin/python tests/unit/test_layering.py --write"


if __name__ == "__main__":
    if "--write" in sys.argv:
        text = DESIGN.read_text()
        DESIGN.write_text(text[: text.index(BEGIN)] + design_section() + text[text.index(END) + len(END):])
    print(diagram())
