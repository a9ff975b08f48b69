"""What the ranks compare before a save or a load writes or reads anything.

A mistake on one rank (a bad argument, different steps, a name the checkpoint lacks) must stop
every rank with the same message: a rank that raised alone would leave the others waiting in a
collective it never joins. So each rank sends what it was given, and every rank runs the same
checks on everybody's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from cutpipe.train.checkpoint.errors import CheckpointError


def layout_fingerprint(model: nn.Module) -> str:
    """A fingerprint of the names a rank holds: equal layouts restore RNG states."""
    names = "\n".join(sorted(model.state_dict()))
    return hashlib.sha256(names.encode()).hexdigest()[:16]


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _names_text(names: Iterable[str], most: int = 6) -> str:
    names = sorted(names)
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_agreement(said: list[tuple[str | None, str | None, int, str, str]]) -> None:
    """Raise the same error on every rank if any rank's input was wrong or the ranks differ."""
    mistakes = [(r, entry[0]) for r, entry in enumerate(said) if entry[0]]
    if mistakes:
        rank, mistake = mistakes[0]
        raise ValueError(f"rank {rank} cannot save: {mistake}")
    if said[0][1]:
        raise CheckpointError(said[0][1])
    steps = {entry[2] for entry in said}
    if len(steps) > 1:
        story = ", ".join(f"rank {r} step {entry[2]}" for r, entry in enumerate(said))
        raise CheckpointError(f"the ranks save different steps ({story}): save at the same step")
    differ = [r for r, entry in enumerate(said) if entry[3] != said[0][3]]
    if differ:
        raise CheckpointError(
            f"extra differs between rank 0 and {_ranks_text(differ)}: pass the same extra on "
            "every rank (what all ranks share, such as the data loader's position)"
        )


@dataclass(frozen=True)
class Holding:
    """What one rank holds, for the checks every rank makes alike."""

    model: list[str]
    optimizer: list[str]
    layout: str


def check_names(
    everyone: list[Holding], saved_model: set[str], saved_optim: set[str], optimizer_given: bool
) -> list[str]:
    """Each problem with the names, the same text on every rank."""
    problems = []
    for rank, holding in enumerate(everyone):
        missing = set(holding.model) - saved_model
        if missing:
            problems.append(f"rank {rank} holds {_names_text(missing)}, which the checkpoint lacks")
    held = set().union(*(h.model for h in everyone))
    unexpected = saved_model - held
    if unexpected:
        problems.append(f"the checkpoint holds {_names_text(unexpected)}, which no rank holds")
    if optimizer_given:
        for rank, holding in enumerate(everyone):
            missing = set(holding.optimizer) - saved_optim
            if missing:
                problems.append(
                    f"rank {rank}'s optimizer updates {_names_text(missing)}, for which the "
                    "checkpoint holds no optimizer state"
                )
    return problems
