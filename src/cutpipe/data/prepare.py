"""From a corpus to tokens: a token file (``cutpipe data prepare``), or tokens in memory for a
training run given text instead of a token file.

``prepare``, ``load_tokens`` and the launcher's pre-check (``check.check_data``) read ``--data``
the same way: ``token_file_of`` says whether the paths name one token file, and a ``TextCorpus``
walks text files, ``.jsonl`` and ``.parquet`` files and folders once, counting what it skips, and
says what it read when it found no text. So the three accept and refuse the same data with the
same messages.

Without a tokenizer the tokens are the corpus's bytes, documents joined by one NUL byte. With one
(``tokenizer.TextTokenizer``) every document is encoded and followed by its end-of-sequence
token, in batches of about ``BATCH_BYTES`` of text (by several threads for ``prepare``:
``tokenizer.encode_stream``), and the ids are written as they come: memory holds a few batches,
never the corpus's ids.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cutpipe.data.corpus import (
    STDLIB_BYTES,
    corpus_chunks,
    corpus_documents,
    stdlib_sources,
    user_sources,
)
from cutpipe.data.entries import Skipped
from cutpipe.data.tokens import (
    BYTES,
    EmptyCorpus,
    Header,
    Tokens,
    is_token_file,
    read_tokens,
    write_tokens,
)

if TYPE_CHECKING:
    from cutpipe.data.tokenizer import TextTokenizer

#: Text handed to the tokenizer at a time (one task of an encoding thread).
BATCH_BYTES = 2**20

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
    at ``STDLIB_BYTES``), their bytes in order from ``chunks`` (or their documents from
    ``documents``), with what was used and skipped; ``text_field`` names the text of a
    ``.jsonl`` or ``.parquet`` record, and ``advance`` is told the bytes of the files as they are
    read (of ``total`` in all), for a progress bar."""

    def __init__(
        self,
        paths: Paths,
        max_bytes: int | None = None,
        text_field: str = "text",
        advance: Callable[[int], None] | None = None,
    ) -> None:
        self.text_field = text_field
        self.advance = advance or (lambda count: None)
        self.skipped = Skipped()
        if paths:
            self.sources = user_sources(paths, self.skipped)
            self.name, self.cap = ", ".join(map(str, paths)), max_bytes
        else:
            self.cap = STDLIB_BYTES if max_bytes is None else max_bytes
            self.sources, self.name = stdlib_sources(), default_corpus_name(self.cap)
        self.files = 0  # files that gave text so far
        self.size = 0  # bytes given so far

    @property
    def total(self) -> int:
        """The size of the corpus's files, in bytes (what ``advance`` is told in all)."""
        sizes = 0
        for source in self.sources:
            with contextlib.suppress(OSError):
                sizes += source.path.stat().st_size
        return sizes

    def chunks(self) -> Iterator[bytes]:
        """The corpus's bytes, a document (and the separator before it) at a time."""
        chunks = corpus_chunks(self.sources, self.cap, self.skipped, self.text_field, self.advance)
        yield from self._counted(chunks)

    def documents(self) -> Iterator[bytes]:
        """The corpus's documents (UTF-8), without separators; the cap counts their bytes."""
        documents = corpus_documents(
            self.sources, self.cap, self.skipped, self.text_field, self.advance
        )
        yield from self._counted(documents)

    def _counted(self, pieces: Iterable[tuple[object, bytes]]) -> Iterator[bytes]:
        last = None
        for source, piece in pieces:
            if source is not last:
                self.files += 1
                last = source
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


def batches(documents: Iterable[bytes], size: int = BATCH_BYTES) -> Iterator[list[str]]:
    """``documents`` decoded (UTF-8, a bad byte replaced) in lists of about ``size`` bytes."""
    batch: list[str] = []
    held = 0
    for document in documents:
        batch.append(document.decode("utf-8", errors="replace"))
        held += len(document)
        if held >= size:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def prepare(
    paths: Paths,
    output: str | os.PathLike,
    max_bytes: int | None = None,
    *,
    tokenizer: TextTokenizer | None = None,
    text_field: str = "text",
    workers: int = 1,
    advance: Callable[[int], None] | None = None,
) -> Prepared:
    """Write the tokens of ``paths`` (default: the standard library corpus, capped at
    ``STDLIB_BYTES``) to the token file ``output``; ``max_bytes`` caps any corpus. Bytes by
    default; with ``tokenizer`` its ids, each document followed by its EOS, encoded by
    ``workers`` threads. ``advance`` is told the bytes read (``TextCorpus``)."""
    corpus = TextCorpus(paths, max_bytes, text_field, advance)
    try:
        if tokenizer is None:
            header = write_tokens(output, corpus.chunks())
        else:
            from cutpipe.data.tokenizer import encode_stream

            chunks = encode_stream(tokenizer, batches(corpus.documents()), workers)
            header = write_tokens(output, chunks, tokenizer.vocab, tokenizer.digest, tokenizer.eos)
    except EmptyCorpus:
        raise corpus.no_text() from None
    return Prepared(header, corpus.files, corpus.name, corpus.skipped)


def check_tokenizer(made_by: str, source: str, tokenizer: str | os.PathLike[str]) -> None:
    """A one-line ValueError if tokens ``source`` made by the tokenizer of digest ``made_by``
    (``BYTES`` for bytes) are not of the tokenizer at ``tokenizer`` (a ``--tokenizer`` path)."""
    from cutpipe.data.tokenizer import tokenizer_digest

    given = tokenizer_digest(tokenizer)
    if given == made_by:
        return
    theirs = "bytes" if made_by == BYTES else f"the tokenizer {made_by[:16]}"
    raise ValueError(
        f"{source} holds the tokens of {theirs}, --tokenizer {tokenizer} is {given[:16]}: give "
        "the tokenizer the data was prepared with, or prepare the data again with this one"
    )


def load_tokens(
    paths: str | os.PathLike[str] | Paths = (),
    max_bytes: int | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
) -> Tokens:
    """The tokens to train on: one token file's, mapped, its digest checked (and, with
    ``tokenizer``, its tokenizer's); or text files', ``.jsonl``, ``.parquet`` files' and
    folders' (default: the standard library corpus), read into memory, as bytes or encoded by
    ``tokenizer`` (a ``tokenizer.json`` or a folder holding one) as ``prepare`` does. The same
    corpus gives the same fingerprint either way, so a run may resume from a token file prepared
    from the text it started on."""
    paths = as_paths(paths)
    file = token_file_of(paths, max_bytes)
    if file is not None:
        tokens = read_tokens(file)
        if tokenizer is not None:
            check_tokenizer(tokens.tokenizer, str(file), tokenizer)
        return tokens
    corpus = TextCorpus(paths, max_bytes)
    if tokenizer is None:
        data = bytearray().join(corpus.chunks())
        if not data:
            raise corpus.no_text()
        return Tokens.from_bytes(data, source=corpus.name)
    import torch

    from cutpipe.data.tokenizer import encode_stream, load_tokenizer

    loaded = load_tokenizer(tokenizer)
    data = bytearray().join(encode_stream(loaded, batches(corpus.documents())))
    if not data:
        raise corpus.no_text()
    values = torch.frombuffer(data, dtype=getattr(torch, loaded.dtype))
    return Tokens.from_tensor(values, loaded.vocab, corpus.name, loaded.digest, loaded.eos)
