"""Scenes as one self-contained HTML page: a canvas timeline with zoom, pan and tooltips.

The page embeds its data as JSON and its script inline, so it opens from disk with no network.
Boxes are stored column by column and drawn on a canvas, culled to the visible time range and
found under the pointer by binary search per rank, so 25,000 boxes stay responsive.

Everything the page says in words (legend entries, parameter copies, which rows repeat which) is
worked out here, so tests can read it from the embedded JSON; the script only lays it out.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from cutpipe.files import write_text
from cutpipe.viz.scene import Box, Panel, Scene
from cutpipe.viz.style import KIND_COLOURS, KIND_NAMES, TEXT_ON

#: Legend entries on the page; an F&B box's label needs saying, it holds two microbatches.
LEGEND_NAMES = {**KIND_NAMES, "FB": "F&B overlapped pair, labelled forward mb / backward mb"}
#: What one unit of the memory strips is (``Costs.activation``: what one F leaves live).
MEMORY_UNIT = "one stage's activations for one microbatch"
#: Panels with more ranks show memory as a heat map, one thin row per rank: more lines tangle.
HEAT_MAP_ABOVE = 8
#: What the hatched second leg means, by placement kind.
LEG_NAMES = {"bidirectional": "second direction (DualPipe)", "v": "second leg of the V"}


def _columns(boxes: list[Box], kinds: list[str]) -> dict[str, list]:
    index = {kind: i for i, kind in enumerate(kinds)}
    return {
        "rank": [b.rank for b in boxes],
        "start": [b.start for b in boxes],
        "end": [b.end for b in boxes],
        "kind": [index[b.kind] for b in boxes],
        "leg": [b.leg for b in boxes],
        "stage": [b.stage for b in boxes],
        "microbatch": [b.microbatch for b in boxes],
        "label": [b.label for b in boxes],
        "name": [b.name for b in boxes],
        "waited": [b.waited for b in boxes],
    }


def _name(panel: Panel) -> str:
    return panel.display or panel.timeline.schedule.name


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _runs(same_as: tuple[tuple[int, int] | None, ...]) -> list[tuple[int, int, int, int]]:
    """Consecutive rows repeating consecutive rows of one earlier panel, as (first row, last
    row, that panel, its first row)."""
    runs: list[tuple[int, int, int, int]] = []
    for rank, source in enumerate(same_as):
        if source is None:
            continue
        if runs:
            first, last, panel, source_first = runs[-1]
            if last == rank - 1 and source == (panel, source_first + rank - first):
                runs[-1] = (first, rank, panel, source_first)
                continue
        runs.append((rank, rank, *source))
    return runs


def shared_rows(scene: Scene) -> list[dict]:
    """Each run of rows that repeats an earlier panel's rows box for box, with the note the page
    writes at both ends (Cut-in-half's rows 0-3 are DualPipe's rows 0-3)."""
    shared = []
    for index, panel in enumerate(scene.panels):
        for first, last, source, source_first in _runs(panel.same_as):
            source_last = source_first + last - first
            there = scene.panels[source]
            shared.append(
                {
                    "panel": index,
                    "rows": [first, last],
                    "source": source,
                    "source_rows": [source_first, source_last],
                    "note": f"rows {_span(first, last)} = {_name(there)} rows "
                    f"{_span(source_first, source_last)}, box for box",
                    "source_note": f"rows {_span(source_first, source_last)} repeat as "
                    f"{_name(panel)} rows {_span(first, last)}",
                }
            )
    return shared


def legend(scene: Scene) -> list[dict]:
    """The legend: the kinds of op on the page, then the second direction or leg if any box runs
    in it, then idle time."""
    entries = [
        {"kind": kind, "name": LEGEND_NAMES[kind], "colour": KIND_COLOURS[kind]}
        for kind in scene.kinds
    ]
    legs = [
        LEG_NAMES.get(p.timeline.schedule.placement.kind, "second leg")
        for p in scene.panels
        if any(b.leg for b in p.boxes)
    ]
    if legs:
        entries.append({"kind": "leg", "name": " / ".join(dict.fromkeys(legs)), "colour": None})
    entries.append({"kind": "idle", "name": "idle", "colour": None})
    return entries


def _parameters(panel: Panel) -> str:
    """The panel's parameter storage in words: '2x an even 1/8 split'."""
    return f"{panel.parameter_copies:g}x an even 1/{panel.ranks} split"


def _panel_data(panel: Panel, kinds: list[str]) -> dict:
    return {
        "title": panel.title,
        "display": _name(panel),
        "ranks": panel.ranks,
        "begin": panel.timeline.begin,
        "end": max((b.end for b in panel.boxes), default=panel.timeline.begin),
        "kinds": list(panel.kinds),
        "parameter_copies": panel.parameter_copies,
        "parameters": _parameters(panel),
        "same_as": [list(s) if s is not None else None for s in panel.same_as],
        "boxes": _columns(panel.boxes, kinds),
        "ghost": _columns(panel.ghost, kinds) if panel.ghost else None,
        "memory": [{"t": [t for t, _ in s], "v": [v for _, v in s]} for s in panel.memory],
        "metrics": panel.metrics.to_dict(),
    }


def data(scene: Scene) -> dict:
    """What the page embeds as JSON."""
    kinds = list(scene.kinds)
    return {
        "unit": scene.unit,
        "begin": min(p.timeline.begin for p in scene.panels),
        "end": scene.end,
        "rows": sum(p.ranks for p in scene.panels),
        "kinds": kinds,
        "colours": {k: KIND_COLOURS[k] for k in kinds},
        "text": {k: TEXT_ON[k] for k in kinds},
        "names": {k: LEGEND_NAMES[k] for k in kinds},
        "legend": legend(scene),
        "memory_unit": MEMORY_UNIT,
        "heat_map_above": HEAT_MAP_ABOVE,
        "shared": shared_rows(scene),
        "panels": [_panel_data(p, kinds) for p in scene.panels],
    }


def page(scene: Scene, title: str | None = None) -> str:
    """The HTML page of ``scene``."""
    title = title or " / ".join(_name(p) for p in scene.panels) + " - cutpipe"
    payload = json.dumps(data(scene), separators=(",", ":"), allow_nan=False)
    payload = payload.replace("</", "<\\/")  # no "</script>" inside the script element
    template = files("cutpipe.viz").joinpath("page.html").read_text()
    escaped = title.replace("&", "&amp;").replace("<", "&lt;")
    return template.replace("__TITLE__", escaped).replace("__DATA__", payload)


def save(scene: Scene, path: str | Path) -> int:
    """Write the page of ``scene`` atomically; return the number of op boxes on it."""
    write_text(path, page(scene))
    return scene.box_count
