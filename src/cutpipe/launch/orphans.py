"""Workers die with the process that started them, however it dies.

A launcher that is killed outright (SIGKILL, the OOM killer) runs no clean-up, so its workers
would train on, holding ports and memory, waiting for peers that are gone. Linux's parent-death
signal ends them instead; elsewhere nothing is set (the launcher's own clean-up still runs on
the signals it can catch).
"""

from __future__ import annotations

import contextlib
import os
import signal


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies. With ``parent`` (the pid that
    started it), a process whose parent is already another one (the launcher died before this
    ran, and the process was handed on) ends at once."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)
