"""``cutpipe export``: the plain unsplit model out of a training checkpoint.

Reads the latest complete checkpoint of a ``cutpipe train --checkpoint-dir`` directory (or one
``step-...`` folder) in this one process, with no process group, after checking its files against
the checksums its completion mark records, and writes the model's state dict under the unsplit
model's names as ``.safetensors`` or ``.pt`` (docs/training.md).
"""

from __future__ import annotations

import argparse

from cutpipe.cli.common import description, output_file, require_torch

ENDINGS = (".safetensors", ".pt")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export", help="write a checkpoint's model as one .safetensors or .pt file",
        description=description(__doc__),
    )  # fmt: skip
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a --checkpoint-dir of cutpipe train, or one step folder in it")  # fmt: skip
    parser.add_argument("--output", "-o", required=True, type=output_file(ENDINGS), metavar="FILE",
                        help=f"ending: {', '.join(ENDINGS)}")  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    require_torch()
    from cutpipe.train.checkpoint import export_checkpoint

    written = export_checkpoint(args.checkpoint, args.output, note=print)
    print(f"wrote {written}: the unsplit model")
    return 0
