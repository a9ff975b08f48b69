"""What a rank tells its peers about itself, once a second: alive, where it is, what it waits for.

The step writes a few fields of ``Progress`` as it goes (an int per op, a tuple per wait); the
guard's thread turns them into a ``Beat`` in the c10d store. Peers read beats to tell a slow rank
from a stuck one and a stuck one from a dead one, and to name who everybody is waiting for.

A heartbeat cannot tell a frozen process from one holding Python's GIL in a long C call: neither
beats. On the same host the operating system can: ``process_state`` reads the peer's scheduler
state, so a stopped (``SIGSTOP``) or vanished process is named at once and a busy one is left be.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass

#: What a rank waits for: (peer rank or None for a collective of the whole group, something whose
#: ``str`` describes it; formatting waits until a heartbeat reads it).
Waiting = tuple[int | None, object]


class Progress:
    """Written by the step on the step's thread, read by the guard's thread; plain attributes,
    because one int store per op is all the hot loop can afford."""

    def __init__(self) -> None:
        self.step = 0  # steps begun
        self.in_step = False
        self.ops_done = 0  # ops completed in all steps: moves while the rank makes progress
        self.waiting: Waiting | None = None
        self.between: str | None = None  # the watched work between steps, if any

    def wait_for(self, peer: int | None, what: object) -> None:
        self.waiting = (peer, what)

    def done_waiting(self) -> None:
        self.waiting = None

    @contextlib.contextmanager
    def watched(self, what: str) -> Iterator[None]:
        """Work between steps that waits on the peers (``what`` says which: an optimizer step
        that reduces a gradient norm, an evaluation, a checkpoint): the guard watches the peers
        during it as it does in a step, so a dead or stopped one cannot leave it waiting."""
        previous, self.between = self.between, what
        try:
            yield
        finally:
            self.between = previous

    def marker(self) -> tuple[int, int, bool]:
        """Changes whenever the rank gets anywhere: a new step, a finished op, a phase change."""
        return self.step, self.ops_done, self.in_step


@dataclass(frozen=True)
class Beat:
    """One heartbeat: the rank's state ("step", "idle" or "closed"), its step and op, what it
    waits for, how long it has made no progress, and where its process runs."""

    count: int
    state: str
    step: int
    op: str
    waiting_peer: int | None
    waiting_for: str | None
    stalled: float  # seconds since the rank last made progress (0 when idle)
    host: str
    pid: int

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | bytes) -> Beat | None:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError):
            return None

    @property
    def where(self) -> str:
        """Where the rank is, in words, for messages."""
        if self.state == "closed":
            return f"after closing its runner (after step {self.step})"
        if self.state == "idle":
            return (
                f"between steps (after step {self.step})" if self.step else "before its first step"
            )
        return f"in step {self.step} at {self.op}"


def this_host() -> str:
    return socket.gethostname()


def process_state(host: str, pid: int) -> str:
    """ "running", "stopped" (SIGSTOP or a debugger), "gone", or "unknown" (another host, or no
    /proc to read)."""
    if host != this_host() or pid <= 0:
        return "unknown"
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return _exists(pid)
    state = fields[0] if fields else "?"
    if state in ("T", "t"):
        return "stopped"
    if state in ("Z", "X"):
        return "gone"
    return "running"


def _exists(pid: int) -> str:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except OSError:
        return "unknown"
    return "running"
