"""The unsplit model out of a checkpoint, as one ``.pt`` or ``.safetensors`` file.

A checkpoint keeps the model under its unsplit names (``model.<fqn>``, see ``state``), so
exporting is reading every ``model.`` key in one process, with no process group, whatever layout
saved it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cutpipe.files import check_output, write_with
from cutpipe.train.checkpoint.folders import resolve
from cutpipe.train.checkpoint.load import read_metadata
from cutpipe.train.checkpoint.ranks import alone_quietly
from cutpipe.train.checkpoint.safetensors_file import write_safetensors

ENDINGS = (".pt", ".safetensors")


def model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict saved in the checkpoint ``path`` (a step folder, or a
    directory: its latest), read in this process alone."""
    folder = resolve(path)
    keys = read_metadata(folder).state_dict_metadata
    loaded = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in keys.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    if not loaded:
        raise ValueError(f"the checkpoint {folder} holds no model tensors (no model.* keys)")
    with alone_quietly(True):
        dcp.load(loaded, checkpoint_id=folder, no_dist=True)
    return {key[len("model.") :]: tensor for key, tensor in loaded.items()}


def export_checkpoint(path: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Write the unsplit model of checkpoint ``path`` to ``output``: ``.pt`` (``torch.save`` of
    the state dict) or ``.safetensors``, chosen by the ending. Returns ``output``."""
    target = check_output(output, ENDINGS)
    state = model_state(path)
    if target.suffix.lower() == ".pt":
        write_with(target, lambda temporary: torch.save(state, temporary))
    else:
        write_safetensors(state, target)
    return target
