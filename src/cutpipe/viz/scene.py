"""What a picture of a timeline shows, independent of how it is drawn.

A ``Scene`` holds one or more *panels* (a schedule's timeline each, stacked on one time axis): per
op a box with its rank, start, end, kind, stage, microbatch, leg (the two directions of DualPipe,
the two legs of a V) and what it waited for; per rank the live activation memory over time; and
the metrics. A panel of several steps (``steps_panel``) holds every step's boxes, each with its
step, the all-reduces and optimizer steps between them, and where each rank's step ended. The
PNG/SVG, HTML and Chrome-trace writers all render a scene, and the tests check scenes rather than
pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cutpipe.schedule.actions import Action, Overlap, units
from cutpipe.schedule.dataflow import Key, awaited, produced
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import activation_trace
from cutpipe.sim.metrics import Metrics, metrics
from cutpipe.sim.steps import MultiStep
from cutpipe.sim.timeline import Timeline

#: The most op boxes one picture holds. Past it a picture shows nothing a smaller run would
#: not (a box is narrower than a pixel) and takes long to build; see docs/cli.md, "Limits".
MAX_BOXES = 200_000
#: The most boxes of a PNG or SVG image: matplotlib draws a few thousand boxes a second, so
#: this takes a few seconds; the HTML page and the Chrome trace take up to ``MAX_BOXES``.
MAX_IMAGE_BOXES = 50_000


def check_boxes(count: int, limit: int = MAX_BOXES, what: str = "a picture") -> None:
    """A ValueError with the limit and what to change if ``count`` boxes are too many."""
    if count <= limit:
        return
    other = "" if limit >= MAX_BOXES else f", or write .html, which takes up to {MAX_BOXES:,}"
    raise ValueError(
        f"{what} of {count:,} ops is over the limit of {limit:,} boxes: draw fewer ranks or "
        f"microbatches (the bubble and the order show as well at a smaller size){other}"
    )


@dataclass(frozen=True, slots=True)
class Box:
    """One op on one rank."""

    rank: int
    start: float
    end: float
    kind: str  # "F", "B", "W", "BW" or "FB"
    stage: int  # for an overlapped pair: the forward's
    microbatch: int  # for an overlapped pair: the forward's
    leg: int  # 0 or 1: which direction (DualPipe) or leg of the V (ZB-V, DualPipeV) it runs in
    name: str  # the op in PyTorch's notation, e.g. "3F1" or "(0F7;7B3)"
    label: str  # what fits in the box: the microbatch (counted per direction), "7/3" for a pair
    waited: str  # why it started when it did
    step: int = 0  # which training step it belongs to, in a panel of several


#: Kinds in the order legends list them; AR (the gradient all-reduce every rank waits for at a
#: synchronised step boundary) and OPT (an optimizer step) appear only between steps.
KIND_ORDER = ("F", "B", "W", "BW", "FB", "AR", "OPT")


@dataclass(frozen=True)
class Panel:
    """One schedule's timeline, ready to draw."""

    title: str
    timeline: Timeline
    boxes: list[Box]
    memory: list[list[tuple[float, float]]]  # per rank: (time, live activations) steps
    metrics: Metrics
    ghost: list[Box] | None = None  # a simulated prediction drawn over a measured timeline
    #: the schedule's display name: "Cut-in-half (DualPipeV)", "ZB-V", "Interleaved 1F1B", ...
    display: str = ""
    #: parameters the fullest rank stores, as a multiple of an even 1/R split: DualPipe keeps
    #: every stage on two ranks (2x), Cut-in-half and every single-pipe schedule once (1x)
    parameter_copies: float = 1.0
    #: per rank, (earlier panel, its rank) whose row this one repeats box for box, or None
    same_as: tuple[tuple[int, int] | None, ...] = ()
    #: in a panel of several steps: per step, per rank, when the rank may start its next step
    step_ends: tuple[tuple[float, ...], ...] = ()

    @property
    def ranks(self) -> int:
        return self.timeline.num_ranks

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of op this panel (and its ghost) shows, in legend order."""
        present = {b.kind for b in self.boxes} | {b.kind for b in self.ghost or ()}
        return tuple(kind for kind in KIND_ORDER if kind in present)


@dataclass(frozen=True)
class Scene:
    panels: list[Panel]
    unit: str  # "cost" (the cost model's units) or "s"

    @property
    def end(self) -> float:
        return max(max((b.end for b in p.boxes), default=0.0) for p in self.panels)

    @property
    def box_count(self) -> int:
        return sum(len(p.boxes) for p in self.panels)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of op any panel shows, in legend order (what a legend should list)."""
        present = {kind for p in self.panels for kind in p.kinds}
        return tuple(kind for kind in KIND_ORDER if kind in present)


