"""What the training tests run on every rank (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

from cutpipe.train.options import TrainOptions
from cutpipe.train.trainer import train


def train_rank(rank: int, world: int, options: TrainOptions) -> dict[str, Any]:
    return train(options)
