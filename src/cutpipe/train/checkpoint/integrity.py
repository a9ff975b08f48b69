"""Whether a checkpoint's files are still the bytes that were saved, and which checkpoint to read.

When a checkpoint is marked complete, its mark records each file's size and SHA-256 (``folders.
Manifest``); a load or an export checks them before it reads anything, so that a truncated or
overwritten file is an error that names the file and the step, instead of a traceback or, worse,
quietly wrong weights. A mark without checksums (saved before they were recorded) loads with a
note that it is unverified.

Rank 0 hashes every file, in the writer thread that completes the checkpoint: after DCP's last
step (every rank's part is on disk) and before the mark. One rank hashes them all, rather than
each rank its own files, because

- rank 0 alone completes a checkpoint already: hashing there adds no collective to the writer
  threads, where it would have to be ordered against DCP's own on the same group, and where a
  rank lost half-way would leave the others waiting in it;
- which rank wrote which file is DCP's business (its file names, its plan), so a rank cannot
  list "its" files without relying on them, while rank 0 sees the finished folder;
- it costs the training nothing but a core: the thread runs beside the step loop, and file reads
  and ``hashlib`` release the GIL. The next save waits for it, as it waits for the previous write.

A load verifies on rank 0 too, before any rank reads (``load``): every rank then reads the files
rank 0 checked, on the shared file system a multi-rank checkpoint needs anyway. Imports no torch.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from cutpipe.train.checkpoint.errors import CheckpointError
from cutpipe.train.checkpoint.folders import (
    MARK,
    FileRecord,
    Manifest,
    is_complete,
    locate,
    step_folders,
)

CHUNK = 1 << 20  # bytes read at a time: large enough that hashlib releases the GIL


def digest(path: Path) -> FileRecord:
    """``path``'s size and SHA-256."""
    sha256 = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            sha256.update(chunk)
            size += len(chunk)
    return FileRecord(size=size, sha256=sha256.hexdigest())


def digest_folder(folder: Path) -> dict[str, FileRecord]:
    """Every file of the checkpoint ``folder`` but its mark, by name."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MARK)
    return {path.name: digest(path) for path in files}


def damage(folder: Path, files: Mapping[str, FileRecord]) -> str | None:
    """What differs between ``folder`` and the ``files`` its mark records (the first file that
    does: sizes are checked first, they cost nothing), or None."""
    for name, record in sorted(files.items()):
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != record.size:
            how = "truncated" if size < record.size else "grown"
            return f"{name} holds {size} bytes where {record.size} were saved ({how})"
    for name, record in sorted(files.items()):
        if digest(folder / name).sha256 != record.sha256:
            return f"{name} does not match the SHA-256 recorded when it was saved"
    return None


def verify(folder: Path) -> str | None:
    """Check the complete checkpoint ``folder`` against its mark: a ``CheckpointError`` of one
    line naming the file and the step if it is damaged; a note if the mark records no
    checksums (it is loaded unverified); else None."""
    try:
        files = Manifest.read(folder).files
        if files is None:
            return f"{folder} was saved without checksums (by an older cutpipe): read unverified"
        problem = damage(folder, files)
    except OSError as error:
        problem = f"it cannot be read ({error})"
    except ValueError:
        problem = f"its {MARK} cannot be read"
    if problem is not None:
        raise CheckpointError(f"checkpoint {folder} is damaged: {problem}")
    return None


def choose(
    path: str | os.PathLike, *, fallback: bool = False, hint: str = ""
) -> tuple[Path, list[str]]:
    """The checkpoint ``path`` names (a step folder, or a directory: its latest), verified, and
    the notes to report. A damaged one is a ``CheckpointError`` (``hint`` appended, after a
    semicolon), unless ``fallback`` and ``path`` is a directory: then the newest intact older
    checkpoint, with a note for each damaged one passed over."""
    found = locate(path)
    folder = found.folder
    assert folder is not None  # locate raises where there is none
    notes = [found.note] if found.note else []
    falls_back = fallback and Path(path) != folder  # a directory: its older checkpoints
    first: CheckpointError | None = None
    for candidate in [folder, *(_older(Path(path), folder) if falls_back else [])]:
        try:
            note = verify(candidate)
        except CheckpointError as damaged:
            if not falls_back:
                raise CheckpointError(f"{damaged}; {hint}" if hint else str(damaged)) from None
            first = first or damaged
            notes.append(f"{damaged}: passed over for an older checkpoint")
            continue
        return candidate, notes + ([note] if note else [])
    raise CheckpointError(f"{first}, and no older checkpoint in {path} is intact")


def _older(directory: Path, than: Path) -> list[Path]:
    """The complete checkpoints of ``directory`` taken before ``than``, newest first."""
    steps = dict((folder, step) for step, folder in step_folders(directory))
    limit = steps.get(than, 0)
    return [f for f, step in reversed(steps.items()) if step < limit and is_complete(f)]
