"""Loading a checkpoint into any layout of the same model: each rank reads only the names it holds.

Rank 0 decides which folder to read (one view of ``latest``) and checks its files against the
checksums of its mark (``integrity``); the ranks swap what each holds and check together that the
checkpoint fits the layout (``agreement``), then DCP reads every rank's keys from wherever they
were saved. RNG states come back only into the layout that saved them. A file DCP cannot read is
a ``CheckpointError`` of one line on every rank (DCP's own failures reach every rank).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from cutpipe.train.checkpoint.agreement import Holding, LoadRequest, SavedNames, name_problems
from cutpipe.train.checkpoint.errors import CheckpointError, Failure, cause
from cutpipe.train.checkpoint.folders import Manifest
from cutpipe.train.checkpoint.integrity import choose
from cutpipe.train.checkpoint.optimizer_state import (
    OptimizerKey,
    nested_optimizer,
    optimizer_keys,
    optimizer_names,
)
from cutpipe.train.checkpoint.ranks import Ranks, alone_quietly, default_group
from cutpipe.train.checkpoint.state import rng_prefix, set_rng_state


@dataclass(frozen=True)
class Restored:
    """What ``load`` put back, and what it could not."""

    folder: Path
    step: int
    extra: dict[str, Any]
    rng_restored: bool
    notes: tuple[str, ...] = ()


#: What a damaged checkpoint's error suggests to a load without ``fallback``.
FALLBACK_HINT = "--resume-fallback (fallback=True in code) resumes from the newest intact one"


def read_metadata(folder: Path) -> Metadata:
    """DCP's index of a checkpoint folder; a ``CheckpointError`` if it cannot be read."""
    try:
        return dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as error:
        raise CheckpointError(f"cannot read the index of {folder}: {cause(error)}") from None


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    allow_partial: bool = False,
    fallback: bool = False,
) -> Restored:
    """Load the checkpoint ``path`` (a step folder, or a directory: its latest) into this rank's
    ``model`` (and ``optimizer``, ``scheduler``), whatever layout saved it.

    Every rank of ``process_group`` (default: the whole world; none in a single process) calls
    it and reads only the names its model holds. A name the ranks hold but the checkpoint lacks,
    or one the checkpoint holds but no rank does, is a ``ValueError`` naming them on every rank,
    unless ``allow_partial``. RNG states are restored only if the same layout saved them.

    Its files are checked against their checksums first: a damaged checkpoint is a
    ``CheckpointError`` naming the file and the step, unless ``fallback`` (and ``path`` is a
    directory): then the newest intact older checkpoint is loaded, and the notes say so."""
    ranks = Ranks.of(default_group(process_group))
    groups = optimizer_names(model, optimizer) if optimizer is not None else []
    mine = Holding.of(model, groups)
    folder, everyone, notes = _find_checkpoint(path, mine, ranks, fallback)
    index = read_metadata(folder).state_dict_metadata
    saved = SavedNames.of(index)
    problems = _check_fit(folder, everyone, saved, optimizer is not None, allow_partial)
    manifest = Manifest.read(folder)
    same_layout = manifest.saved_by([holding.layout for holding in everyone])
    optimizer_places = optimizer_keys(index, mine.optimizer) if optimizer is not None else {}
    rng_keys_prefix = rng_prefix(ranks.rank) if same_layout else None
    keys = _keys_to_read(index, mine, optimizer_places, scheduler is not None, rng_keys_prefix)
    loaded = _read(folder, ranks, _placeholders(index, keys, model, optimizer_places))
    _restore_model_and_optimizer(model, optimizer, groups, loaded, optimizer_places)
    notes += _restore_scheduler(scheduler, loaded)
    rng_restored = _restore_rng(loaded, ranks.rank)
    if not rng_restored:
        notes.append(
            f"RNG states not restored: the checkpoint was saved by {manifest.world_size} "
            f"ranks in another layout than these {ranks.size}"
        )
    if problems:
        notes.append("loaded partially: " + "; ".join(problems))
    return Restored(
        folder=folder,
        step=int(loaded.get("step", manifest.step)),
        extra=json.loads(loaded.get("extra", "{}")),
        rng_restored=rng_restored,
        notes=tuple(notes),
    )


def _find_checkpoint(
    path: str | os.PathLike, mine: Holding, ranks: Ranks, fallback: bool
) -> tuple[Path, list[Holding], list[str]]:
    """The folder to read, what every rank holds, and rank 0's notes on the choice. Rank 0 alone
    resolves ``path`` and verifies the folder, so that every rank reads the same checkpoint even
    if ``latest`` moves meanwhile; its error, if it finds none intact, is raised on every rank."""
    request = LoadRequest(mine)
    if ranks.rank == 0:
        try:
            folder, notes = choose(path, fallback=fallback, hint=FALLBACK_HINT)
            request = LoadRequest(mine, folder=folder, notes=tuple(notes))
        except (OSError, CheckpointError) as error:
            request = LoadRequest(mine, failure=Failure.of(error))
    requests: list[LoadRequest] = ranks.gather(request)
    found = requests[0]
    if found.failure is not None:
        raise found.failure.exception(
            NotADirectoryError, CheckpointError, otherwise=FileNotFoundError
        )
    assert found.folder is not None  # rank 0 sends a folder or a failure
    return found.folder, [request.holding for request in requests], list(found.notes)


