"""No hangs: when one rank fails, hangs or dies, every rank stops and says which rank and where.

Each runner keeps a small record in the c10d store that ``init_process_group`` created:

- ``beat/<rank>``: a ``Beat``, rewritten every ``heartbeat`` seconds (and at once when a step
  begins or ends) by a daemon thread: the rank's state, step, op, what it waits for and how long
  it has made no progress;
- ``failure``: the first failure of the pipeline, written once (compare-and-set) by the rank that
  raised, or on behalf of a rank that died, froze or stopped making progress.

Three watchdogs run on that thread while the rank is in a step; liveness and exit also run while
it waits in a collective between steps (a gathered timeline, a gradient norm), which a stopped
or dead peer would leave waiting as surely as a step:

- *progress*: this rank has completed no op for ``step_timeout`` seconds. Following the wait
  chain (``diagnosis.find_stall``) names the rank everybody waits for, its op and what it waits
  for; a rank that only waits for a slower peer that still makes progress is left alone.
- *liveness*: a peer's heartbeat stopped for ``dead_after`` seconds. On the same host the
  operating system says whether the process is gone or stopped (a busy process holding the GIL in
  a C call is neither, and is not declared dead); on another host a silence longer than
  ``max(dead_after, step_timeout)`` counts as death.
- *exit*: a rank blocked in a receive cannot be interrupted from Python (gloo ignores abort and a
  timed-out wait destroys the connection), so a rank still stuck ``exit_after`` seconds after a
  failure went on record prints it and ends its process, as PyTorch's NCCL watchdog does.

Staleness is measured on each rank's own clock (a beat that stops changing), so clock skew
between hosts does not matter.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from cutpipe.runtime.failure.diagnosis import find_stall
from cutpipe.runtime.failure.heartbeat import Beat, Progress, process_state, this_host

#: how long closing waits for the watchdog thread to leave a store call. A daemon thread still
#: inside torch's C++ when the interpreter exits is unwound by force, which aborts the process
#: ("terminate called without an active exception"), so this is generous: a store call ends in
#: milliseconds unless the store's host is gone.
STOP_WAIT = 10.0

#: the base store's key under which a process leaves a word on why it exited
EXIT_KEY = "cutpipe/exit/{rank}"


class PipelineError(RuntimeError):
    """Another rank of the pipeline failed; the message names it and the action it was in."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def leave_word(store: dist.Store, global_rank: int, message: str) -> None:
    """Record why this process is going (first word wins), without ever blocking an exit for long:
    the store's host may be gone already."""

    def write() -> None:
        with contextlib.suppress(Exception):
            store.compare_set(EXIT_KEY.format(rank=global_rank), "", message)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(timeout=STOP_WAIT)


def exit_word(store: dist.Store, global_rank: int) -> str | None:
    """What ``global_rank`` said when its process went, if it said anything."""
    key = EXIT_KEY.format(rank=global_rank)
    try:
        if store.check([key]):
            return store.get(key).decode()
    except Exception:
        return None
    return None


