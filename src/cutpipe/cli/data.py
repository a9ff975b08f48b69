"""``cutpipe data``: prepare a corpus's tokens once, and look at a token file.

``cutpipe data prepare [PATH ...] -o FILE`` writes the byte tokens of text files and folders
(default: the Python standard library's sources, the first 8 MiB) to a token file that
``cutpipe train --data FILE`` maps instead of reading the text again; ``cutpipe data info FILE``
checks one and prints its size, vocabulary, digest and unigram entropy (the loss a model that
ignores context cannot beat). Preparing needs no torch; ``info`` does.
"""

from __future__ import annotations

import argparse
import time

from cutpipe.cli.common import description, output_file, print_json, real, require_torch

#: The largest ``--max-mb``: a mebibyte short of 1 PiB, far beyond any corpus, still exact.
MAX_MB = 2.0**30


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "data", help="training data: data prepare writes a token file, data info reads one",
        description=description(__doc__),
    )  # fmt: skip
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="write the byte tokens of text files and folders to a token file",
        description="Write the byte tokens of text files and folders (default: the Python "
        "standard library's *.py sources, first 8 MiB) to a token file. Folders are walked in "
        "sorted order; binary files (with a NUL byte), named pipes, sockets, devices and "
        "unreadable files are skipped there and counted, dot-named entries skipped quietly.",
    )  # fmt: skip
    prepare.add_argument("paths", nargs="*", metavar="PATH",
                         help="text files or folders (default: the standard library)")  # fmt: skip
    prepare.add_argument("--output", "-o", required=True, type=output_file(), metavar="FILE",
                         help="the token file to write")  # fmt: skip
    prepare.add_argument("--max-mb", type=real(0.0, MAX_MB, unit="MiB"), metavar="MB",
                         help="keep only the corpus's first MB mebibytes (default: all; 8 for "
                         "the standard library)")  # fmt: skip
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


def run_prepare(args: argparse.Namespace) -> int:
    from cutpipe.data import prepare

    cap = None if args.max_mb is None else max(1, int(args.max_mb * 2**20))
    start = time.perf_counter()
    done = prepare(args.paths, args.output, cap)
    seconds = time.perf_counter() - start
    header = done.header
    if args.json:
        print_json({
            "file": str(args.output), "tokens": header.count, "vocab": header.vocab,
            "dtype": header.dtype, "digest": header.digest, "files": done.files,
            "skipped": done.skipped.as_dict(), "corpus": done.corpus, "seconds": round(seconds, 3),
        })  # fmt: skip
        return 0
    print(
        f"wrote {args.output}: {header.count:,} tokens ({_size(header.count)}, vocab "
        f"{header.vocab}) from {done.files:,} file{'s' if done.files != 1 else ''} of "
        f"{done.corpus} in {seconds:.2f} s"
    )
    if done.skipped.total:
        print(f"skipped {done.skipped}")
    print(f"digest {header.digest}")
    return 0


def run_info(args: argparse.Namespace) -> int:
    require_torch()
    from cutpipe.data import nats_to_bits, read_tokens, unigram_entropy

    tokens = read_tokens(args.file)  # every token compared with the header's digest
    nats = unigram_entropy(tokens)
    if args.json:
        print_json({
            "file": args.file, "tokens": len(tokens), "vocab": tokens.vocab,
            "dtype": str(tokens.values.dtype).removeprefix("torch."),
            "digest": tokens.fingerprint, "entropy_nats": nats, "entropy_bits": nats_to_bits(nats),
        })  # fmt: skip
        return 0
    rows = [
        ("file", args.file),
        ("tokens", f"{len(tokens):,} ({_size(len(tokens) * tokens.values.element_size())})"),
        ("vocab", f"{tokens.vocab} (byte-level)" if tokens.vocab == 256 else str(tokens.vocab)),
        ("digest", f"{tokens.fingerprint} (checked)"),
        ("unigram entropy", f"{nats_to_bits(nats):.4f} bits/token, {nats:.4f} nats/token"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0
