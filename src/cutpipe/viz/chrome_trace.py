"""Scenes as Chrome trace event files, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One process per panel (schedule), one thread per rank, and in them:

- one complete event (``"ph": "X"``) per op, its args saying what it is, what it waited for and
  how many expert-parallel all-to-alls the cost model puts inside it;
- one flow arrow per transfer: a value one op makes and an op on *another* rank reads, from the
  maker's slice to the reader's. Flows are the legacy pair ``"ph": "s"`` / ``"ph": "f"`` with a
  shared ``id``, ``cat`` and ``name`` ("3F1 -> 4F1 activation"), the ``"f"`` with ``"bp": "e"``
  (bind to the enclosing slice). Perfetto's JSON importer and chrome://tracing both bind each
  end to the slice open on its thread at the event's time, so the ``"s"`` sits just inside the
  maker's end and the ``"f"`` just inside the reader's start. A handoff on one rank (a V's turn,
  a last stage's loss, a W after its B) moves nothing and has no arrow; each half of an
  overlapped pair has its own input and output;
- one counter track per rank (``"ph": "C"``) of the live activations (``Panel.memory``), which
  Perfetto names "rank 3 activations".

The timeline records when each op ran, not when its all-to-alls did: the simulator adds
``ep_f``/``ep_b`` to each F's and backward's time (in an overlapped pair, the pair's time covers
both halves' all-to-alls), so the trace marks the ops that hold them (args ``all_to_alls``)
rather than drawing intervals nobody measured.

Times are in microseconds as the format requires: a cost unit is drawn as one millisecond, a
measured second as a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cutpipe.files import write_text
from cutpipe.schedule.actions import units
from cutpipe.schedule.dataflow import ACTIVATION, Key, awaited, produced
from cutpipe.viz.scene import Box, Panel, Scene

#: Keys every event has; a complete event ("X") also has "dur".
REQUIRED = ("name", "ph", "ts", "pid", "tid")
#: How far inside a slice a flow end sits (microseconds; a quarter of a shorter slice). Perfetto
#: binds a flow end to the slice open on its thread, and a slice that starts where another ends
#: would otherwise tie with it.
FLOW_INSET = 1.0
#: The cost model's expert-parallel all-to-alls inside one op of each kind: one per F and one per
#: backward (B or BW), none in a W, both halves' in an overlapped pair (``Metrics.ep_alltoalls``).
ALL_TO_ALLS = {"F": 1, "B": 1, "BW": 1, "W": 0, "FB": 2}
ALL_TO_ALL_NOTE = (
    "the timeline records no all-to-all intervals: the simulator adds ep_f / ep_b to each F's and "
    "backward's time, and an overlapped F&B pair's time covers both halves' all-to-alls; an op's "
    "args.all_to_alls counts the ones inside it"
)


@dataclass(frozen=True, slots=True)
class Transfer:
    """A value one op makes and an op on another rank reads: one flow arrow."""

    source: int  # index in ``panel.boxes`` of the op that makes the value
    target: int  # index in ``panel.boxes`` of the op that reads it
    sender: str  # the action that makes it, e.g. "3F1" (a half of a pair names itself)
    receiver: str  # the action that reads it, e.g. "4F1"
    what: str  # "activation" or "gradient"

    @property
    def name(self) -> str:
        return f"{self.sender} -> {self.receiver} {self.what}"


def transfers(panel: Panel) -> list[Transfer]:
    """Every value that crosses ranks in ``panel``, in the order of the reading op's box.

    Same-rank handoffs are not transfers. An overlapped pair reads and makes one value per half.
    """
    timeline = panel.timeline
    schedule = timeline.schedule
    S = schedule.num_stages
    ops = [op for rank in range(timeline.num_ranks) for op in schedule.actions[rank]]
    if len(ops) != len(panel.boxes):  # boxes are the ops rank by rank, in order
        raise ValueError(f"panel has {len(panel.boxes)} boxes for {len(ops)} ops")
    made: dict[Key, tuple[int, str]] = {}
    for index, op in enumerate(ops):
        for action in units(op):
            key = produced(*action)
            if key is not None:
                made[key] = (index, str(action))
    found = []
    for index, op in enumerate(ops):
        rank = panel.boxes[index].rank
        for action in units(op):
            need = awaited(*action, S)
            if need is None or need not in made:
                continue
            source, sender = made[need]
            if panel.boxes[source].rank != rank:
                what = "activation" if need[0] == ACTIVATION else "gradient"
                found.append(Transfer(source, index, sender, str(action), what))
    return found


def _inset(box: Box, scale: float) -> float:
    return min(FLOW_INSET, (box.end - box.start) * scale / 4)


def _all_to_alls(box: Box) -> dict:
    """The op's args on all-to-alls: how many, and for a pair that they overlap its compute."""
    count = ALL_TO_ALLS.get(box.kind, 0)
    args = {"all_to_alls": count} if count else {}
    if box.kind == "FB":
        args["all_to_alls_overlapped"] = True
    return args


