"""Schedule files: one versioned JSON format for every command, and torch's CSV in and out.

JSON (``.json``) is cutpipe's own format, written by ``cutpipe schedule -o`` and ``cutpipe tune
-o`` and read by ``--from FILE`` in ``simulate``, ``draw``, ``compare`` and ``train``::

    {"format": "cutpipe.schedule", "version": 1, "name": "dualpipev",
     "placement": {"kind": "v", "num_ranks": 4, "pipes": [[0, 1, 2, 3, 3, 2, 1, 0]]},
     "num_microbatches": 10, "actions": [["0F0", "0F1", ...], ...]}

CSV (``.csv``) is what ``torch.distributed.pipelining`` reads (``_load_csv``, torchtitan's
``pipeline_parallel_schedule_csv``): one row per rank, one compute action per cell in torch's
notation, with no placement: reading one infers the placement from which rank runs each stage,
which only works when every stage is on one rank (DualPipe's two pipes have no CSV form).

Both round-trip exactly: ``load_schedule(path) == schedule`` after ``save_schedule(schedule,
path)`` (a CSV's name is its file's stem). Every schedule read is validated before it is
returned, so a hand-edited file that would deadlock fails here, naming the op. A file is
refused before it is read when it is no regular file (a pipe would block the read) or larger than
``limits.MAX_FILE_BYTES``, and after parsing when it holds more than ``limits.MAX_OPS`` ops.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
from pathlib import Path

from cutpipe.files import write_text
from cutpipe.records import require_keys
from cutpipe.schedule.actions import Op, parse_op, units
from cutpipe.schedule.limits import FILE_BYTES_PER_OP, MAX_FILE_BYTES, MAX_OPS, check_ops
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import validate

FORMAT = "cutpipe.schedule"
VERSION = 1
#: File endings and the format each one means.
ENDINGS = {".json": "json", ".csv": "csv"}
#: What ``dumps`` writes: the two file formats and the text ``cutpipe schedule`` prints.
FORMATS = ("text", "csv", "json")

TEXT_LEGEND = (
    "# notation of torch.distributed.pipelining: <stage><kind><microbatch>; F forward, I input-only "
    "backward, W weight backward, B full backward, (..;..)OVERLAP_F_B an overlapped pair"
)


def format_of(path: str | os.PathLike) -> str:
    """``"json"`` or ``"csv"`` from the file's ending; a ValueError for any other ending."""
    suffix = Path(path).suffix.lower()
    if suffix not in ENDINGS:
        raise ValueError(
            f"cannot tell the schedule format of {path}: name it .json (cutpipe's format) or "
            ".csv (torch.distributed.pipelining's)"
        )
    return ENDINGS[suffix]


def dumps(schedule: Schedule, format: str = "json") -> str:
    """``schedule`` as text in ``format``: ``"json"``, ``"csv"`` or ``"text"`` (for people)."""
    if format == "json":
        record = {"format": FORMAT, "version": VERSION, **schedule.to_dict()}
        return json.dumps(record, allow_nan=False) + "\n"
    if format == "csv":
        if schedule.placement.num_pipes != 1:
            raise ValueError(
                f"{schedule.name!r} puts every stage on two ranks ({schedule.placement.kind} "
                "placement), which torch's CSV cannot express: save it as .json"
            )
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for ops in schedule.actions:
            writer.writerow([str(op) for op in ops])
        return out.getvalue()
    if format == "text":
        return f"{TEXT_LEGEND}\n{schedule.text()}\n"
    raise ValueError(f"unknown schedule format {format!r}: use one of {', '.join(FORMATS)}")


def loads(text: str, format: str = "json", name: str = "imported") -> Schedule:
    """The schedule in ``text`` (``"json"`` or ``"csv"``), validated; ``name`` names a CSV's."""
    if format == "json":
        schedule = _from_json(text)
    elif format == "csv":
        rows = list(csv.reader(io.StringIO(text)))
        check_ops(sum(1 for row in rows for cell in row if cell.strip()))
        schedule = from_rows(name, rows)
    else:
        raise ValueError(f"cannot read schedules as {format!r}: use json or csv")
    validate(schedule)
    return schedule


def save_schedule(schedule: Schedule, path: str | os.PathLike, format: str | None = None) -> None:
    """Write ``schedule`` to ``path`` atomically, in ``format`` or the one its ending names."""
    write_text(path, dumps(schedule, format or format_of(path)))


