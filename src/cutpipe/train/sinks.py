"""Where rank 0's step records go: the JSON-lines log, TensorBoard, Weights & Biases.

Each is a sink with ``write(record)`` (the record as a dict) and ``close()``; ``open_sinks``
makes the ones the options ask for behind one ``Sinks``, so the training loop hands each
record to one thing. TensorBoard and W&B get every finite number of a record (``scalars``)
under a tidy tag, so fields other parts of cutpipe add to records (validation, MoE routing)
appear without a change here. The first record a run writes also carries what ran (``run``:
model, schedule, learning-rate schedule), which ``cutpipe draw --metrics`` titles its picture
with.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Mapping
from typing import Any, Protocol

from cutpipe.train.options import TrainOptions

#: the tag of each field StepRecord has; other fields: ``val_x`` -> ``val/x``, else ``train/x``
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time": "perf/step_time",
    "bubble": "perf/bubble",
    "peak_activation_bytes": "memory/peak_activation_bytes",
    "balance_loss": "moe/balance_loss",
    "expert_load": "moe/expert_load",
    "dropped": "moe/dropped",
    "pipeline_ms": "perf/pipeline_ms",
    "outside_ms": "perf/outside_ms",
    "replay_ms": "perf/replay_ms",
}
#: fields that are no measurement
SKIPPED = ("step", "run")

TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install 'cutpipe[logging]'"
WANDB_MISSING = "--wandb needs the wandb package: pip install wandb"


def tag(name: str) -> str:
    """The tag a record's field is shown under."""
    if name in TAGS:
        return TAGS[name]
    if name.startswith("val_"):
        return f"val/{name[4:]}"
    return f"train/{name}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Every finite number of ``record`` by its tag (a table of numbers, such as each MoE
    layer's load, one tag per entry); NaN (an emulated run's loss), None and text left out."""
    found: dict[str, float] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                add(f"{name}/{key}", item)
        elif _is_number(value) and math.isfinite(value):
            found[name] = float(value)

    for name, value in record.items():
        if name not in SKIPPED:
            add(tag(name), value)
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def require(options: TrainOptions) -> None:
    """The packages the asked-for sinks need, checked before any worker starts."""
    for wanted, module, message in (
        (options.tensorboard, "tensorboard", TENSORBOARD_MISSING),
        (options.wandb, "wandb", WANDB_MISSING),
    ):
        if wanted:
            _import(module, message)


def _import(module: str, message: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(message) from None


class TensorBoardSink:
    """Scalars per step as TensorBoard events in ``directory``; a resumed run hides what the
    earlier run logged after the step it resumes from (``purge_step``)."""

    def __init__(self, directory: str, run: Mapping[str, Any], resumed: int | None = None) -> None:
        _import("tensorboard", TENSORBOARD_MISSING)
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(
            log_dir=directory, purge_step=None if resumed is None else resumed + 1
        )
        options = run.get("options")
        if options:  # the run's options, readable beside its curves
            self._writer.add_text("run/options", "    " + options.replace("\n", "\n    "))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars per step as one W&B run of ``project``, the run's options as its config;
    ``WANDB_MODE=offline`` keeps them on this machine (``wandb sync`` uploads them later)."""

    def __init__(self, project: str, run: Mapping[str, Any], options: TrainOptions) -> None:
        from cutpipe.train.config_file import flat_options

        wandb = _import("wandb", WANDB_MISSING)
        config = {**flat_options(options), **{k: v for k, v in run.items() if k != "options"}}
        self._run = wandb.init(project=project, config=config, mode=os.environ.get("WANDB_MODE"))

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """Every sink a run writes to; the first record also carries the run's description."""

    def __init__(self, sinks: list[Sink], run: Mapping[str, Any] | None = None) -> None:
        self._sinks = sinks
        self._run = run

    def write(self, record: Any) -> None:
        data = record.to_dict()
        if self._run is not None:  # once per (re)start: a resumed run's log says it again
            data["run"] = {k: v for k, v in self._run.items() if k != "options"}
            self._run = None
        for sink in self._sinks:
            sink.write(data)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def describe_run(trainer: Any) -> dict[str, Any]:
    """What ran, for the sinks: model, schedule, ranks, the learning-rate schedule, and the
    options (the TOML ``--print-config`` writes); ``run`` in the log's first record."""
    from cutpipe.train.config_file import to_toml

    options = trainer.options
    run: dict[str, Any] = {
        "model": trainer.task.name,
        "schedule": trainer.schedule.name,
        "ranks": trainer.world,
        "microbatches": trainer.schedule.num_microbatches,
    }
    if not options.emulate:
        run["stage_sizes"] = list(trainer.layout.stage_sizes)
        if trainer.balance is not None:
            run["balance"] = trainer.balance.to_dict()
        run["lr_schedule"] = (
            f"lr {options.lr:g}, warm-up {options.warmup_steps}, cosine to "
            f"{options.min_lr_ratio:g}x over {options.steps} steps"
        )
    run["options"] = to_toml(options)
    return run


def open_sinks(options: TrainOptions, run: Mapping[str, Any], resumed: int | None) -> Sinks:
    """The sinks ``options`` ask for (rank 0 only); a resumed run appends to its log."""
    from cutpipe.train.metrics import MetricsLog

    sinks: list[Sink] = []
    try:
        if options.log:
            sinks.append(MetricsLog(options.log, append=resumed is not None))
        if options.tensorboard:
            sinks.append(TensorBoardSink(options.tensorboard, run, resumed))
        if options.wandb:
            sinks.append(WandbSink(options.wandb, run, options))
    except BaseException:
        Sinks(sinks).close()
        raise
    return Sinks(sinks, run)
