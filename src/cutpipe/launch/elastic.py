"""Start training workers the way people do: through torch's elastic agent.

``cutpipe train --nproc N`` is ``torchrun --nproc-per-node N -m cutpipe train ...``: the agent
(``torch.distributed.launcher.elastic_launch``) runs a c10d rendezvous, starts N workers that run
the same command, watches them, and on a failure stops them all and, if ``--max-restarts``
allows, starts them again (they resume from the latest checkpoint). A worker knows it is one by
the environment the agent gives it, so the command runs unchanged under plain ``torchrun``, and
``--nnodes`` with a shared ``--rdzv-endpoint`` joins several agents (machines) into one run.

A signal to the launcher stops the workers and ends the launcher as the signal would
(SIGTERM: exit status 143; Ctrl-C: 130); ``--timeout`` stops them with a message; and a worker
dies with its launcher if the launcher is killed outright (``cutpipe.launch.orphans``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

#: Set by torchrun and the elastic agent in every worker they start.
WORKER_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE")


def is_worker() -> bool:
    """This process was started by torchrun or an elastic agent (and should train, not launch)."""
    return all(name in os.environ for name in WORKER_VARIABLES)


@dataclass(frozen=True)
class Launch:
    """How many workers, on how many machines, meeting where, restarted how often."""

    nproc: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    timeout: float | None = None


class LaunchFailed(RuntimeError):
    """The workers failed (after any restarts) or ran out of time; the message says which."""


def _failure_summary(error: BaseException) -> str:
    failures = getattr(error, "failures", None)
    if not failures:
        return str(error)
    lines = []
    for rank, failure in sorted(failures.items()):
        message = getattr(failure, "message", "") or ""
        if isinstance(message, dict):
            message = message.get("message", "")
        first = str(message).strip().splitlines()[-1:] if message else []
        code = getattr(failure, "exitcode", None)
        ending = f"exit code {code}" if code is None or code >= 0 else signal.Signals(-code).name
        lines.append(f"rank {rank}: {ending}" + (f": {first[0]}" if first else ""))
    return "; ".join(lines)


from cutpipe.launch.orphans import die_with_parent  # noqa: E402 - re-exported for workers

__all__ = ["Launch", "LaunchFailed", "die_with_parent", "is_worker", "run_workers"]


def run_workers(arguments: list[str], plan: Launch) -> None:
    """Run ``python -m cutpipe <arguments>`` on ``plan.nproc`` workers; raise ``LaunchFailed``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    standalone = plan.rdzv_endpoint is None
    if standalone and plan.nnodes > 1:
        raise ValueError(
            f"--nnodes {plan.nnodes} needs --rdzv-endpoint HOST:PORT shared by every node"
        )
    config = LaunchConfig(
        min_nodes=plan.nnodes,
        max_nodes=plan.nnodes,
        nproc_per_node=plan.nproc,
        run_id=plan.rdzv_id or str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0" if standalone else plan.rdzv_endpoint,
        max_restarts=plan.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    timer = None
    timed_out = threading.Event()
    if plan.timeout is not None:

        def expire() -> None:
            timed_out.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the agent stops its workers on SIGTERM

        timer = threading.Timer(plan.timeout, expire)
        timer.daemon = True
        timer.start()
    handlers = _signal_handlers()  # the agent installs its own and leaves them behind
    # our own SIGTERM at the deadline is no news: the message below says what happened
    quiet = _DropWhen(timed_out.is_set)
    for name in AGENT_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        elastic_launch(config, sys.executable)("-m", "cutpipe", *arguments)
    except ChildFailedError as error:
        raise LaunchFailed(_failure_summary(error)) from None
    except BaseException as error:
        if timed_out.is_set():
            raise LaunchFailed(_timed_out(plan)) from None
        signum = getattr(error, "sigval", None)  # the agent's SignalException
        if signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        if signum is not None:  # the workers are stopped: end as the signal would have
            raise SystemExit(128 + int(signum)) from None
        raise
    finally:
        for name in AGENT_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        if timer is not None:
            timer.cancel()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


class _DropWhen(logging.Filter):
    """Drops every record while ``when()`` holds."""

    def __init__(self, when: Callable[[], bool]) -> None:
        super().__init__()
        self._when = when

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._when()


def _timed_out(plan: Launch) -> str:
    if plan.nnodes == 1:
        ranks = ", ".join(str(r) for r in range(plan.nproc))
        return f"timed out after {plan.timeout:g} s: ranks {ranks} were still running"
    return (
        f"timed out after {plan.timeout:g} s: this node's {plan.nproc} workers were still running"
    )


#: Where the agent logs how it stops its workers.
AGENT_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)
#: What the elastic agent handles while its workers run (torch's TORCHELASTIC_SIGNALS_TO_HANDLE).
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def _signal_handlers() -> dict[int, object]:
    """This process's handlers of the signals the agent takes over (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        getattr(signal, name): signal.getsignal(getattr(signal, name))
        for name in AGENT_SIGNALS
        if hasattr(signal, name)
    }
