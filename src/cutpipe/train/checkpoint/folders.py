"""The checkpoint directory on disk: step folders, the completion mark, ``latest``, and deletion.

Everything that decides whether a checkpoint exists lives here, so that the rule "complete or
invisible" is kept in one place. What ``DIR`` holds:

- ``DIR/step-000123/``: one checkpoint, DCP's files (``.metadata`` and a ``.distcp`` file per
  rank) and ``complete.json``, the completion mark, written by rank 0 only after every rank's part
  is on disk (DCP's last step gathers every rank's result before rank 0 writes ``.metadata``);
- ``DIR/latest``: the name of the newest complete checkpoint, replaced atomically (temporary file,
  fsync, ``os.replace``, fsync of ``DIR``) after the mark.

A crash at any moment leaves ``latest`` naming a complete checkpoint, and a folder without the
mark is never loaded. Older checkpoints are deleted (mark first) only after a newer one is
complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cutpipe.files import flush_to_disk, write_text

FORMAT = "cutpipe-checkpoint/1"
MARK = "complete.json"
POINTER = "latest"
_STEP = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Manifest:
    """What the completion mark records: the step, and the layout that saved the checkpoint
    (RNG states are restored only into the same one). cutpipe writes every field; a mark that
    lacks one reads as step 0 and None."""

    step: int
    world_size: int | None
    layouts: tuple[str, ...] | None  # each rank's layout fingerprint, in rank order

    def text(self) -> str:
        """The mark's JSON, ``format`` first."""
        record = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "layouts": None if self.layouts is None else list(self.layouts),
        }
        return json.dumps(record, indent=1) + "\n"

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The mark of the complete checkpoint ``folder``."""
        mark = json.loads((folder / MARK).read_text(encoding="utf-8"))
        layouts = mark.get("layouts")
        return cls(
            step=mark.get("step", 0),
            world_size=mark.get("world_size"),
            layouts=tuple(layouts) if isinstance(layouts, list) else None,
        )

    def saved_by(self, layouts: Sequence[str]) -> bool:
        """Whether ranks with these layout fingerprints, in rank order, are the ones that saved
        the checkpoint."""
        return self.world_size == len(layouts) and self.layouts == tuple(layouts)


def step_folder(directory: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint taken after ``step`` lives."""
    return Path(directory) / f"step-{step:06d}"


def is_complete(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a checkpoint whose every part was written."""
    try:
        mark = json.loads((Path(folder) / MARK).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("format") == FORMAT


def _step_folders(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        matched = _STEP.fullmatch(child.name)
        if matched and child.is_dir():
            found.append((int(matched.group(1)), child))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The complete checkpoint ``DIR/latest`` names; if that pointer is missing or broken, the
    newest complete step folder; None when ``DIR`` holds no complete checkpoint (or is absent).

    The pointer is followed rather than the newest folder because a crash between the mark and
    the pointer leaves a complete folder that the run never reported as saved."""
    directory = Path(directory)
    try:
        name = (directory / POINTER).read_text(encoding="utf-8").strip()
    except OSError:
        name = ""
    if _STEP.fullmatch(name) and is_complete(directory / name):
        return directory / name
    complete = [folder for _, folder in _step_folders(directory) if is_complete(folder)]
    return complete[-1] if complete else None


def resolve(path: str | os.PathLike) -> Path:
    """A complete step folder: ``path`` itself, or the latest checkpoint of the directory
    ``path``; otherwise an error that says what to pass."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path}: the folder does not exist; pass a checkpoint directory or "
            "one of its step-NNNNNN folders"
        )
    if not path.is_dir():
        raise NotADirectoryError(
            f"{path} is a file: pass a checkpoint directory or one of its step-NNNNNN folders"
        )
    if is_complete(path):
        return path
    if _STEP.fullmatch(path.name) or (path / ".metadata").exists():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (it has no {MARK}: its save did not finish); "
            f"pass its directory {path.parent} to load the latest complete one"
        )
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"{path} holds no complete checkpoint (no step-NNNNNN folder with {MARK})"
        )
    return latest


def write_mark(folder: Path, manifest: Manifest) -> None:
    """Mark ``folder`` complete (rank 0, once every rank's part is on disk)."""
    write_text(folder / MARK, manifest.text())
    flush_to_disk(folder)


def point_latest(directory: Path, folder: Path) -> None:
    """Make ``DIR/latest`` name ``folder`` (after its mark)."""
    write_text(directory / POINTER, folder.name + "\n")
    flush_to_disk(directory)


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder, its mark first, so that a crash half-way leaves an incomplete
    folder rather than a complete-looking one."""
    mark = folder / MARK
    if mark.exists():
        mark.unlink()
        flush_to_disk(folder)
    shutil.rmtree(folder, ignore_errors=True)


def prune(directory: str | os.PathLike, keep: int, newest: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints up to step ``newest``, and the
    unfinished folders of crashed saves before it; folders after ``newest`` (from a run that was
    resumed from an earlier step) are left alone. Returns the deleted folders."""
    folders = [(step, folder) for step, folder in _step_folders(Path(directory)) if step <= newest]
    complete = [folder for _, folder in folders if is_complete(folder)]
    doomed = complete[:-keep]
    doomed += [f for s, f in folders if s < newest and f not in complete]
    for folder in doomed:
        remove_checkpoint(folder)
    return doomed
