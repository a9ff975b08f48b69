"""What ``recommend`` returns: plans it simulated and candidates it refused, and their names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cutpipe.plan.costs.model import PLAIN, Hardware, Training
from cutpipe.plan.plan_file import PlanFile
from cutpipe.plan.recommend.footprint import Footprint
from cutpipe.schedule.registry import schedule_info
from cutpipe.spec import ModelSpec

#: The chunks tried for a schedule that takes them and is named without them (``interleaved``).
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
    bubble: float  # the pipeline's bubble ratio (absolute measure)
    peak_memory: float  # bytes on the fullest device
    comm_share: float
    stage_sizes: list[int]
    #: what ``step_time`` and ``bubble`` measure: "makespan" (steps synchronised) or "span"
    step_measure: str = "makespan"
    training: Training = PLAIN  # ZeRO, recompute, precision, TP
    footprint: Footprint | None = None  # the fullest rank's memory by what holds it

    @property
    def tp(self) -> int:
        return self.training.tp

    def layout(self) -> str:
        return _layout(self.pp, self.dp, self.ep, self.tp)

    def shape(self) -> tuple[int, int, int, int]:
        """(PP, DP, EP, TP): plans on the same devices in the same way."""
        return self.pp, self.dp, self.ep, self.tp

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
            dp=self.dp, ep=self.ep, tp=self.tp, zero=training.zero,
            recompute=training.recompute, fp8=training.fp8,
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

    def layout(self) -> str:
        return _layout(self.pp, self.dp, self.ep, self.tp)

    def schedule_label(self) -> str:
        return self.schedule or "every schedule"


def _layout(pp: int, dp: int, ep: int, tp: int = 1) -> str:
    return f"PP={pp} DP={dp}" + (f" EP={ep}" if ep > 1 else "") + (f" TP={tp}" if tp > 1 else "")


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


def expand(schedules: Sequence[str]) -> list[str]:
    """The schedules to try, as ``label``s in the order given: one named without its chunks
    (``interleaved``) becomes one per ``CHUNK_CHOICES``; an explicit ``interleaved:chunks=8``
    stays as given."""
    out: list[str] = []
    for name in schedules:
        info = schedule_info(name)
        chunks = [p.name for p in info.params if p.stages_per_rank]
        if chunks and chunks[0] not in dict(info.values):  # bound only when given
            names = [label(info.bind(**{chunks[0]: k}).spec) for k in CHUNK_CHOICES]
        else:
            names = [label(name)]
        out.extend(n for n in names if n not in out)
    return out
