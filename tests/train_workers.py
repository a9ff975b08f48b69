"""What the training tests run on every rank (spawned processes import this module)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cutpipe.train.checkpoint import POINTER, step_folder
from cutpipe.train.options import TrainOptions
from cutpipe.train.trainer import train


def train_rank(rank: int, world: int, options: TrainOptions) -> dict[str, Any]:
    return train(options)


def moe_layouts(rank: int, world: int, runs: list) -> list:
    """``moe_workers.several_layouts``: the runtime's PP x EP (x DP) layouts, in a launch of
    this module's (tests/test_train_moe.py's one 8-process launch)."""
    import moe_workers

    return moe_workers.several_layouts(rank, world, runs)


def in_turn(rank: int, world: int, calls: list[tuple[str, tuple]]) -> list[Any]:
    """Each ``(function name, arguments)`` of this module, one after another, in the same
    processes: the checks of several tests from one launch (each launch costs its workers'
    start-up, seconds on a small machine)."""
    done = []
    for name, arguments in calls:
        dist.barrier()  # every rank has finished the previous call
        done.append(globals()[name](rank, world, *arguments))
    return done


def loaded_parameters(rank: int, world: int, layouts: list[TrainOptions]) -> list[dict[str, Any]]:
    """For each of ``layouts`` (resuming from the same checkpoint): the parameters this rank
    holds once the checkpoint is loaded, by their names in the whole model."""
    from cutpipe.train.trainer import Trainer

    held = []
    for options in layouts:
        trainer = Trainer(options)
        trainer.resume()
        held.append({name: p.detach().clone() for name, p in trainer.held.named_parameters()})
        trainer.close()
    return held


def train_runs(rank: int, world: int, runs: list[TrainOptions]) -> list[dict[str, Any]]:
    """Several runs one after another in the same processes: one launch, not one per run."""
    return [train(options) for options in runs]


def train_and_resume(
    rank: int, world: int, whole: TrainOptions, resumed: TrainOptions, back_to: int
) -> list[dict[str, Any]]:
    """``whole``, then ``resumed`` (a new run: its own model, optimizer and data, loaded from
    the checkpoint) from ``whole``'s checkpoint after step ``back_to``, its final checkpoint
    removed as a run that stopped there would have left it. One launch, not one per run."""
    first = train(whole)
    dist.barrier()
    if rank == 0:
        directory = Path(whole.checkpoint_dir)
        shutil.rmtree(step_folder(directory, whole.steps))
        (directory / POINTER).write_text(step_folder(directory, back_to).name)
    dist.barrier()
    return [first, train(resumed)]
