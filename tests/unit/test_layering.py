"""The planner side is pure: graph/ and plan/ import neither torch nor the runtime."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "partita"
PURE = ["graph", "plan", "schedule", "sim"]


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_pure_packages_import_no_torch_and_no_runtime():
    for pkg in PURE:
        for f in (SRC / pkg).glob("*.py"):
            for name in imports(f):
                assert not name.startswith("torch"), f"{f} imports {name}"
                assert not name.startswith(("partita.runtime", "partita.capture", "partita.api")), f"{f} imports {name}"


def test_planner_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "from partita.plan import choose_plan; from partita.graph import Block, BlockCost, ModelGraph, Profile; "
            "from partita.graph.graph import Fit; f = Fit.line(0, 1); "
            "g = ModelGraph((Block(0, 'l', (0, 1), 'a', 'a', 's', 1, f, f, f, ('p',)),), {'p': 4}, (), f); "
            "from partita.cluster import parse_cluster; p = Profile('t', (BlockCost(f, f, f),)); "
            "print(choose_plan(g, p, parse_cluster('1xA100-40GB'), global_batch=1, optimizer_factor=0).num_stages)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(SRC.parent)})
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
