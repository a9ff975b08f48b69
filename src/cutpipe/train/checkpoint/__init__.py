"""Checkpoints of a pipeline's ranks: written in the background, complete or invisible, and
loadable into any split of the same model.

Every rank saves its own modules under the unsplit model's names (FQNs), so a checkpoint does not
depend on how the model was cut: ``torch.distributed.checkpoint`` (DCP) writes each rank's
tensors and an index of them, and a rank that loads asks the index for the names it holds,
wherever they were saved. A DualPipe stage held by two ranks is written once (DCP keeps one copy
of a name saved by several ranks).

The modules, each with one job:

- ``folders``: the directory on disk (step folders, the completion mark, ``latest``, pruning,
  what is moved aside) and whether a run may start in it (``check_directory``, torch-free);
- ``integrity``: each file's checksum in the mark, checked before a load or an export reads;
- ``state``: the keys a rank saves (model, optimizer, scheduler, step, ``extra``, RNG states);
- ``optimizer_state``: the optimizer flattened by FQN, and rebuilt for any grouping;
- ``ranks``: the process group a save or a load runs over, or none;
- ``agreement``: what the ranks compare before they write or read;
- ``errors``: ``CheckpointError``;
- ``save``: ``Checkpointer`` (asynchronous saves) and ``save``;
- ``load``: ``load`` into any layout;
- ``export``: the unsplit model as one ``.pt`` or ``.safetensors`` file;
- ``safetensors_file``: the safetensors format, without the ``safetensors`` package.
"""

from cutpipe.train.checkpoint.errors import CheckpointError
from cutpipe.train.checkpoint.export import export_checkpoint, model_state
from cutpipe.train.checkpoint.folders import (
    FORMAT,
    FRESH,
    IF_PRESENT,
    MARK,
    OVERWRITE,
    POINTER,
    RESUME,
    START_MODES,
    check_directory,
    find_latest,
    is_complete,
    latest_checkpoint,
    prune,
    resolve,
    start_mode,
    step_folder,
)
from cutpipe.train.checkpoint.integrity import verify
from cutpipe.train.checkpoint.load import Restored, load, read_metadata
from cutpipe.train.checkpoint.ranks import alone_quietly
from cutpipe.train.checkpoint.safetensors_file import read_safetensors, write_safetensors
from cutpipe.train.checkpoint.save import Checkpointer, save

__all__ = [
    "FORMAT",
    "FRESH",
    "IF_PRESENT",
    "MARK",
    "OVERWRITE",
    "POINTER",
    "RESUME",
    "START_MODES",
    "CheckpointError",
    "Checkpointer",
    "Restored",
    "alone_quietly",
    "check_directory",
    "export_checkpoint",
    "find_latest",
    "is_complete",
    "latest_checkpoint",
    "load",
    "model_state",
    "prune",
    "read_metadata",
    "read_safetensors",
    "resolve",
    "save",
    "start_mode",
    "step_folder",
    "verify",
    "write_safetensors",
]
