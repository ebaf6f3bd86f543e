"""Module outputs that are tensors of their own to autograd, over the same memory (nothing is copied).

Two of torch's mechanisms go wrong on an output that autograd sees as a view of another tensor, or as a value
its op saved for the backward:
- torch's split backward (zero-bubble schedules) detaches a stage's outputs in place once their input
  gradients are computed: autograd refuses that for a view (a stage sending on a reshaped tensor), and it
  breaks the weight half for an output its op saved (tanh's, softmax's);
- FSDP2 hooks its gathering for the backward on a unit's outputs: an in-place op on an output that is a view
  would drop the hook (torch warns of every such output, on every rank).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only


def own_tensors(out):
    """`out` (a tensor or a structure of them) with each tensor a new one over the same memory."""
    return tree_map_only(torch.Tensor, lambda t: torch.ops.aten._unsafe_view(t, t.shape), out)
