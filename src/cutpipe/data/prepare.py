"""From a corpus to tokens: a token file (``cutpipe data prepare``), or tokens in memory for a
training run given text instead of a token file."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cutpipe.data.corpus import STDLIB_BYTES, Source, corpus_chunks, stdlib_sources, user_sources
from cutpipe.data.tokens import (
    EmptyCorpus,
    Header,
    Tokens,
    is_token_file,
    read_tokens,
    write_tokens,
)

Paths = Sequence["str | os.PathLike[str]"]


@dataclass(frozen=True)
class Prepared:
    """A written token file: its header, how many files it took text from, and the corpus."""

    header: Header
    files: int
    corpus: str


def default_corpus_name(cap: int = STDLIB_BYTES) -> str:
    version = ".".join(map(str, sys.version_info[:2]))
    return f"the Python {version} standard library (*.py, at most {cap:,} bytes)"


def _corpus(paths: Paths, max_bytes: int | None) -> tuple[list[Source], str, int | None]:
    """(sources, how to name the corpus, size cap): ``paths``'s, or the standard library's."""
    if paths:
        return user_sources(paths), ", ".join(map(str, paths)), max_bytes
    cap = STDLIB_BYTES if max_bytes is None else max_bytes
    return stdlib_sources(), default_corpus_name(cap), cap


def _empty(corpus: str) -> ValueError:
    return ValueError(
        f"no text in {corpus}: its files are empty or binary (they hold NUL bytes), or there "
        "are none; give text files or folders that hold some"
    )


def prepare(paths: Paths, output: str | os.PathLike, max_bytes: int | None = None) -> Prepared:
    """Write the tokens of ``paths`` (default: the standard library corpus, capped at
    ``STDLIB_BYTES``) to the token file ``output``; ``max_bytes`` caps any corpus."""
    sources, corpus, cap = _corpus(paths, max_bytes)
    used: list[Source] = []

    def chunks() -> Iterator[bytes]:
        for source, piece in corpus_chunks(sources, cap):
            used.append(source)
            yield piece

    try:
        header = write_tokens(output, chunks())
    except EmptyCorpus as error:
        raise _empty(corpus) from error
    return Prepared(header, len(used), corpus)


def load_tokens(paths: str | os.PathLike[str] | Paths = (), max_bytes: int | None = None) -> Tokens:
    """The tokens to train on: one token file's, mapped; or text files' and folders' (default:
    the standard library corpus), read into memory. The same corpus gives the same fingerprint
    either way, so a run may resume from a token file prepared from the text it started on."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = [path for path in paths if is_token_file(path)]
    if files and len(paths) == 1:
        if max_bytes is not None:
            raise ValueError(f"{files[0]} is a token file: its size is set; drop the size cap")
        return read_tokens(files[0])
    if files:
        raise ValueError(f"{files[0]} is a token file: give it alone, or give only text")
    sources, corpus, cap = _corpus(paths, max_bytes)
    data = bytearray().join(piece for _, piece in corpus_chunks(sources, cap))
    if not data:
        raise _empty(corpus)
    return Tokens.from_bytes(data)
