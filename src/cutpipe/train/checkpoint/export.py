"""The unsplit model out of a checkpoint, as one ``.pt`` or ``.safetensors`` file.

A checkpoint keeps the model under its unsplit names (``model.<fqn>``, see ``state``), so
exporting is reading every ``model.`` key in one process, with no process group, whatever layout
saved it. The files are checked against the checksums of the mark first (``integrity``): a
damaged checkpoint is never exported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cutpipe.files import check_output, write_with
from cutpipe.train.checkpoint.errors import CheckpointError, cause
from cutpipe.train.checkpoint.integrity import choose
from cutpipe.train.checkpoint.load import read_metadata
from cutpipe.train.checkpoint.ranks import alone_quietly
from cutpipe.train.checkpoint.safetensors_file import write_safetensors

ENDINGS = (".pt", ".safetensors")


#: What a damaged checkpoint's error suggests to an export.
OLDER_HINT = "export one of the older step-NNNNNN folders beside it"


def model_state(
    path: str | os.PathLike, note: Callable[[str], None] | None = None
) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict saved in the checkpoint ``path`` (a step folder, or a
    directory: its latest), verified, then read in this process alone; ``note`` hears what is
    worth reporting (a broken ``latest`` passed over, a checkpoint without checksums)."""
    return model_and_record(path, note)[0]


def model_and_record(
    path: str | os.PathLike, note: Callable[[str], None] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``model_state``, and the JSON ``extra`` the trainer saved beside it (its ``run`` record
    says what model was trained on what: ``cutpipe.train.resume``)."""
    folder, notes = choose(path, hint=OLDER_HINT)
    if note is not None:
        for line in notes:
            note(line)
    keys = read_metadata(folder).state_dict_metadata
    loaded: dict[str, Any] = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in keys.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    if not loaded:
        raise ValueError(f"the checkpoint {folder} holds no model tensors (no model.* keys)")
    if "extra" in keys:
        loaded["extra"] = None
    try:
        with alone_quietly(True):
            dcp.load(loaded, checkpoint_id=folder, no_dist=True)
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        raise CheckpointError(f"cannot read the checkpoint {folder}: {cause(error)}") from None
    extra = json.loads(loaded.pop("extra", None) or "{}")
    return {key[len("model.") :]: tensor for key, tensor in loaded.items()}, extra


def export_checkpoint(
    path: str | os.PathLike, output: str | os.PathLike, note: Callable[[str], None] | None = None
) -> Path:
    """Write the unsplit model of checkpoint ``path`` to ``output``: ``.pt`` (``torch.save`` of
    the state dict) or ``.safetensors``, chosen by the ending. Returns ``output``. A damaged
    checkpoint is a ``CheckpointError`` naming the file and the step; ``note``: as
    ``model_state``."""
    target = check_output(output, ENDINGS)
    state = model_state(path, note)
    if target.suffix.lower() == ".pt":
        write_with(target, lambda temporary: torch.save(state, temporary))
    else:
        write_safetensors(state, target)
    return target
