"""The checkpoint directory on disk: step folders, the completion mark, ``latest``, what is moved
aside, and whether a run may start in it.

Everything that decides whether a checkpoint exists lives here, so that the rule "complete or
invisible" is kept in one place. What ``DIR`` holds:

- ``DIR/step-000123/``: one checkpoint, DCP's files (``.metadata`` and a ``.distcp`` file per
  rank) and ``complete.json``, the completion mark, written by rank 0 only after every rank's part
  is on disk (DCP's last step gathers every rank's result before rank 0 writes ``.metadata``);
  the mark records each file's size and SHA-256 (``integrity``);
- ``DIR/latest``: the name of the newest complete checkpoint, replaced atomically (temporary file,
  fsync, ``os.replace``, fsync of ``DIR``) after the mark;
- ``DIR/replaced-<UTC time>/``: what a run moved aside rather than delete: an earlier run's steps
  and ``latest`` (``--overwrite``), or an old folder under a step name a save needs;
- ``DIR/run.json``: which launch started in ``DIR`` (its elastic run id), so that a restarted
  worker resumes its own launch's checkpoints and nobody else's.

A crash at any moment leaves ``latest`` naming a complete checkpoint, and a folder without the
mark is never loaded. A run deletes only what it wrote: older complete checkpoints after a newer
one is complete (``--keep``), never a folder it did not write; this module imports no torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cutpipe.files import flush_to_disk, write_text
from cutpipe.train.checkpoint.errors import CheckpointError

FORMAT = "cutpipe-checkpoint/1"
MARK = "complete.json"
POINTER = "latest"
RUN = "run.json"
ASIDE = "replaced-"
_STEP = re.compile(r"step-(\d+)")

#: How a run meets its checkpoint directory (``start_mode`` from the options).
FRESH = "fresh"  # a new run: refused where checkpoints are
RESUME = "resume"  # continue from the latest complete checkpoint: an error where there is none
IF_PRESENT = "if-present"  # continue if there is a complete checkpoint, else start
OVERWRITE = "overwrite"  # a new run: what is there is moved aside first
START_MODES = (FRESH, RESUME, IF_PRESENT, OVERWRITE)


# -- the completion mark ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as it was when the checkpoint was marked complete."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What the completion mark records: the step, the layout that saved the checkpoint (RNG
    states are restored only into the same one) and each file's size and checksum. cutpipe
    writes every field; a mark that lacks one reads as step 0 and None (``files`` None: saved
    before checksums, loaded unverified)."""

    step: int
    world_size: int | None
    layouts: tuple[str, ...] | None  # each rank's layout fingerprint, in rank order
    files: Mapping[str, FileRecord] | None = None  # by file name, the mark's own excluded

    def text(self) -> str:
        """The mark's JSON, ``format`` first."""
        record: dict = {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "layouts": None if self.layouts is None else list(self.layouts),
        }
        if self.files is not None:
            record["files"] = {
                name: {"size": file.size, "sha256": file.sha256}
                for name, file in sorted(self.files.items())
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
            files=_files(mark.get("files"), folder),
        )

    def saved_by(self, layouts: Sequence[str]) -> bool:
        """Whether ranks with these layout fingerprints, in rank order, are the ones that saved
        the checkpoint."""
        return self.world_size == len(layouts) and self.layouts == tuple(layouts)


def _files(entry: object, folder: Path) -> dict[str, FileRecord] | None:
    """The mark's ``files``; a malformed one is damage, not an old mark."""
    if entry is None:
        return None
    damaged = CheckpointError(
        f"checkpoint {folder} is damaged: the files list of its {MARK} cannot be read"
    )
    if not isinstance(entry, dict):
        raise damaged
    try:
        return {name: FileRecord(int(f["size"]), str(f["sha256"])) for name, f in entry.items()}
    except (KeyError, TypeError, ValueError):
        raise damaged from None


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


