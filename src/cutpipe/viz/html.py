"""Scenes as one self-contained HTML page: a canvas timeline with zoom, pan and tooltips.

The page embeds its data as JSON and its script inline, so it opens from disk with no network.
Boxes are stored column by column and drawn on a canvas, culled to the visible time range and
found under the pointer by binary search per rank, so 25,000 boxes stay responsive.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from cutpipe.files import write_text
from cutpipe.viz.scene import Box, Scene
from cutpipe.viz.style import KIND_COLOURS, KIND_NAMES, TEXT_ON

KINDS = list(KIND_COLOURS)


def _columns(boxes: list[Box]) -> dict[str, list]:
    index = {kind: i for i, kind in enumerate(KINDS)}
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


def page(scene: Scene, title: str | None = None) -> str:
    """The HTML page of ``scene``."""
    title = title or " / ".join(p.timeline.schedule.name for p in scene.panels) + " - cutpipe"
    data = {
        "unit": scene.unit,
        "begin": min(p.timeline.begin for p in scene.panels),
        "end": scene.end,
        "rows": sum(p.ranks for p in scene.panels),
        "kinds": KINDS,
        "colours": KIND_COLOURS,
        "text": TEXT_ON,
        "names": KIND_NAMES,
        "panels": [
            {
                "title": p.title,
                "ranks": p.ranks,
                "begin": p.timeline.begin,
                "end": max((b.end for b in p.boxes), default=p.timeline.begin),
                "boxes": _columns(p.boxes),
                "ghost": _columns(p.ghost) if p.ghost else None,
                "memory": [{"t": [t for t, _ in s], "v": [v for _, v in s]} for s in p.memory],
                "metrics": p.metrics.to_dict(),
            }
            for p in scene.panels
        ],
    }
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    template = files("cutpipe.viz").joinpath("page.html").read_text()
    escaped = title.replace("&", "&amp;").replace("<", "&lt;")
    return template.replace("__TITLE__", escaped).replace("__DATA__", payload)


def save(scene: Scene, path: str | Path) -> int:
    """Write the page of ``scene`` atomically; return the number of op boxes on it."""
    write_text(path, page(scene))
    return scene.box_count
