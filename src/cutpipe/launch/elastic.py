"""Start training workers the way people do: through torch's elastic agent.

``cutpipe train --nproc N`` is ``torchrun --nproc-per-node N -m cutpipe train ...``: the agent
(``torch.distributed.launcher.elastic_launch``) runs a c10d rendezvous, starts N workers that run
the same command, watches them, and on a failure stops them all and, if ``--max-restarts``
allows, starts them again (they resume from the latest checkpoint). A worker knows it is one by
the environment the agent gives it, so the command runs unchanged under plain ``torchrun``, and
``--nnodes`` with a shared ``--rdzv-endpoint`` joins several agents (machines) into one run.

Whatever ends the run is said once, by the launcher, in one line:

- a worker that fails writes its exception to the agent's error file (``report_failure``) and
  prints nothing under this launcher; the launcher names the failure that came first and was not
  a consequence of another (``LaunchFailed.cause``), so bad input that only a worker can find is
  still one line (the CLI exits 2 for it, 1 for a failed run or a bug);
- a signal to the launcher stops the workers and ends the launcher as the signal would
  (SIGTERM: exit status 143; Ctrl-C: 130); ``--timeout`` stops them with a message;
- a worker dies with its launcher if the launcher is killed outright
  (``cutpipe.launch.orphans``), from its first line of Python on.

The agent's own log lines are dropped unless ``debug`` asks for them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cutpipe.launch.orphans import die_with_parent

__all__ = [
    "Launch",
    "LaunchFailed",
    "WorkerFailure",
    "die_with_parent",
    "is_worker",
    "report_failure",
    "run_workers",
]

#: Set by torchrun and the elastic agent in every worker they start.
WORKER_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE")
#: Set by ``run_workers`` for its workers (to its pid): they leave the saying to it, and die
#: with it (``python -m cutpipe`` reads it before anything else).
LAUNCHED_VARIABLE = "CUTPIPE_LAUNCHER"
#: Exceptions that mean the input was wrong, not the code: the CLI's exit status 2.
INPUT_ERRORS = frozenset(
    {"ValueError", "TypeError", "OSError", "FileNotFoundError", "FileExistsError",
     "NotADirectoryError", "IsADirectoryError", "PermissionError", "MissingTorch"}
)  # fmt: skip
#: A worker's failure caused by another's (the runtime's guard reports it).
CONSEQUENCES = frozenset({"PipelineError"})
#: Where the agent logs.
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")
#: What the elastic agent handles while its workers run (torch's TORCHELASTIC_SIGNALS_TO_HANDLE).
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


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
    debug: bool = False  # the agent's log lines and the workers' tracebacks


@dataclass(frozen=True)
class WorkerFailure:
    """How one worker ended: its exception's class name and message, or how it was stopped."""

    rank: int
    kind: str  # "ValueError", "PipelineError", "SIGKILL", "exit code 3", ...
    message: str  # the first line of what it said ("" when it said nothing)
    timestamp: int = 0

    @property
    def is_input_error(self) -> bool:
        return self.kind in INPUT_ERRORS

    @property
    def is_consequence(self) -> bool:
        return self.kind in CONSEQUENCES

    def __str__(self) -> str:
        said = f": {self.message}" if self.message else ""
        return f"rank {self.rank}: {self.kind}{said}"