def record_for_agent(kind: str, message: str) -> bool:
    """Leave ``kind: message`` where torch's elastic agent reads a worker's error (the file
    ``TORCHELASTIC_ERROR_FILE`` names, in its format), so that a launcher can name why this
    process ends although it ends without raising (``os._exit``); whether it was left."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    record = {
        "message": {
            "message": f"{kind}: {message}",
            "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))},
        }
    }
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:
        return False
    return True


class Guard:
    """Heartbeats, the shared failure record and the watchdogs of one runner on one rank."""

    def __init__(
        self,
        store: dist.Store,
        base_store: dist.Store,
        rank: int,
        global_ranks: list[int],
        progress: Progress,
        action: Callable[[], str],
        *,
        heartbeat: float = 1.0,
        dead_after: float = 20.0,
        exit_after: float = 10.0,
        step_timeout: float | None = None,
    ) -> None:
        self._store = store
        self._base = base_store
        self._rank = rank
        self._global = global_ranks
        self._world = len(global_ranks)
        self._progress = progress
        self._action = action
        self._heartbeat = heartbeat
        self._dead_after = dead_after
        self._exit_after = exit_after
        self._step_timeout = step_timeout
        self._host, self._pid = this_host(), os.getpid()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._beats = 0
        self._closed = False
        self._marker = progress.marker()
        self._progress_since = time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last beat, when it changed)
        self._stuck_since: float | None = None
        self._beat()
        atexit.register(self._at_exit)
        self._thread = threading.Thread(
            target=self._watch, name=f"cutpipe-guard-{rank}", daemon=True
        )
        self._thread.start()

    # -- the step's side ---------------------------------------------------------------------

    def enter_step(self) -> None:
        self._wake.set()  # tell the peers at once: a beat from before the step would mislead

    def leave_step(self) -> None:
        self._stuck_since = None
        self._wake.set()

    def record(self, message: str) -> str:
        """Record ``message`` as the pipeline's failure unless one is already there; return the
        failure on record."""
        try:
            value = self._store.compare_set("failure", "", message)
            return value.decode() if isinstance(value, bytes) else str(value)
        except Exception:  # the store is gone with its host: keep our own account
            return message

    def failure(self) -> str | None:
        try:
            if self._store.check(["failure"]):
                return self._store.get("failure").decode()
        except Exception:
            return None
        return None

    def beat_of(self, rank: int) -> Beat | None:
        try:
            if self._store.check([f"beat/{rank}"]):
                return Beat.decode(self._store.get(f"beat/{rank}"))
        except Exception:
            return None
        return None

    def explain_loss(self, peer: int | None) -> str | None:
        """Why the connection to ``peer`` (None: some peer of a collective) broke, from what the
        peers left in the store: a word at exit, or a process that is gone."""
        candidates = (
            [peer] if peer is not None else [r for r in range(self._world) if r != self._rank]
        )
        for candidate in candidates:
            word = exit_word(self._base, self._global[candidate])
            if word is not None:
                return self._story(candidate, word)
        for candidate in candidates:
            beat = self.beat_of(candidate)
            if beat is None:
                continue
            if process_state(beat.host, beat.pid) == "gone":
                return f"rank {candidate} died (last seen {beat.where}; its process exited)"
            if peer is not None:
                return f"rank {candidate} died (last seen {beat.where})"
        return None

    def _story(self, rank: int, word: str) -> str:
        """ "rank 1 raised ValueError: ... (last seen between steps (after step 3))"."""
        beat = self.beat_of(rank)
        if beat is None or word.startswith("exited"):
            return f"rank {rank} {word}"
        return f"rank {rank} {word} (last seen {beat.where})"

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=STOP_WAIT)
        atexit.unregister(self._at_exit)
        with contextlib.suppress(Exception):
            self._beat()

    # -- the watchdog thread -------------------------------------------------------------------

    def _state(self) -> str:
        if self._closed:
            return "closed"
        return "step" if self._progress.in_step else "idle"

    def _beat(self) -> None:
        progress, now = self._progress, time.monotonic()
        marker = progress.marker()
        if marker != self._marker:
            self._marker, self._progress_since = marker, now
        waiting = progress.waiting
        self._beats += 1
        beat = Beat(
            count=self._beats,
            state=self._state(),
            step=progress.step,
            op=self._action(),
            waiting_peer=None if waiting is None else waiting[0],
            waiting_for=None if waiting is None else str(waiting[1]),
            stalled=now - self._progress_since if progress.in_step else 0.0,
            host=self._host,
            pid=self._pid,
        )
        self._store.set(f"beat/{self._rank}", beat.encode())
        self._last_beat = beat

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._heartbeat)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
                if self._blocked():
                    self._check_peers()
                    if self._progress.in_step:
                        self._check_progress()
                    self._exit_if_stuck(self.failure())
                else:
                    self._stuck_since = None
            except Exception as error:  # the store's host is gone
                if self._blocked():
                    self._exit_if_stuck(
                        f"the c10d store is unreachable ({error}): the process hosting it, "
                        "usually rank 0 or the launcher, has exited"
                    )

    def _blocked(self) -> bool:
        """In a step, or waiting in a collective between steps (gathering a timeline, reducing a
        gradient norm): where a stopped or dead peer leaves this rank waiting for ever."""
        progress = self._progress
        return progress.in_step or progress.waiting is not None or progress.between is not None

    def _peer_beats(self) -> dict[int, Beat]:
        """Every rank's latest beat, its stall counting the time its beat has not changed."""
        now = time.monotonic()
        beats: dict[int, Beat] = {}
        for peer in range(self._world):
            if peer == self._rank:
                continue
            if self._stop.is_set():  # closing: leave the store alone
                break
            try:
                if not self._store.check([f"beat/{peer}"]):
                    continue
                raw = self._store.get(f"beat/{peer}").decode()
            except Exception:
                continue
            last, since = self._seen.get(peer, ("", now))
            if raw != last:
                self._seen[peer] = (raw, now)
                since = now
            beat = Beat.decode(raw)
            if beat is not None:
                silent = now - since
                beats[peer] = replace(beat, stalled=beat.stalled + silent) if silent > 0 else beat
        return beats

    def _check_peers(self) -> None:
        """Liveness: a peer whose heartbeat stopped is dead or frozen, if its host can say so."""
        now = time.monotonic()
        patience = max(self._dead_after, self._step_timeout or 0.0)
        for peer, beat in self._peer_beats().items():
            silent = now - self._seen[peer][1]
            if beat.state == "closed" or silent <= self._dead_after:
                continue
            state = process_state(beat.host, beat.pid)
            if state == "stopped":
                self.record(
                    f"rank {peer} is frozen (last seen {beat.where}): its process {beat.pid} on "
                    f"{beat.host} is stopped (SIGSTOP or a debugger), no heartbeat for {silent:.0f} s"
                )
            elif state == "gone":
                word = exit_word(self._base, self._global[peer])
                self.record(
                    word or f"rank {peer} died (last seen {beat.where}; its process exited)"
                )
            elif state == "unknown" and silent > patience:
                self.record(
                    f"rank {peer} stopped responding (last seen {beat.where}): no heartbeat for "
                    f"{silent:.0f} s (its process died, froze or holds the GIL)"
                )

    def _check_progress(self) -> None:
        """Progress: no op completed here for ``step_timeout``; find out who everybody waits for."""
        timeout = self._step_timeout
        if timeout is None:
            return
        stalled = time.monotonic() - self._progress_since
        if stalled < timeout:
            return
        beats = self._peer_beats()
        beats[self._rank] = self._last_beat
        stall = find_stall(self._rank, beats, timeout)
        if stall is None:
            return
        failure = self.record(f"{stall.message} (step_timeout {_seconds(timeout)} s)")
        if stall.root == self._rank:  # nothing will ever unblock this rank: go now, and the
            self._exit(failure)  # peers waiting on it see its connection close and stop cleanly

    def _exit_if_stuck(self, failure: str | None) -> None:
        if failure is None:
            return
        now = time.monotonic()
        if self._stuck_since is None:
            self._stuck_since = now
        elif now - self._stuck_since > self._exit_after and self._blocked():
            self._exit(failure)

    def _exit(self, failure: str) -> None:
        """End this process now, saying why once: to the elastic agent when there is one (its
        launcher names it), else on stderr."""
        if not record_for_agent("PipelineError", failure):
            print(
                f"cutpipe: rank {self._rank} stops (stuck in {self._action()}): {failure}",
                file=sys.stderr,
                flush=True,
            )
        os._exit(1)

    def _at_exit(self) -> None:
        """The process is exiting without having closed its runner: stop the watchdog thread (a
        thread left inside a store call while the interpreter shuts down can abort the process)
        and say why the rank is going, if known."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=STOP_WAIT)
        error = getattr(sys, "last_value", None)
        reason = f" with {type(error).__name__}: {error}" if error is not None else ""
        progress = self._progress
        where = (
            f"in step {progress.step} at {self._action()}"
            if progress.in_step
            else f"between steps (after step {progress.step})"
            if progress.step
            else "before its first step"
        )
        leave_word(self._base, self._global[self._rank], f"exited {where}{reason}")


def _seconds(value: float) -> str:
    return str(int(value)) if math.isclose(value, round(value)) else f"{value:g}"
