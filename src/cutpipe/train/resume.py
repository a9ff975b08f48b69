"""What a resumed run keeps, changes and refuses, against the run its checkpoint saved.

Every checkpoint carries the run's record (``run_record``): the options that shape the training
and what they resolved to (the model's sizes, the global batch, the schedule...). On resume the
record is compared with the new run's:

- **refused** (another value is another run): the model, the data (and the share of it held
  out for validation), the tokenizer that made its tokens (its digest, or bytes), the sequence
  length, ``--seed``, the global batch, the accumulation, and whether an MoE holds a balancing
  bias. One line names each with both values;
- **applied**, and named in one line: the learning rate and its schedule (``lr``, ``warmup``,
  ``min_lr_ratio``, ``steps``), weight decay, clipping, the layout (schedule, microbatches,
  replicas, expert parallelism, data-parallel mode: checkpoints reshard, experts saved under
  their index in the whole model), precision and recompute, the step boundary, the balancing
  bias's rate and the capacity factor.

The learning-rate schedule is recomputed from the new options at the step reached: with more
``--steps`` the cosine stretches to end at the new last step, so the rate jumps up to where the
longer cosine is at that step (a shorter run jumps down); the warm-up counts from step 0 as
before. A checkpoint without a record (an older cutpipe) is compared on nothing, with a note.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from cutpipe.train.layout import RunLayout
    from cutpipe.train.options import TrainOptions
    from cutpipe.train.tasks import Task

#: What defines the run: a checkpoint resumed with another value would continue another run.
FIXED = (
    "model", "data", "tokenizer", "seq_len", "seed", "batch", "grad_accum", "routing_bias",
    "val_fraction",
)  # fmt: skip
#: What a resumed run may change; the new value applies from the resumed step on.
CHANGEABLE = (
    "lr", "warmup", "min_lr_ratio", "steps", "weight_decay", "clip", "schedule",
    "microbatches", "dp", "ep", "dp_mode", "dtype", "recompute", "step_boundary",
    "routing_bias_rate", "capacity_factor",
)  # fmt: skip


def run_record(options: TrainOptions, task: Task, layout: RunLayout) -> dict[str, Any]:
    """The values a checkpoint keeps to compare a resumed run with (JSON)."""
    spec = dataclasses.asdict(task.spec)  # type: ignore[attr-defined]
    for name in ("name", "microbatch_size", "seq_len"):  # compared on their own (or not at all)
        spec.pop(name, None)
    defaults = {f.name: f.default for f in dataclasses.fields(task.spec)}  # type: ignore[arg-type]
    for name in getattr(task.spec, "RECORDED_IF_SET", ()):  # as records made before they existed
        if spec.get(name) == defaults[name]:
            spec.pop(name)
    return {
        "model": spec,
        "data": list(options.data),
        "tokenizer": getattr(task, "data_tokenizer", None),  # its digest, or "bytes"
        "val_fraction": options.val_fraction,  # what of the data is trained on
        "seq_len": task.tokens_per_sample,
        "seed": options.seed,
        "batch": layout.batch,
        "grad_accum": options.grad_accum,
        "lr": options.lr,
        "warmup": options.warmup_steps,
        "min_lr_ratio": options.min_lr_ratio,
        "steps": options.steps,
        "weight_decay": options.weight_decay,
        "clip": options.clip,
        "schedule": layout.schedule.name,
        "microbatches": layout.schedule.num_microbatches,
        "dp": layout.dp,
        "ep": layout.ep,
        "dp_mode": options.dp_mode,
        "dtype": options.dtype,
        "recompute": options.recompute,
        "step_boundary": options.step_boundary,
        "routing_bias": options.routing_bias_rate > 0,  # the MoE holds a bias (checkpointed)
        "routing_bias_rate": options.routing_bias_rate,
        "capacity_factor": options.capacity_factor,
    }


@dataclasses.dataclass(frozen=True)
class Differences:
    """How a resumed run differs from its checkpoint's."""

    changed: dict[str, tuple[Any, Any]]  # name: (saved, now), applied
    refused: dict[str, tuple[Any, Any]]  # name: (saved, now), another run
    recorded: bool = True  # False: the checkpoint holds no record to compare with

    @property
    def reschedules(self) -> bool:
        """The learning rate, its schedule or the decay changed: the loaded ones are replaced."""
        return bool(set(self.changed) & {"lr", "warmup", "min_lr_ratio", "steps", "weight_decay"})

    def check(self, step: int) -> None:
        """Raise ``ValueError`` (one line) when a refused value differs."""
        if not self.refused:
            return
        said = "; ".join(f"{name} {_pair(old, new)}" for name, (old, new) in self.refused.items())
        raise ValueError(
            f"--resume: the checkpoint of step {step} is of another run ({said}): these define "
            "the run; resume with the same values, or start a new run in another --checkpoint-dir"
        )

    def line(self) -> str | None:
        """What the resumed run changes, for rank 0 to print (None: nothing)."""
        if not self.recorded:
            return "the checkpoint records no options: the resumed run is compared on nothing"
        if not self.changed:
            return None
        said = ", ".join(f"{name} {_pair(old, new)}" for name, (old, new) in self.changed.items())
        note = ""
        if self.reschedules:
            note = " (the learning rate follows the new schedule from this step)"
        return f"the resumed run changes {said}{note}"


def differences(saved: Mapping[str, Any] | None, now: Mapping[str, Any]) -> Differences:
    """Compare a checkpoint's record with this run's (``run_record``)."""
    if not saved:
        return Differences({}, {}, recorded=False)
    changed = {n: (saved[n], now[n]) for n in CHANGEABLE if n in saved and saved[n] != now[n]}
    refused = {n: (saved[n], now[n]) for n in FIXED if n in saved and saved[n] != now[n]}
    return Differences(changed, refused)


def apply_schedule(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    options: TrainOptions,
) -> None:
    """After a checkpoint's optimizer and scheduler are loaded: the learning rate, its schedule
    and weight decay of ``options`` from the step reached on (the loaded ones are the saved
    run's)."""
    from cutpipe.train.optim import WarmupCosine

    schedule = WarmupCosine(options.warmup_steps, options.steps, float(options.min_lr_ratio))
    scheduler.lr_lambdas = [schedule for _ in optimizer.param_groups]
    scheduler.base_lrs = [options.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = options.lr
        group["lr"] = options.lr * schedule(scheduler.last_epoch)
        if group.get("weight_decay", 0.0):  # the decayed group keeps decaying, by the new amount
            group["weight_decay"] = options.weight_decay


def _pair(old: Any, new: Any) -> str:
    """``old -> new``; of two mappings, only the keys that differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in {**old, **new} if old.get(k) != new.get(k)]
        old = {k: old.get(k) for k in keys}
        new = {k: new.get(k) for k in keys}
    return f"{_shown(old)} -> {_shown(new)}"


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