def load_schedule(path: str | os.PathLike) -> Schedule:
    """The schedule in a ``.json`` (cutpipe) or ``.csv`` (torch) file, validated."""
    format = format_of(path)
    raw = _read_bounded(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file: expected a schedule as {format}") from None
    try:
        return loads(text, format, name=Path(path).stem)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _read_bounded(path: str | os.PathLike) -> bytes:
    """The bytes of the regular file at ``path``, refused by its size before they are read."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise ValueError(f"cannot read schedule file {path}: {error.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a pipe?)"
        raise ValueError(f"{path} is {what}: give a schedule file")
    limit = f"{MAX_FILE_BYTES:,} bytes ({MAX_OPS:,} ops of at most {FILE_BYTES_PER_OP} bytes)"
    if info.st_size > MAX_FILE_BYTES:
        raise ValueError(
            f"{path} is {info.st_size:,} bytes, more than a schedule file may be, {limit}: "
            "give a schedule of fewer ops"
        )
    with open(path, "rb") as file:  # a regular file: opening it cannot block
        raw = file.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:  # it grew since the stat
        raise ValueError(f"{path} grew past {limit} while it was read: give a smaller schedule")
    return raw


def _from_json(text: str) -> Schedule:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at line {error.lineno})") from None
    record = require_keys(record, "schedule file", ("placement", "num_microbatches", "actions"))
    actions = record["actions"]
    if isinstance(actions, list):
        check_ops(sum(len(ops) for ops in actions if isinstance(ops, list)))
    version = record.get("version", VERSION)  # tune -o of cutpipe 0.1 wrote no header
    if record.get("format", FORMAT) != FORMAT:
        raise ValueError(f"not a schedule: its format is {record['format']!r}, not {FORMAT!r}")
    if version != VERSION:
        raise ValueError(
            f"schedule file version {version!r} is not one this cutpipe reads ({VERSION}): "
            "upgrade cutpipe, or write the file again with this one"
        )
    return Schedule.from_dict(record)


def from_rows(name: str, rows: list[list[str]]) -> Schedule:
    """A schedule from per-rank lists of ops in torch's notation, its placement inferred.

    Every stage must run on exactly one rank. The placement is named ``linear``, ``v`` or
    ``interleaved`` when it is one of those, else ``custom``; the microbatch count is one more
    than the largest microbatch id. Empty cells (torch's idle slots) are skipped.
    """
    ops: list[list[Op]] = []
    for rank, row in enumerate(rows):
        try:
            ops.append([parse_op(cell) for cell in row if cell.strip()])
        except ValueError as error:
            raise ValueError(f"rank {rank}: {error}") from None
    stage_ranks: dict[int, set[int]] = {}
    microbatches = 0
    for rank, rank_ops in enumerate(ops):
        for op in rank_ops:
            for action in units(op):
                stage_ranks.setdefault(action.stage, set()).add(rank)
                microbatches = max(microbatches, action.microbatch + 1)
    if not stage_ranks:
        raise ValueError("the schedule holds no ops")
    stages = max(stage_ranks) + 1
    missing = [s for s in range(stages) if s not in stage_ranks]
    if missing:
        raise ValueError(f"stages {missing} run on no rank: every stage 0..{stages - 1} must run")
    shared = {s: sorted(r) for s, r in stage_ranks.items() if len(r) > 1}
    if shared:
        stage, ranks = next(iter(shared.items()))
        raise ValueError(
            f"stage {stage} runs on ranks {ranks}: a CSV schedule keeps every stage on one rank "
            "(two pipes, as in DualPipe, need cutpipe's .json format)"
        )
    pipe = tuple(stage_ranks[s].pop() for s in range(stages))
    placement = infer_placement(len(ops), pipe)
    return Schedule.from_actions(name, placement, microbatches, ops)


def infer_placement(num_ranks: int, pipe: tuple[int, ...]) -> Placement:
    """The one-pipe placement with ``pipe`` as its stage-to-rank map, named when it is known."""
    for known in (
        Placement.linear(num_ranks),
        Placement.vshape(num_ranks),
        Placement.interleaved(num_ranks, max(1, len(pipe) // num_ranks)),
    ):
        if known.pipes == (pipe,):
            return known
    return Placement("custom", num_ranks, (pipe,))
