"""From a corpus to tokens: a token file (``cutpipe data prepare``), or tokens in memory for a
training run given text instead of a token file.

``prepare``, ``load_tokens`` and the launcher's pre-check (``check.check_data``) read ``--data``
the same way: ``token_file_of`` says whether the paths name one token file, and a ``TextCorpus``
walks text files and folders once, counting what it skips, and says what it read when it found no
text. So the three accept and refuse the same data with the same messages.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cutpipe.data.corpus import STDLIB_BYTES, corpus_chunks, stdlib_sources, user_sources
from cutpipe.data.entries import Skipped
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
    """A written token file: its header, how many files it took text from, the corpus, and
    what the walk skipped (binary files, named pipes, ...)."""

    header: Header
    files: int
    corpus: str
    skipped: Skipped = field(default_factory=Skipped)


def default_corpus_name(cap: int = STDLIB_BYTES) -> str:
    version = ".".join(map(str, sys.version_info[:2]))
    return f"the Python {version} standard library (*.py, at most {cap:,} bytes)"


def as_paths(paths: str | os.PathLike[str] | Paths) -> list[str | os.PathLike[str]]:
    """``paths`` as a list: one path may be given alone."""
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def token_file_of(paths: Paths, max_bytes: int | None = None) -> Path | None:
    """The token file ``paths`` name, or None when they name text; a token file must come alone
    and without a size cap (its size is set)."""
    files = [path for path in paths if is_token_file(path)]
    if not files:
        return None
    if len(paths) > 1:
        raise ValueError(f"{files[0]} is a token file: give it alone, or give only text")
    if max_bytes is not None:
        raise ValueError(f"{files[0]} is a token file: its size is set; drop the size cap")
    return Path(files[0])


class TextCorpus:
    """One reading of a text corpus: ``paths``' files (default: the standard library's, capped
    at ``STDLIB_BYTES``), their bytes in order from ``chunks``, with what was used and skipped."""

    def __init__(self, paths: Paths, max_bytes: int | None = None) -> None:
        self.skipped = Skipped()
        if paths:
            self.sources = user_sources(paths, self.skipped)
            self.name, self.cap = ", ".join(map(str, paths)), max_bytes
        else:
            self.cap = STDLIB_BYTES if max_bytes is None else max_bytes
            self.sources, self.name = stdlib_sources(), default_corpus_name(self.cap)
        self.files = 0  # files that gave text so far
        self.size = 0  # bytes given so far

    def chunks(self) -> Iterator[bytes]:
        """The corpus's bytes, a file (and the separator before it) at a time."""
        for _, piece in corpus_chunks(self.sources, self.cap, self.skipped):
            self.files += 1
            self.size += len(piece)
            yield piece

    def no_text(self) -> ValueError:
        """The error for a corpus that gave no text, saying what was read instead."""
        files = len(self.sources)
        empty = files - (self.skipped.total - self.skipped.counts.get("unreadable folder", 0))
        found = [f"{empty:,} empty file{'s' if empty != 1 else ''}"] if empty else []
        if self.skipped.total:
            found.append(f"skipped {self.skipped}")
        return ValueError(
            f"no text in {self.name}: {'; '.join(found) or 'no files'}; give text files or "
            "folders that hold some (a text file holds no NUL byte)"
        )


def prepare(paths: Paths, output: str | os.PathLike, max_bytes: int | None = None) -> Prepared:
    """Write the tokens of ``paths`` (default: the standard library corpus, capped at
    ``STDLIB_BYTES``) to the token file ``output``; ``max_bytes`` caps any corpus."""
    corpus = TextCorpus(paths, max_bytes)
    try:
        header = write_tokens(output, corpus.chunks())
    except EmptyCorpus:
        raise corpus.no_text() from None
    return Prepared(header, corpus.files, corpus.name, corpus.skipped)


def load_tokens(paths: str | os.PathLike[str] | Paths = (), max_bytes: int | None = None) -> Tokens:
    """The tokens to train on: one token file's, mapped, its digest checked; or text files' and
    folders' (default: the standard library corpus), read into memory. The same corpus gives the
    same fingerprint either way, so a run may resume from a token file prepared from the text it
    started on."""
    paths = as_paths(paths)
    file = token_file_of(paths, max_bytes)
    if file is not None:
        return read_tokens(file)
    corpus = TextCorpus(paths, max_bytes)
    data = bytearray().join(corpus.chunks())
    if not data:
        raise corpus.no_text()
    return Tokens.from_bytes(data, source=corpus.name)