def _metadata(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": tid, "args": args}


def _counters(panel: Panel, pid: int, scale: float) -> list[dict]:
    """Per rank, a counter sample wherever the live activations change."""
    out = []
    for rank, series in enumerate(panel.memory):
        last = None
        for time, value in series:
            if value == last:
                continue  # a counter holds its value until the next sample
            out.append({"name": f"rank {rank}", "ph": "C", "ts": time * scale, "pid": pid,
                        "tid": rank, "args": {"activations": value}})  # fmt: skip
            last = value
    return out


def events(scene: Scene, *, flows: bool = True, counters: bool = True) -> list[dict]:
    """The trace events of ``scene``: metadata, slices, flow arrows and memory counters.

    Each panel is a process whose pid is never one of its ranks (Perfetto takes the thread whose
    tid is its pid for the main thread and lists it first). Each slice is followed by the flow
    ends bound to it, so a zero-length slice still comes before them in a stable sort.
    """
    scale = 1e3 if scene.unit == "cost" else 1e6  # to microseconds
    first_pid = max(p.ranks for p in scene.panels)
    out: list[dict] = []
    flow_id = 0
    for index, panel in enumerate(scene.panels):
        pid = first_pid + index
        out.append(_metadata("process_name", pid, 0, {"name": panel.title}))
        out.append(_metadata("process_sort_index", pid, 0, {"sort_index": index}))
        for rank in range(panel.ranks):
            out.append(_metadata("thread_name", pid, rank, {"name": f"rank {rank}"}))
            out.append(_metadata("thread_sort_index", pid, rank, {"sort_index": rank}))
        incoming: dict[int, list[tuple[int, Transfer]]] = {}
        outgoing: dict[int, list[tuple[int, Transfer]]] = {}
        for transfer in transfers(panel) if flows else ():
            flow_id += 1
            incoming.setdefault(transfer.target, []).append((flow_id, transfer))
            outgoing.setdefault(transfer.source, []).append((flow_id, transfer))
        for number, box in enumerate(panel.boxes):
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
                        **_all_to_alls(box),
                    },
                }
            )
            for ident, transfer in incoming.get(number, ()):
                out.append({"name": transfer.name, "cat": transfer.what, "ph": "f", "bp": "e",
                            "id": ident, "pid": pid, "tid": box.rank,
                            "ts": box.start * scale + _inset(box, scale)})  # fmt: skip
            for ident, transfer in outgoing.get(number, ()):
                out.append({"name": transfer.name, "cat": transfer.what, "ph": "s",
                            "id": ident, "pid": pid, "tid": box.rank,
                            "ts": box.end * scale - _inset(box, scale)})  # fmt: skip
        if counters:
            out.extend(_counters(panel, pid, scale))
    return out


def save(scene: Scene, path: str | Path, *, flows: bool = True, counters: bool = True) -> int:
    """Write the trace of ``scene`` atomically; return the number of op events."""
    unit = "1 cost unit = 1 ms" if scene.unit == "cost" else "seconds"
    other = {"producer": "cutpipe", "time": unit, "all_to_alls": ALL_TO_ALL_NOTE}
    trace = {
        "traceEvents": events(scene, flows=flows, counters=counters),
        "displayTimeUnit": "ms",
        "otherData": other,
    }
    write_text(path, json.dumps(trace, allow_nan=False))
    return scene.box_count
