"""Checkpoints of a pipeline's ranks: written in the background, complete or invisible, and
loadable into any split of the same model.

Every rank saves its own modules under the unsplit model's names (FQNs), so a checkpoint does not
depend on how the model was cut: ``torch.distributed.checkpoint`` (DCP) writes each rank's
tensors and an index of them, and a rank that loads asks the index for the names it holds,
wherever they were saved. A DualPipe stage held by two ranks is written once (DCP keeps one copy
of a name saved by several ranks).

What ``DIR`` holds:

- ``DIR/step-000123/``: one checkpoint, DCP's files (``.metadata`` and a ``.distcp`` file per
  rank) and ``complete.json``, the completion mark, written by rank 0 only after every rank's part
  is on disk (DCP's last step gathers every rank's result before rank 0 writes ``.metadata``);
- ``DIR/latest``: the name of the newest complete checkpoint, replaced atomically (temporary file,
  fsync, ``os.replace``, fsync of ``DIR``) after the mark.

A crash at any moment leaves ``latest`` naming a complete checkpoint, and a folder without the
mark is never loaded. Older checkpoints are deleted (mark first) only after a newer one is
complete. The saved keys:

- ``model.<fqn>``: parameters and buffers;
- ``optim.state.<fqn>.<name>`` and ``optim.param_groups.<fqn>.<hyperparameter>``: the optimizer
  flattened by FQN (``StateDictOptions(flatten_optimizer_state_dict=True)``), so no key depends on
  a rank's parameter order or group numbering;
- ``scheduler``, ``step``, ``extra`` (the caller's JSON dict, e.g. the data loader's position):
  the same on every rank;
- ``rng.rank<r>.{cpu,cuda.<i>,python}``: each rank's random number generators, restored only by
  the same layout (same number of ranks, each holding the same names).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
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
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from cutpipe.files import flush_to_disk, write_text

FORMAT = "cutpipe-checkpoint/1"
MARK = "complete.json"
POINTER = "latest"
_STEP = re.compile(r"step-(\d+)")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or completed; every rank raises the same message."""


@dataclass(frozen=True)
class Restored:
    """What ``load`` put back, and what it could not."""

    folder: Path
    step: int
    extra: dict[str, Any]
    rng_restored: bool
    notes: tuple[str, ...] = ()


# -- the layout of DIR ---------------------------------------------------------------------------


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


def _remove(folder: Path) -> None:
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
        _remove(folder)
    return doomed


