"""The memory/bubble frontier as PNG or SVG: span bubble against activation memory.

One line per placement (the best schedule found at each cap), its lower bound dotted beneath
it, and each fixed schedule as a labelled marker at its own peak. The data comes in plain
(memory, bubble) pairs so that this module needs nothing from the planner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from cutpipe.files import write_with

matplotlib.use("Agg")

COLOURS = {"linear": "#1f5fa8", "v": "#b03a2e"}


def save_frontier(
    lines: Mapping[str, Sequence[tuple[float, float]]],
    bounds: Mapping[str, Sequence[tuple[float, float]]],
    marks: Sequence[tuple[str, str, float, float]],
    path: str | Path,
    title: str = "",
) -> int:
    """``lines`` and ``bounds``: per placement, (memory x 1F1B, span bubble) points; ``marks``:
    (name, placement, memory, bubble) of fixed schedules. Returns the number of points drawn."""
    figure = Figure(figsize=(7, 4.2), layout="constrained")
    axes = figure.add_subplot()
    drawn = 0
    for placement, points in lines.items():
        colour = COLOURS.get(placement, "#444444")
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, marker="o", markersize=4, color=colour, linewidth=1.6,
                  label=f"cost-aware, {placement}")  # fmt: skip
        drawn += len(points)
        if bounds.get(placement):
            bx, by = zip(*bounds[placement], strict=True)
            axes.plot(bx, by, linestyle=":", color=colour, linewidth=1,
                      label=f"lower bound, {placement}")  # fmt: skip
    for name, placement, memory, bubble in marks:
        colour = COLOURS.get(placement, "#444444")
        axes.plot([memory], [bubble], marker="D", markersize=6, color=colour,
                  markerfacecolor="white", linestyle="none")  # fmt: skip
        axes.annotate(name, (memory, bubble), textcoords="offset points", xytext=(6, 4),
                      fontsize=8, color=colour)  # fmt: skip
        drawn += 1
    axes.set_xlabel("activation memory per rank (x 1F1B's peak)")
    axes.set_ylabel("span bubble")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper right", fontsize=8)
    if title:
        axes.set_title(title, fontsize=10)
    kind = Path(path).suffix.lstrip(".").lower()
    write_with(path, lambda temporary: figure.savefig(temporary, dpi=120, format=kind))
    return drawn