def _check_fit(
    folder: Path,
    everyone: list[Holding],
    saved: SavedNames,
    optimizer_given: bool,
    allow_partial: bool,
) -> list[str]:
    """What does not fit between the ranks' names and the checkpoint's: an error on every rank,
    or with ``allow_partial`` the problems, for the notes."""
    problems = name_problems(everyone, saved, optimizer_given)
    if problems and not allow_partial:
        raise ValueError(
            f"the checkpoint {folder} does not fit this layout: {'; '.join(problems)}; load "
            "the model it was saved from, or pass allow_partial=True to load what matches"
        )
    return problems


def _keys_to_read(
    index: Mapping[str, Any],
    mine: Holding,
    optimizer_places: dict[str, OptimizerKey],
    with_scheduler: bool,
    rng_keys_prefix: str | None,
) -> list[str]:
    """The saved keys this rank reads: its model's names, its optimizer's keys, the leaves all
    ranks share, and its RNG states (the keys that start with ``rng_keys_prefix``, if given)."""
    keys = [f"model.{name}" for name in mine.model if f"model.{name}" in index]
    keys += list(optimizer_places)
    keys += [key for key in ("step", "extra") if key in index]
    if with_scheduler and "scheduler" in index:
        keys.append("scheduler")
    if rng_keys_prefix is not None:
        keys += [key for key in index if key.startswith(rng_keys_prefix)]
    return keys


def _placeholders(
    index: Mapping[str, Any],
    keys: list[str],
    model: nn.Module,
    optimizer_places: dict[str, OptimizerKey],
) -> dict[str, Any]:
    """What DCP reads ``keys`` into: each laid out like this rank's ``DTensor`` of the same
    parameter, if it holds one (its optimizer state too), so that it reads only its shard."""
    distributed = _distributed(model)
    likes = {f"model.{name}": value for name, value in distributed.items()}
    likes.update(
        (key, distributed.get(place.name))
        for key, place in optimizer_places.items()
        if place.kind == "state"
    )
    return {key: _empty(index[key], likes.get(key)) for key in keys}


def _empty(entry: Any, like: torch.Tensor | None = None) -> Any:
    """A placeholder that DCP fills in: a tensor of the saved shape and dtype, or a leaf. Where
    this rank holds the tensor as a ``DTensor`` of the saved shape (``like``: FSDP's shards), a
    ``DTensor`` laid out alike, so that DCP reads only this rank's shard of it."""
    if not isinstance(entry, TensorStorageMetadata):
        return None
    dtype = entry.properties.dtype
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(entry.size):
        return torch.empty_like(like.detach(), dtype=dtype)
    return torch.empty(entry.size, dtype=dtype)


def _distributed(model: nn.Module) -> dict[str, DTensor]:
    """The model's ``DTensor`` entries (state and parameters) by name."""
    named = {**model.state_dict(keep_vars=True), **dict(model.named_parameters())}
    return {name: value for name, value in named.items() if isinstance(value, DTensor)}


def _read(folder: Path, ranks: Ranks, placeholders: dict[str, Any]) -> dict[str, Any]:
    """Fill ``placeholders`` from ``folder``, with every rank of the group at once."""
    alone = ranks.group is None
    try:
        with alone_quietly(alone):
            dcp.load(placeholders, checkpoint_id=folder, process_group=ranks.group, no_dist=alone)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        raise CheckpointError(f"cannot read the checkpoint {folder}: {cause(error)}") from None
    return placeholders


def _restore_model_and_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    groups: list[list[str]],
    loaded: dict[str, Any],
    optimizer_places: dict[str, OptimizerKey],
) -> None:
    """Put the loaded state into this rank's model and optimizer (DCP's setters handle
    ``DTensor`` shards)."""
    prefix = "model."
    model_state = {k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)}
    options = StateDictOptions(strict=False)  # the names were checked before, with their story
    if optimizer is None:
        set_model_state_dict(model, model_state, options=options)
        return
    nested = nested_optimizer(loaded, optimizer_places, groups, optimizer)
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict=nested, options=options
    )


def _restore_scheduler(scheduler: Any, loaded: dict[str, Any]) -> list[str]:
    """Put the scheduler back, if one was given; a note if the checkpoint holds none."""
    if scheduler is None:
        return []
    if "scheduler" not in loaded:
        return ["the checkpoint holds no scheduler state: the scheduler was left as it was"]
    scheduler.load_state_dict(loaded["scheduler"][0])
    return []


def _restore_rng(loaded: dict[str, Any], rank: int) -> bool:
    """Put this rank's random number generators back, if they were read."""
    prefix = rng_prefix(rank)
    rng = {k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)}
    if rng:
        set_rng_state(rng)
    return bool(rng)
