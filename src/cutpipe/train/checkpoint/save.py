"""Saving: every rank writes its part in the background while training goes on, and rank 0 marks
the checkpoint complete once every part is on disk.

``Checkpointer.save`` blocks only while the state is copied (``dcp.async_save``); a writer thread
then waits for every rank's part, marks the folder complete, moves ``latest`` and prunes old
checkpoints (``folders``). Background writes use a gloo group of their own, so that they never
interleave with the training's collectives.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from cutpipe.train.checkpoint.agreement import (
    SaveRequest,
    check_save_agreement,
    layout_fingerprint,
)
from cutpipe.train.checkpoint.errors import CheckpointError, Failure
from cutpipe.train.checkpoint.folders import (
    Manifest,
    is_complete,
    latest_checkpoint,
    point_latest,
    prune,
    remove_checkpoint,
    step_folder,
    write_mark,
)
from cutpipe.train.checkpoint.load import Restored, load
from cutpipe.train.checkpoint.ranks import Ranks, alone_quietly, default_group
from cutpipe.train.checkpoint.state import extra_text, rank_state


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
    the group go.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        asynchronous: bool = True,
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
        self._pending: Future[Path] | None = None
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
        """Rank 0, before anyone writes: clear ``folder`` of a save that never became the latest
        (a crash before the mark or the pointer, or a run resumed from an earlier step)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if folder.exists():
                if is_complete(folder) and latest_checkpoint(self.directory) == folder:
                    raise CheckpointError(
                        f"{folder} is the latest complete checkpoint: each save needs a new "
                        "step (delete that folder to save this step again)"
                    )
                remove_checkpoint(folder)
        except OSError as error:
            raise CheckpointError(
                f"cannot write checkpoints into {self.directory}: {error}"
            ) from error

    def _write_in_background(self, state: dict[str, Any], folder: Path, manifest: Manifest) -> None:
        """Start DCP's asynchronous save (it returns once the state is copied), and a writer
        thread that completes the checkpoint once every rank's part is on disk."""
        written = dcp.async_save(
            state,
            checkpoint_id=folder,
            process_group=self._ranks.group,
            no_dist=self._ranks.group is None,
        )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="cutpipe-checkpoint")
        self._pending = self._executor.submit(self._finish, written, folder, manifest)

    def _write_now(self, state: dict[str, Any], folder: Path, manifest: Manifest) -> None:
        """Save and complete the checkpoint before returning; a failure on any rank raises on
        every rank, as ``wait`` does."""
        alone = self._ranks.group is None
        with alone_quietly(alone):
            dcp.save(state, checkpoint_id=folder, process_group=self._ranks.group, no_dist=alone)
        done: Future[Path] = Future()
        try:
            done.set_result(self._finish(None, folder, manifest))
        except Exception as error:
            done.set_exception(error)
        self._pending = done
        self.wait()

    def _finish(self, written: Future | None, folder: Path, manifest: Manifest) -> Path:
        """Wait for every rank's part, then (rank 0) mark the checkpoint complete."""
        if written is not None:
            written.result()
        if self._ranks.rank == 0:
            self._mark(folder, manifest)
            self._point(folder)
            if self.keep is not None:
                prune(self.directory, self.keep, manifest.step)
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
        failure: Failure | None = None
        try:
            folder = pending.result()
        except Exception as error:
            failure = Failure.of(error)
        # every rank's writer thread is done before this gather, so it never meets DCP's own
        # collectives on the group; rank 0 arrives after the mark and the pointer
        failures: list[Failure | None] = self._ranks.gather(failure)
        failed = [f"rank {rank}: {said}" for rank, said in enumerate(failures) if said is not None]
        if failed:
            raise CheckpointError(f"a checkpoint was not completed ({'; '.join(failed)})")
        return folder

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        *,
        path: str | os.PathLike | None = None,
        allow_partial: bool = False,
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
        )

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