def display_name(name: str) -> str:
    """What a picture calls a schedule: the registry's title ("Cut-in-half (DualPipeV)", "ZB-V",
    "Interleaved 1F1B (chunks=4)"); a name the registry does not know (a tuned or imported
    schedule) as it is."""
    try:
        return schedule_info(name).display_title
    except (TypeError, ValueError):
        return name


def _index_in_pipe(timeline: Timeline, microbatch: int) -> int:
    """A microbatch's number within its direction (DualPipe numbers each direction from 0)."""
    schedule = timeline.schedule
    pipe = schedule.pipe_of(microbatch)
    return microbatch - schedule.placement.microbatches_of(pipe, schedule.num_microbatches).start


def _leg(timeline: Timeline, action: Action) -> int:
    """Direction or leg an action runs in: DualPipe's pipe, a V's second half, else 0."""
    schedule = timeline.schedule
    placement = schedule.placement
    if placement.num_pipes > 1:
        return schedule.pipe_of(action.microbatch)
    if placement.kind == "v":
        return int(action.stage >= placement.num_ranks)
    return 0


def _boxes(timeline: Timeline, comm: float) -> list[Box]:
    schedule = timeline.schedule
    S = schedule.num_stages
    made: dict[Key, tuple[int, float, str]] = {}  # the value -> (rank, end, op) that made it
    for rank in range(timeline.num_ranks):
        for op, _, end in timeline.events(rank):
            for action in units(op):
                key = produced(*action)
                if key is not None:
                    made[key] = (rank, end, str(action))
    boxes = []
    for rank in range(timeline.num_ranks):
        free_at, previous = timeline.begin, None
        for op, start, end in timeline.events(rank):
            halves = units(op)
            head = halves[0]
            latest = None
            for action in halves:
                need = awaited(*action, S)
                if need is not None and need in made:
                    source, ready, name = made[need]
                    ready += comm if source != rank else 0.0
                    if latest is None or ready > latest[0]:
                        latest = (ready, name, source)
            if latest is not None and latest[0] > free_at + 1e-12:
                waited = f"waited for {latest[1]} from rank {latest[2]} (ready at {latest[0]:.6g})"
            elif previous is None:
                waited = "first op of the rank"
            else:
                waited = f"started when {previous} ended: the rank was busy, not waiting"
            if type(op) is Overlap:
                forward = _index_in_pipe(timeline, op.forward.microbatch)
                backward = _index_in_pipe(timeline, op.backward.microbatch)
                kind, label, name = (
                    "FB",
                    f"{forward}/{backward}",
                    str(op).removesuffix("OVERLAP_F_B"),
                )
            else:
                kind, label, name = (
                    head.kind.name,
                    str(_index_in_pipe(timeline, head.microbatch)),
                    str(head),
                )
            boxes.append(
                Box(
                    rank,
                    start,
                    end,
                    kind,
                    head.stage,
                    head.microbatch,
                    _leg(timeline, head),
                    name,
                    label,
                    waited,
                )
            )
            free_at, previous = end, name
    return boxes


def _memory(timeline: Timeline, costs: Costs) -> list[list[tuple[float, float]]]:
    """Per rank: live activations at each op start (the op's high) and end (after it)."""
    traces = activation_trace(timeline.schedule, costs)
    series = []
    for rank, trace in enumerate(traces):
        points = [(timeline.begin, 0.0)]
        for (high, after), start, end in zip(
            trace, timeline.starts[rank], timeline.ends[rank], strict=True
        ):
            points.append((start, high))
            points.append((end, after))
        series.append(points)
    return series


def panel(timeline: Timeline, costs: Costs | None = None, ghost: Timeline | None = None) -> Panel:
    """A drawable panel of ``timeline``; ``ghost``, a simulated timeline, is drawn over it."""
    costs = costs or Costs()
    schedule = timeline.schedule
    result = metrics(timeline, costs)
    measured = "measured " if timeline.source == "measured" else ""
    display = display_name(schedule.name)
    copies = max(schedule.placement.parameter_shares()) * schedule.num_ranks
    title = (
        f"{measured}{display}: R={schedule.num_ranks}, m={schedule.num_microbatches}, "
        f"bubble {result.bubble_ratio:.1%} (span {result.bubble_ratio_span:.1%}), "
        f"peak activations {max(result.peak_activations_per_rank):g}, params {copies:g}x"
    )
    comm = costs.comm if timeline.source == "simulated" else 0.0
    return Panel(
        title=title,
        timeline=timeline,
        boxes=_boxes(timeline, comm),
        memory=_memory(timeline, costs),
        metrics=result,
        ghost=_boxes(ghost, costs.comm) if ghost is not None else None,
        display=display,
        parameter_copies=copies,
        same_as=(None,) * schedule.num_ranks,
    )


