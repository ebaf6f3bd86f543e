"""The model as the planner sees it: an ordered list of blocks with numbers, no torch objects."""

from partita.graph.graph import Block, ModelGraph

__all__ = ["Block", "ModelGraph"]
