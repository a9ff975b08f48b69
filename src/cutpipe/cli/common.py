"""Arguments and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cutpipe.arguments import Real, Whole
from cutpipe.files import check_output
from cutpipe.schedule.params import split_specs
from cutpipe.schedule.registry import SCHEDULES, generate, schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import MAX_COST, Costs

#: A petabyte per device: more than any accelerator, small enough to stay finite in bytes.
MAX_MEMORY_GB = 1e6


def whole_number(least: int = 1, most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a whole number in [least, most], refused before any work."""
    return Whole(least, most).argument_type()


def real(
    least: float = 0.0, most: float | None = None, *, exclusive: bool = True, unit: str = ""
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number above ``least`` (or from it, if not ``exclusive``),
    at most ``most``; NaN and infinities are refused."""
    return Real(least, most, exclusive, unit).argument_type()


#: A count of something that must exist at least once: ranks, microbatches, steps, devices.
positive_int = whole_number(1)
#: A duration or rate that must be above zero: timeouts, learning rates, time units.
positive_float = real(0.0)


#: ``--help`` for an option that takes a schedule.
SCHEDULE_HELP = (
    f"one of: {', '.join(SCHEDULES)} (or PyTorch's class name, e.g. ZBVZeroBubble), with "
    "parameters after a colon, e.g. interleaved:chunks=4"
)


def description(doc: str | None) -> str:
    """A command's description from its module docstring's first paragraph, as plain text
    (reST's double backticks left out: a terminal shows them literally)."""
    first = (doc or "").split("\n\n")[0]
    return " ".join(first.replace("``", "").split())


def schedule_names(text: str) -> tuple[str, ...]:
    """An argparse ``type``: comma-separated known schedules, at least one, each possibly with
    parameters (``1f1b,interleaved:chunks=4``)."""
    names = tuple(schedule_name(spec) for spec in split_specs(text))
    if not names:
        raise argparse.ArgumentTypeError(f"give at least one schedule: {', '.join(SCHEDULES)}")
    return names


def schedule_name(text: str) -> str:
    """An argparse ``type``: one known schedule, by name or PyTorch class name, possibly with
    parameters; returned in registry form (``Interleaved1F1B:chunks=4`` -> ``interleaved:chunks=4``),
    which ``generate`` and ``schedule_info`` take as is."""
    try:
        return schedule_info(text).spec
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class MissingTorch(ImportError):
    """A command that needs PyTorch runs where PyTorch cannot be imported."""


def missing_torch_message() -> str:
    return (
        "this command needs PyTorch, which is not installed: pip install torch "
        "(or: pip install 'cutpipe[torch]')"
    )


def require_torch() -> None:
    """A ``MissingTorch`` with the install command, before any work, if torch cannot load."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "torch":
            raise
        raise MissingTorch(missing_torch_message(), name="torch") from None
    except ImportError as error:  # installed, but broken
        raise MissingTorch(
            f"this command needs PyTorch, which is installed but fails to import ({error}): "
            "reinstall it: pip install --force-reinstall torch",
            name="torch",
        ) from None


def add_schedule_source(parser: argparse.ArgumentParser, *, group=None) -> None:
    """--schedule NAME with --ranks and --microbatches, or --from FILE (a saved schedule).

    ``group``, a mutually exclusive group, takes --schedule and --from when given (draw adds its
    other sources there); exactly one of them is required either way.
    """
    choice = group if group is not None else parser.add_mutually_exclusive_group(required=True)
    choice.add_argument("--schedule", "-s", type=schedule_name, metavar="NAME", help=SCHEDULE_HELP)
    choice.add_argument(
        "--from",
        dest="schedule_file",
        type=readable_file,
        metavar="FILE",
        help="a schedule file: .json (cutpipe schedule -o, tune -o) or .csv (torch's format)",
    )
    parser.add_argument(
        "--ranks", "-r", type=positive_int, help="pipeline ranks (devices), with --schedule"
    )
    parser.add_argument(
        "--microbatches", "-m", type=positive_int, help="microbatches per step, with --schedule"
    )


def schedule_from_args(args: argparse.Namespace) -> Schedule:
    """The schedule ``add_schedule_source``'s options name: generated, or read from a file."""
    if args.schedule_file is not None:
        return load_schedule_file(args.schedule_file, args.ranks, args.microbatches)
    missing = [
        o for o, v in (("--ranks", args.ranks), ("--microbatches", args.microbatches)) if v is None
    ]
    if missing:
        raise ValueError(f"--schedule needs {' and '.join(missing)} (or give --from FILE)")
    return generate(args.schedule, args.ranks, args.microbatches)


def load_schedule_file(
    path: str, ranks: int | None = None, microbatches: int | None = None
) -> Schedule:
    """The schedule in ``path``; ``ranks`` / ``microbatches``, if given, must agree with it."""
    from cutpipe.schedule.fileformat import load_schedule

    schedule = load_schedule(path)
    for option, given, own in (
        ("--ranks", ranks, schedule.num_ranks),
        ("--microbatches", microbatches, schedule.num_microbatches),
    ):
        if given is not None and given != own:
            raise ValueError(
                f"{path} holds a schedule of {own} for {option}, not {given}: drop {option} "
                "(the file fixes it)"
            )
    return schedule


def readable_file(text: str) -> str:
    """An argparse ``type``: a regular file that exists (checked before any work; a named pipe
    is refused here, unopened, since reading one would wait for a writer)."""
    if not os.path.isfile(text):
        what = "not a regular file" if os.path.exists(text) else "no such file"
        raise argparse.ArgumentTypeError(f"{what}: {text}")
    return text


def parse_costs(text: str) -> Costs:
    """An argparse ``type``: ``Costs.parse``, its errors as usage errors."""
    try:
        return Costs.parse(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def output_file(endings: tuple[str, ...] | None = None) -> Callable[[str], Path]:
    """An argparse ``type``: a file that can be written (folder exists and is writable, and
    the ending is one of ``endings``), checked before any work so no result is lost."""

    def parse(text: str) -> Path:
        try:
            return check_output(text, endings)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = "output file"
    return parse


def add_plan_output(parser: argparse.ArgumentParser, what: str) -> None:
    """``-o/--output FILE.json``: a plan file that ``cutpipe train --plan`` runs."""
    parser.add_argument(
        "-o", "--output", type=output_file((".json",)), metavar="FILE",
        help=f"also write {what} as a plan file (.json) that cutpipe train --plan runs",
    )  # fmt: skip


def add_costs_argument(parser: argparse.ArgumentParser, default: str, per: str) -> None:
    parser.add_argument(
        "--costs",
        default=default,
        type=parse_costs,
        metavar="K=V,...",
        help=f"costs per {per}, e.g. F=1,B=1,W=1,FB=2.5,comm=0.1 (keys: f, b, w, fb, comm, ep_f, "
        f"ep_b, activation, w_memory, p2p_bytes, ep_bytes; default: {default or 'F=B=W=1'})",
    )


#: ``--boundary`` choices: one of the step boundaries, or both (``sync`` then ``overlap``).
BOUNDARY_CHOICES = ("sync", "overlap", "both")


def add_steps_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--steps K with --boundary, --optimizer and --reduction: several steps back to back."""
    parser.add_argument(
        "--steps",
        type=whole_number(1, 1000),
        metavar="K",
        help=f"{what} K steps back to back, and the time per step once they repeat",
    )
    parser.add_argument(
        "--boundary",
        choices=BOUNDARY_CHOICES,
        help="with --steps: sync (every rank waits for all and the all-reduce, then steps its "
        "optimizer), overlap (each rank steps its optimizer when its own ops are done and goes "
        "on) or both (the default)",
    )
    time = real(0.0, MAX_COST, exclusive=False, unit="cost units")
    parser.add_argument("--optimizer", type=time, metavar="X",
                        help="with --steps: one optimizer step's time (default 0)")  # fmt: skip
    parser.add_argument("--reduction", type=time, metavar="Y",
                        help="with --steps: the gradient all-reduce's time (default 0)")  # fmt: skip


def steps_from_args(args: argparse.Namespace, schedule: Schedule, costs: Costs) -> list:
    """The ``MultiStep`` of each boundary ``add_steps_arguments``' options ask for; [] without
    --steps (then none of its options may be given)."""
    from cutpipe.sim.steps import simulate_steps

    if args.steps is None:
        given = [f"--{name}" for name in ("boundary", "optimizer", "reduction")
                 if getattr(args, name) is not None]  # fmt: skip
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(
                f"{' and '.join(given)} {verb} --steps K (the steps to run back to back)"
            )
        return []
    boundaries = ("sync", "overlap") if args.boundary in (None, "both") else (args.boundary,)
    return [
        simulate_steps(schedule, costs, steps=args.steps, boundary=boundary,
                       optimizer=args.optimizer or 0.0, reduction=args.reduction or 0.0)
        for boundary in boundaries
    ]  # fmt: skip


def print_json(data: Any) -> None:
    """Strict JSON on stdout: NaN and infinities are refused (the input checks exclude them)."""
    sys.stdout.write(json.dumps(data, indent=2, allow_nan=False) + "\n")


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits}f}".rstrip("0").rstrip(".")


def add_model_arguments(parser: argparse.ArgumentParser, gpu_required: bool = True) -> None:
    """--model, --profile, --gpu, --memory-gb: what is trained on what."""
    parser.add_argument("--model", metavar="FILE",
                        help="cutpipe model YAML/JSON or a Hugging Face config.json")  # fmt: skip
    parser.add_argument("--seq-len", type=whole_number(1, 2**24), metavar="N",
                        help="tokens per sequence (default: the model file's; a Hugging Face "
                        "config's max_position_embeddings)")  # fmt: skip
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="measured costs from cutpipe profile instead of the analytic model "
        "(its model is used when --model is not given)",
    )
    parser.add_argument(
        "--gpu",
        required=gpu_required,
        metavar="NAME",
        help="A100-40GB, A100-80GB (A100), H100, H800, H200, B200, MI300X, or a GPU file FILE.yaml",
    )
    parser.add_argument(
        "--memory-gb",
        type=real(0.0, MAX_MEMORY_GB, unit="GB per device"),
        metavar="G",
        help="memory per device (default: the GPU's)",
    )


def load_model_arguments(args: argparse.Namespace):
    """(model, hardware, profile or None, memory bytes or None) from ``add_model_arguments``."""
    from cutpipe.model_config import load_model_config
    from cutpipe.plan.costs.hardware import gpu
    from cutpipe.plan.costs.profile import Profile

    if args.model is None and args.profile is None:
        raise ValueError("give the model: --model FILE.yaml (or --profile FILE.json)")
    profile = Profile.load(args.profile) if args.profile is not None else None
    seq_len = getattr(args, "seq_len", None)
    if args.model is not None:
        model = load_model_config(args.model, seq_len=seq_len)
    else:
        model = profile.model
        if seq_len is not None and seq_len != model.seq_len:
            raise ValueError(
                f"{args.profile} was measured at sequences of {model.seq_len} tokens: drop "
                f"--seq-len {seq_len}, or profile at that length"
            )
    if profile is not None and profile.model != model:
        raise ValueError(
            f"{args.profile} was measured for model {profile.model.name!r}, not {model.name!r}: "
            "profile this model or drop --model"
        )
    hardware = gpu(args.gpu) if args.gpu is not None else None
    memory = args.memory_gb * 1e9 if args.memory_gb is not None else None
    return model, hardware, profile, memory
