"""``cutpipe profile``: measure a model's per-item costs on this machine."""

from __future__ import annotations

import argparse
import re

from cutpipe.cli.common import output_file, print_json, require_torch, whole_number
from cutpipe.plan.costs.profile import DTYPES
from cutpipe.spec import ModelSpec

#: Timed or warm-up rounds: each builds and runs every item of the model once.
MAX_ROUNDS = 1000


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "profile",
        help="measure per-layer F, B, W times and memory on this machine",
        description="Build one of each kind of item of the model (embedding, dense layer, MoE "
        "layer, head), time its forward, input-gradient backward and weight-gradient backward, "
        "weigh its activations, and write a file that recommend and partition accept "
        "with --profile.",
    )
    parser.add_argument("--model", required=True, metavar="FILE", help="model (YAML or JSON)")
    parser.add_argument("-o", "--output", required=True, type=output_file(), metavar="FILE",
                        help="profile to write")  # fmt: skip
    parser.add_argument(
        "--device",
        type=device_name,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if present)",
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), help="default: fp32 on CPU, the model's on GPU"
    )
    parser.add_argument("--repeats", type=whole_number(1, MAX_ROUNDS), default=3,
                        help="timed rounds (median)")  # fmt: skip
    parser.add_argument("--warmup", type=whole_number(0, MAX_ROUNDS), default=1,
                        help="untimed rounds first")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="also print the profile")
    parser.set_defaults(run=run)


def device_name(text: str) -> str:
    """An argparse ``type``: cpu, cuda or cuda:N."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text.strip()


def run(args: argparse.Namespace) -> int:
    model = ModelSpec.load(args.model)
    require_torch()
    import torch

    from cutpipe.profiling import check_fits, profile_model  # imports torch

    device = args.device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but this machine has no usable GPU")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s), "
                f"numbered from 0"
            )
    check_fits(model, device, args.dtype)
    profile = profile_model(model, device, args.dtype, args.repeats, args.warmup)
    profile.save(args.output)
    if args.json:
        print_json(profile.to_dict())
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{model.name} on {profile.device} ({profile.dtype}), per microbatch")
    for column in ("item", "F ms", "B ms", "W ms", "activation MB", "parameters"):
        table.add_column(column, justify="left" if column == "item" else "right")
    for kind, item in profile.items.items():
        table.add_row(kind, f"{item.forward * 1e3:.2f}", f"{item.backward * 1e3:.2f}",
                      f"{item.weight * 1e3:.2f}", f"{item.activation / 1e6:.2f}", f"{item.parameters:,.0f}")  # fmt: skip
    console = Console()
    console.print(table)
    console.print(f"W keeps {profile.w_memory:.0%} of a layer's activation; wrote {args.output}")
    return 0
