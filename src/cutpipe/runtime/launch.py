"""Start a process group on this machine and run a function on every rank.

``cutpipe train --nproc N`` and the multi-process tests use this instead of ``torchrun
--standalone``: the parent process hosts the c10d store (so it outlives any worker, which the
failure guard relies on), starts N spawned workers that join a process group through it, collects
each rank's return value, exit code and the tail of its stderr, and kills every worker still alive
at the deadline. Nothing waits forever.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Outcome:
    """How one rank ended."""

    rank: int
    ok: bool
    result: Any = None
    error: str | None = None  # the traceback, if the function raised
    exitcode: int | None = None
    stderr: str = ""  # the last lines the rank wrote to stderr


class LaunchError(RuntimeError):
    def __init__(self, outcomes: list[Outcome]) -> None:
        failed = [o for o in outcomes if not o.ok]
        details = "\n".join(
            f"--- rank {o.rank} (exit code {o.exitcode}) ---\n{o.error or o.stderr or 'no output'}"
            for o in failed
        )
        super().__init__(f"{len(failed)} of {len(outcomes)} ranks failed:\n{details}")
        self.outcomes = outcomes


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, log: str,
            fn: Callable, args: tuple, results: Any) -> None:  # fmt: skip
    stderr = open(log, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(stderr.fileno(), 2)
    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=60))  # fmt: skip
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        results.put((rank, True, value, None))
    except BaseException:
        results.put((rank, False, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout: float = 300.0,
    threads_per_process: int = 1,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` local ranks; ``fn`` must be importable
    (defined at module level) and return something picklable. Returns each rank's ``Outcome``."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    store = dist.TCPStore("127.0.0.1", 0, nprocs + 1, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    logs = tempfile.TemporaryDirectory(prefix="cutpipe-launch-")
    processes = []
    for rank in range(nprocs):
        log = str(Path(logs.name) / f"rank{rank}.log")
        process = context.Process(
            target=_worker,
            args=(rank, nprocs, store.port, backend, threads_per_process, log, fn, args, results),
        )
        process.start()
        processes.append(process)
    reported: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < nprocs and time.monotonic() < deadline:
            try:
                rank, ok, value, error = results.get(timeout=0.2)
                reported[rank] = (ok, value, error)
            except queue.Empty:
                silent = [p for r, p in enumerate(processes) if r not in reported]
                if all(not p.is_alive() for p in silent):
                    break
        for process in processes:
            process.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    outcomes = []
    for rank, process in enumerate(processes):
        log = Path(logs.name) / f"rank{rank}.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
        ok, value, error = reported.get(rank, (False, None, None))
        outcomes.append(Outcome(rank, ok, value, error, process.exitcode, tail))
    logs.cleanup()
    return outcomes


def run(fn: Callable[..., Any], nprocs: int, args: tuple = (), **options: Any) -> list[Any]:
    """``launch`` that returns each rank's result, or raises ``LaunchError`` naming failed ranks."""
    outcomes = launch(fn, nprocs, args, **options)
    if not all(o.ok for o in outcomes):
        raise LaunchError(outcomes)
    return [o.result for o in outcomes]
