"""Arguments and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cutpipe.schedule.registry import SCHEDULES
from cutpipe.sim.costs import Costs


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--schedule, --ranks, --microbatches."""
    parser.add_argument(
        "--schedule",
        "-s",
        required=True,
        metavar="NAME",
        help=f"one of: {', '.join(SCHEDULES)}",
    )
    parser.add_argument("--ranks", "-r", type=int, required=True, help="pipeline ranks (devices)")
    parser.add_argument(
        "--microbatches", "-m", type=int, required=True, help="microbatches per step"
    )


def parse_costs(text: str) -> Costs:
    try:
        return Costs.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_costs_argument(parser: argparse.ArgumentParser, default: str, per: str) -> None:
    parser.add_argument(
        "--costs",
        default=default,
        type=parse_costs,
        metavar="K=V,...",
        help=f"costs per {per}, e.g. F=1,B=1,W=1,FB=2.5,comm=0.1 (keys: f, b, w, fb, comm, ep_f, "
        f"ep_b, activation, w_memory, p2p_bytes, ep_bytes; default: {default or 'F=B=W=1'})",
    )


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def fmt(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits}f}".rstrip("0").rstrip(".")


def add_model_arguments(parser: argparse.ArgumentParser, gpu_required: bool = True) -> None:
    """--model, --profile, --gpu, --memory-gb: what is trained on what."""
    parser.add_argument("--model", metavar="FILE", help="model description (YAML or JSON)")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="measured costs from `cutpipe profile` instead of the analytic model "
        "(its model is used when --model is not given)",
    )
    parser.add_argument("--gpu", required=gpu_required, metavar="NAME", help="A100, H100 or H200")
    parser.add_argument(
        "--memory-gb", type=float, metavar="G", help="memory per device (default: the GPU's)"
    )


def load_model_arguments(args: argparse.Namespace):
    """(model, hardware, profile or None, memory bytes or None) from ``add_model_arguments``."""
    from cutpipe.plan.costs import ModelSpec, gpu
    from cutpipe.plan.profile import Profile

    if not args.model and not args.profile:
        raise ValueError("give the model: --model FILE.yaml (or --profile FILE.json)")
    profile = Profile.load(args.profile) if args.profile else None
    model = ModelSpec.load(args.model) if args.model else profile.model
    if profile is not None and profile.model != model:
        raise ValueError(
            f"{args.profile} was measured for model {profile.model.name!r}, not {model.name!r}: "
            "profile this model or drop --model"
        )
    if args.memory_gb is not None and args.memory_gb <= 0:
        raise ValueError(f"--memory-gb must be positive, got {args.memory_gb}")
    hardware = gpu(args.gpu) if args.gpu else None
    memory = args.memory_gb * 1e9 if args.memory_gb is not None else None
    return model, hardware, profile, memory
