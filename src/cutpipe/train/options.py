"""``TrainOptions``: one checked value that says how a training run goes.

``cutpipe train`` builds it from the command line, every worker process rebuilds the same value
(under ``torchrun`` or the elastic agent each worker parses the same arguments), and
``cutpipe.train.trainer.train`` reads nothing else. docs/training.md describes every field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cutpipe.sim.steps import BOUNDARIES

DTYPES = ("fp32", "bf16")
RECOMPUTE = ("none", "selective", "full")
#: data parallelism next to the pipeline (cutpipe.parallel.data_parallel, cutpipe.parallel.fsdp)
DP_MODES = ("allreduce", "zero1", "fsdp")


@dataclass(frozen=True)
class TrainOptions:
    """Attributes:
    model: a cutpipe model file (YAML/JSON) or a Hugging Face ``config.json``.
    schedule: a schedule name (``cutpipe.generate``'s), with parameters (``interleaved:chunks=4``),
        or the path of a schedule file (``.json`` or ``.csv``, see ``cutpipe.schedule.fileformat``).
    microbatches: per optimizer step and accumulation round; None: at least 2 x ranks.
    batch: sequences per accumulation round (split into the microbatches).
    seq_len: tokens per sequence; None: the model file's.
    data: text files, folders or a prepared token file; empty: the standard library's sources.
    grad_accum: pipeline steps whose gradients one optimizer step averages.
    dtype: "bf16" runs the forwards under autocast with fp32 master weights.
    recompute: per layer: keep every activation, recompute the cheap ones, or recompute all.
    checkpoint_every: steps between checkpoints (0: only the last step, with a directory).
    resume: continue from the latest complete checkpoint in ``checkpoint_dir``.
    profile_steps: (first, last) step, 1-based and inclusive, traced with torch.profiler.
    dp: data-parallel replicas: the processes form a (pipeline, dp) mesh, each pipeline trains
        on its share of every batch and the runner averages the gradients over the replicas.
    dp_mode: "allreduce" (every replica keeps all optimizer state), "zero1" (optimizer state
        sharded over the replicas) or "fsdp" (parameters sharded too, FSDP2).
    step_boundary: "sync" (every rank waits for the global gradient norm before stepping) or
        "overlap" (each rank steps at once; a step that should have been clipped or skipped is
        rolled back and redone: ``cutpipe.runtime.step_boundary``).
    skip_nonfinite: skip an optimizer step whose gradients hold a NaN or infinity instead of
        stopping the run.
    """

    model: str
    schedule: str
    steps: int = 300
    microbatches: int | None = None
    batch: int | None = None
    seq_len: int | None = None
    data: tuple[str, ...] = ()
    seed: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    clip: float | None = 1.0
    grad_accum: int = 1
    dtype: str = "fp32"
    recompute: str = "none"
    aux_weight: float = 0.01
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep: int = 2
    resume: bool = False
    log: str | None = None
    profile_steps: tuple[int, int] | None = None
    profile_dir: str = "profile"
    step_timeout: float | None = 60.0
    backend: str = "gloo"
    quiet: bool = False
    dp: int = 1
    dp_mode: str = "allreduce"
    step_boundary: str = "sync"
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in ("steps", "grad_accum", "keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("microbatches", "batch", "seq_len", "warmup"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (name != "warmup")):
                problems.append(f"{name} must be a whole number >= 1, got {value!r}")
        for name, low in (("lr", 0.0), ("weight_decay", -1.0), ("aux_weight", -1.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > low):
                problems.append(f"{name} must be a finite number > {max(low, 0)}, got {value!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}")
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            problems.append(f"clip must be a finite number > 0 (or None), got {self.clip!r}")
        if self.warmup is not None and self.warmup > self.steps:
            problems.append(f"warmup {self.warmup} is longer than the {self.steps} steps")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.recompute not in RECOMPUTE:
            problems.append(
                f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
            )
        if not isinstance(self.dp, int) or self.dp < 1:
            problems.append(f"dp must be a whole number >= 1, got {self.dp!r}")
        if self.dp_mode not in DP_MODES:
            problems.append(f"dp_mode must be one of {', '.join(DP_MODES)}, got {self.dp_mode!r}")
        if self.dp_mode == "zero1" and self.checkpoint_dir:
            problems.append(
                "zero1 shards the optimizer state in a form DCP does not save yet: use "
                "--dp-mode allreduce or fsdp with --checkpoint-dir"
            )
        if self.step_boundary not in BOUNDARIES:
            problems.append(
                f"step_boundary must be one of {', '.join(BOUNDARIES)}, got {self.step_boundary!r}"
            )
        elif self.runner_steps and self.grad_accum > 1:
            problems.append(
                "--step-boundary overlap and --skip-nonfinite step the optimizer after each "
                "pipeline step: use --grad-accum 1 (or more microbatches)"
            )
        elif self.runner_steps and self.dp_mode != "allreduce":
            problems.append(
                "--step-boundary overlap and --skip-nonfinite undo a step from copies of plain "
                "parameters and optimizer state: use --dp-mode allreduce"
            )
        if self.checkpoint_every < 0:
            problems.append(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            problems.append("checkpoints need a directory: give checkpoint_dir (--checkpoint-dir)")
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not 1 <= first <= last <= self.steps:
                problems.append(
                    f"profile_steps {first}:{last} must satisfy 1 <= A <= B <= steps ({self.steps})"
                )
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def runner_steps(self) -> bool:
        """Whether the runner takes the optimizer step (to overlap it, or to skip bad steps)."""
        return self.step_boundary == "overlap" or self.skip_nonfinite

    @property
    def warmup_steps(self) -> int:
        """Linear warm-up length: the given one, or 5% of the run (at least one step)."""
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)


def default_microbatches(schedule: str, ranks: int) -> int:
    """Microbatches when none are given: the schedule's least, and at least two per rank."""
    from cutpipe.schedule.registry import schedule_info

    return max(2 * ranks, schedule_info(schedule).min_microbatches(ranks))


def is_schedule_file(schedule: str) -> bool:
    """Whether ``schedule`` names a schedule file rather than a generator."""
    from cutpipe.schedule.fileformat import ENDINGS

    return any(schedule.lower().endswith(ending) for ending in ENDINGS)


def resolve_schedule(schedule: str, ranks: int, microbatches: int | None = None):
    """The ``Schedule`` a run uses: generated by name for ``ranks`` (``microbatches`` or the
    default), or read from a file, which must be one for ``ranks`` (and ``microbatches``)."""
    from cutpipe.schedule.fileformat import load_schedule
    from cutpipe.schedule.registry import generate

    if not is_schedule_file(schedule):
        return generate(schedule, ranks, microbatches or default_microbatches(schedule, ranks))
    loaded = load_schedule(schedule)
    if loaded.num_ranks != ranks:
        raise ValueError(
            f"{schedule} is a schedule for {loaded.num_ranks} ranks, but the run has {ranks}: "
            f"start {loaded.num_ranks} processes (--nproc x --nnodes)"
        )
    if microbatches is not None and microbatches != loaded.num_microbatches:
        raise ValueError(
            f"{schedule} runs {loaded.num_microbatches} microbatches, not {microbatches}: drop "
            "--microbatches (the file fixes it)"
        )
    return loaded
