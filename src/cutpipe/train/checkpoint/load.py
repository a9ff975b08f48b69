"""Loading a checkpoint into any layout of the same model: each rank reads only the names it holds.

Rank 0 decides which folder to read (one view of ``latest``); the ranks swap what each holds and
check together that the checkpoint fits the layout (``agreement``), then DCP reads every rank's
keys from wherever they were saved. RNG states come back only into the layout that saved them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from cutpipe.train.checkpoint.agreement import Holding, LoadRequest, SavedNames, name_problems
from cutpipe.train.checkpoint.errors import Failure
from cutpipe.train.checkpoint.folders import Manifest, resolve
from cutpipe.train.checkpoint.optimizer_state import (
    nested_optimizer,
    optimizer_keys,
    optimizer_names,
)
from cutpipe.train.checkpoint.ranks import Ranks, alone_quietly, default_group
from cutpipe.train.checkpoint.state import set_rng_state


@dataclass(frozen=True)
class Restored:
    """What ``load`` put back, and what it could not."""

    folder: Path
    step: int
    extra: dict[str, Any]
    rng_restored: bool
    notes: tuple[str, ...] = ()


def read_metadata(folder: Path) -> Metadata:
    """DCP's index of a checkpoint folder."""
    return dcp.FileSystemReader(str(folder)).read_metadata()


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


def _under(keys: Iterable[str], prefix: str) -> list[str]:
    return [key for key in keys if key.startswith(prefix)]


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    allow_partial: bool = False,
) -> Restored:
    """Load the checkpoint ``path`` (a step folder, or a directory: its latest) into this rank's
    ``model`` (and ``optimizer``, ``scheduler``), whatever layout saved it.

    Every rank of ``process_group`` (default: the whole world; none in a single process) calls
    it and reads only the names its model holds. A name the ranks hold but the checkpoint lacks,
    or one the checkpoint holds but no rank does, is a ``ValueError`` naming them on every rank,
    unless ``allow_partial``. RNG states are restored only if the same layout saved them."""
    ranks = Ranks.of(default_group(process_group))
    groups = optimizer_names(model, optimizer) if optimizer is not None else []
    holding = Holding.of(model, groups)
    request = LoadRequest(holding)
    if ranks.rank == 0:
        try:
            request = LoadRequest(holding, folder=resolve(path))
        except OSError as error:
            request = LoadRequest(holding, failure=Failure.of(error))
    requests: list[LoadRequest] = ranks.gather(request)
    found = requests[0]
    if found.failure is not None:
        raise found.failure.exception(FileNotFoundError, NotADirectoryError)
    assert found.folder is not None  # rank 0 sends a folder or a failure
    folder = found.folder
    everyone = [request.holding for request in requests]
    keys = read_metadata(folder).state_dict_metadata
    saved = SavedNames.of(keys)
    problems = name_problems(everyone, saved, optimizer is not None)
    if problems and not allow_partial:
        raise ValueError(
            f"the checkpoint {folder} does not fit this layout: {'; '.join(problems)}; load "
            "the model it was saved from, or pass allow_partial=True to load what matches"
        )
    manifest = Manifest.read(folder)
    same_layout = manifest.saved_by([holding.layout for holding in everyone])
    wanted = [f"model.{name}" for name in holding.model if name in saved.model]
    where = optimizer_keys(keys, holding.optimizer) if optimizer is not None else {}
    wanted += list(where)
    wanted += [key for key in ("step", "extra") if key in keys]
    if scheduler is not None and "scheduler" in keys:
        wanted.append("scheduler")
    rng_prefix = f"rng.rank{ranks.rank}."
    if same_layout:
        wanted += _under(keys, rng_prefix)
    distributed = _distributed(model)
    likes = {f"model.{name}": value for name, value in distributed.items()}
    likes.update((key, distributed.get(at.name)) for key, at in where.items() if at.kind == "state")
    loaded = {key: _empty(keys[key], likes.get(key)) for key in wanted}
    with alone_quietly(ranks.group is None):
        dcp.load(
            loaded, checkpoint_id=folder, process_group=ranks.group, no_dist=ranks.group is None
        )
    model_state = {k[len("model.") :]: v for k, v in loaded.items() if k.startswith("model.")}
    options = StateDictOptions(strict=False)  # the names were checked above, with their story
    if optimizer is None:
        set_model_state_dict(model, model_state, options=options)
    else:
        nested = nested_optimizer(loaded, where, groups, optimizer)
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=nested, options=options
        )
    notes = []
    if scheduler is not None:
        if "scheduler" in loaded:
            scheduler.load_state_dict(loaded["scheduler"][0])
        else:
            notes.append(
                "the checkpoint holds no scheduler state: the scheduler was left as it was"
            )
    rng = {k[len(rng_prefix) :]: v for k, v in loaded.items() if k.startswith(rng_prefix)}
    if rng:
        set_rng_state(rng)
    else:
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
        rng_restored=bool(rng),
        notes=tuple(notes),
    )
