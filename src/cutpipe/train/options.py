"""``TrainOptions``: one checked value that says how a training run goes, declared once.

Each option is one field of one group below (``cutpipe.arguments.option``: its kind, help and
flag), and ``cutpipe train``'s parser is generated from these groups, so a new option is one
field. ``cutpipe train`` builds the value from the command line, every worker process rebuilds
the same value (under ``torchrun`` or the elastic agent each worker parses the same arguments),
and ``cutpipe.train.trainer.train`` reads nothing else. In code, ``TrainOptions.build(model=...,
schedule=..., steps=...)`` takes any field of any group by name. docs/training.md describes
every option.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from cutpipe.arguments import (
    Choice,
    Custom,
    ReadableFile,
    Real,
    Text,
    Whole,
    check_fields,
    option,
)
from cutpipe.files import check_output
from cutpipe.schedule.registry import SCHEDULES, schedule_info
from cutpipe.sim.costs import RECOMPUTE_MODES, Costs
from cutpipe.sim.steps import BOUNDARIES

DTYPES = ("fp32", "bf16")
#: how the trainer balances its stages without a plan (cutpipe.train.balance)
BALANCES = ("measured", "nominal")
#: data parallelism next to the pipeline (``cutpipe.parallel``)
DP_MODES = ("allreduce", "zero1", "fsdp")
BACKENDS = ("gloo", "nccl")
#: The default global batch, in the model's microbatches: the same on any layout, so the same
#: command trains the same thing on 2 processes or 8 (the layout only cuts it differently).
GLOBAL_BATCH_MICROBATCHES = 8
#: Local processes ``train`` starts at most: more only oversubscribe the machine's cores.
MAX_PROCESSES = 64


def schedule_name(text: str) -> str:
    """A schedule the registry knows, by name or PyTorch class name, possibly with parameters;
    in registry form (``Interleaved1F1B:chunks=4`` -> ``interleaved:chunks=4``)."""
    return schedule_info(text).spec


def output_path(text: str) -> str:
    """A file that can be written (its folder exists), checked before any work."""
    return str(check_output(text))


def step_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        pair = (int(first), int(last if sep else first))
    except ValueError:
        raise ValueError(f"expected A:B (steps), got {text!r}") from None
    if pair[0] < 1 or pair[1] < pair[0]:
        raise ValueError(f"expected 1 <= A <= B, got {text!r}")
    return pair


def held_out_share(text: str) -> float:
    """A share strictly between 0 and 1 (``--val-fraction``)."""
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0.0 < share < 1.0:
        raise ValueError(f"expected a share between 0 and 1, e.g. 0.05, got {text!r}")
    return share


SOURCE = "schedule source"


@dataclass(frozen=True)
class ScheduleOptions:
    """the schedule and its step"""

    schedule: str | None = option(
        None, f"one of: {', '.join(SCHEDULES)} (or PyTorch's class name, e.g. ZBVZeroBubble), "
        "with parameters after a colon, e.g. interleaved:chunks=4",
        Custom(schedule_name, str), flags=("--schedule", "-s"), metavar="NAME",
        exclusive=SOURCE, required_one=True,
    )  # fmt: skip
    schedule_file: str | None = option(
        None, "a schedule file (.json from cutpipe schedule -o or tune -o, or a .csv of torch's) "
        "for exactly the run's pipeline ranks", ReadableFile(), flags=("--from",),
        exclusive=SOURCE,
    )  # fmt: skip
    plan: str | None = option(
        None, "a plan file (cutpipe recommend -o or partition -o): its schedule, microbatches, "
        "layout and stage partition", ReadableFile(), exclusive=SOURCE,
    )  # fmt: skip
    balance: str = option(
        "measured", "how stages are balanced when no plan gives them: measured (each kind of "
        "block timed on this machine at start-up, cached) or nominal (the planner's cost model "
        "of an H100)", Choice(BALANCES),
    )  # fmt: skip
    profile: str | None = option(
        None, "balance stages from this profile (cutpipe profile -o) instead of timing blocks "
        "at start-up", ReadableFile(), metavar="FILE",
    )  # fmt: skip
    microbatches: int | None = option(
        None, "microbatches per pipeline step (default: the schedule's least, at least 2 x ranks)",
        Whole(1), flags=("--microbatches", "-m"),
    )  # fmt: skip
    step_boundary: str = option(
        "sync", "sync: every rank waits for the global gradient norm before stepping; overlap: "
        "each rank steps at once, a step that should have been clipped or skipped is redone",
        Choice(BOUNDARIES),
    )  # fmt: skip
    skip_nonfinite: bool = option(
        False, "skip a step whose gradients hold a NaN or infinity instead of stopping"
    )
    step_timeout: float | None = option(  # None in code: no watchdog
        60.0, "stop every rank when one completes no op for this long (seconds, at least 1)",
        Real(1.0, exclusive=False, unit="seconds"), metavar="SECONDS", optional=True,
    )  # fmt: skip


@dataclass(frozen=True)
class ModelOptions:
    """the model"""

    model: str = option(
        "mlp", "a cutpipe model file (YAML/JSON), a Hugging Face config.json, or mlp (the "
        "example MLP on synthetic data)", Text(), metavar="FILE",
    )  # fmt: skip
    seq_len: int | None = option(None, "tokens per sequence (default: the model file's)", Whole(1))
    init_from: str | None = option(
        None, "start from a Hugging Face model folder's weights (config.json and *.safetensors, "
        "sharded or not): each rank reads only its own stages' tensors", Text(), metavar="DIR",
    )  # fmt: skip
    seed: int = option(0, "seeds the weights and the order of the data", Whole(0, 2**63 - 1))
    dtype: str = option("fp32", "bf16: autocast, fp32 master weights", Choice(DTYPES))
    recompute: str = option("none", "activation recompute per layer", Choice(RECOMPUTE_MODES))
    aux_weight: float = option(
        0.01, "weight of the MoE load-balancing loss", Real(0.0, exclusive=False)
    )
    routing_bias_rate: float = option(
        0.0, "MoE balancing without an auxiliary loss (DeepSeek-V3): after each step, move each "
        "expert's routing bias by this much toward an even load (0: off)",
        Real(0.0, exclusive=False),
    )  # fmt: skip
    capacity_factor: float | None = option(
        None, "cap each expert at this factor x its even share of a microbatch's choices; the "
        "overflow is dropped and counted (default: no token is dropped)", Real(0.0),
    )  # fmt: skip


@dataclass(frozen=True)
class DataOptions:
    """the data"""

    data: tuple[str, ...] = option(
        (), "text files, folders or a prepared token file (default: Python's standard library)",
        Text(), metavar="PATH", many=True,
    )  # fmt: skip
    tokenizer: str | None = option(
        None, "a Hugging Face tokenizer.json, or a folder holding one, that text in --data is "
        "tokenized with and a token file must have been prepared with (default: bytes, or the "
        "token file's own)", Text(), metavar="PATH",
    )  # fmt: skip
    global_batch: int | None = option(
        None, "sequences (samples) per optimizer step, over every replica and accumulated "
        f"pipeline step (default: {GLOBAL_BATCH_MICROBATCHES} x the model's microbatch size, "
        "whatever the layout)", Whole(1),
    )  # fmt: skip


@dataclass(frozen=True)
class EvaluationOptions:
    """validation: a held-out loss during training (cutpipe.train.evaluate)"""

    val_data: tuple[str, ...] = option(
        (), "validation text files, folders or a prepared token file, read like --data",
        Text(), metavar="PATH", many=True,
    )  # fmt: skip
    val_fraction: float | None = option(
        None, "hold out this last share of the training tokens (0 < F < 1) for validation; "
        "training reads only the rest", Custom(held_out_share, float), metavar="F",
    )  # fmt: skip
    eval_every: int | None = option(
        None, "steps between evaluations, and one after the last step (default: only after "
        "the last step when there is a validation set; 0: never)", Whole(0, 10**9),
        metavar="STEPS",
    )  # fmt: skip
    eval_steps: int | None = option(
        None, "global batches per evaluation, the same ones every time (default: all of the "
        "validation set, at most 8)", Whole(1, 10**6), metavar="N",
    )  # fmt: skip


@dataclass(frozen=True)
class OptimizerOptions:
    """the optimizer (AdamW) and its learning rate"""

    steps: int = option(10, "optimizer steps", Whole(1))
    lr: float = option(3e-3, "peak learning rate", Real(0.0))
    warmup: int | None = option(
        None, "warm-up steps (default: 5% of --steps, at least 1)", Whole(0, 10**9)
    )
    min_lr_ratio: float = option(
        0.1, "cosine decay ends at this fraction of --lr", Real(0.0, 1.0, exclusive=False)
    )
    weight_decay: float = option(0.1, "AdamW weight decay", Real(0.0, exclusive=False))
    clip: float | None = option(  # None in code: no clipping
        1.0, "clip the global gradient norm to this", Real(0.0), optional=True
    )
    grad_accum: int = option(1, "pipeline steps per optimizer step", Whole(1))


@dataclass(frozen=True)
class ParallelOptions:
    """parallelism beside the pipeline"""

    dp: int = option(
        1, "data-parallel replicas: the processes form pipelines of (nproc x nnodes) / dp ranks",
        Whole(1, 10**4),
    )  # fmt: skip
    dp_mode: str = option(
        "allreduce", "allreduce: every replica keeps all optimizer state; zero1: optimizer "
        "state sharded over the replicas; fsdp: parameters, gradients and optimizer state "
        "sharded (FSDP2)", Choice(DP_MODES),
    )  # fmt: skip
    ep: int = option(
        1, "expert parallelism (MoE models): each MoE's experts spread over groups of this many "
        "ranks, which exchange tokens by all-to-all; the processes form (pp, dp, ep) meshes",
        Whole(1, 10**4),
    )  # fmt: skip
    no_overlap: bool = option(
        False, "run an overlapped F&B pair's halves one after the other instead of interleaving "
        "their phases (the overlap hook; to compare)",
    )  # fmt: skip


@dataclass(frozen=True)
class CheckpointOptions:
    """checkpoints"""

    checkpoint_dir: str | None = option(
        None, "save checkpoints here (DCP, asynchronous)", Text(), metavar="DIR"
    )
    checkpoint_every: int = option(
        0, "steps between checkpoints (default: only after the last step)", Whole(0, 10**9),
        metavar="STEPS",
    )  # fmt: skip
    keep: int = option(2, "complete checkpoints kept", Whole(1))
    resume: bool = option(
        False, "continue from the latest complete checkpoint in --checkpoint-dir (an error if "
        "there is none)",
    )  # fmt: skip
    resume_if_present: bool = option(
        False, "continue from the latest complete checkpoint if there is one, else start at step 1"
    )
    resume_fallback: bool = option(
        False, "when resuming, take the newest intact checkpoint if the latest is damaged"
    )
    overwrite: bool = option(
        False, "start a new run in a --checkpoint-dir that holds checkpoints: they are moved aside "
        "into DIR/replaced-<UTC time>/ (kept)",
    )  # fmt: skip


@dataclass(frozen=True)
class LoggingOptions:
    """what a run reports"""

    log: str | None = option(
        None, "write metrics as JSON lines (--log is the same; under torchrun, which takes "
        "--log as its own --log-dir, write --metrics)", Custom(output_path, str),
        flags=("--metrics", "--log"), metavar="FILE",
    )  # fmt: skip
    trace: str | None = option(
        None, "write the last step's measured timeline as JSON (for cutpipe draw)",
        Custom(output_path, str), metavar="FILE",
    )  # fmt: skip
    profile_steps: tuple[int, int] | None = option(
        None, "torch.profiler over steps A..B", Custom(step_range, tuple), metavar="A:B"
    )
    profile_dir: str = option("profile", "where profiler traces go", Text(), metavar="DIR")
    tensorboard: str | None = option(
        None, "write each step's numbers (loss, lr, grad norm, throughput, ...) as TensorBoard "
        "events in this folder (pip install 'cutpipe[logging]')", Text(), metavar="DIR",
    )  # fmt: skip
    wandb: str | None = option(
        None, "log each step's numbers to this Weights & Biases project (pip install wandb; "
        "WANDB_MODE=offline keeps the run on this machine)", Text(), metavar="PROJECT",
    )  # fmt: skip
    quiet: bool = option(False, "no progress line")


@dataclass(frozen=True)
class EmulationOptions:
    """time emulation: every op sleeps for its cost instead of computing"""

    emulate: bool = option(
        False, "sleep for each op's cost instead of computing, and print the measured step "
        "beside the simulated one",
    )  # fmt: skip
    costs: Costs | None = option(
        None, "per-stage costs for --emulate (default F=B=W=1)", Custom(Costs.parse, Costs),
        metavar="K=V,...",
    )  # fmt: skip
    time_unit: float = option(0.02, "seconds per cost unit with --emulate", Real(0.0))


@dataclass(frozen=True)
class LaunchOptions:
    """starting the workers"""

    nproc: int | None = option(
        None, f"processes on this machine (at most {MAX_PROCESSES}); under torchrun, torchrun's "
        "own", Whole(1, MAX_PROCESSES), flags=("--nproc", "-n"),
    )  # fmt: skip
    nnodes: int = option(1, "machines (agents) in the run", Whole(1, 10**4))
    rdzv_endpoint: str | None = option(
        None, "c10d rendezvous shared by every node", Text(), metavar="HOST:PORT"
    )
    rdzv_id: str | None = option(None, "run id shared by every node", Text(), metavar="ID")
    max_restarts: int = option(
        0, "restart the workers this often after a failure (they resume from the latest "
        "checkpoint)", Whole(0, 1000),
    )  # fmt: skip
    timeout: float | None = option(
        None, "stop every process after this long (seconds; default: no limit)",
        Real(0.0, unit="seconds"), metavar="SECONDS",
    )  # fmt: skip
    backend: str = option(
        "gloo", "torch.distributed backend: gloo (CPU) or nccl (one GPU per rank)",
        Choice(BACKENDS),
    )  # fmt: skip


#: The groups, by the names ``TrainOptions`` holds them under (none is also an option's name).
GROUPS = {
    "pipeline": ScheduleOptions,
    "run": ModelOptions,
    "inputs": DataOptions,
    "evaluation": EvaluationOptions,
    "optimizer": OptimizerOptions,
    "parallel": ParallelOptions,
    "checkpoints": CheckpointOptions,
    "logging": LoggingOptions,
    "emulation": EmulationOptions,
    "launch": LaunchOptions,
}


def expert_emulation_problems(costs: Costs | None) -> list[str]:
    """What ``--emulate --ep`` cannot take in ``costs``: its stages sleep in phases with real
    exchanges between them (``cutpipe.parallel.emulated_moe``), so a backward runs whole in its B,
    a pair lasts what the overlap makes of it, and the transfers are gloo's."""
    costs = costs or Costs()
    problems = []
    kinds = ("f", "b", "w", "ep_f", "ep_b")
    per_stage = [n for n in kinds if not isinstance(getattr(costs, n), float | int)]
    if per_stage:
        problems.append(
            f"--emulate --ep takes one cost per kind for every stage: give {', '.join(per_stage)} "
            "as single numbers"
        )
    elif costs.w:
        problems.append(
            f"--emulate --ep runs each backward whole in its B (its stages defer no weights): "
            f"give W=0 and the whole backward as B (B={costs.b + costs.w:g})"
        )
    elif not costs.f:
        problems.append("--emulate --ep needs a forward to sleep in: give F > 0")
    if costs.fb is not None:
        problems.append(
            "--emulate --ep measures what the overlap hook makes of an F&B pair: drop FB"
        )
    if costs.comm:
        problems.append(
            "--emulate --ep sends the pipeline's tensors over the process group as they are: "
            "drop comm"
        )
    return problems


