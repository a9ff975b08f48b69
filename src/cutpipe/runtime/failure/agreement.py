"""Ranks agree on what they run before they run it, or all stop with one message.

Two ranks that build different schedules exchange messages the other never expects and wait
forever. So before any process group is made and before any boundary value moves:

- at set-up, every rank writes a description of its schedule (or the error its own checks
  raised) to the c10d store and reads everybody's; any difference stops every rank with one
  message that names the ranks and what differs ("rank 1 runs 1f1b m=4, rank 0 runs 1f1b m=8").
  The store wait has a timeout, so a rank that never builds its runner is named too;
- at each step, one small all-gather (started in the background, waited for before the step's
  first transfer) compares what each rank is about to do: training or forward-only, which step,
  the batch size each rank was given, and rank 0's input signature, which also tells the
  boundaries whether shapes must be learned again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cutpipe.runtime.failure.guard import PipelineError
from cutpipe.schedule.schedule import Schedule


class MismatchError(PipelineError):
    """The ranks of a pipeline disagree on what to run; every rank raises the same message."""


def schedule_digest(schedule: Schedule) -> str:
    """A short fingerprint of every rank's ops and the placement."""
    text = json.dumps([schedule.placement.to_dict(), schedule.codes], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def describe(schedule: Schedule, emulated: bool) -> dict[str, object]:
    """What a rank runs, in the terms a message about a mismatch needs."""
    return {
        "name": schedule.name,
        "microbatches": schedule.num_microbatches,
        "ranks": schedule.num_ranks,
        "placement": schedule.placement.kind,
        "digest": schedule_digest(schedule),
        "emulated": emulated,
    }


def _label(setup: dict[str, object]) -> str:
    text = f"{setup['name']} m={setup['microbatches']} on {setup['ranks']} ranks"
    if setup.get("emulated"):
        text += " (emulated)"
    return text


def _groups(values: Sequence[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def agree_on_setup(
    store: dist.Store,
    rank: int,
    world_size: int,
    setup: dict[str, object] | None,
    error: str | None,
    timeout: float,
) -> None:
    """Publish this rank's set-up (or its error) and check everybody's; raise ``MismatchError`` on
    any difference, ``PipelineError`` if a peer failed or never came. A rank whose own checks
    failed publishes its error and returns at once: the caller raises it."""
    store.set(f"setup/{rank}", json.dumps({"setup": setup, "error": error}))
    if error is not None:
        return
    keys = [f"setup/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise PipelineError(
            f"{_ranks(missing)} did not build a PipelineRunner within {timeout:g} s of rank "
            f"{rank}: every rank of the group must build one, with the same schedule"
        ) from None
    everyone = [json.loads(store.get(key)) for key in keys]
    failed = [(r, entry["error"]) for r, entry in enumerate(everyone) if entry["error"]]
    if failed:
        culprit, message = failed[0]
        raise PipelineError(f"rank {culprit} could not build its runner: {message}", rank=culprit)
    setups = [entry["setup"] for entry in everyone]
    if all(s == setups[0] for s in setups):
        return
    labels = [_label(s) for s in setups]
    groups = _groups(labels)
    if len(groups) > 1:
        story = ", ".join(f"{_ranks(ranks)} {'runs' if len(ranks) == 1 else 'run'} {label}"
                          for label, ranks in groups.items())  # fmt: skip
        raise MismatchError(f"the ranks run different schedules: {story}")
    digests = _groups([str(s["digest"]) for s in setups])
    story = ", ".join(f"{_ranks(ranks)} digest {d}" for d, ranks in digests.items())
    raise MismatchError(
        f"the ranks run schedules with the same name and shape but different ops ({story}): "
        "build the schedule the same way on every rank"
    )


#: one rank's word on a step: training?, step number, its input and target batch sizes (-1:
#: none given), and whether its own checks failed; then rank 0's input signature
STEP_FIELDS = 5
#: the field of a step word that says its rank could not start the step
FAILED_FIELD = 4


def step_word(
    training: bool, step: int, inputs: int, targets: int, failed: bool, signature: torch.Tensor
) -> torch.Tensor:
    """This rank's row of the step's all-gather."""
    head = torch.tensor([int(training), step, inputs, targets, int(failed)], dtype=torch.int64)
    return torch.cat([head, signature.cpu()])


def failed_ranks(words: torch.Tensor) -> list[int]:
    """The ranks whose own checks of the step's input failed."""
    return [rank for rank, flag in enumerate(words[:, FAILED_FIELD].tolist()) if flag]


def check_step(words: torch.Tensor) -> list[int]:
    """Raise ``MismatchError`` unless every rank runs the same step; return rank 0's signature."""
    rows = words.tolist()
    training = [bool(row[0]) for row in rows]
    if len(set(training)) > 1:
        kinds = _groups(["a training step" if t else "a forward-only step (torch.no_grad())"
                         for t in training])  # fmt: skip
        story = ", ".join(f"{_ranks(ranks)} {kind}" for kind, ranks in kinds.items())
        raise MismatchError(
            f"the ranks run different kinds of step: {story}: run step() with the same grad mode "
            "on every rank"
        )
    steps = [row[1] for row in rows]
    if len(set(steps)) > 1:
        story = ", ".join(
            f"{_ranks(ranks)} at step {s}" for s, ranks in _groups(list(map(str, steps))).items()
        )
        raise MismatchError(
            f"the ranks are at different steps: {story}: every rank must call step() as often"
        )
    sizes = [(r, "inputs", row[2]) for r, row in enumerate(rows) if row[2] >= 0]
    sizes += [(r, "targets", row[3]) for r, row in enumerate(rows) if row[3] >= 0]
    if len({size for _, _, size in sizes}) > 1:
        story = ", ".join(f"rank {r} {what} of {size}" for r, what, size in sorted(sizes))
        raise MismatchError(
            f"the ranks were given different batch sizes: {story}: pass every rank the same batch"
        )
    return rows[0][STEP_FIELDS:]
