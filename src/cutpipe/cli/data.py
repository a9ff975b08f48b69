"""``cutpipe data``: prepare a corpus's tokens once, and look at a token file.

``cutpipe data prepare [PATH ...] -o FILE`` writes the tokens of text files, ``.jsonl`` and
``.parquet`` files and folders (default: the Python standard library's sources, the first 8 MiB)
to a token file that ``cutpipe train --data FILE`` maps instead of reading the text again: bytes,
or with ``--tokenizer`` a Hugging Face tokenizer's ids, each document followed by its
end-of-sequence token. ``cutpipe data info FILE`` checks one and prints its size, vocabulary,
tokenizer, digest and unigram entropy (the loss a model that ignores context cannot beat).
Preparing needs no torch; ``info`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

from cutpipe.cli.common import (
    description,
    output_file,
    print_json,
    real,
    require_torch,
    whole_number,
)

#: The largest ``--max-mb``: a mebibyte short of 1 PiB, far beyond any corpus, still exact.
MAX_MB = 2.0**30


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "data", help="training data: data prepare writes a token file, data info reads one",
        description=description(__doc__),
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="write the tokens of text, .jsonl and .parquet files to a token file",
        description="Write the tokens of text files, .jsonl and .parquet files and folders "
        "(default: the Python standard library's *.py sources, first 8 MiB) to a token file: "
        "bytes (documents joined by a NUL byte), or with --tokenizer a Hugging Face tokenizer's "
        "ids, each document followed by its end-of-sequence token. A text file is one document; "
        "a .jsonl file one per line (the --text-field of its JSON object), a .parquet file one "
        "per row (the --text-field column). A .jsonl line that is not a JSON object with the "
        "field as text, and a .parquet file without the column or with a null in it, are errors "
        "naming the file and line or row (nothing is skipped); blank lines and empty documents "
        "are passed over. Folders are walked in sorted order; binary files (with a NUL byte), "
        "named pipes, sockets, devices and unreadable files are skipped there and counted, "
        "dot-named entries skipped quietly.",
    )  # fmt: skip
    prepare.add_argument("paths", nargs="*", metavar="PATH",
                         help="text, .jsonl or .parquet files, or folders (default: the "
                         "standard library)")  # fmt: skip
    prepare.add_argument("--output", "-o", required=True, type=output_file(), metavar="FILE",
                         help="the token file to write")  # fmt: skip
    prepare.add_argument("--max-mb", type=real(0.0, MAX_MB, unit="MiB"), metavar="MB",
                         help="keep only the corpus's first MB mebibytes (default: all; 8 for "
                         "the standard library)")  # fmt: skip
    prepare.add_argument("--tokenizer", metavar="PATH",
                         help="a Hugging Face tokenizer.json, or a model folder holding one "
                         "(default: bytes); needs pip install 'cutpipe[data]'")  # fmt: skip
    prepare.add_argument("--eos", metavar="TOKEN",
                         help="the end-of-sequence token put after each document (default: the "
                         "folder's tokenizer_config.json eos_token, else </s>, <|endoftext|>, "
                         "<|end_of_text|>, <|im_end|>, <eos> or <|eos|>, the first the "
                         "tokenizer has)")  # fmt: skip
    prepare.add_argument("--text-field", default="text", metavar="NAME",
                         help="the field of a .jsonl object, or the .parquet column, that holds "
                         "the text (default: text)")  # fmt: skip
    prepare.add_argument("--workers", type=whole_number(1, 1024), metavar="N",
                         help="threads encoding with --tokenizer (default: the CPUs, at most "
                         "8)")  # fmt: skip
    prepare.add_argument("--json", action="store_true", help="print the result as JSON")
    prepare.set_defaults(run=run_prepare)
    info = actions.add_parser(
        "info", help="check a token file; print its size, vocabulary and unigram entropy",
        description="Check a token file (header and digest) and print its size, vocabulary "
        "and unigram entropy in bits and nats per token.",
    )  # fmt: skip
    info.add_argument("file", metavar="FILE", help="a token file from cutpipe data prepare")
    info.add_argument("--json", action="store_true", help="print the figures as JSON")
    info.set_defaults(run=run_info)


def _size(count: int) -> str:
    """Bytes as people read them: 16 bytes, 12.3 KiB, 8.00 MiB, 1.50 GiB."""
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 2), ("KiB", 2**10, 1)):
        if count >= scale:
            return f"{count / scale:.{digits}f} {unit}"
    return f"{count} bytes"


def default_workers() -> int:
    """Encoding threads when --workers is not given: the CPUs this process may use, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


