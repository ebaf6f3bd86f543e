"""The model as the planner sees it: an ordered list of blocks with numbers, no torch objects."""

from partita.graph.graph import Block, Fit, ModelGraph
from partita.graph.profile import BlockCost, Profile

__all__ = ["Block", "BlockCost", "Fit", "ModelGraph", "Profile"]
