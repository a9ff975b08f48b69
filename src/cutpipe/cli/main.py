"""Entry point of the ``cutpipe`` command, and its one error boundary.

Every failure ends in one line on stderr and a documented exit status (docs/cli.md):

- 0: done. 2: a usage or input error, ``cutpipe <command>: error: <what to change>``.
- 1: an unexpected error, i.e. a bug: one line saying so; the traceback with ``--debug`` or
  ``CUTPIPE_DEBUG=1``.
- 130: interrupted (Ctrl-C), quietly. 141: stdout was closed early (``cutpipe ... | head``),
  quietly, the status a shell gives a program that SIGPIPE stops.
- A ``SystemExit`` raised below (the launcher's 128 + signal number) passes through unchanged.

Importing this module must not import torch: the commands that need it import it when run.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

from cutpipe.cli import (
    bench,
    compare,
    data,
    doctor,
    draw,
    export,
    generate,
    partition,
    profile,
    recommend,
    schedule,
    simulate,
    train,
    tune,
)
from cutpipe.cli.common import MissingTorch, missing_torch_message

USAGE_ERROR = 2
BUG = 1
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head`
DEBUG_VARIABLE = "CUTPIPE_DEBUG"


class UsageError(Exception):
    """A command line argparse cannot read; ``prog`` names the (sub)command."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (and printed as one line by ``main``), not
    printed with the whole usage text and exited from."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def _add_debug(parser: argparse.ArgumentParser, top: bool) -> None:
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help=f"print the traceback of an unexpected error (or set {DEBUG_VARIABLE}=1)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cutpipe")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser, nested ones (``bench moe``) included."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *_subparsers(child)]
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="cutpipe",
        description="Pipeline-parallel schedules: generate, validate, simulate and compare.",
    )
    _add_debug(parser, top=True)
    parser.add_argument("--version", action="version", version=f"cutpipe {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (
        simulate, compare, schedule, draw, train, tune, partition, recommend, profile, bench, data,
        export, generate, doctor,
    ):  # fmt: skip
        module.register(commands)
    for child in _subparsers(parser):
        _add_debug(child, top=False)
    return parser


def _command(args: argparse.Namespace | None) -> str:
    """``cutpipe simulate``, ``cutpipe bench moe``: who speaks in a message."""
    words = ["cutpipe"]
    if args is not None:
        words.append(args.command)
        if getattr(args, "bench", None):
            words.append(args.bench)
    return " ".join(words)


def _message(error: BaseException, whole: bool = False) -> str:
    """The message of ``error``: its first line, unless ``whole`` (with --debug)."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if whole or len(lines) == 1:
        return text
    return f"{lines[0]} (more: rerun with --debug)"


def _is_missing_torch(error: BaseException) -> bool:
    return isinstance(error, MissingTorch) or (
        isinstance(error, ImportError) and (error.name or "").split(".")[0] == "torch"
    )


def _debug_wanted(args: argparse.Namespace | None) -> bool:
    if os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in ("", "0", "false", "no"):
        return True
    return bool(args is not None and getattr(args, "debug", False))


def _quiet_broken_pipe() -> int:
    """Python's documented recipe: point stdout at /dev/null so the exit flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is not a real file (captured)
        pass
    return BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    """Run ``cutpipe`` with ``argv`` (default: the command line); return the exit status."""
    args = None
    try:
        parser = build_parser()
        try:
            args, unknown = parser.parse_known_args(argv)
        except SystemExit as done:  # --help printed
            return done.code if isinstance(done.code, int) else 0
        if unknown:
            raise UsageError(_command(args), f"unrecognized arguments: {' '.join(unknown)}")
        args.argv = list(sys.argv[1:] if argv is None else argv)  # what workers are started with
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the boundary
        return status
    except SystemExit:
        raise
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except UsageError as error:
        print(f"{error.prog}: error: {_message(error)}", file=sys.stderr)
        return USAGE_ERROR
    except Exception as error:
        debug = _debug_wanted(args)
        if debug:
            traceback.print_exc()
        print(_report(error, _command(args), debug), file=sys.stderr)
        return USAGE_ERROR if _is_user_error(error) else BUG


#: Optional packages whose absence is the user's to fix (``pip install "cutpipe[...]"``).
OPTIONAL_PACKAGES = ("ortools",)


def _is_user_error(error: Exception) -> bool:
    """Bad input or a missing package: the user can fix it (exit 2), unlike a bug (exit 1)."""
    missing_optional = isinstance(error, ImportError) and (
        (error.name or "").split(".")[0] in OPTIONAL_PACKAGES
    )
    return (
        isinstance(error, (ValueError, TypeError, OSError))
        or _is_missing_torch(error)
        or missing_optional
    )


#: Failures of a run that say what happened (a rank died or hung, a checkpoint could not be
#: completed, the loss diverged), named so that checking them needs no torch.
RUN_FAILURES = ("PipelineError", "CheckpointError", "FloatingPointError")


def _is_run_failure(error: Exception) -> bool:
    return any(kind.__name__ in RUN_FAILURES for kind in type(error).__mro__)


def _report(error: Exception, command: str, debug: bool) -> str:
    if _is_missing_torch(error):
        text = str(error) if isinstance(error, MissingTorch) else missing_torch_message()
        return f"{command}: error: {text}"
    if _is_user_error(error):
        return f"{command}: error: {_message(error, whole=debug)}"
    if _is_run_failure(error):
        return f"{command}: {_message(error, whole=debug)}"
    if isinstance(error, MemoryError):
        return (
            f"{command}: ran out of memory: use fewer ranks, microbatches or a smaller model "
            f"(rerun with --debug or {DEBUG_VARIABLE}=1 to see where)"
        )
    return (
        f"{command}: failed unexpectedly ({type(error).__name__}: {_message(error)[:200]}); "
        f"this is a bug in cutpipe: rerun with --debug (or {DEBUG_VARIABLE}=1) for the "
        "traceback and report it"
    )


if __name__ == "__main__":
    sys.exit(main())
