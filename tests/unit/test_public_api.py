"""`import partita` is small: what a training script uses every day (at most 15 names), the rest in submodules;
names that need torch load on first use, so that `import partita` alone does not import torch."""

import json
import subprocess
import sys

import pytest

import partita
from support.source import SRC


def test_at_most_15_names():
    assert len(partita.__all__) <= 15, partita.__all__
    assert partita.__all__ == sorted(set(partita.__all__)) == dir(partita)


def test_every_name_resolves_and_import_alone_needs_no_torch():
    code = ("import importlib, json, sys, partita\n"
            "torch_first = sorted(n for n in sys.modules if n.split('.')[0] == 'torch')\n"
            "missing = [n for n in partita.__all__ if getattr(partita, n, None) is None]\n"
            "elsewhere = [f'{m}.{n}' for n, m in partita._ELSEWHERE.items()\n"
            "             if not hasattr(importlib.import_module(m), n) or n in partita.__all__]\n"
            "print(json.dumps([torch_first, missing, elsewhere]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC.parent)}, timeout=120)
    assert out.returncode == 0, out.stderr
    torch_first, missing, elsewhere = json.loads(out.stdout)
    assert torch_first == [], "import partita imported torch"
    assert missing == [], f"partita.__all__ names that do not resolve: {missing}"
    assert elsewhere == [], f"_ELSEWHERE points to modules without these names: {elsewhere}"


def test_a_name_that_moved_says_where():
    with pytest.raises(AttributeError, match=r"it is partita\.errors\.CheckpointError \(from partita\.errors import"):
        partita.CheckpointError  # noqa: B018
    with pytest.raises(AttributeError, match=r"^module 'partita' has no attribute 'nothing'$"):
        partita.nothing  # noqa: B018
