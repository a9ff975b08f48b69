"""Saving: every rank writes its part in the background while training goes on, and rank 0 marks
the checkpoint complete once every part is on disk.

``Checkpointer.save`` blocks only while the state is copied (``dcp.async_save``); a writer thread
then waits for every rank's part, hashes the files and marks the folder complete (``integrity``),
moves ``latest`` and prunes old checkpoints (``folders``). Background writes use a gloo group of
their own, so that they never interleave with the training's collectives.

``Checkpointer.start`` begins a run in the directory: it refuses a new run where checkpoints are
(they would be hidden or overwritten), moves them aside when asked, and resumes from the newest
complete checkpoint, verified first. A save whose step folder exists moves the old one aside
rather than delete a folder this run did not write.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from cutpipe.train.checkpoint.agreement import (
    SaveRequest,
    check_save_agreement,
    layout_fingerprint,
)
from cutpipe.train.checkpoint.errors import CheckpointError, Failure, by_ranks, cause, one_line
from cutpipe.train.checkpoint.folders import (
    IF_PRESENT,
    OVERWRITE,
    Manifest,
    check_directory,
    claim,
    claimed_by,
    is_complete,
    latest_checkpoint,
    point_latest,
    prune,
    release,
    set_aside,
    step_folder,
    used_names,
    write_mark,
)
from cutpipe.train.checkpoint.integrity import digest_folder
from cutpipe.train.checkpoint.load import Restored, load
from cutpipe.train.checkpoint.ranks import Ranks, alone_quietly, default_group
from cutpipe.train.checkpoint.state import extra_text, rank_state


def _step_of(folder: Path) -> int:
    """The step of a ``step-NNNNNN`` folder."""
    return int(folder.name.split("-", 1)[1])


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0, got {step!r}")


class Checkpointer:
    """Saves checkpoints of this rank's model into ``directory`` (``DIR/step-NNNNNN``), in the
    background by default, keeping the ``keep`` newest complete ones (None: all).

    Every rank of the group builds one and calls ``save`` at the same steps. Without
    ``process_group`` it makes its own gloo group over the whole world (a collective call), so
    that the background writes never interleave with the training's collectives; a pipeline that
    is a subgroup of the world passes a gloo group of its ranks. ``save`` blocks only to copy the
    state (``stall`` says how long) and waits first for the previous save. ``wait`` returns when
    the pending checkpoint is complete on every rank, ``latest`` updated; ``close`` waits and lets
    the group go. ``say`` hears, on rank 0, each line worth reporting: a folder moved aside, the
    step a run resumed from, a checkpoint passed over.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        asynchronous: bool = True,
        say: Callable[[str], None] | None = None,
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a whole number >= 1 or None (keep all), got {keep!r}")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(f"{self.directory} is a file: give a folder for checkpoints")
        self.keep = keep
        self.asynchronous = asynchronous
        self._own_group = None
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = self._own_group = dist.new_group(backend="gloo")
        self._ranks = Ranks.of(process_group)
        self._say = say
        self._pending: Future[Path] | None = None
        self._pending_folder: Path | None = None
        self._written: set[Path] = set()  # the step folders this checkpointer began
        self._resumed_step: int | None = None
        self._run: str | None = None  # the launch that claimed the directory, to release it
        self._executor: ThreadPoolExecutor | None = None
        self.stall = 0.0  # seconds the last save() kept its caller waiting

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._ranks.group

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Start the checkpoint of the state after ``step``; returns its folder once the state is
        copied (or written, if not asynchronous). ``extra`` must be the same on every rank."""
        started = time.perf_counter()
        self.wait()
        mine = self._request(step, model, extra)
        everyone: list[SaveRequest] = self._ranks.gather(mine)
        check_save_agreement(everyone)
        folder = step_folder(self.directory, step)
        state = rank_state(self._ranks.rank, step, model, optimizer, scheduler, mine.extra)
        layouts = tuple(request.layout for request in everyone)
        manifest = Manifest(step=step, world_size=self._ranks.size, layouts=layouts)
        self._written.add(folder)
        self._pending_folder = folder
        if self.asynchronous:
            self._write_in_background(state, folder, manifest)
        else:
            self._write_now(state, folder, manifest)
        self.stall = time.perf_counter() - started
        return folder

    def _request(self, step: int, model: nn.Module, extra: dict[str, Any] | None) -> SaveRequest:
        """What this rank asks to save. A mistake in its arguments goes into the request rather
        than being raised, so that every rank hears of it and none waits for this one; rank 0
        also makes the step's folder ready, or says why it cannot."""
        layout = layout_fingerprint(model)
        try:
            _check_step(step)
            text = extra_text(extra)
        except (TypeError, ValueError) as error:
            return SaveRequest(step=0, extra="{}", layout=layout, mistake=Failure.of(error))
        refusal = None
        if self._ranks.rank == 0:
            try:
                self._prepare_folder(step_folder(self.directory, step))
            except CheckpointError as error:
                refusal = Failure.of(error)
        return SaveRequest(step=step, extra=text, layout=layout, refusal=refusal)

    def _prepare_folder(self, folder: Path) -> None:
        """Rank 0, before anyone writes: move aside whatever holds ``folder``'s name (a save that
        never became the latest, a later step of a run resumed from an earlier one, the damaged
        checkpoint a resume fell back from), never deleting a folder this run did not write."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if folder.exists():
                # a run resumed from an earlier step (passing over a damaged latest) saves anew
                behind = self._resumed_step is not None and self._resumed_step < _step_of(folder)
                latest = is_complete(folder) and latest_checkpoint(self.directory) == folder
                if latest and not behind:
                    raise CheckpointError(
                        f"{folder} is the latest complete checkpoint: each save needs a new "
                        "step (move that folder away to save this step again)"
                    )
                kind = "earlier" if is_complete(folder) else "unfinished"
                aside = set_aside(self.directory, [folder.name])
                self._tell(f"moved the {kind} {folder} aside to {aside}: this run saves that step")
        except OSError as error:
            raise CheckpointError(
                f"cannot write checkpoints into {self.directory}: {error}"
            ) from error

    def _write_in_background(self, state: dict[str, Any], folder: Path, manifest: Manifest) -> None:
        """Start DCP's asynchronous save (it returns once the state is copied), and a writer
        thread that completes the checkpoint once every rank's part is on disk."""
        try:
            written = dcp.async_save(
                state,
                checkpoint_id=folder,
                process_group=self._ranks.group,
                no_dist=self._ranks.group is None,
            )
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            raise CheckpointError(f"checkpoint {folder} was not started: {cause(error)}") from None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="cutpipe-checkpoint")
        self._pending = self._executor.submit(self._finish, written, folder, manifest)

    def _write_now(self, state: dict[str, Any], folder: Path, manifest: Manifest) -> None:
        """Save and complete the checkpoint before returning; a failure on any rank raises on
        every rank, as ``wait`` does."""
        alone = self._ranks.group is None

        def write_and_finish() -> Path:
            try:
                with alone_quietly(alone):
                    dcp.save(
                        state, checkpoint_id=folder, process_group=self._ranks.group, no_dist=alone
                    )
            except (Exception, CheckpointException) as error:  # DCP's is a BaseException
                raise CheckpointError(cause(error)) from None
            return self._finish(None, folder, manifest)

        done: Future[Path] = Future()
        try:
            done.set_result(write_and_finish())
        except Exception as error:
            done.set_exception(error)
        self._pending = done
        self.wait()

    def _finish(self, written: Future | None, folder: Path, manifest: Manifest) -> Path:
        """Wait for every rank's part, then (rank 0) hash the files and mark the checkpoint
        complete (``integrity``: why rank 0 hashes them all)."""
        if written is not None:
            try:
                written.result()
            except (Exception, CheckpointException) as error:  # DCP's is a BaseException
                raise CheckpointError(cause(error)) from None
        if self._ranks.rank == 0:
            self._mark(folder, replace(manifest, files=digest_folder(folder)))
            self._point(folder)
            if self.keep is not None:
                prune(self.directory, self.keep, manifest.step, self._written)
        return folder

    def _mark(self, folder: Path, manifest: Manifest) -> None:
        write_mark(folder, manifest)

    def _point(self, folder: Path) -> None:
        point_latest(self.directory, folder)

    def wait(self) -> Path | None:
        """Block until the pending checkpoint is complete on every rank; its folder, or None if
        none was pending. A failure on any rank raises ``CheckpointError`` on every rank."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        folder: Path | None = None
        failure: str | None = None
        try:
            folder = pending.result()
        except Exception as error:
            failure = str(error) if isinstance(error, CheckpointError) else one_line(error)
        latest = None
        if self._ranks.rank == 0:  # what a failure leaves, as rank 0 sees it
            latest = latest_checkpoint(self.directory)
        # every rank's writer thread is done before this gather, so it never meets DCP's own
        # collectives on the group; rank 0 arrives after the mark and the pointer
        everyone: list[tuple[str | None, Path | None]] = self._ranks.gather((failure, latest))
        failed = {rank: said for rank, (said, _) in enumerate(everyone) if said is not None}
        if failed:
            latest = everyone[0][1]
            left = f"latest still names {latest.name}" if latest else "no checkpoint is complete"
            raise CheckpointError(
                f"checkpoint {self._pending_folder} was not completed: {by_ranks(failed)}; {left}"
            )
        return folder

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        path: str | os.PathLike | None = None,
        allow_partial: bool = False,
        fallback: bool = False,
    ) -> Restored:
        """``load`` from ``path`` (default: this checkpointer's directory) over its group."""
        self.wait()
        return load(
            self.directory if path is None else path,
            model,
            optimizer,
            scheduler,
            process_group=self._ranks.group,
            allow_partial=allow_partial,
            fallback=fallback,
        )

    def start(
        self,
        mode: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        fallback: bool = False,
        run: str | None = None,
        restarted: bool = False,
    ) -> Restored | None:
        """Begin a run in this directory, in ``mode`` (``folders.START_MODES``; ``folders.
        start_mode`` reads the options): refuse a new run where checkpoints are, move them aside
        (OVERWRITE), or resume from the latest complete checkpoint (RESUME, IF_PRESENT), verified
        first; with ``fallback``, a damaged one is passed over for the newest intact older one.
        What it resumed from, or None if the run starts at step 1. Every rank calls it; a refusal
        is the same ``ValueError`` on every rank.

        ``run`` (the elastic run id) is recorded in the directory, so that a worker the agent
        ``restarted`` resumes its own launch's checkpoints, and only those: a restart of a launch
        that was refused is refused again."""
        self.wait()
        verdict: tuple[bool, list[str], Failure | None] = (False, [], None)
        if self._ranks.rank == 0:
            try:
                verdict = (*self._begin(mode, run, restarted), None)
            except OSError as error:
                failure = CheckpointError(f"cannot prepare {self.directory}: {error}")
                verdict = (False, [], Failure.of(failure))
            except ValueError as error:
                verdict = (False, [], Failure.of(error))
        resumes, notes, failure = self._ranks.gather(verdict)[0]
        if failure is not None:
            raise failure.exception(ValueError, otherwise=CheckpointError)
        self._run = run
        for note in notes:
            self._tell(note)
        if not resumes:
            return None
        restored = self.load(model, optimizer, scheduler, fallback=fallback)
        self._resumed_step = restored.step
        for note in restored.notes:
            self._tell(note)
        self._tell(f"resumed from {restored.folder} (after step {restored.step})")
        return restored

    def _begin(self, mode: str, run: str | None, restarted: bool) -> tuple[bool, list[str]]:
        """Rank 0: check the directory for ``mode``, move an earlier run aside if asked, claim
        the directory for ``run``; whether to resume, and what to report."""
        if restarted and run is not None and claimed_by(self.directory) == run:
            mode = IF_PRESENT  # this launch's own checkpoints, or none yet
        resumes = check_directory(self.directory, mode) is not None
        notes = []
        if mode == OVERWRITE and self.directory.is_dir():
            names = used_names(self.directory)
            if names:
                aside = set_aside(self.directory, names)
                notes.append(
                    f"--overwrite: moved the checkpoints in {self.directory} aside to {aside} "
                    "(kept: delete that folder when they are no longer needed)"
                )
        if run is not None:
            claim(self.directory, run)
        return resumes, notes

    def _tell(self, line: str) -> None:
        """Report ``line`` through ``say``, once (rank 0)."""
        if self._say is not None and self._ranks.rank == 0:
            self._say(line)

    def load_latest(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> dict[str, Any] | None:
        """Resume from the latest complete checkpoint: its ``extra``, or None (and nothing
        loaded) when the directory holds none yet."""
        self.wait()
        found = latest_checkpoint(self.directory) is not None
        if not self._ranks.gather(found)[0]:  # rank 0's view, as load() takes its folder
            return None
        return self.load(model, optimizer, scheduler).extra

    def abandon(self) -> None:
        """After a failure elsewhere: stop without waiting for the other ranks (they may be gone).
        A checkpoint still being written never gets its completion mark, so it is never used."""
        self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def close(self) -> None:
        """Wait for the pending checkpoint and let the writer thread and the group go."""
        try:
            self.wait()
            if self._run is not None and self._ranks.rank == 0:
                release(self.directory, self._run)  # finished: a restart is no longer its own
                self._run = None
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._own_group is not None:
                dist.destroy_process_group(self._own_group)
                self._own_group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def save(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    *,
    keep: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save one checkpoint synchronously over ``process_group`` (default: the whole world, if
    there is one); the complete folder. Training loops use a ``Checkpointer`` instead."""
    checkpointer = Checkpointer(
        directory, keep=keep, process_group=default_group(process_group), asynchronous=False
    )
    try:
        return checkpointer.save(step, model, optimizer, scheduler, extra)
    finally:
        checkpointer.close()
