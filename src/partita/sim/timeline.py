"""A picture of a simulated step: a row per rank, a box per action, transfers and the tail visible.

`draw_timeline(trace, "step.svg")` writes a self-contained SVG (no dependency); a path ending in .png is drawn
with matplotlib, imported only then.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import NamedTuple

from partita.schedule.action import FORWARD
from partita.sim.trace import SEND_ACTIVATIONS, SEND_GRADIENTS, TAIL, Trace

# One colour family per op; successive stages of the same rank (looped, V-shaped) take successive shades.
COLOURS = {
    "F": ("#2f6db5", "#7fb0e6", "#1b3f6b"),
    "B": ("#e07b00", "#f7b35c", "#8a4b00"),
    "I": ("#d0453a", "#f0908a", "#7d231c"),
    "W": ("#3c9a45", "#8fd096", "#1f5a25"),
}
TRANSFER_COLOUR, TAIL_COLOUR = "#9a9a9a", "#c8c8c8"
ROW_HEIGHT, COMPUTE_HEIGHT, SEND_HEIGHT = 1.0, 0.6, 0.15  # in rows; sends run in a thin lane under the compute


class Box(NamedTuple):
    """One rectangle: time on x (seconds), rows on y (rank r's compute lane starts at r)."""

    x_s: float
    width_s: float
    y: float
    height: float
    colour: str
    label: str


def draw_timeline(trace: Trace, path: str | Path) -> Path:
    """Write the picture of `trace` to `path` (.svg or .png) and return the path.

    >>> import tempfile
    >>> from partita.schedule import orders
    >>> from partita.sim import StageCosts, simulate
    >>> trace = simulate(orders("1F1B", 4, 4, 8), StageCosts.uniform(4, 1.0, 2.0, send_s=0.25), tail_s=(1,) * 4)
    >>> out = draw_timeline(trace, Path(tempfile.mkdtemp()) / "1f1b.svg")
    >>> out.read_text().startswith("<svg")
    True
    """
    path = Path(path)
    boxes = timeline_boxes(trace)
    title = (f"{trace.num_ranks} ranks: step {trace.step_s * 1e3:.4g} ms (pipeline {trace.makespan_s * 1e3:.4g} ms"
             f" + tail {(trace.step_s - trace.makespan_s) * 1e3:.4g} ms), bubble {trace.bubble_fraction:.1%}")
    if path.suffix == ".svg":
        path.write_text(_svg(boxes, trace, title))
    elif path.suffix == ".png":
        _png(boxes, trace, title, path)
    else:
        raise ValueError(f"draw_timeline writes .svg or .png files, not {path.name!r}")
    return path


def timeline_boxes(trace: Trace) -> list[Box]:
    """The picture as rectangles, for any renderer: compute boxes, then transfers, then tails."""
    local_index = {}  # stage -> its position among its rank's stages, for the shade
    for order in trace.orders:
        for i, stage in enumerate(sorted({action.stage for action in order})):
            local_index[stage] = i
    boxes = []
    for event in trace.events:
        width = event.end_s - event.start_s
        if event.op in (SEND_ACTIVATIONS, SEND_GRADIENTS):
            y = event.rank * ROW_HEIGHT + COMPUTE_HEIGHT + (0.02 if event.op == SEND_ACTIVATIONS else 0.19)
            boxes.append(Box(event.start_s, width, y, SEND_HEIGHT, TRANSFER_COLOUR, ""))
        elif event.op == TAIL:
            boxes.append(Box(event.start_s, width, event.rank * ROW_HEIGHT, COMPUTE_HEIGHT, TAIL_COLOUR,
                             "all-reduce + step"))
        else:
            shades = COLOURS[event.op]
            colour = shades[local_index[event.stage] % len(shades)]
            boxes.append(Box(event.start_s, width, event.rank * ROW_HEIGHT, COMPUTE_HEIGHT, colour,
                             str(event.micro_batch)))
    return boxes


def _legend(trace: Trace) -> list[tuple[str, str]]:
    ops = {action.op for order in trace.orders for action in order}
    names = {"F": "forward", "B": "backward", "I": "input-grad backward", "W": "weight-grad backward"}
    legend = [(COLOURS[op][0], names[op]) for op in "FBIW" if op in ops]
    if any(len({action.stage for action in order}) > 1 for order in trace.orders):
        legend.append((COLOURS[FORWARD][1], "lighter: a rank's next stage"))
    return legend + [(TRANSFER_COLOUR, "sends (activations above, gradients below)"), (TAIL_COLOUR, "after pipeline")]


def _svg(boxes: list[Box], trace: Trace, title: str) -> str:
    left_px, top_px, width_px, row_px, char_px = 60, 40, 1200, 40, 6.5
    end_s = max(trace.step_s, 1e-12)
    scale = width_px / end_s
    height_px = top_px + trace.num_ranks * row_px + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left_px + width_px + 20}" height="{height_px}" '
             f'font-family="sans-serif" font-size="10">', '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{left_px}" y="16" font-size="13">{escape(title)}</text>']
    x_legend = left_px
    for colour, name in _legend(trace):
        parts.append(f'<rect x="{x_legend}" y="24" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{x_legend + 13}" y="33">{escape(name)}</text>')
        x_legend += 20 + char_px * len(name)
    for rank in range(trace.num_ranks):
        y = top_px + rank * row_px + COMPUTE_HEIGHT * row_px / 2 + 4
        parts.append(f'<text x="4" y="{y:.1f}">rank {rank}</text>')
    for box in boxes:
        x, y = left_px + box.x_s * scale, top_px + box.y * row_px
        w, h = max(box.width_s * scale, 0.5), box.height * row_px
        parts.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{box.colour}" '
                     f'stroke="white" stroke-width="0.3"/>')
        if box.label and w > char_px * len(box.label) + 2:
            parts.append(f'<text x="{x + w / 2:.2f}" y="{y + h / 2 + 3.5:.2f}" text-anchor="middle">'
                         f'{escape(box.label)}</text>')
    axis_y = top_px + trace.num_ranks * row_px + 5
    for i in range(11):
        x = left_px + i * width_px / 10
        parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="black"/>'
                     f'<text x="{x:.1f}" y="{axis_y + 15}" text-anchor="middle">{end_s * i / 10 * 1e3:.3g} ms</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _png(boxes: list[Box], trace: Trace, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    figure, axes = plt.subplots(figsize=(14, 1.0 + 0.5 * trace.num_ranks))
    to_ms = 1e3
    for box in boxes:
        axes.add_patch(Rectangle((box.x_s * to_ms, box.y), box.width_s * to_ms, box.height, facecolor=box.colour,
                                 edgecolor="white", linewidth=0.3))
    axes.set_xlim(0, trace.step_s * to_ms)
    axes.set_ylim(trace.num_ranks * ROW_HEIGHT, 0)
    # label a box only where its number fits (the width in pixels is approximate: before tight_layout)
    pixels_per_ms = figure.dpi * axes.get_position().width * figure.get_figwidth() / max(trace.step_s * to_ms, 1e-9)
    for box in boxes:
        if box.label and box.width_s * to_ms * pixels_per_ms > 6.5 * len(box.label) + 2:
            axes.text((box.x_s + box.width_s / 2) * to_ms, box.y + box.height / 2, box.label, ha="center",
                      va="center", fontsize=7)
    axes.set_yticks([r * ROW_HEIGHT + COMPUTE_HEIGHT / 2 for r in range(trace.num_ranks)],
                    [f"rank {r}" for r in range(trace.num_ranks)])
    axes.set_xlabel("ms")
    axes.set_title(title, fontsize=10)
    axes.legend(handles=[Patch(color=c, label=n) for c, n in _legend(trace)], loc="upper center",
                bbox_to_anchor=(0.5, -0.25 if trace.num_ranks > 2 else -0.5), ncol=6, fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
