"""``cutpipe generate``: text from a trained model, on one process.

``--checkpoint DIR`` is a ``cutpipe train --checkpoint-dir`` (its latest complete checkpoint) or
one step folder in it: the checkpoint's run record says what model was trained, so no model
file is needed. It may also be a Hugging Face folder (``config.json`` and safetensors, as
``cutpipe export --format hf`` writes). Text becomes bytes, as ``cutpipe train`` reads it by
default; ``--tokenizer`` names a ``tokenizer.json`` (or a folder holding one) for a model
trained on its tokens, and a Hugging Face folder's own ``tokenizer.json`` is used when it has
one. ``--temperature 0`` picks the most likely token each time (docs/training.md,
"Generation").
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from cutpipe.cli.common import description, real, require_torch, whole_number

if TYPE_CHECKING:
    from cutpipe.train.trained import Codec


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate", help="continue a prompt with a trained model (a checkpoint or an HF folder)",
        description=description(__doc__),
    )  # fmt: skip
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a --checkpoint-dir of cutpipe train, one step folder in it, or a "
                        "Hugging Face model folder")  # fmt: skip
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=whole_number(1, 10**6), default=64, metavar="N",
                        help="tokens to add at most (default 64)")  # fmt: skip
    parser.add_argument("--temperature", type=real(0.0, 100.0, exclusive=False), default=1.0,
                        metavar="T", help="sampling temperature; 0 picks the most likely token "
                        "(default 1)")  # fmt: skip
    parser.add_argument("--top-k", type=whole_number(1), metavar="K",
                        help="draw only from the K most likely tokens")  # fmt: skip
    parser.add_argument("--seed", type=whole_number(0, 2**63 - 1), default=0,
                        help="seeds the sampling (default 0)")  # fmt: skip
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="a tokenizer.json, or a folder holding one (default: bytes, or the "
                        "Hugging Face folder's own)")  # fmt: skip
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    source = Path(args.checkpoint)
    if not source.is_dir():
        raise ValueError(
            f"--checkpoint {source}: no such folder; give a --checkpoint-dir of cutpipe train or "
            "a Hugging Face model folder"
        )
    require_torch()
    from cutpipe.models.generate import Sampling, generate
    from cutpipe.train.trained import from_checkpoint, from_hf_folder

    sampling = Sampling(args.temperature, args.top_k, args.seed)
    hf = (source / "config.json").is_file()
    tokenizer = args.tokenizer
    if tokenizer is None and hf and (source / "tokenizer.json").is_file():
        tokenizer = str(source)
    codec = None if tokenizer is None else tokenizer_codec(tokenizer)
    trained = from_hf_folder(source, codec) if hf else from_checkpoint(source, codec)
    given = "bytes" if codec is None else codec.digest
    if not hf and trained.tokenizer not in (None, given):
        raise ValueError(
            f"the checkpoint's run trained on tokenizer {trained.tokenizer[:12]}, not "
            f"{given[:12]}: give --tokenizer the tokenizer.json it was trained with"
            if trained.tokenizer != "bytes"
            else f"the checkpoint's run trained on bytes: drop --tokenizer {tokenizer}"
        )
    prompt = trained.encode(args.prompt)
    if max(prompt, default=0) >= trained.spec.vocab:
        raise ValueError(
            f"the prompt's tokens reach {max(prompt)}, past the model's vocabulary of "
            f"{trained.spec.vocab}: give the tokenizer the model was trained with (--tokenizer)"
        )
    new = generate(
        trained.model, prompt, args.max_new_tokens, trained.spec.seq_len, sampling, trained.stop
    )
    print(args.prompt + trained.decode(new), flush=True)
    return 0


def tokenizer_codec(path: str) -> Codec:
    """Encode and decode with a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library);
    generation stops at its end-of-sequence token when it has one."""
    from cutpipe.data.tokenizer import load_tokenizer, require, tokenizer_digest, tokenizer_file
    from cutpipe.train.trained import Codec

    library = require("tokenizers", "--tokenizer")
    file = tokenizer_file(path)
    tokenizer = library.Tokenizer.from_file(str(file))
    try:
        stop: int | None = load_tokenizer(file).eos
    except ValueError:  # no end-of-sequence token to stop at
        stop = None
    return Codec(
        lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
        lambda tokens: tokenizer.decode(list(tokens)),
        stop, tokenizer_digest(file),
    )  # fmt: skip
