"""What the ranks compare before a save or a load writes or reads anything.

A mistake on one rank (a bad argument, different steps, a name the checkpoint lacks) must stop
every rank with the same message: a rank that raised alone would leave the others waiting in a
collective it never joins. So each rank sends a record of what it was given (``SaveRequest``,
``LoadRequest``), and every rank runs the same checks on everybody's records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from cutpipe.train.checkpoint.errors import CheckpointError, Failure
from cutpipe.train.checkpoint.optimizer_state import saved_parameters


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


# -- before a save ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveRequest:
    """What one rank asks to save. When ``mistake`` is set, ``step`` and ``extra`` are
    placeholders (0 and "{}"): the mistake stops the save before they are compared."""

    step: int
    extra: str  # the JSON text of the caller's ``extra``
    layout: str  # the layout fingerprint of the rank's model
    mistake: Failure | None = None  # the rank's own arguments were wrong
    refusal: Failure | None = None  # rank 0 could not prepare the step's folder


def check_save_agreement(requests: list[SaveRequest]) -> None:
    """Raise the same error on every rank if any rank's input was wrong, rank 0 cannot write
    the folder, or the ranks differ."""
    for rank, request in enumerate(requests):
        if request.mistake is not None:  # a bad argument, whichever exception the rank caught
            raise ValueError(f"rank {rank} cannot save: {request.mistake.message}")
    refusal = requests[0].refusal
    if refusal is not None:
        raise refusal.exception(otherwise=CheckpointError)
    if len({request.step for request in requests}) > 1:
        story = ", ".join(f"rank {r} step {request.step}" for r, request in enumerate(requests))
        raise CheckpointError(f"the ranks save different steps ({story}): save at the same step")
    differ = [r for r, request in enumerate(requests) if request.extra != requests[0].extra]
    if differ:
        raise CheckpointError(
            f"extra differs between rank 0 and {_ranks_text(differ)}: pass the same extra on "
            "every rank (what all ranks share, such as the data loader's position)"
        )


# -- before a load ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holding:
    """What one rank holds: the names of its model's state, the parameters its optimizer
    updates, and its layout fingerprint."""

    model: tuple[str, ...]
    optimizer: tuple[str, ...]
    layout: str

    @classmethod
    def of(cls, model: nn.Module, optimizer_groups: list[list[str]]) -> Holding:
        """``model``'s holding; ``optimizer_groups``: the FQNs of each optimizer group."""
        return cls(
            model=tuple(sorted(model.state_dict())),
            optimizer=tuple(sorted(name for names in optimizer_groups for name in names)),
            layout=layout_fingerprint(model),
        )


@dataclass(frozen=True)
class LoadRequest:
    """What one rank tells the others before a load: what it holds and, from rank 0 only, the
    folder every rank reads (verified) and the notes on that choice, or why there is none (one
    rank looks, so that all read the same ``latest``)."""

    holding: Holding
    folder: Path | None = None
    failure: Failure | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SavedNames:
    """The names a checkpoint holds: of the model's state, and of the parameters with saved
    optimizer hyperparameters."""

    model: frozenset[str]
    optimizer: frozenset[str]

    @classmethod
    def of(cls, keys: Iterable[str]) -> SavedNames:
        """The names in the keys of a checkpoint's index."""
        keys = list(keys)
        prefix = "model."
        return cls(
            model=frozenset(key[len(prefix) :] for key in keys if key.startswith(prefix)),
            optimizer=frozenset(saved_parameters(keys)),
        )


def name_problems(everyone: list[Holding], saved: SavedNames, optimizer_given: bool) -> list[str]:
    """Each way the ranks' names and the checkpoint's differ, the same text on every rank."""
    problems = []
    for rank, holding in enumerate(everyone):
        missing = set(holding.model) - saved.model
        if missing:
            problems.append(f"rank {rank} holds {_names_text(missing)}, which the checkpoint lacks")
    held = set().union(*(holding.model for holding in everyone))
    unexpected = saved.model - held
    if unexpected:
        problems.append(f"the checkpoint holds {_names_text(unexpected)}, which no rank holds")
    if optimizer_given:
        for rank, holding in enumerate(everyone):
            missing = set(holding.optimizer) - saved.optimizer
            if missing:
                problems.append(
                    f"rank {rank}'s optimizer updates {_names_text(missing)}, for which the "
                    "checkpoint holds no optimizer state"
                )
    return problems
