"""Start a process group on this machine and run a function on every rank.

The multi-process tests, the benchmarks and ``cutpipe bench`` use this instead of ``torchrun
--standalone`` (``cutpipe train`` starts its workers under torch's elastic agent:
``cutpipe.launch.elastic``): the parent process hosts the c10d store (so it outlives any worker, which the
failure guard relies on), starts N spawned workers that join a process group through it, and
collects each rank's return value, exit code and the tail of its stderr. Nothing waits forever:

- when a rank fails (raises, or its process dies), the others get ``grace`` seconds to stop on
  their own (the runner's guard stops them within seconds) and are then killed;
- at the deadline every worker still running is killed, and its outcome says "timed out";
- SIGTERM or SIGINT to the launcher kills every worker before the launcher goes (exit status
  128 + signal for SIGTERM, ``KeyboardInterrupt`` for SIGINT); workers also die with the
  launcher if it is killed outright (Linux's parent-death signal).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cutpipe.launch.orphans import die_with_parent
from cutpipe.runtime.failure.guard import leave_word


@dataclass(frozen=True)
class Outcome:
    """How one rank ended."""

    rank: int
    ok: bool
    result: Any = None
    error: str | None = None  # the traceback, if the function raised
    exitcode: int | None = None
    stderr: str = ""  # the last lines the rank wrote to stderr
    note: str | None = None  # what the launcher did to it: timed out, killed after a failure

    @property
    def reason(self) -> str:
        """One line: why this rank failed."""
        if self.error:
            return self.error.strip().splitlines()[-1]
        if self.note:
            return self.note
        said = [line for line in self.stderr.splitlines() if line.strip()]
        for line in reversed(said):
            if line.startswith("cutpipe:"):
                return line
        if self.exitcode is not None and self.exitcode < 0:
            name = signal.Signals(-self.exitcode).name
            return f"its process was killed by {name}"
        return f"its process exited with code {self.exitcode}" + (f": {said[-1]}" if said else "")


class LaunchError(RuntimeError):
    def __init__(self, outcomes: list[Outcome]) -> None:
        failed = [o for o in outcomes if not o.ok]
        details = "\n".join(
            f"--- rank {o.rank} ({_ending(o)}) ---\n{o.error or o.stderr or o.note or 'no output'}"
            for o in failed
        )
        super().__init__(f"{len(failed)} of {len(outcomes)} ranks failed:\n{details}")
        self.outcomes = outcomes

    @property
    def summary(self) -> str:
        """One line: the rank that failed first in its own right, and why."""
        failed = [o for o in self.outcomes if not o.ok]
        timed_out = [o for o in failed if (o.note or "").startswith("timed out")]
        if timed_out and len(timed_out) == len(failed):
            ranks = ", ".join(str(o.rank) for o in timed_out)
            return f"{timed_out[0].note}: ranks {ranks} were still running"
        own = [o for o in failed if "PipelineError" not in o.reason] or failed
        first = own[0]
        return (
            f"rank {first.rank} failed: {first.reason} ({len(failed)} of {len(self.outcomes)} "
            "ranks failed)"
        )


def _ending(outcome: Outcome) -> str:
    if outcome.note:
        return outcome.note
    if outcome.exitcode is not None and outcome.exitcode < 0:
        return f"killed by {signal.Signals(-outcome.exitcode).name}"
    return f"exit code {outcome.exitcode}"


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, log: str,
            fn: Callable, args: tuple, results: Any) -> None:  # fmt: skip
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    stderr = open(log, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(stderr.fileno(), 2)
    torch.set_num_threads(threads)
    failed = False
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=60))  # fmt: skip
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        # pickled here, tensors copied in: the queue's own pickler would share their storage
        # through this process, which may have ended before the launcher reads the result
        results.put((rank, True, pickle.dumps(value), None))
    except BaseException as error:
        failed = True
        if dist.is_initialized():  # the peers waiting on this rank read it when it is gone
            default_store = dist.distributed_c10d._get_default_store()
            leave_word(default_store, rank, f"raised {type(error).__name__}: {error}")
        results.put((rank, False, None, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()
    if failed:
        sys.exit(1)


class _Stopped(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_the_launch() -> Iterator[None]:
    """SIGTERM and SIGINT raise ``_Stopped`` in the launcher while workers run (main thread only:
    elsewhere Python cannot install handlers, and the caller's own handling applies)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _kill(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout: float = 300.0,
    threads_per_process: int = 1,
    grace: float = 30.0,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` local ranks; ``fn`` must be importable
    (defined at module level) and return something picklable. Returns each rank's ``Outcome``
    as soon as every rank has ended, or ``grace`` seconds after the first failure, or at
    ``timeout``."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    for name, value in (("timeout", timeout), ("grace", grace)):
        if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    store = dist.TCPStore("127.0.0.1", 0, nprocs + 1, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    logs = tempfile.TemporaryDirectory(prefix="cutpipe-launch-")
    processes: list[Any] = []
    reported: dict[int, tuple] = {}
    notes: dict[int, str] = {}
    stopped: _Stopped | None = None
    try:
        with _signals_stop_the_launch():
            try:
                for rank in range(nprocs):
                    log = str(Path(logs.name) / f"rank{rank}.log")
                    process = context.Process(
                        target=_worker,
                        args=(rank, nprocs, store.port, backend, threads_per_process, log, fn,
                              args, results),
                    )  # fmt: skip
                    process.start()
                    processes.append(process)
                _supervise(processes, results, reported, notes, timeout, grace)
            except _Stopped as signal_received:
                stopped = signal_received
            finally:
                _kill(processes)
        _drain(results, reported)
        outcomes = []
        for rank, process in enumerate(processes):
            log = Path(logs.name) / f"rank{rank}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            tail = "\n".join(text.splitlines()[-40:])
            ok, value, error = reported.get(rank, (False, None, None))
            ended_well = ok and process.exitcode == 0
            outcome = Outcome(
                rank, ended_well, value, error, process.exitcode, tail, notes.get(rank)
            )
            outcomes.append(outcome)
    finally:
        logs.cleanup()
    if stopped is not None:
        if stopped.signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + stopped.signum)
    return outcomes


def _drain(results: Any, reported: dict[int, tuple], wait: float = 0.0) -> None:
    """Move every result waiting in the queue into ``reported``."""
    while True:
        try:
            rank, ok, value, error = results.get(timeout=wait) if wait else results.get_nowait()
        except queue.Empty:
            return
        except (EOFError, OSError):
            return
        reported[rank] = (ok, pickle.loads(value) if ok else value, error)


def _supervise(processes: list[Any], results: Any, reported: dict[int, tuple],
               notes: dict[int, str], timeout: float, grace: float) -> None:  # fmt: skip
    """Wait until every worker has ended; after a failure wait ``grace`` more, then kill."""
    started = time.monotonic()
    failed_at: float | None = None
    failed_rank = -1
    while True:
        _drain(results, reported, wait=0.1)
        running = [r for r, p in enumerate(processes) if p.is_alive()]
        if not running:
            return
        now = time.monotonic()
        if failed_at is None:
            for rank, process in enumerate(processes):
                fell = not process.is_alive() and process.exitcode != 0
                if fell or (rank in reported and not reported[rank][0]):
                    failed_at, failed_rank = now, rank
                    break
        if failed_at is not None and now - failed_at > grace:
            for rank in running:
                notes[rank] = f"killed: still running {grace:g} s after rank {failed_rank} failed"
            _kill(processes)
            return
        if now - started > timeout:
            for rank in running:
                notes[rank] = f"timed out after {timeout:g} s"
            _kill(processes)
            return


def run(fn: Callable[..., Any], nprocs: int, args: tuple = (), **options: Any) -> list[Any]:
    """``spawn`` that returns each rank's result, or raises ``LaunchError`` naming failed ranks."""
    outcomes = spawn(fn, nprocs, args, **options)
    if not all(o.ok for o in outcomes):
        raise LaunchError(outcomes)
    return [o.result for o in outcomes]
