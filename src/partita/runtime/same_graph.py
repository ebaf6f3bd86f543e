"""Every rank runs the stages of one graph: rank 0's.

Ranks exchange node names and the values behind them, so every rank must hold the same captured graph. A model
whose Python code orders its operations by something of the process (a loop over a set of strings follows the
interpreter's hash seed, PYTHONHASHSEED, which torchrun does not fix: Hugging Face's Gemma 3 builds its rotary
tables so) captures the same operations in another order on each rank. Where the ranks' graphs differ, each rank
whose graph computes the same operations as rank 0's in another order rebuilds it in rank 0's order and names
(`capture.listing.reordered`), and rank 0 says so; where they compute different operations, every rank raises the
same CaptureError naming where the graphs first differ, each rank's hash seed, the likely cause and the fix. The
common case costs one all-reduce (`agreement.compare`).
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from partita.capture.export import CapturedGraph
from partita.capture.listing import Order, digest, different_graphs, hash_seeds_text, node_lines, reordered
from partita.errors import CaptureError
from partita.runtime import agreement

log = logging.getLogger("partita")


def agreed_capture(cap: CapturedGraph, graph_digest: str) -> CapturedGraph:
    """Collective: `cap` (whose listing's digest is `graph_digest`), or, where it computes rank 0's operations
    in another order, the same in rank 0's order and names; see the module's docstring."""
    every = agreement.compare(f"captured graph {graph_digest}", lambda: (
        os.environ.get("PYTHONHASHSEED"), node_lines(cap.gm), Order.of(cap.gm)))
    if every is None:
        return cap
    _, lines, order = every[0]
    rank = dist.get_rank()
    if digest(every[rank][1]) != digest(lines):
        try:
            cap = reordered(cap, order) or cap
        except Exception:  # noqa: BLE001 - a graph that cannot be rebuilt so differs, and is refused on every rank below
            pass
    if agreement.compare(f"captured graph {digest(node_lines(cap.gm))}", lambda: None) is not None:
        raise CaptureError(different_graphs([(seed, listing) for seed, listing, _ in every]))
    if rank == 0:
        others = [r for r, (_, listing, _) in enumerate(every) if digest(listing) != digest(lines)]
        log.warning("partita: rank%s %s captured the model's operations in another order than rank 0 (%s) and run "
                    "them in rank 0's order, which computes the same. Start every rank with the same PYTHONHASHSEED "
                    "(`partita run` does) to capture alike.", "s" if len(others) > 1 else "",
                    ", ".join(map(str, others)), hash_seeds_text([seed for seed, _, _ in every]))
    return cap
