"""What ``recommend`` returns: plans it simulated and candidates it refused, and their names."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cutpipe.plan.costs.model import PLAIN, Hardware, Training
from cutpipe.plan.plan_file import PlanFile
from cutpipe.plan.recommend.footprint import Footprint
from cutpipe.schedule.registry import schedule_info
from cutpipe.spec import ModelSpec

#: The chunks ``expand`` lists for a schedule named without them, before the pipeline size is
#: known; ``recommend`` tries ``chunk_choices`` for each pipeline size instead.
CHUNK_CHOICES = (2, 4)
#: On one rank (PP = 1) every schedule is plain data parallelism, except that DualPipeV's order
#: overlaps one microbatch's forward with another's backward, hiding expert all-to-alls.
SINGLE_RANK = ("1f1b", "dualpipev")
OVERLAPPING = ("dualpipev",)


@dataclass(frozen=True)
class Plan:
    """One simulated way to train the model on the devices."""

    pp: int
    dp: int
    ep: int
    schedule: str
    microbatches: int
    step_time: float  # seconds
    tokens_per_second: float
    #: the idle share of the busiest rank's pipeline time: 1 - its busy time / the makespan
    #: (or, when steps overlap, / its span)
    bubble: float
    peak_memory: float  # bytes on the fullest device
    comm_share: float
    stage_sizes: list[int]
    #: what ``step_time`` and ``bubble`` measure: "makespan" (steps synchronised) or "span"
    step_measure: str = "makespan"
    training: Training = PLAIN  # ZeRO, recompute, precision, TP
    footprint: Footprint | None = None  # the fullest rank's memory by what holds it
    #: model FLOPs (``training_flops_per_token``, recompute not counted) per second per GPU
    model_tflops_per_gpu: float = 0.0
    mfu: float = 0.0  # model_tflops_per_gpu over the GPU's dense peak in the plan's precision
    hfu: float = 0.0  # the same with the recomputed forward's FLOPs counted
    #: seconds of the busiest rank's step by what fills them (``breakdown.PARTS``); they add
    #: up to ``step_time``
    breakdown: dict[str, float] = field(default_factory=dict)
    busiest_rank: int = 0  # the pipeline rank ``bubble`` and ``breakdown`` describe

    @property
    def tp(self) -> int:
        return self.training.tp

    @property
    def cp(self) -> int:
        return self.training.cp

    def layout(self) -> str:
        return _layout(self.pp, self.dp, self.ep, self.tp, self.cp)

    def shape(self) -> tuple[int, int, int, int, int]:
        """(PP, DP, EP, TP, CP): plans on the same devices in the same way."""
        return self.pp, self.dp, self.ep, self.tp, self.cp

    def schedule_label(self) -> str:
        """Short: the registry name with its chunks, or what a single rank does."""
        if self.pp > 1:
            return self.schedule
        return "none+overlap" if self.schedule in OVERLAPPING else "none"

    def schedule_title(self) -> str:
        if self.pp > 1:
            return title(self.schedule)
        if self.schedule in OVERLAPPING:
            return "no pipeline, F&B overlap"
        return "no pipeline"

    def to_plan_file(self, model: ModelSpec, hardware: Hardware) -> PlanFile:
        """This plan for ``model`` as ``cutpipe recommend -o`` writes it, for ``train --plan``:
        the layout, the schedule's label, the stage sizes it was priced with, the training
        setting and what it predicts on ``hardware``."""
        training = self.training
        return PlanFile(
            model=model.name, layers=model.layers, schedule=self.schedule,
            microbatches=self.microbatches, stage_sizes=tuple(self.stage_sizes), pp=self.pp,
            dp=self.dp, ep=self.ep, tp=self.tp, cp=self.cp, zero=training.zero,
            recompute=training.recompute, fp8=training.fp8,
            sequence_parallel=training.sequence_parallel,
            predicted={
                "step_time": self.step_time, "tokens_per_second": self.tokens_per_second,
                "peak_memory": self.peak_memory, "hardware": hardware.name,
            },
        )  # fmt: skip


@dataclass(frozen=True)
class Rejected:
    """A candidate ``recommend`` did not keep, and why."""

    pp: int
    dp: int
    ep: int
    schedule: str  # "" when the layout is refused for every schedule
    microbatches: int  # 0 where the global batch does not split into whole microbatches
    reason: str
    tp: int = 1
    excess: float = 0.0  # bytes over the usable memory, where that is the reason
    training: Training = PLAIN  # the last setting tried
    cp: int = 1

    def layout(self) -> str:
        return _layout(self.pp, self.dp, self.ep, self.tp, self.cp)

    def schedule_label(self) -> str:
        return self.schedule or "every schedule"


def _layout(pp: int, dp: int, ep: int, tp: int = 1, cp: int = 1) -> str:
    extra = [f"{name}={value}" for name, value in (("EP", ep), ("TP", tp), ("CP", cp)) if value > 1]
    return " ".join([f"PP={pp} DP={dp}", *extra])


def label(name: str) -> str:
    """The registry name with every parameter written out: ``interleaved:chunks=2``."""
    info = schedule_info(name)
    settings = info.settings
    return ":".join([info.name, *(f"{p.name}={settings[p.name]}" for p in info.params)])


def title(name: str) -> str:
    """``Interleaved 1F1B (chunks=2)``: the title with every parameter, defaults included."""
    info = schedule_info(name)
    if not info.params:
        return info.title
    settings = info.settings
    return f"{info.base_title} ({', '.join(f'{p.name}={settings[p.name]}' for p in info.params)})"


def chunk_parameter(name: str) -> str | None:
    """The parameter of schedule ``name`` that sets its stages per rank, if it has one."""
    return next((p.name for p in schedule_info(name).params if p.stages_per_rank), None)


def takes_chunks(name: str) -> bool:
    """Whether ``name`` is a schedule with chunks that its name leaves open (``interleaved``)."""
    info = schedule_info(name)
    chunks = chunk_parameter(name)
    return chunks is not None and chunks not in dict(info.values)  # bound only when given


def chunk_choices(pp: int, layers: int) -> list[int]:
    """The chunk counts tried at PP = ``pp`` for a schedule named without them: every K >= 2
    that divides the layers per rank (``ceil(layers / pp)``), so that each chunk holds about
    as many layers as the others, and whose ``PP*K`` stages are at most the layers + embedding
    + head; K = 2 when none does (a refusal then says why)."""
    per_rank = math.ceil(layers / pp)
    fitting = [k for k in range(2, per_rank + 1) if per_rank % k == 0 and pp * k <= layers + 2]
    return fitting or [2]


def expand(schedules: Sequence[str], chunks: Sequence[int] = CHUNK_CHOICES) -> list[str]:
    """The schedules to try, as ``label``s in the order given: one named without its chunks
    (``interleaved``) becomes one per count in ``chunks``; an explicit ``interleaved:chunks=8``
    stays as given."""
    out: list[str] = []
    for name in schedules:
        info = schedule_info(name)
        if takes_chunks(name):
            key = chunk_parameter(name)
            names = [label(info.bind(**{key: k}).spec) for k in chunks]
        else:
            names = [label(name)]
        out.extend(n for n in names if n not in out)
    return out