def steps_panel(result: MultiStep, costs: Costs | None = None) -> Panel:
    """A drawable panel of several steps: every step's ops (``Box.step`` says which), then per
    rank the all-reduce (``sync``: every rank waits for it) and the optimizer step between
    steps, and where each rank's next step may start (``Panel.step_ends``)."""
    costs = costs or Costs()
    first = result.steps[0]
    base = panel(first, costs)
    boxes: list[Box] = []
    memory: list[list[tuple[float, float]]] = [[] for _ in range(first.num_ranks)]
    for step, (timeline, ready) in enumerate(zip(result.steps, result.ready, strict=True)):
        boxes += [replace(box, step=step) for box in _boxes(timeline, costs.comm)]
        boxes += _boundary_boxes(result, step, timeline, ready)
        for rank, points in enumerate(_memory(timeline, costs)):
            memory[rank] += points if step == 0 else points[1:]
    name = f"{base.display} ({result.boundary})"
    title = (
        f"{name}: R={first.num_ranks}, m={first.schedule.num_microbatches}, {result.count} "
        f"steps, optimizer {result.optimizer:g}, reduction {result.reduction:g}: "
        f"{result.steady:g} per step once the steps repeat, one step alone: makespan "
        f"{result.makespan:g}, longest span {result.span:g}"
    )
    ends = tuple(tuple(t + result.optimizer for t in ready) for ready in result.ready)
    return replace(base, title=title, boxes=boxes, memory=memory, display=name, step_ends=ends)


def _boundary_boxes(
    result: MultiStep, step: int, timeline: Timeline, ready: tuple[float, ...]
) -> list[Box]:
    """The all-reduce every rank waits for (``sync``) and each rank's optimizer step."""
    boxes = []
    for rank, at in enumerate(ready):
        if result.boundary == "sync" and result.reduction > 0:
            boxes.append(
                Box(rank, at - result.reduction, at, "AR", -1, -1, 0, f"all-reduce {step}", "",
                    "the gradient all-reduce, after every rank's last op of the step", step)
            )  # fmt: skip
        if result.optimizer > 0:
            ended = timeline.ends[rank][-1] if timeline.ends[rank] else at
            why = (
                "every rank's last op and the all-reduce"
                if result.boundary == "sync"
                else "its own last op"
            )
            if at > ended and result.boundary == "overlap":
                why = "the previous step's check (reduction)"
            boxes.append(
                Box(rank, at, at + result.optimizer, "OPT", -1, -1, 0, f"optimizer {step}", "",
                    f"the optimizer step, after {why}", step)
            )  # fmt: skip
    return boxes


def steps_scene(results: list[MultiStep], costs: Costs | None = None) -> Scene:
    """A scene of one panel per multi-step simulation (``sync`` above ``overlap``, say)."""
    if not results:
        raise ValueError("nothing to draw: give at least one multi-step simulation")
    check_boxes(sum(r.count * r.schedule.num_ops for r in results))
    panels = [steps_panel(result, costs) for result in results]
    return Scene(_mark_shared_rows(panels), "cost")


def _row_signatures(panel: Panel) -> list[tuple]:
    """Per rank, its boxes' (start, end, kind, label) in order, in one pass over the boxes."""
    rows: list[list[tuple]] = [[] for _ in range(panel.ranks)]
    for box in panel.boxes:
        rows[box.rank].append((box.start, box.end, box.kind, box.label))
    return [tuple(row) for row in rows]


def _mark_shared_rows(panels: list[Panel]) -> list[Panel]:
    """Each row that repeats an earlier panel's row box for box (times, kinds, labels) points at
    it: Cut-in-half's rows are DualPipe's first half, which the pictures then say."""
    first_seen: dict[tuple, tuple[int, int]] = {}
    marked = []
    for index, each in enumerate(panels):
        same_as: list[tuple[int, int] | None] = []
        for rank, signature in enumerate(_row_signatures(each)):
            earlier = first_seen.get(signature) if signature else None
            same_as.append(earlier if earlier is not None and earlier[0] != index else None)
            first_seen.setdefault(signature, (index, rank))
        marked.append(replace(each, same_as=tuple(same_as)))
    return marked


def scene(timelines: list[Timeline], costs: list[Costs] | Costs | None = None,
          ghosts: list[Timeline | None] | None = None) -> Scene:  # fmt: skip
    """A scene of one panel per timeline, all on one time axis (their units must agree)."""
    if not timelines:
        raise ValueError("nothing to draw: give at least one timeline")
    ghosts = ghosts or [None] * len(timelines)
    check_boxes(
        sum(t.schedule.num_ops for t in timelines) + sum(g.schedule.num_ops for g in ghosts if g)
    )
    units_ = {t.unit for t in timelines}
    if len(units_) > 1:
        raise ValueError(f"cannot stack timelines in different units on one axis: {sorted(units_)}")
    per = costs if isinstance(costs, list) else [costs] * len(timelines)
    panels = [panel(t, c, g) for t, c, g in zip(timelines, per, ghosts, strict=True)]
    return Scene(_mark_shared_rows(panels), units_.pop())
