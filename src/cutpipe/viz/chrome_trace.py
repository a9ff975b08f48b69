"""Scenes as Chrome trace event files, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One process per panel (schedule), one thread per rank, one complete event ("ph": "X") per op.
Times are in microseconds as the format requires: a cost unit is drawn as one millisecond, a
measured second as a second.
"""

from __future__ import annotations

import json
from pathlib import Path

from cutpipe.files import write_text
from cutpipe.viz.scene import Scene

REQUIRED = ("name", "ph", "ts", "dur", "pid", "tid")


def events(scene: Scene) -> list[dict]:
    scale = 1e3 if scene.unit == "cost" else 1e6  # to microseconds
    out: list[dict] = []
    for pid, panel in enumerate(scene.panels):
        out.append({"name": "process_name", "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": 0,
                    "args": {"name": panel.title}})  # fmt: skip
        for rank in range(panel.ranks):
            out.append({"name": "thread_name", "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": rank,
                        "args": {"name": f"rank {rank}"}})  # fmt: skip
        for box in panel.boxes:
            out.append(
                {
                    "name": box.name,
                    "cat": box.kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": box.rank,
                    "ts": box.start * scale,
                    "dur": (box.end - box.start) * scale,
                    "args": {
                        "stage": box.stage,
                        "microbatch": box.microbatch,
                        "leg": box.leg,
                        "waited": box.waited,
                    },
                }
            )
    return out


def save(scene: Scene, path: str | Path) -> int:
    """Write the trace of ``scene`` atomically; return the number of op events."""
    unit = "1 cost unit = 1 ms" if scene.unit == "cost" else "seconds"
    trace = {"traceEvents": events(scene), "displayTimeUnit": "ms",
             "otherData": {"producer": "cutpipe", "time": unit}}  # fmt: skip
    write_text(path, json.dumps(trace, allow_nan=False))
    return scene.box_count