@dataclass(frozen=True)
class TrainOptions:
    """Every option of a run, by group; ``options.steps`` reads any option by its name."""

    pipeline: ScheduleOptions = field(default_factory=ScheduleOptions)
    run: ModelOptions = field(default_factory=ModelOptions)
    inputs: DataOptions = field(default_factory=DataOptions)
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    checkpoints: CheckpointOptions = field(default_factory=CheckpointOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    emulation: EmulationOptions = field(default_factory=EmulationOptions)
    launch: LaunchOptions = field(default_factory=LaunchOptions)

    def __post_init__(self) -> None:
        problems = [p for name in GROUPS for p in check_fields(getattr(self, name))]
        if problems:
            raise ValueError("; ".join(problems))
        problems = self._conflicts()
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def build(cls, **settings: Any) -> TrainOptions:
        """Options from any fields of any groups, by name (the rest at their defaults)."""
        groups: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        owner = {f.name: name for name, group in GROUPS.items() for f in dataclasses.fields(group)}
        for key, value in settings.items():
            if key not in owner:
                raise TypeError(f"TrainOptions has no option {key!r}")
            groups[owner[key]][key] = tuple(value) if key in ("data", "val_data") else value
        return cls(**{name: GROUPS[name](**groups[name]) for name in GROUPS})

    def replace(self, **settings: Any) -> TrainOptions:
        """These options with some fields (of any groups) changed."""
        current = {
            f.name: getattr(getattr(self, name), f.name)
            for name, group in GROUPS.items()
            for f in dataclasses.fields(group)
        }
        return self.build(**{**current, **settings})

    def __getattr__(self, name: str) -> Any:
        # any option by its name, wherever its group (only called for names not found)
        for group in GROUPS:
            values = self.__dict__.get(group)
            if values is not None and name in values.__dataclass_fields__:
                return getattr(values, name)
        raise AttributeError(f"TrainOptions has no option {name!r}")

    def _conflicts(self) -> list[str]:
        """What options say that cannot hold together."""
        problems = []
        if self.warmup is not None and self.warmup > self.steps:
            problems.append(f"warmup {self.warmup} is longer than the {self.steps} steps")
        if self.dp_mode == "zero1" and self.checkpoint_dir:
            problems.append(
                "zero1 shards the optimizer state in a form DCP does not save yet: use "
                "--dp-mode allreduce or fsdp with --checkpoint-dir"
            )
        if self.runner_steps and self.grad_accum > 1:
            problems.append(
                "--step-boundary overlap and --skip-nonfinite step the optimizer after each "
                "pipeline step: use --grad-accum 1 (or more microbatches)"
            )
        elif self.runner_steps and self.dp_mode != "allreduce":
            problems.append(
                "--step-boundary overlap and --skip-nonfinite undo a step from copies of plain "
                "parameters and optimizer state: use --dp-mode allreduce"
            )
        uses_checkpoints = (
            self.checkpoint_every, self.resume, self.resume_if_present, self.resume_fallback,
            self.overwrite,
        )  # fmt: skip
        if any(uses_checkpoints) and not self.checkpoint_dir:
            problems.append("checkpoints need a directory: give checkpoint_dir (--checkpoint-dir)")
        if self.resume and self.resume_if_present:
            problems.append("--resume-if-present already resumes: give it or --resume, not both")
        if self.overwrite and (self.resume or self.resume_if_present):
            problems.append(
                "--overwrite starts a new run and --resume continues one: give one of them"
            )
        if self.profile_steps is not None:
            first, last = self.profile_steps
            if not 1 <= first <= last <= self.steps:
                problems.append(
                    f"profile_steps {first}:{last} must satisfy 1 <= A <= B <= steps ({self.steps})"
                )
        if self.emulate and (self.checkpoint_dir or self.dp != 1 or self.grad_accum != 1):
            problems.append(
                "--emulate sleeps instead of computing: it trains nothing, so it takes no "
                "--checkpoint-dir, --dp or --grad-accum"
            )
        if self.profile and (self.plan or self.balance != "measured"):
            problems.append(
                "--profile balances the stages from its costs: drop it, or drop "
                + ("--plan (the plan fixes the partition)" if self.plan else "--balance nominal")
            )
        if self.trace and self.step_boundary == "overlap":
            problems.append(
                "--trace records the last step's timeline, which needs --step-boundary sync "
                "(overlapped steps share their boundaries)"
            )
        if self.emulate and self.ep > 1:
            problems += expert_emulation_problems(self.costs)
        problems += self._validation_conflicts()
        if self.emulate and self.runner_steps:
            problems.append(
                "--emulate trains nothing: drop --step-boundary overlap and --skip-nonfinite"
            )
        return problems

    def _validation_conflicts(self) -> list[str]:
        """What the validation options say that cannot hold together."""
        problems = []
        if self.val_data and self.val_fraction is not None:
            problems.append(
                "--val-data and --val-fraction both give a validation set: give one of them"
            )
        if self.val_fraction is not None and not 0.0 < self.val_fraction < 1.0:
            problems.append(
                f"val_fraction (--val-fraction) is the share of the tokens held out: give one "
                f"between 0 and 1, not {self.val_fraction}"
            )
        if not self.validates:
            given = [flag for flag, value in (("--eval-every", self.eval_every),
                                              ("--eval-steps", self.eval_steps)) if value]  # fmt: skip
            if given:
                needs = "needs" if len(given) == 1 else "need"
                problems.append(
                    f"{' and '.join(given)} {needs} a validation set: give --val-data or "
                    "--val-fraction"
                )
        elif self.emulate:
            problems.append("--emulate trains nothing to evaluate: drop --val-data/--val-fraction")
        return problems

    @property
    def validates(self) -> bool:
        """Whether the run has a validation set (``--val-data`` or ``--val-fraction``)."""
        return bool(self.val_data) or self.val_fraction is not None

    @property
    def simulated_costs(self) -> Costs:
        """The costs the simulator is given for an ``--emulate`` run: the emulated ones, and with
        ``--ep --no-overlap`` an F&B pair that takes its compute plus its exchanges."""
        costs = self.costs or Costs()
        if self.ep > 1 and self.no_overlap:
            parts = (costs.f, costs.b, costs.w, costs.ep_f, costs.ep_b)
            return dataclasses.replace(costs, fb=float(sum(parts)))  # scalars: checked above
        return costs

    @property
    def schedule_source(self) -> str:
        """The schedule a run uses: a name, or the path of a schedule file (``resolve_schedule``
        reads it); with a plan, the plan's (``cutpipe.train.layout``)."""
        return self.schedule_file or self.schedule or ""

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