@contextlib.contextmanager
def progress_bar(total: int | None, what: str) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar of the bytes read of ``total``, on stderr; None for no bar (``total``
    None)."""
    if total is None:
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
        TransferSpeedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, transient=True, console=Console(stderr=True)) as progress:
        task = progress.add_task(what, total=total)

        def advance(count: int) -> None:
            progress.update(task, advance=count)

        yield advance


def run_prepare(args: argparse.Namespace) -> int:
    from cutpipe.data import load_tokenizer, prepare
    from cutpipe.data.prepare import TextCorpus

    if args.tokenizer is None and args.eos is not None:
        raise ValueError("--eos names a tokenizer's token: give --tokenizer too, or drop --eos")
    tokenizer = None if args.tokenizer is None else load_tokenizer(args.tokenizer, args.eos)
    cap = None if args.max_mb is None else max(1, int(args.max_mb * 2**20))
    workers = args.workers or default_workers()
    start = time.perf_counter()
    # a bar on a terminal only: its total, the size of the files to read, walks them once more
    total = TextCorpus(args.paths, cap).total if sys.stderr.isatty() and not args.json else None
    with progress_bar(total, f"preparing {args.output}") as advance:
        done = prepare(
            args.paths, args.output, cap, tokenizer=tokenizer, text_field=args.text_field,
            workers=workers, advance=advance,
        )  # fmt: skip
    seconds = time.perf_counter() - start
    header = done.header
    if args.json:
        print_json({
            "file": str(args.output), "tokens": header.count, "vocab": header.vocab,
            "dtype": header.dtype, "digest": header.digest, "tokenizer": header.tokenizer,
            "eos": header.eos, "files": done.files, "skipped": done.skipped.as_dict(),
            "corpus": done.corpus, "seconds": round(seconds, 3),
        })  # fmt: skip
        return 0
    size = _size(header.count * header.itemsize)
    made = "" if tokenizer is None else f", {header.dtype}, EOS {tokenizer.eos_token!r}"
    print(
        f"wrote {args.output}: {header.count:,} tokens ({size}, vocab {header.vocab}{made}) "
        f"from {done.files:,} file{'s' if done.files != 1 else ''} of {done.corpus} in "
        f"{seconds:.2f} s"
    )
    if done.skipped.total:
        print(f"skipped {done.skipped}")
    print(f"digest {header.digest}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    require_torch()
    from cutpipe.data import BYTES, nats_to_bits, read_tokens, unigram_entropy

    tokens = read_tokens(args.file)  # every token compared with the header's digest
    nats = unigram_entropy(tokens)
    if args.json:
        print_json({
            "file": args.file, "tokens": len(tokens), "vocab": tokens.vocab,
            "dtype": str(tokens.values.dtype).removeprefix("torch."),
            "tokenizer": tokens.tokenizer, "eos": tokens.eos, "digest": tokens.fingerprint,
            "entropy_nats": nats, "entropy_bits": nats_to_bits(nats),
        })  # fmt: skip
        return 0
    byte_level = tokens.tokenizer == BYTES
    dtype = str(tokens.values.dtype).removeprefix("torch.")
    rows = [
        ("file", args.file),
        ("tokens", f"{len(tokens):,} ({_size(len(tokens) * tokens.values.element_size())})"),
        ("vocab", f"{tokens.vocab} (byte-level)" if byte_level else f"{tokens.vocab} ({dtype})"),
        *([] if byte_level else [("tokenizer", tokens.tokenizer), ("eos", str(tokens.eos))]),
        ("digest", f"{tokens.fingerprint} (checked)"),
        ("unigram entropy", f"{nats_to_bits(nats):.4f} bits/token, {nats:.4f} nats/token"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
