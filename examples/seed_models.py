"""Model factories for `partita plan` (plan for hardware you don't have), e.g.

    partita plan examples/seed_models.py:tutorial_2p5b --devices 8xA100-40GB --batch 512 --input 5000
    partita plan examples/seed_models.py:gpt3_175b --devices 1024xA100-80GB --batch 1536 --input 2048:int64 \\
        --dtype bfloat16
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import SmallGPT, TutorialMLP  # noqa: E402


def tutorial_small() -> TutorialMLP:
    """RaNNC's tutorial model at (hidden 512, 10 layers): 2.6 M parameters."""
    return TutorialMLP(512, 10)


def tutorial_2p5b() -> TutorialMLP:
    """RaNNC's tutorial model at (hidden 5000, 100 layers): 2.5 B parameters."""
    return TutorialMLP(5000, 100)


def gpt3_175b() -> SmallGPT:
    """The shape of GPT-3 175B: 96 layers, hidden 12288, 96 heads, context 2048, vocabulary 50257."""
    return SmallGPT(vocab=50257, dim=12288, heads=96, layers=96, context=2048)
