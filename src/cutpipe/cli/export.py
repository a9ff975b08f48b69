"""``cutpipe export``: the plain unsplit model out of a training checkpoint.

Reads the latest complete checkpoint of a ``cutpipe train --checkpoint-dir`` directory (or one
``step-...`` folder) in this one process, with no process group, after checking its files against
the checksums its completion mark records, and writes the model's state dict under the unsplit
model's names as ``.safetensors`` or ``.pt`` (docs/training.md), or, with ``--format hf``, a
folder that ``transformers.AutoModelForCausalLM.from_pretrained`` loads (``config.json`` and
``model.safetensors``; ``--model`` names the model file the run trained, docs/models.md).
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
    parser.add_argument("--output", "-o", required=True, metavar="PATH",
                        help=f"a file ({', '.join(ENDINGS)}), or with --format hf a folder")  # fmt: skip
    parser.add_argument("--format", choices=("file", "hf"), default="file",
                        help="file: one .safetensors or .pt (default); hf: a Hugging Face folder")  # fmt: skip
    parser.add_argument("--model", metavar="FILE",
                        help="with --format hf: the model file or config.json the run trained")  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.format == "file":
        try:  # the ending, checked before any work
            output_file(ENDINGS)(args.output)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"--output: {error}") from None
        if args.model is not None:
            raise ValueError("--model is for --format hf: drop it, or add --format hf")
    elif args.model is None:
        raise ValueError("--format hf needs --model FILE: the model file the run trained")
    require_torch()
    from cutpipe.train.checkpoint import export_checkpoint

    if args.format == "file":
        written = export_checkpoint(args.checkpoint, args.output, note=print)
        print(f"wrote {written}: the unsplit model")
        return 0
    from cutpipe.model_config import load_model_config
    from cutpipe.models.hf import save_hf_folder
    from cutpipe.train.checkpoint.export import model_state

    spec = load_model_config(args.model)
    folder = save_hf_folder(model_state(args.checkpoint, note=print), spec, args.output)
    print(f"wrote {folder}: config.json and model.safetensors, for transformers")
    return 0