def step_folders(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``step-NNNNNN`` folder of ``directory``, complete or not, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        matched = _STEP.fullmatch(child.name)
        if matched and child.is_dir():
            found.append((int(matched.group(1)), child))
    return sorted(found)


def complete_folders(directory: str | os.PathLike) -> list[Path]:
    """The complete checkpoints of ``directory``, oldest first."""
    return [folder for _, folder in step_folders(directory) if is_complete(folder)]


# -- which checkpoint is the latest ----------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A complete checkpoint (or None), and why ``latest`` was not followed if it was not."""

    folder: Path | None
    note: str | None = None


def find_latest(directory: str | os.PathLike) -> Found:
    """The complete checkpoint ``DIR/latest`` names; if that pointer is missing or broken, the
    newest complete step folder, with a note that says so; None when ``DIR`` holds no complete
    checkpoint (or is absent).

    The pointer is followed rather than the newest folder because a crash between the mark and
    the pointer leaves a complete folder that the run never reported as saved."""
    directory = Path(directory)
    pointer = directory / POINTER
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = None
    if name is not None and _STEP.fullmatch(name) and is_complete(directory / name):
        return Found(directory / name)
    complete = complete_folders(directory)
    if not complete:
        return Found(None)
    if name is None:
        why = "is missing" if not pointer.exists() else "cannot be read"
    elif not _STEP.fullmatch(name):
        why = f"does not name a step folder ({name[:40]!r})"
    elif not (directory / name).is_dir():
        why = f"names {name}, which does not exist"
    else:
        why = f"names {name}, which is not complete (no {MARK})"
    return Found(
        complete[-1], f"{pointer} {why}: using {complete[-1].name}, the newest complete one"
    )


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The latest complete checkpoint of ``directory`` (``find_latest``), or None."""
    return find_latest(directory).folder


def locate(path: str | os.PathLike) -> Found:
    """A complete step folder: ``path`` itself, or the latest checkpoint of the directory
    ``path`` (with ``find_latest``'s note); otherwise an error that says what to pass."""
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
        return Found(path)
    if _STEP.fullmatch(path.name) or (path / ".metadata").exists():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (it has no {MARK}: its save did not finish); "
            f"pass its directory {path.parent} to load the latest complete one"
        )
    found = find_latest(path)
    if found.folder is None:
        raise FileNotFoundError(
            f"{path} holds no complete checkpoint (no step-NNNNNN folder with {MARK})"
        )
    return found


def resolve(path: str | os.PathLike) -> Path:
    """``locate``'s folder."""
    folder = locate(path).folder
    assert folder is not None  # locate raises where there is none
    return folder


# -- writing and deleting --------------------------------------------------------------------------


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


def prune(
    directory: str | os.PathLike, keep: int, newest: int, written: Collection[Path] = ()
) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints up to step ``newest``, and the
    unfinished folders before it among ``written`` (the saves this run started); an unfinished
    folder the run did not write, and folders after ``newest`` (from a run that was resumed from
    an earlier step), are left alone. Returns the deleted folders."""
    folders = [(step, folder) for step, folder in step_folders(directory) if step <= newest]
    complete = [folder for _, folder in folders if is_complete(folder)]
    doomed = complete[:-keep]
    doomed += [f for s, f in folders if s < newest and f not in complete and f in written]
    for folder in doomed:
        remove_checkpoint(folder)
    return doomed


def set_aside(directory: Path, names: Sequence[str]) -> Path:
    """Move the entries ``names`` of ``directory`` into a new ``DIR/replaced-<UTC time>/`` (a
    rename each: nothing is copied or deleted); that folder."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for attempt in range(1000):
        aside = directory / f"{ASIDE}{stamp}{f'-{attempt}' if attempt else ''}"
        try:
            aside.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{directory} holds 1000 {ASIDE}{stamp}* folders already")
    for name in names:  # ``latest`` first where it is given first: it never names a moved step
        os.replace(directory / name, aside / name)
    flush_to_disk(aside)
    flush_to_disk(directory)
    return aside


def used_names(directory: Path) -> list[str]:
    """What in ``directory`` belongs to a run's checkpoints: ``latest`` first, then every step
    folder, complete or not."""
    pointer = [POINTER] if os.path.lexists(directory / POINTER) else []
    return pointer + [folder.name for _, folder in step_folders(directory)]


# -- whether a run may start here ------------------------------------------------------------------


def start_mode(*, resume: bool, resume_if_present: bool, overwrite: bool) -> str:
    """The start mode that ``--resume``, ``--resume-if-present`` and ``--overwrite`` ask for."""
    if resume:
        return RESUME
    if resume_if_present:
        return IF_PRESENT
    return OVERWRITE if overwrite else FRESH


def check_directory(path: str | os.PathLike, resume: str) -> str | None:
    """Whether a run that starts in mode ``resume`` (one of ``START_MODES``) may use the
    checkpoint directory ``path``: the step folder it would resume from (None: it starts at
    step 1), or a ``ValueError`` of one line that says what to change. Reads only names and
    marks (no checksums), so the launcher can call it before starting any worker.

    Refused: ``path`` a file or not writable; a fresh run where checkpoints are (complete or not:
    it would hide or overwrite them); ``--resume`` where no complete checkpoint is."""
    if resume not in START_MODES:
        raise ValueError(f"resume must be one of {', '.join(START_MODES)}, got {resume!r}")
    directory = Path(path)
    _check_writable(directory)
    used = used_names(directory) if directory.is_dir() else []
    latest = find_latest(directory).folder
    if resume == FRESH and used:
        held = f"the latest complete is {latest.name}" if latest else "none of them complete"
        raise ValueError(
            f"--checkpoint-dir {directory} already holds checkpoints ({held}): pass --resume to "
            "continue that run, --overwrite to move them aside and start anew, or another "
            "--checkpoint-dir"
        )
    if resume == RESUME and latest is None:
        if not directory.exists():
            what = "does not exist"
        elif used:
            what = f"holds no complete checkpoint (no step folder has its {MARK})"
        else:
            what = "holds no checkpoint"
        raise ValueError(
            f"--resume: {directory} {what}, so there is nothing to resume: drop --resume to "
            "start a new run, or pass --resume-if-present"
        )
    if resume in (RESUME, IF_PRESENT) and latest is not None:
        return latest.name
    return None


def _check_writable(directory: Path) -> None:
    """A ``ValueError`` unless checkpoints can be written into ``directory`` (made if absent)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ValueError(f"--checkpoint-dir {directory}: {existing} is a file; give a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--checkpoint-dir {directory}: the folder {existing} is not writable")


# -- which launch started here ---------------------------------------------------------------------


def claim(directory: Path, run: str) -> None:
    """Record that the launch ``run`` (its elastic run id) started in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    write_text(directory / RUN, json.dumps({"run": run}) + "\n")


def claimed_by(directory: Path) -> str | None:
    """The launch that last started in ``directory`` and has not finished, if recorded."""
    try:
        run = json.loads((directory / RUN).read_text(encoding="utf-8")).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def release(directory: Path, run: str) -> None:
    """Forget the claim of ``run``, once it finished (another launch's is left alone)."""
    if claimed_by(directory) == run:
        (directory / RUN).unlink(missing_ok=True)