# -- ranks ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ranks:
    """This process's place in the checkpoint's process group (or alone, without one)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> _Ranks:
        if group is None:
            return cls(None, 0, 1)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a small pickled object each)."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values


def _default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _layout(model: nn.Module) -> str:
    """A fingerprint of the names a rank holds: equal layouts restore RNG states."""
    names = "\n".join(sorted(model.state_dict()))
    return hashlib.sha256(names.encode()).hexdigest()[:16]


def _extra_text(extra: dict[str, Any] | None) -> str:
    if extra is None:
        return "{}"
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    try:
        return json.dumps(extra, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"extra must hold JSON values (numbers, strings, lists, dicts): {error}; convert "
            "tensors with .tolist()"
        ) from None


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _names(names: Iterable[str], most: int = 6) -> str:
    names = sorted(names)
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


@contextmanager
def alone_quietly(alone: bool) -> Iterator[None]:
    """DCP warns that it assumes a single process whenever it runs without a process group; here
    that is the intent, so the warning is dropped (in this thread's calls only)."""
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- what a rank saves ---------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    devices = sorted(int(k.removeprefix("cuda.")) for k in state if k.startswith("cuda."))
    cuda = [state[f"cuda.{device}"] for device in devices]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _optimizer_items(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state by FQN, leaving a fresh optimizer fresh: DCP builds
    missing optimizer state with a zero-learning-rate step, which would count as a step."""
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer, options=_FLAT)
    if fresh:
        optimizer.state.clear()
        optim_state = {k: v for k, v in optim_state.items() if not k.startswith("state.")}
    return model_state, optim_state


def _state(
    rank: int,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    extra: str,
) -> dict[str, Any]:
    """The rank's part of a checkpoint, as DCP saves it."""
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model), {}
    else:
        model_state, optim_state = _optimizer_items(model, optimizer)
    state: dict[str, Any] = {
        "model": model_state,
        "step": step,
        "extra": extra,
        "rng": {f"rank{rank}": _rng_state()},
    }
    if optim_state:
        state["optim"] = optim_state
    if scheduler is not None:
        # one pickled leaf: DCP would flatten the dict, and loading would need its shape first
        state["scheduler"] = (scheduler.state_dict(),)
    return state


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a whole number >= 0, got {step!r}")


def _check_agreement(said: list[tuple[str | None, str | None, int, str, str]]) -> None:
    """Raise the same error on every rank if any rank's input was wrong or the ranks differ."""
    mistakes = [(r, entry[0]) for r, entry in enumerate(said) if entry[0]]
    if mistakes:
        rank, mistake = mistakes[0]
        raise ValueError(f"rank {rank} cannot save: {mistake}")
    if said[0][1]:
        raise CheckpointError(said[0][1])
    steps = {entry[2] for entry in said}
    if len(steps) > 1:
        story = ", ".join(f"rank {r} step {entry[2]}" for r, entry in enumerate(said))
        raise CheckpointError(f"the ranks save different steps ({story}): save at the same step")
    differ = [r for r, entry in enumerate(said) if entry[3] != said[0][3]]
    if differ:
        raise CheckpointError(
            f"extra differs between rank 0 and {_ranks_text(differ)}: pass the same extra on "
            "every rank (what all ranks share, such as the data loader's position)"
        )


# -- saving --------------------------------------------------------------------------------------


class Checkpointer:
    """Saves checkpoints of this rank's model into ``directory`` (``DIR/step-NNNNNN``), in the
    background by default, keeping the ``keep`` newest complete ones (None: all).

    Every rank of the group builds one and calls ``save`` at the same steps. Without
    ``process_group`` it makes its own gloo group over the whole world (a collective call), so
    that the background writes never interleave with the training's collectives; a pipeline that
    is a subgroup of the world passes a gloo group of its ranks. ``save`` blocks only to copy the state (``stall`` says how long)
    and waits first for the previous save. ``wait`` returns when the pending checkpoint is
    complete on every rank, ``latest`` updated; ``close`` waits and lets the group go.
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
        self._ranks = _Ranks.of(process_group)
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
        text, mistake = "{}", None
        try:
            _check_step(step)
            text = _extra_text(extra)
        except (TypeError, ValueError) as error:
            mistake = str(error)  # told to every rank, so that none waits for this one
        folder = step_folder(self.directory, step if mistake is None else 0)
        problem = None
        if self._ranks.rank == 0 and mistake is None:
            problem = self._prepare_folder(folder)
        said = self._ranks.gather((mistake, problem, step, text, _layout(model)))
        _check_agreement(said)
        state = _state(self._ranks.rank, step, model, optimizer, scheduler, text)
        manifest = {
            "format": FORMAT,
            "step": step,
            "world_size": self._ranks.size,
            "layouts": [entry[4] for entry in said],
        }
        no_dist = self._ranks.group is None
        if self.asynchronous:
            written = dcp.async_save(
                state, checkpoint_id=folder, process_group=self._ranks.group, no_dist=no_dist
            )
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="cutpipe-checkpoint")
            self._pending = self._executor.submit(self._finish, written, folder, manifest)
        else:
            with alone_quietly(no_dist):
                dcp.save(
                    state, checkpoint_id=folder, process_group=self._ranks.group, no_dist=no_dist
                )
            done: Future[Path] = Future()
            try:
                done.set_result(self._finish(None, folder, manifest))
            except Exception as error:
                done.set_exception(error)
            self._pending = done
            self.wait()
        self.stall = time.perf_counter() - started
        return folder

    def _prepare_folder(self, folder: Path) -> str | None:
        """Rank 0, before anyone writes: clear ``folder`` of a save that never became the latest
        (a crash before the mark or the pointer, or a run resumed from an earlier step)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if folder.exists():
                if is_complete(folder) and latest_checkpoint(self.directory) == folder:
                    return (
                        f"{folder} is the latest complete checkpoint: each save needs a new "
                        "step (delete that folder to save this step again)"
                    )
                _remove(folder)
        except OSError as error:
            return f"cannot write checkpoints into {self.directory}: {error}"
        return None

    def _finish(self, written: Future | None, folder: Path, manifest: dict[str, Any]) -> Path:
        """Wait for every rank's part, then (rank 0) mark the checkpoint complete."""
        if written is not None:
            written.result()
        if self._ranks.rank == 0:
            self._mark(folder, manifest)
            self._point(folder)
            if self.keep is not None:
                prune(self.directory, self.keep, manifest["step"])
        return folder

    def _mark(self, folder: Path, manifest: dict[str, Any]) -> None:
        write_text(folder / MARK, json.dumps(manifest, indent=1) + "\n")
        flush_to_disk(folder)

    def _point(self, folder: Path) -> None:
        write_text(self.directory / POINTER, folder.name + "\n")
        flush_to_disk(self.directory)

    def wait(self) -> Path | None:
        """Block until the pending checkpoint is complete on every rank; its folder, or None if
        none was pending. A failure on any rank raises ``CheckpointError`` on every rank."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            folder, error = pending.result(), None
        except Exception as failure:
            folder, error = None, f"{type(failure).__name__}: {failure}"
        # every rank's writer thread is done before this gather, so it never meets DCP's own
        # collectives on the group; rank 0 arrives after the mark and the pointer
        errors = self._ranks.gather(error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            story = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise CheckpointError(f"a checkpoint was not completed ({story})")
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
        directory, keep=keep, process_group=_default_group(process_group), asynchronous=False
    )
    try:
        return checkpointer.save(step, model, optimizer, scheduler, extra)
    finally:
        checkpointer.close()


# -- loading -------------------------------------------------------------------------------------


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


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The FQNs of each of the optimizer's parameter groups."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                f"the optimizer holds {len(unknown)} parameters that are not in the model: "
                "give the module whose parameters the optimizer updates"
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def _optimizer_keys(keys: Iterable[str], names: Iterable[str]) -> dict[str, tuple[str, str, str]]:
    """Each saved optimizer key of the parameters ``names``: (state or param_groups, FQN, field).
    The FQN is the longest dotted head of the key that names a parameter (a parameter has no
    children, so no other head can)."""
    names = set(names)
    found = {}
    for key in keys:
        for kind in ("state", "param_groups"):
            prefix = f"optim.{kind}."
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            cut = rest.rfind(".")
            while cut > 0 and rest[:cut] not in names:
                cut = rest.rfind(".", 0, cut)
            if cut > 0:
                found[key] = (kind, rest[:cut], rest[cut + 1 :])
    return found


def _nested_optimizer(
    loaded: dict[str, Any],
    where: dict[str, tuple[str, str, str]],
    groups: list[list[str]],
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """The FQN-keyed optimizer state DCP's ``set_state_dict`` takes, from the flat keys this rank
    loaded; each of this optimizer's groups takes the saved hyperparameters of its parameters
    (its own, if none of them was saved)."""
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, (kind, name, field) in where.items():
        (state if kind == "state" else hyper).setdefault(name, {})[field] = loaded[key]
    param_groups = []
    for names, current in zip(groups, optimizer.param_groups, strict=True):
        present = [name for name in names if name in hyper]
        if not present:
            param_groups.append(
                {k: v for k, v in current.items() if k != "params"} | {"params": []}
            )
            continue
        values = hyper[present[0]]
        for name in present[1:]:
            if hyper[name] != values:
                raise ValueError(
                    f"{present[0]} and {name} share an optimizer group here but were saved in "
                    "groups with different hyperparameters: group the parameters as the saved "
                    "run did"
                )
        param_groups.append({"params": present, **values})
    return {"state": state, "param_groups": param_groups}


@dataclass(frozen=True)
class _Holding:
    """What one rank holds, for the checks every rank makes alike."""

    model: list[str]
    optimizer: list[str]
    layout: str


def _check_names(
    everyone: list[_Holding], saved_model: set[str], saved_optim: set[str], optimizer_given: bool
) -> list[str]:
    """Each problem with the names, the same text on every rank."""
    problems = []
    for rank, holding in enumerate(everyone):
        missing = set(holding.model) - saved_model
        if missing:
            problems.append(f"rank {rank} holds {_names(missing)}, which the checkpoint lacks")
    held = set().union(*(h.model for h in everyone))
    unexpected = saved_model - held
    if unexpected:
        problems.append(f"the checkpoint holds {_names(unexpected)}, which no rank holds")
    if optimizer_given:
        for rank, holding in enumerate(everyone):
            missing = set(holding.optimizer) - saved_optim
            if missing:
                problems.append(
                    f"rank {rank}'s optimizer updates {_names(missing)}, for which the "
                    "checkpoint holds no optimizer state"
                )
    return problems


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
    ranks = _Ranks.of(_default_group(process_group))
    groups = _optimizer_names(model, optimizer) if optimizer is not None else []
    holding = _Holding(
        sorted(model.state_dict()),
        sorted(name for names in groups for name in names),
        _layout(model),
    )
    if ranks.rank == 0:
        try:
            where: str = str(resolve(path))
        except OSError as error:
            where = f"!{type(error).__name__}!{error}"
    else:
        where = ""
    said = ranks.gather((where, holding))
    where = said[0][0]
    if where.startswith("!"):
        _, kind, message = where.split("!", 2)
        error_type = {"NotADirectoryError": NotADirectoryError}.get(kind, FileNotFoundError)
        raise error_type(message)
    folder = Path(where)
    everyone = [entry[1] for entry in said]
    keys = read_metadata(folder).state_dict_metadata
    saved_model = {key[len("model.") :] for key in _under(keys, "model.")}
    saved_optim = {
        key[len("optim.param_groups.") :].rpartition(".")[0]
        for key in _under(keys, "optim.param_groups.")
    }
    # hyperparameter names have no dots, so the FQN is all before the last one
    problems = _check_names(everyone, saved_model, saved_optim, optimizer is not None)
    if problems and not allow_partial:
        raise ValueError(
            f"the checkpoint {folder} does not fit this layout: {'; '.join(problems)}; load "
            "the model it was saved from, or pass allow_partial=True to load what matches"
        )
    manifest = json.loads((folder / MARK).read_text(encoding="utf-8"))
    same_layout = manifest.get("world_size") == ranks.size and manifest.get("layouts") == [
        h.layout for h in everyone
    ]
    wanted = [f"model.{name}" for name in holding.model if name in saved_model]
    where = _optimizer_keys(keys, holding.optimizer) if optimizer is not None else {}
    wanted += list(where)
    wanted += [key for key in ("step", "extra") if key in keys]
    if scheduler is not None and "scheduler" in keys:
        wanted.append("scheduler")
    rng_prefix = f"rng.rank{ranks.rank}."
    if same_layout:
        wanted += _under(keys, rng_prefix)
    distributed = _distributed(model)
    likes = {f"model.{name}": value for name, value in distributed.items()}
    likes.update(
        (key, distributed.get(name)) for key, (kind, name, _) in where.items() if kind == "state"
    )
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
        nested = _nested_optimizer(loaded, where, groups, optimizer)
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
        _set_rng_state(rng)
    else:
        notes.append(
            f"RNG states not restored: the checkpoint was saved by {manifest.get('world_size')} "
            f"ranks in another layout than these {ranks.size}"
        )
    if problems:
        notes.append("loaded partially: " + "; ".join(problems))
    return Restored(
        folder=folder,
        step=int(loaded.get("step", manifest.get("step", 0))),
        extra=json.loads(loaded.get("extra", "{}")),
        rng_restored=bool(rng),
        notes=tuple(notes),
    )
