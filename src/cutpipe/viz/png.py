"""Scenes as PNG or SVG, with matplotlib.

One row per rank, time on the x-axis; a box per op, coloured by kind, hatched in the second
direction or leg; the grey behind the boxes is idle time. Under each panel's rows, every rank's
live activation memory over time: a line per rank for a few ranks, a heat map (a row per rank)
for many, where lines would only overlap. Rows that repeat an earlier panel's rows box for box
are bracketed at the right ("= DualPipe rows 0-3"), so a comparison shows what it shares without
reading the titles. A panel of several steps draws odd steps lighter, the all-reduce and optimizer
steps between them hatched, a black tick where each rank's step ends (its next step may start
there) and each step's number above its first op. Boxes of one kind, leg and step parity go into
one ``PolyCollection``, so a 25,000-box
schedule draws in about a second; the microbatch number goes into every box wide enough to hold
it. Figures are built without pyplot and settings are scoped with ``rc_context``, so drawing never
changes the caller's matplotlib backend or state. The layout is computed in inches, so a legend,
a title or a bracket never lands on the data whatever the number of ranks.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.textpath import TextToPath

from cutpipe.files import write_with
from cutpipe.viz.scene import MAX_IMAGE_BOXES, Box, Panel, Scene, check_boxes
from cutpipe.viz.style import (
    IDLE_COLOUR,
    KIND_COLOURS,
    KIND_HATCH,
    LEG_EDGE,
    LEG_HATCH,
    MEMORY_UNIT,
    ODD_STEP_ALPHA,
    SHARED_COLOUR,
    TEXT_ON,
    legend_name,
)

WIDTH_INCHES = 13.0
DPI = 110  # a saved PNG's resolution: 1,430 pixels across
LEFT_INCHES = 0.8
ROW_INCHES = 0.32
DENSE_ROW_INCHES = 0.26  # past DENSE_RANKS ranks, so a 32-rank picture stays on a screen
DENSE_RANKS = 16
#: Up to this many ranks the memory strip draws a line per rank; past it, a heat map.
MANY_RANKS = 8
LINE_MEMORY_INCHES = 1.0
HEAT_ROW_INCHES = 0.055
HALF = 0.4  # half a row's height
MAX_LABELS = 5000
TITLE_POINTS = 11.0
LEGEND_POINTS = 8.5
SMALL_POINTS = 8.0
SHARED_POINTS = 9.0
STEP_LABEL_INCHES = 0.16  # room above a panel of several steps for the step numbers
#: A legend entry's handle, the gap to its text and the spacing to the next column, in ems.
LEGEND_HANDLE_EMS, LEGEND_PAD_EMS, LEGEND_SPACING_EMS = 1.6, 0.6, 1.5
LEGEND_ENTRY_EMS = LEGEND_HANDLE_EMS + LEGEND_PAD_EMS + LEGEND_SPACING_EMS
#: Settings for drawing and saving only; ``svg.fonttype`` keeps SVG text as selectable text.
RC = {"hatch.linewidth": 0.5, "hatch.color": "#333333", "svg.fonttype": "none"}


@dataclass(frozen=True)
class SharedRun:
    """Rows ``first..last`` of a panel repeat rows ``their_first..their_last`` of ``panel``."""

    first: int
    last: int
    panel: int
    their_first: int
    their_last: int


def shared_runs(panel: Panel) -> list[SharedRun]:
    """Contiguous runs of ``panel.same_as``, so one bracket covers each."""
    runs: list[SharedRun] = []
    for rank, link in enumerate(panel.same_as):
        if link is None:
            continue
        other, theirs = link
        if runs and _extends(runs[-1], rank, other, theirs):
            previous = runs[-1]
            runs[-1] = SharedRun(previous.first, rank, other, previous.their_first, theirs)
        else:
            runs.append(SharedRun(rank, rank, other, theirs, theirs))
    return runs


def _extends(run: SharedRun, rank: int, other: int, theirs: int) -> bool:
    """Whether row ``rank`` continues ``run``: the next row, the same panel, one row on (either
    way, so a mirrored run stays one bracket)."""
    if rank != run.last + 1 or other != run.panel or abs(theirs - run.their_last) != 1:
        return False
    step = run.their_last - run.their_first
    return step == 0 or step * (theirs - run.their_last) > 0


def _shared_text(run: SharedRun, scene: Scene) -> str:
    source = scene.panels[run.panel]
    name = source.display or source.title.split(":")[0]
    rows = (
        f"row {run.their_first}"
        if run.first == run.last
        else f"rows {run.their_first}-{run.their_last}"
    )
    return "= " + "\n".join(textwrap.wrap(name, 18)) + "\n" + rows


def _text_inches(text: str, points: float, bold: bool = False) -> float:
    """How wide ``text`` (its longest line) sets, measured from the font without a renderer, so
    margins and wrapping are planned before anything is drawn."""
    font = FontProperties(size=points, weight="bold" if bold else "normal")
    measure = TextToPath()
    widths = (measure.get_text_width_height_descent(line, font, ismath=False)[0]
              for line in text.split("\n"))  # fmt: skip
    return max(widths, default=0.0) / 72


def wrap_title(title: str, width_inches: float, points: float = TITLE_POINTS) -> str:
    """``title`` broken after its ": " and ", " into lines that fit ``width_inches``, so a long
    name or a narrow figure wraps instead of running off the right edge."""
    lines: list[str] = []
    for piece in re.split(r"(?<=[:,]) ", title):
        if lines and _text_inches(f"{lines[-1]} {piece}", points) <= width_inches:
            lines[-1] += " " + piece
        else:
            lines.append(piece)
    return "\n".join(lines)


def _is_heat(panel: Panel) -> bool:
    return panel.ranks > MANY_RANKS


def _right_inches(scene: Scene) -> float:
    """The margin right of the data: room for shared-row brackets and heat-map colour bars."""
    need = 0.2
    for panel in scene.panels:
        for run in shared_runs(panel):
            need = max(need, 0.3 + _text_inches(_shared_text(run, scene), SHARED_POINTS, True))
        if _is_heat(panel):
            need = max(need, 0.95)
    return need


def _hatch_label(scene: Scene) -> str | None:
    """What the hatching means in this scene: DualPipe's second direction, a V's second leg."""
    bidirectional = v = False
    for panel in scene.panels:
        if any(box.leg for box in panel.boxes):
            two_pipes = panel.timeline.schedule.placement.num_pipes > 1
            bidirectional, v = bidirectional or two_pipes, v or not two_pipes
    if bidirectional and v:
        return "hatched: second direction / leg"
    if bidirectional or v:
        return "hatched: second direction" if bidirectional else "hatched: second leg of the V"
    return None


def legend_handles(scene: Scene) -> list[Patch]:
    """One entry per kind the scene shows, then hatching, idle and a ghost where present."""
    handles = [
        Patch(facecolor=KIND_COLOURS[kind], edgecolor="#4d4d4d", hatch=KIND_HATCH.get(kind),
              label=legend_name(kind))
        for kind in scene.kinds
    ]  # fmt: skip
    if any(p.step_ends for p in scene.panels):
        handles.append(
            Patch(facecolor=to_rgba("#808080", ODD_STEP_ALPHA), edgecolor="#4d4d4d",
                  label="lighter: odd steps")
        )  # fmt: skip
        handles.append(
            Line2D([], [], color="#000000", marker="|", linestyle="none", markersize=11,
                   markeredgewidth=2, label="a rank's next step may start")
        )  # fmt: skip
    hatch = _hatch_label(scene)
    if hatch:
        handles.append(
            Patch(facecolor="white", edgecolor="#111111", hatch=LEG_HATCH[1], label=hatch)
        )
    handles.append(Patch(facecolor=IDLE_COLOUR, label="idle"))
    if any(p.ghost for p in scene.panels):
        handles.append(
            Patch(facecolor="none", edgecolor="#000000", linestyle="--", label="simulated")
        )
    return handles


def _legend_columns(labels: list[str], width_inches: float) -> int:
    """The most columns whose entries, read row by row, fit across ``width_inches``."""
    em = LEGEND_POINTS / 72
    widths = [LEGEND_ENTRY_EMS * em + _text_inches(label, LEGEND_POINTS) for label in labels]
    for columns in range(len(widths), 1, -1):
        total = sum(max(widths[column::columns]) for column in range(columns))
        if total <= width_inches:
            return columns
    return 1


def row_major(items: list, columns: int) -> list:
    """``items`` reordered so a legend, which fills column by column, reads row by row."""
    rows = ceil(len(items) / columns)
    return [items[row * columns + column] for column in range(columns) for row in range(rows)
            if row * columns + column < len(items)]  # fmt: skip


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


def _draw_boxes(ax: Axes, panel: Panel, end: float) -> int:
    """Idle bars, the op boxes (one collection per kind and leg) and any ghost; the box count."""
    begin = panel.timeline.begin
    ax.barh(range(panel.ranks), end - begin, left=begin, height=2 * HALF, color=IDLE_COLOUR,
            linewidth=0)  # fmt: skip
    groups: dict[tuple[str, int, int], list[Box]] = {}
    for box in panel.boxes:
        groups.setdefault((box.kind, box.leg, box.step % 2), []).append(box)
    for (kind, leg, odd), boxes in sorted(groups.items()):
        ax.add_collection(
            PolyCollection(
                _rectangles(boxes),
                facecolors=to_rgba(KIND_COLOURS[kind], ODD_STEP_ALPHA if odd else 1.0),
                edgecolors=LEG_EDGE[leg],
                linewidths=0.3,
                hatch=KIND_HATCH.get(kind) or LEG_HATCH[leg] or None,
            )
        )
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
    return len(panel.boxes)


def _draw_labels(ax: Axes, panel: Panel, pixels_per_unit: float) -> None:
    """The microbatch in every box wide enough to hold it (up to ``MAX_LABELS``)."""
    labels = 0
    for box in panel.boxes:
        if labels >= MAX_LABELS:
            break
        if box.label and (box.end - box.start) * pixels_per_unit >= 4 + 5 * len(box.label):
            ax.text((box.start + box.end) / 2, box.rank, box.label, ha="center", va="center",
                    fontsize=6.5, color=TEXT_ON[box.kind])  # fmt: skip
            labels += 1


def _draw_steps(ax: Axes, panel: Panel) -> None:
    """A tick where each rank's step ends and each step's number above its first op."""
    if not panel.step_ends:
        return
    ticks = [[(t, rank - HALF), (t, rank + HALF)] for ends in panel.step_ends
             for rank, t in enumerate(ends)]  # fmt: skip
    ax.add_collection(LineCollection(ticks, colors="#000000", linewidths=2.0))
    starts: dict[int, float] = {}
    for box in panel.boxes:
        starts[box.step] = min(starts.get(box.step, box.start), box.start)
    transform = ax.get_xaxis_transform()  # x in data, y in axes fractions
    for step, start in sorted(starts.items()):
        ax.text(start, 1.0, f"step {step}", transform=transform, ha="left", va="bottom",
                fontsize=SMALL_POINTS, fontweight="bold")  # fmt: skip


def _draw_shared(ax: Axes, panel: Panel, scene: Scene, index: int) -> None:
    """A bracket right of each run of rows repeated from an earlier panel, naming that panel."""
    inches = ax.get_position().width * ax.figure.get_figwidth()
    near, far = 1 + 0.06 / inches, 1 + 0.16 / inches
    transform = ax.get_yaxis_transform()  # x in axes fractions, y in rows
    for number, run in enumerate(shared_runs(panel)):
        low, high = run.first - HALF, run.last + HALF
        ax.plot([near, far, far, near], [low, low, high, high], color=SHARED_COLOUR,
                linewidth=1.4, transform=transform, clip_on=False)  # fmt: skip
        text = ax.text(far + 0.06 / inches, (run.first + run.last) / 2, _shared_text(run, scene),
                       transform=transform, ha="left", va="center", fontsize=SHARED_POINTS,
                       color=SHARED_COLOUR, fontweight="bold", clip_on=False)  # fmt: skip
        text.set_gid(f"shared-rows-{index}-{number}")


def heat_grid(panel: Panel, edges: np.ndarray) -> np.ndarray:
    """Per rank, the most memory live in each column between ``edges``: the peak of the step
    function, not a sample of it, so a spike narrower than a column still shows."""
    grid = np.zeros((panel.ranks, len(edges) - 1))
    for rank, points in enumerate(panel.memory):
        times = np.fromiter((t for t, _ in points), float, len(points))
        values = np.append(np.fromiter((v for _, v in points), float, len(points)), 0.0)
        first = np.maximum(np.searchsorted(times, edges[:-1], side="right") - 1, 0)
        last = np.maximum(np.searchsorted(times, edges[1:], side="left") - 1, first)
        grid[rank] = np.maximum.reduceat(values, np.stack([first, last + 1], 1).ravel())[::2]
    return grid


def _memory_heading(ax: Axes, ranks: int) -> None:
    order = " (rank 0 on top)" if ranks > MANY_RANKS else ""
    ax.set_title(f"live activations per rank{order}, in {MEMORY_UNIT}", loc="left",
                 fontsize=SMALL_POINTS + 0.5, pad=3)  # fmt: skip


def memory_groups(panel: Panel) -> list[list[int]]:
    """Ranks whose memory over time is the same, grouped (in order of their first rank): one line
    each, so a rank whose line another one hides (DualPipe's mirrored ranks) is still named."""
    groups: dict[tuple[tuple[float, float], ...], list[int]] = {}
    for rank, points in enumerate(panel.memory):
        groups.setdefault(tuple(points), []).append(rank)
    return list(groups.values())


def _draw_memory_lines(ax: Axes, panel: Panel) -> None:
    """A distinct line per rank (or ranks alike), the legend above the strip, clear of lines."""
    colours = matplotlib.colormaps["tab10"]
    groups = memory_groups(panel)
    for number, ranks in enumerate(groups):
        times, values = zip(*panel.memory[ranks[0]], strict=True)
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        ax.step(times, values, where="post", linewidth=1.2, color=colours(number % 10),
                label=name)  # fmt: skip
    ax.set_ylabel("live act.", fontsize=SMALL_POINTS)
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", linewidth=0.3)
    if panel.ranks > 1:
        ax.legend(loc="lower right", bbox_to_anchor=(1, 1), ncol=len(groups), frameon=False,
                  fontsize=SMALL_POINTS - 0.5, borderaxespad=0.2, handlelength=1.4,
                  columnspacing=1.0)  # fmt: skip


def _draw_memory_heat(ax: Axes, colour_ax: Axes, panel: Panel, span: tuple[float, float],
                      columns: int) -> None:  # fmt: skip
    """A row per rank, colour for live activations, and a colour bar that states the unit."""
    edges = np.linspace(span[0], span[1], columns + 1)
    grid = heat_grid(panel, edges)
    image = ax.imshow(
        grid, aspect="auto", interpolation="nearest", cmap="magma_r", vmin=0,
        vmax=max(float(grid.max()), 1e-12), extent=(span[0], span[1], panel.ranks - 0.5, -0.5),
    )  # fmt: skip
    ticks = sorted({round(r) for r in np.linspace(0, panel.ranks - 1, 5)})
    ax.set_yticks(ticks, [f"rank {r}" for r in ticks], fontsize=7)
    colour_bar = ax.figure.colorbar(image, cax=colour_ax)
    colour_bar.set_label(MEMORY_UNIT.replace(" ", "\n"), fontsize=SMALL_POINTS - 0.5)
    colour_ax.tick_params(labelsize=7)


@dataclass(frozen=True)
class _Band:
    """One panel's heights, in inches, top to bottom."""

    title: float
    rows: float
    heading: float
    memory: float


def _band(panel: Panel, title: str) -> _Band:
    row = DENSE_ROW_INCHES if panel.ranks > DENSE_RANKS else ROW_INCHES
    memory = (
        min(max(HEAT_ROW_INCHES * panel.ranks, 1.2), 2.0) if _is_heat(panel) else LINE_MEMORY_INCHES
    )
    lines = title.count("\n") + 1
    steps = STEP_LABEL_INCHES if panel.step_ends else 0.0
    return _Band(0.1 + 0.2 * lines + steps, row * panel.ranks, 0.34, memory)


@dataclass
class _Frame:
    """The figure being built and where things go on it: positions are planned in inches."""

    figure: Figure
    plot: float  # the data's width
    span: tuple[float, float]  # the time axis
    timed: list[Axes] = field(default_factory=list)  # axes on the time axis, top to bottom

    def rect(self, left: float, low: float, wide: float, tall: float) -> tuple[float, ...]:
        width, height = self.figure.get_size_inches()
        return (left / width, low / height, wide / width, tall / height)

    def axes(self, low: float, tall: float, label: str) -> Axes:
        """Axes on the shared time axis, ``tall`` inches high with its bottom at ``low``."""
        rect = self.rect(LEFT_INCHES, low, self.plot, tall)
        made = self.figure.add_axes(rect, sharex=self.timed[0] if self.timed else None, label=label)
        made.tick_params(axis="x", labelbottom=False)
        self.timed.append(made)
        return made


def _draw_panel(frame: _Frame, scene: Scene, index: int, band: _Band, title: str,
                cursor: float) -> tuple[int, float]:  # fmt: skip
    """One panel's rows and memory strip below ``cursor``; the boxes drawn and the new cursor."""
    panel = scene.panels[index]
    start, end = frame.span
    cursor -= band.title + band.rows
    rows_ax = frame.axes(cursor, band.rows, f"panel {index}")
    drawn = _draw_boxes(rows_ax, panel, end)
    _draw_labels(rows_ax, panel, frame.plot * frame.figure.dpi / max(end - start, 1e-12))
    _draw_steps(rows_ax, panel)
    rows_ax.set_ylim(panel.ranks - 0.5, -0.5)
    rows_ax.set_yticks(range(panel.ranks), [f"rank {r}" for r in range(panel.ranks)],
                       fontsize=7 if panel.ranks > DENSE_RANKS else 8)  # fmt: skip
    pad = 5 + (STEP_LABEL_INCHES * 72 if panel.step_ends else 0)
    rows_ax.set_title(title, fontsize=TITLE_POINTS, loc="left", pad=pad)
    _draw_shared(rows_ax, panel, scene, index)
    cursor -= band.heading + band.memory
    memory_ax = frame.axes(cursor, band.memory, f"memory {index}")
    _memory_heading(memory_ax, panel.ranks)
    if _is_heat(panel):
        rect = frame.rect(LEFT_INCHES + frame.plot + 0.12, cursor, 0.12, band.memory)
        colour_ax = frame.figure.add_axes(rect, label=f"colour bar {index}")
        _draw_memory_heat(memory_ax, colour_ax, panel, frame.span, int(frame.plot * DPI))
    else:
        _draw_memory_lines(memory_ax, panel)
    return drawn, cursor


def render(scene: Scene) -> tuple[Figure, int]:
    """A matplotlib figure of ``scene`` and how many op boxes it holds (nothing saved yet)."""
    with matplotlib.rc_context(RC):
        return _render(scene)


def _render(scene: Scene) -> tuple[Figure, int]:
    plot = WIDTH_INCHES - LEFT_INCHES - _right_inches(scene)
    titles = [wrap_title(p.title, plot) for p in scene.panels]
    bands = [_band(p, t) for p, t in zip(scene.panels, titles, strict=True)]
    handles = legend_handles(scene)
    columns = _legend_columns([h.get_label() for h in handles], WIDTH_INCHES - 0.3)
    top = 0.2 + 0.24 * ceil(len(handles) / columns)
    gap, bottom = 0.3, 0.55
    height = top + sum(b.title + b.rows + b.heading + b.memory + gap for b in bands) - gap + bottom
    start = min(p.timeline.begin for p in scene.panels)
    end = max(scene.end, start + 1e-9)  # all costs zero: an empty axis, not a singular one
    frame = _Frame(Figure(figsize=(WIDTH_INCHES, height)), plot, (start, end))
    drawn, cursor = 0, height - top
    for index, (band, title) in enumerate(zip(bands, titles, strict=True)):
        count, cursor = _draw_panel(frame, scene, index, band, title, cursor)
        drawn, cursor = drawn + count, cursor - gap
    last = frame.timed[-1]
    last.tick_params(axis="x", labelbottom=True)
    last.set_xlim(start, end)
    last.set_xlabel("time (cost units)" if scene.unit == "cost" else f"time ({scene.unit})")
    frame.figure.legend(handles=row_major(handles, columns), loc="upper center",
                        bbox_to_anchor=(0.5, 1 - 0.06 / height), ncol=columns,
                        fontsize=LEGEND_POINTS, frameon=False, handlelength=LEGEND_HANDLE_EMS,
                        handletextpad=LEGEND_PAD_EMS,
                        columnspacing=LEGEND_SPACING_EMS)  # fmt: skip
    return frame.figure, drawn


def save(scene: Scene, path: str | Path, dpi: int = DPI) -> int:
    """Write ``scene`` as a PNG or SVG (by the path's ending), atomically; return the boxes drawn.

    Refuses scenes of more than ``MAX_IMAGE_BOXES`` boxes before drawing (use the HTML page).
    """
    check_boxes(scene.box_count, MAX_IMAGE_BOXES, "a PNG or SVG image")
    figure, drawn = render(scene)
    kind = Path(path).suffix.lstrip(".").lower() or "png"
    with matplotlib.rc_context(RC):
        write_with(path, lambda temporary: figure.savefig(temporary, dpi=dpi, format=kind))
    return drawn
