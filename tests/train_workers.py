"""What the training tests run on every rank (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

from cutpipe.train.options import TrainOptions
from cutpipe.train.trainer import train


def train_rank(rank: int, world: int, options: TrainOptions) -> dict[str, Any]:
    return train(options)


def train_runs(rank: int, world: int, runs: list[TrainOptions]) -> list[dict[str, Any]]:
    """Several runs one after another in the same processes: one launch, not one per run."""
    return [train(options) for options in runs]
