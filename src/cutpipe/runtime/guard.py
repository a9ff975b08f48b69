"""No hangs: when one rank fails, every rank stops, and says which rank failed and where.

Each runner keeps a small record in the c10d store that ``init_process_group`` created:

- ``beat/<rank>``: a heartbeat, rewritten every second by a daemon thread, carrying a counter, the
  rank's state (in a step or idle) and the action it is running;
- ``failure``: the first failure of the pipeline, written once (compare-and-set) by the rank that
  raised, or on behalf of a rank whose process died or stopped beating.

A rank that raises inside a step records the failure and re-raises. A rank whose receive breaks
because its peer's process died (gloo reports the closed connection at once) records the peer's
death with the peer's last action. A rank blocked in a receive cannot be interrupted from Python
(gloo ignores abort and a timed-out wait destroys the connection), so the heartbeat thread is the
last resort: if a failure is on record, or a peer stopped beating, while this rank stays stuck in
its step for ``exit_after`` seconds, it prints the failure and ends the process, as PyTorch's NCCL
watchdog does. Staleness is measured on each rank's own clock (a beat counter that stops moving),
so clock skew between hosts does not matter.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist


class PipelineError(RuntimeError):
    """Another rank of the pipeline failed; the message names it and the action it was in."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Guard:
    """Heartbeats and the shared failure record of one runner on one rank."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        action: Callable[[], str],
        heartbeat: float = 1.0,
        dead_after: float = 20.0,
        exit_after: float = 10.0,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world = world_size
        self._action = action
        self._heartbeat = heartbeat
        self._dead_after = dead_after
        self._exit_after = exit_after
        self._in_step = False
        self._stop = threading.Event()
        self._beats = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last beat, when it last changed)
        self._stuck_since: float | None = None
        self._beat()
        self._thread = threading.Thread(
            target=self._watch, name=f"cutpipe-guard-{rank}", daemon=True
        )
        self._thread.start()

    # -- the step's side ---------------------------------------------------------------------

    def enter_step(self) -> None:
        self._in_step = True

    def leave_step(self) -> None:
        self._in_step = False
        self._stuck_since = None

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

    def last_action_of(self, rank: int) -> str:
        """What ``rank`` was doing at its last heartbeat."""
        try:
            _, _, action = self._store.get(f"beat/{rank}").decode().split("|", 2)
            return action
        except Exception:
            return "an unknown action"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._heartbeat)
        with contextlib.suppress(Exception):
            self._store.set(f"beat/{self._rank}", f"{self._beats}|closed|")

    # -- the watchdog thread -------------------------------------------------------------------

    def _beat(self) -> None:
        self._beats += 1
        state = "step" if self._in_step else "idle"
        self._store.set(f"beat/{self._rank}", f"{self._beats}|{state}|{self._action()}")

    def _watch(self) -> None:
        while not self._stop.wait(self._heartbeat):
            try:
                self._beat()
                if self._in_step:
                    self._check_peers()
                    self._exit_if_stuck(self.failure())
            except Exception as error:  # the store's host (rank 0's process) is gone
                if self._in_step:
                    self._exit_if_stuck(
                        f"the c10d store is unreachable ({error}): the rank hosting it, usually "
                        "rank 0, has exited"
                    )

    def _check_peers(self) -> None:
        now = time.monotonic()
        for peer in range(self._world):
            if peer == self._rank or not self._store.check([f"beat/{peer}"]):
                continue
            beat = self._store.get(f"beat/{peer}").decode()
            last, since = self._seen.get(peer, ("", now))
            if beat != last:
                self._seen[peer] = (beat, now)
            elif beat.split("|")[1] == "step" and now - since > self._dead_after:
                action = beat.split("|", 2)[2]
                self.record(
                    f"rank {peer} stopped responding while in {action} (no heartbeat for "
                    f"{now - since:.0f} s: its process died or hangs)"
                )

    def _exit_if_stuck(self, failure: str | None) -> None:
        if failure is None:
            return
        now = time.monotonic()
        if self._stuck_since is None:
            self._stuck_since = now
        elif now - self._stuck_since > self._exit_after and self._in_step:
            print(
                f"cutpipe: rank {self._rank} stops (stuck in {self._action()}): {failure}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
