"""Scenes as PNG or SVG, with matplotlib.

One row per rank, time on the x-axis; a box per op, coloured by kind, hatched in the second
direction or leg; the grey behind the boxes is idle time. Under each panel's rows, every rank's
live activation memory over time. Boxes of one kind and leg go into one ``PolyCollection``, so a
25,000-box schedule draws in about a second; the microbatch number goes into every box wide
enough to hold it. Figures are built without pyplot, so drawing never changes the caller's
matplotlib backend or state.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from cutpipe.files import write_with
from cutpipe.viz.scene import MAX_IMAGE_BOXES, Box, Panel, Scene, check_boxes
from cutpipe.viz.style import (
    IDLE_COLOUR,
    KIND_COLOURS,
    KIND_NAMES,
    LEG_EDGE,
    LEG_HATCH,
    TEXT_ON,
)

WIDTH_INCHES = 13.0
ROW_INCHES = 0.32
MEMORY_INCHES = 1.1
MAX_LABELS = 5000
HALF = 0.4  # half a row's height


def _rectangles(boxes: list[Box]) -> np.ndarray:
    starts = np.fromiter((b.start for b in boxes), float, len(boxes))
    ends = np.fromiter((b.end for b in boxes), float, len(boxes))
    rows = np.fromiter((b.rank for b in boxes), float, len(boxes))
    low, high = rows - HALF, rows + HALF
    return np.stack(
        [
            np.stack([starts, low], 1),
            np.stack([starts, high], 1),
            np.stack([ends, high], 1),
            np.stack([ends, low], 1),
        ],
        axis=1,
    )


def _draw_panel(ax, memory_ax, panel: Panel, end: float, pixels_per_unit: float) -> int:
    """Draw one panel; return how many boxes it drew."""
    ranks = panel.ranks
    begin = panel.timeline.begin
    ax.barh(range(ranks), end - begin, left=begin, height=2 * HALF, color=IDLE_COLOUR, linewidth=0)
    drawn = 0
    groups: dict[tuple[str, int], list[Box]] = {}
    for box in panel.boxes:
        groups.setdefault((box.kind, box.leg), []).append(box)
    for (kind, leg), boxes in sorted(groups.items()):
        collection = PolyCollection(
            _rectangles(boxes), facecolors=KIND_COLOURS[kind], edgecolors=LEG_EDGE[leg],
            linewidths=0.3, hatch=LEG_HATCH[leg] or None,
        )  # fmt: skip
        ax.add_collection(collection)
        drawn += len(boxes)
    if panel.ghost:
        ax.add_collection(
            PolyCollection(
                _rectangles(panel.ghost),
                facecolors="none",
                edgecolors="#000000",
                linewidths=0.8,
                linestyles="--",
            )
        )
    labels = 0
    for box in panel.boxes:
        if labels >= MAX_LABELS:
            break
        if (box.end - box.start) * pixels_per_unit >= 4 + 5 * len(box.label):
            ax.text((box.start + box.end) / 2, box.rank, box.label, ha="center", va="center",
                    fontsize=6.5, color=TEXT_ON[box.kind])  # fmt: skip
            labels += 1
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(
        range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=7 if ranks > 16 else 8
    )
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.tick_params(axis="x", labelbottom=False)
    colours = matplotlib.colormaps["viridis"]
    for rank, points in enumerate(panel.memory):
        times, values = zip(*points, strict=True)
        memory_ax.step(times, values, where="post", linewidth=0.9, color=colours(rank / max(1, ranks - 1)),
                       label=f"rank {rank}")  # fmt: skip
    memory_ax.set_ylabel("live act.", fontsize=8)
    memory_ax.set_ylim(bottom=0)
    memory_ax.grid(axis="y", linewidth=0.3)
    if ranks <= 8:
        memory_ax.legend(fontsize=6, ncol=min(ranks, 8), loc="upper right", frameon=False)
    return drawn


def render(scene: Scene) -> tuple[Figure, int]:
    """A matplotlib figure of ``scene`` and how many op boxes it holds."""
    with matplotlib.rc_context({"hatch.linewidth": 0.5, "hatch.color": "#333333"}):
        return _render(scene)


def _render(scene: Scene) -> tuple[Figure, int]:
    heights = []
    for panel in scene.panels:
        heights += [ROW_INCHES * panel.ranks + 0.45, MEMORY_INCHES]
    figure = Figure(figsize=(WIDTH_INCHES, sum(heights) + 1.0))
    axes = figure.subplots(
        len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights}, squeeze=False
    )
    axes = axes[:, 0]
    start = min(p.timeline.begin for p in scene.panels)
    end = max(scene.end, start + 1e-9)  # all costs zero: an empty axis, not a singular one
    plot_inches = WIDTH_INCHES * 0.82
    pixels_per_unit = plot_inches * figure.dpi / max(end - start, 1e-12)
    drawn = 0
    for index, panel in enumerate(scene.panels):
        drawn += _draw_panel(axes[2 * index], axes[2 * index + 1], panel, end, pixels_per_unit)
    axes[-1].set_xlim(start, end)
    axes[-1].set_xlabel("time (cost units)" if scene.unit == "cost" else f"time ({scene.unit})")
    handles = [
        Patch(facecolor=KIND_COLOURS[k], edgecolor="#4d4d4d", label=KIND_NAMES[k])
        for k in KIND_COLOURS
    ]
    handles.append(
        Patch(
            facecolor="white",
            edgecolor="#111111",
            hatch=LEG_HATCH[1],
            label="second direction / leg",
        )
    )
    handles.append(Patch(facecolor=IDLE_COLOUR, label="idle"))
    if any(p.ghost for p in scene.panels):
        handles.append(
            Patch(facecolor="none", edgecolor="#000000", linestyle="--", label="simulated")
        )
    figure.legend(
        handles=handles, loc="upper center", ncol=len(handles), fontsize=7.5, frameon=False
    )
    figure.subplots_adjust(
        left=0.07,
        right=0.99,
        top=1 - 0.55 / (sum(heights) + 1.0),
        bottom=0.5 / (sum(heights) + 1.0),
        hspace=0.35,
    )
    return figure, drawn


def save(scene: Scene, path: str | Path, dpi: int = 110) -> int:
    """Write ``scene`` as a PNG or SVG (by the path's ending), atomically; return the boxes drawn.

    Refuses scenes of more than ``MAX_IMAGE_BOXES`` boxes before drawing (use the HTML page).
    """
    check_boxes(scene.box_count, MAX_IMAGE_BOXES, "a PNG or SVG image")
    figure, drawn = render(scene)
    kind = Path(path).suffix.lstrip(".").lower() or "png"
    write_with(path, lambda temporary: figure.savefig(temporary, dpi=dpi, format=kind))
    return drawn
