"""What ``recommend`` weighs: the job (the same for every candidate) and one candidate layout.

Grouping them keeps each step of the search down to a few named things: ``evaluate`` simulates
one ``Layout`` of a ``Job`` under one training setting; the enumeration lists the layouts a job
allows.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from cutpipe.plan.costs.model import PLAIN, Hardware, Training
from cutpipe.plan.costs.profile import Profile
from cutpipe.plan.recommend.plans import Rejected
from cutpipe.records import check_count
from cutpipe.spec import ModelSpec

#: The share of a GPU's memory a plan may fill (``usable_memory``). The zero-bubble paper's runs
#: peaked at up to 74 GB on 80 GB GPUs (92.5 %); the remaining 5 % covers the CUDA context and
#: the allocator's fragmentation. At 90 % layouts the paper ran were refused.
USABLE_MEMORY = 0.95
#: ``step_boundary`` -> the step measure it ranks by.
STEP_MEASURES = {"sync": "makespan", "overlap": "span"}
#: When a rank's gradient reduction starts (``cutpipe.plan.recommend.reduction``): each stage's
#: once that stage is done (cutpipe's runtime, overlapped DDP), or all of the rank's after its
#: last op (Megatron-LM's local DDP).
REDUCTION_STARTS = ("stage", "rank")
#: More devices than any cluster; ``recommend`` enumerates the divisors of the count.
MAX_DEVICES = 1_000_000
#: Sequences per step per device when the job gives no global batch.
SEQUENCES_PER_DEVICE = 8


@dataclass(frozen=True)
class Job:
    """A model to train on ``devices`` GPUs of one kind, and how its step is measured.

    ``global_batch`` counts sequences (None: ``SEQUENCES_PER_DEVICE`` per device); ``memory`` is
    bytes per device (None: the GPU's), of which ``usable_memory`` (0 < F <= 1) may be filled;
    ``profile``: measured costs instead of the analytic model; ``step_boundary``: "sync" or
    "overlap" (``STEP_MEASURES``); ``reduction_start``: "stage" or "rank"
    (``REDUCTION_STARTS``)."""

    model: ModelSpec
    hardware: Hardware
    devices: int
    global_batch: int | None = None
    memory: float | None = None
    usable_memory: float = USABLE_MEMORY
    profile: Profile | None = None
    step_boundary: str = "sync"
    reduction_start: str = "stage"

    def __post_init__(self) -> None:
        check_job(self)

    @property
    def batch(self) -> int:
        """Sequences per step."""
        if self.global_batch is None:
            return SEQUENCES_PER_DEVICE * self.devices
        return self.global_batch

    @property
    def capacity(self) -> float:
        """Usable bytes per device."""
        memory = self.hardware.memory if self.memory is None else self.memory
        return memory * self.usable_memory

    @property
    def within_node(self) -> bool:
        """Whether every device is in one node (pipeline neighbours then use NVLink)."""
        return self.devices <= self.hardware.gpus_per_node

    @property
    def step_measure(self) -> str:
        """What a step's time is: "makespan" (steps synchronised) or "span" (steps overlap)."""
        return STEP_MEASURES[self.step_boundary]


@dataclass(frozen=True)
class Layout:
    """One candidate: PP x DP x TP x CP devices (EP inside the data-parallel group) and the
    schedule (a registry label) that runs ``microbatches`` per step on each pipeline."""

    pp: int
    dp: int
    ep: int
    schedule: str
    microbatches: int
    tp: int = 1
    cp: int = 1  # context parallel: each sequence split over ``cp`` ranks

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "ep", "microbatches", "tp", "cp"):
            check_count(getattr(self, name), f"layout: {name}")
        if not isinstance(self.schedule, str) or not self.schedule:
            raise ValueError(f"layout: schedule must be a schedule name, got {self.schedule!r}")

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.tp * self.cp

    @property
    def gradient_ranks(self) -> tuple[int, int]:
        """The ranks a stage's gradients are reduced over: the DP and CP ranks for its dense
        weights, DP x CP / EP of them for its routed experts."""
        ranks = self.dp * self.cp
        return ranks, max(1, ranks // self.ep)

    def refused(self, reason: str, excess: float = 0.0, training: Training = PLAIN) -> Rejected:
        """This layout as a ``Rejected``: ``excess`` bytes over the usable memory, if that is
        why, and the last training setting tried."""
        return Rejected(
            self.pp, self.dp, self.ep, self.schedule, self.microbatches, reason, self.tp, excess,
            training, self.cp,
        )  # fmt: skip


def check_job(job: Job) -> None:
    """A TypeError or ValueError naming the part of ``job`` that ``recommend`` cannot use."""
    if not isinstance(job.model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(job.model).__name__}")
    if not isinstance(job.hardware, Hardware):
        raise TypeError(f"hardware must be a Hardware (e.g. gpu('H100')), got {job.hardware!r}")
    check_count(job.devices, "devices")
    if job.global_batch is not None:
        check_count(job.global_batch, "global_batch")
    if job.devices > MAX_DEVICES:
        raise ValueError(f"devices must be at most {MAX_DEVICES:,}, got {job.devices:,}")
    memory = job.memory
    if memory is not None:
        if isinstance(memory, bool) or not isinstance(memory, numbers.Real):
            raise TypeError(f"memory must be a number of bytes per device, got {memory!r}")
        if not (math.isfinite(memory) and memory > 0):
            raise ValueError(
                f"memory must be a positive finite number of bytes per device, got {memory}"
            )
    if job.profile is not None and not isinstance(job.profile, Profile):
        raise TypeError(f"profile must be a Profile (Profile.load(path)), got {job.profile!r}")
    boundary = job.step_boundary
    if not isinstance(boundary, str) or boundary not in STEP_MEASURES:
        raise ValueError(
            f"step_boundary must be one of {', '.join(map(repr, STEP_MEASURES))}, got {boundary!r}"
        )
    if job.reduction_start not in REDUCTION_STARTS:
        raise ValueError(
            f"reduction_start must be one of {', '.join(map(repr, REDUCTION_STARTS))}, "
            f"got {job.reduction_start!r}"
        )
    usable = job.usable_memory
    if isinstance(usable, bool) or not isinstance(usable, numbers.Real):
        raise TypeError(f"usable_memory must be a fraction of the memory, got {usable!r}")
    if not (math.isfinite(usable) and 0 < usable <= 1):
        raise ValueError(f"usable_memory must be > 0 and <= 1, got {usable}")