class LaunchFailed(RuntimeError):
    """The workers failed (after any restarts) or ran out of time; the message says which, and
    ``cause`` is the failure that came first in its own right (None: none was reported)."""

    def __init__(self, message: str, cause: WorkerFailure | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def worker_failures(failures: Mapping[int, Any]) -> list[WorkerFailure]:
    """The agent's ``ChildFailedError.failures`` as ``WorkerFailure`` records, by rank."""
    found = []
    for rank, failure in sorted(failures.items()):
        message = getattr(failure, "message", "") or ""
        if isinstance(message, dict):
            message = message.get("message", "")
        text = str(message).strip()
        code = getattr(failure, "exitcode", None)
        stamp = int(getattr(failure, "timestamp", 0) or 0)
        recorded = getattr(failure, "error_file_data", None) or {}
        if isinstance(recorded.get("message"), dict) and ": " in text:  # an error file's
            kind, _, said = text.partition(": ")
            found.append(WorkerFailure(rank, kind, said.strip().split("\n", 1)[0], stamp))
        elif code is not None and code < 0:
            found.append(WorkerFailure(rank, signal.Signals(-code).name, "", stamp))
        else:
            found.append(WorkerFailure(rank, f"exit code {code}", "", stamp))
    return found


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure | None:
    """The failure to name: an exception a worker raised in its own right, else the failure
    the runtime's guard recorded (it names the rank everybody waited for and why), else how a
    process ended; the first of them (ties: the lowest rank)."""
    if not failures:
        return None

    def rank(failure: WorkerFailure) -> tuple[int, int, int]:
        said = bool(failure.message) and not failure.kind.startswith(("SIG", "exit code"))
        order = 0 if said and not failure.is_consequence else 1 if said else 2
        return order, failure.timestamp, failure.rank

    return min(failures, key=rank)


def report_failure(error: BaseException, debug: bool = False) -> int:
    """In a worker, inside ``except``: record ``error`` for the agent (its error file) and say it
    the way the run was started (nothing under ``cutpipe train``, which says it once; one line
    under plain ``torchrun``; the traceback with ``debug``). Returns the exit status: 2 for bad
    input, 1 otherwise."""
    import traceback

    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    ErrorHandler().record_exception(error)
    kind = type(error).__name__
    if debug:
        traceback.print_exc()
    elif LAUNCHED_VARIABLE not in os.environ:
        first = (str(error).strip().splitlines() or [""])[0]
        print(
            f"cutpipe train: rank {os.environ.get('RANK', '?')}: {kind}: {first}", file=sys.stderr
        )
    return 2 if kind in INPUT_ERRORS else 1


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
    quiet = _DropWhen(lambda: not plan.debug)
    agent_loggers = _agent_loggers()
    for logger in agent_loggers:
        logger.addFilter(quiet)
    launched = os.environ.get(LAUNCHED_VARIABLE)
    os.environ[LAUNCHED_VARIABLE] = str(os.getpid())  # the workers inherit it: their parent
    try:
        elastic_launch(config, sys.executable)("-m", "cutpipe", *arguments)
    except ChildFailedError as error:
        failures = worker_failures(error.failures)
        cause = root_cause(failures)
        summary = "; ".join(map(str, failures)) if cause is None else _said(cause, failures)
        raise LaunchFailed(summary, cause) from None
    except BaseException as error:
        if timed_out.is_set():
            raise LaunchFailed(_timed_out(plan)) from None
        signum = getattr(error, "sigval", None)  # the agent's SignalException
        if signum is not None:  # the workers are stopped: end as the signal would have
            print(f"cutpipe train: stopped by {signal.Signals(signum).name}", file=sys.stderr)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise SystemExit(128 + int(signum)) from None
        raise
    finally:
        if launched is None:
            os.environ.pop(LAUNCHED_VARIABLE, None)
        for logger in agent_loggers:
            logger.removeFilter(quiet)
        if timer is not None:
            timer.cancel()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _said(cause: WorkerFailure, failures: list[WorkerFailure]) -> str:
    """One line: the root cause, and how many other ranks stopped with it (bad input, which
    every rank usually finds alike, is said alone)."""
    others = 0 if cause.is_input_error else len(failures) - 1
    also = f" ({others} more rank{'s' if others > 1 else ''} stopped with it)" if others else ""
    if cause.message and (cause.is_input_error or cause.kind in RUN_FAILURES):
        return cause.message + also
    return f"{cause}{also}"


#: Failures of a run that say what happened themselves (their message is the line).
RUN_FAILURES = frozenset({"PipelineError", "CheckpointError", "FloatingPointError"})


class _DropWhen(logging.Filter):
    """Drops every record while ``when()`` holds."""

    def __init__(self, when: Callable[[], bool]) -> None:
        super().__init__()
        self._when = when

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._when()


def _agent_loggers() -> list[logging.Logger]:
    """Every logger of the agent's modules (a filter acts only where a record is made)."""
    names = [name for name in logging.Logger.manager.loggerDict if name.startswith(AGENT_LOGGERS)]
    return [logging.getLogger(name) for name in [*AGENT_LOGGERS, *names]]


def _timed_out(plan: Launch) -> str:
    if plan.nnodes == 1:
        ranks = ", ".join(str(r) for r in range(plan.nproc))
        return f"timed out after {plan.timeout:g} s: ranks {ranks} were still running"
    return (
        f"timed out after {plan.timeout:g} s: this node's {plan.nproc} workers were still running"
    )


def _signal_handlers() -> dict[int, object]:
    """This process's handlers of the signals the agent takes over (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        getattr(signal, name): signal.getsignal(getattr(signal, name))
        for name in AGENT_SIGNALS
        if hasattr(signal, name)
    }
