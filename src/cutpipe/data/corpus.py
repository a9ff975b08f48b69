"""Which files a corpus is made of, and their bytes in a fixed order.

A corpus is a list of text files: the ones the user names (files, or folders walked recursively
in sorted order), or by default the Python standard library's own ``*.py`` sources, which every
machine with Python has, so training needs no download. The standard library corpus leaves out
``site-packages`` (what the user installed, different on every machine) and the test suites (more
bytes than the rest, much of it test data), and is capped (``STDLIB_BYTES``, the first 8 MiB of
about 11 for Python 3.11), so it is the same on every machine with the same Python version and
platform, and takes well under a second to prepare.

A text file is one without a NUL byte. That check, not a list of endings, decides: it keeps
source files of any language and any ending (``Makefile``, ``.rs``, ``.txt``) and skips images,
archives, compiled files and UTF-16 text. Inside folders a binary file, and any entry that is not
a regular readable file (a named pipe, a socket, a device), is skipped and counted (``Skipped``,
from ``entries``, which never opens such an entry); a file named on the command line must be a
text file, or it is an error. Names starting with a dot (``.git``, ``.venv``) are skipped quietly
inside folders, and links to folders are not followed (no loops).

A ``.jsonl`` or ``.parquet`` file holds many documents, one per record (``documents``); a text
file is one. As bytes, documents are joined with one NUL byte between them (``SEPARATOR``): no
text file holds one, so the byte-level model sees where a document ends (a tokenizer puts its
end-of-sequence token after each instead: ``prepare``). No imports from the rest of cutpipe but
``entries`` and ``documents``, and no torch.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cutpipe.data.documents import Advance, jsonl_documents, parquet_documents, record_kind
from cutpipe.data.entries import WHAT, Skipped, kind_of, open_regular, read_text

#: Between two files of a corpus: a byte no text file holds.
SEPARATOR = b"\0"
#: The standard library corpus: at most this many bytes (8 MiB), the first ones in sorted order.
STDLIB_BYTES = 8 * 2**20
#: Folders the standard library corpus leaves out: installed packages, test suites, caches.
STDLIB_SKIPPED = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@dataclass(frozen=True)
class Source:
    """One file of a corpus; ``name`` is how reports show it (relative to the folder given);
    ``named``: the user gave this file itself, so it must be text (a folder's may be skipped)."""

    path: Path
    name: str
    named: bool = False


def _walk(
    folder: Path, suffix: str | None, pruned: frozenset[str], skipped: Skipped | None = None
) -> Iterator[Source]:
    """Entries under ``folder`` other than folders, in sorted order of their relative path,
    pruning ``pruned`` and dot-named folders before descending (site-packages can be larger than
    the rest); a folder that cannot be listed is counted in ``skipped``."""

    def unlisted(error: OSError) -> None:
        if skipped is not None:
            skipped.add("unreadable folder")

    found = []
    for root, folders, files in os.walk(folder, onerror=unlisted):
        folders[:] = [f for f in folders if f not in pruned and not f.startswith(".")]
        for name in files:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            path = Path(root, name)
            found.append(Source(path, path.relative_to(folder).as_posix()))
    # Sort by path parts, not strings, so "a/b" comes before "a-b/c" on every platform.
    yield from sorted(found, key=lambda s: Path(s.name).parts)


def user_sources(
    paths: Iterable[str | os.PathLike], skipped: Skipped | None = None
) -> list[Source]:
    """The files of ``paths`` in the order given, each folder's entries sorted; a file reached
    twice is kept once. A missing path, or one that is neither a folder nor a regular file (a
    named pipe), is an error that names it; ``skipped`` counts folders that cannot be listed."""
    sources: list[Source] = []
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        try:
            kind = kind_of(os.stat(path).st_mode)
        except FileNotFoundError:
            raise ValueError(
                f"{given}: no such file or folder: give a text file or a folder"
            ) from None
        except OSError as error:
            raise ValueError(f"cannot look at {given}: {error.strerror}") from None
        if kind == "folder":
            found = [
                Source(s.path, f"{path.as_posix()}/{s.name}")
                for s in _walk(path, None, frozenset(), skipped)
            ]
        elif kind is None:
            found = [Source(path, str(given), named=True)]
        else:
            raise ValueError(
                f"{given} is {WHAT[kind]}, not a file: give text files, a token file or folders"
            )
        for source in found:
            key = source.path.resolve()
            if key not in seen:
                seen.add(key)
                sources.append(source)
    return sources


def stdlib_folder() -> Path:
    """The standard library of the Python running cutpipe (outside any virtual environment)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(folder: Path | None = None) -> list[Source]:
    """The standard library's ``*.py`` files in sorted order, without ``STDLIB_SKIPPED``."""
    root = stdlib_folder() if folder is None else folder
    if not root.is_dir():
        raise ValueError(
            f"the Python standard library is not at {root}: give the corpus with --data PATH"
        )
    return list(_walk(root, ".py", STDLIB_SKIPPED))


def _nothing(count: int) -> None:
    """Progress reported to no one."""


def source_documents(
    source: Source, skipped: Skipped, text_field: str = "text", advance: Advance = _nothing
) -> Iterator[bytes]:
    """The documents of one file (``documents``): a text file's whole text, or each record of a
    ``.jsonl`` or ``.parquet`` file; ``advance`` is told the file's bytes as they are read."""
    kind = record_kind(source.path)
    if kind is None:
        content = read_text(source.path, source.name, source.named, skipped)
        if content:
            advance(len(content))
            yield content
        return
    file = open_regular(source.path, source.name, source.named, skipped)
    if file is None:
        return
    with file:
        if kind == "jsonl":
            yield from jsonl_documents(file, source.name, text_field, advance)
        else:
            size = os.fstat(file.fileno()).st_size
            yield from parquet_documents(file, source.name, text_field, advance, size)


def _check_cap(max_bytes: int | None) -> None:
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"the size cap must be at least 1 byte, got {max_bytes}")


def corpus_documents(
    sources: Iterable[Source],
    max_bytes: int | None = None,
    skipped: Skipped | None = None,
    text_field: str = "text",
    advance: Advance = _nothing,
) -> Iterator[tuple[Source, bytes]]:
    """Every document of ``sources`` in order with its file, the last one cut where the
    documents reach ``max_bytes`` in all (``corpus_chunks`` for what is skipped or refused)."""
    _check_cap(max_bytes)
    skipped = Skipped() if skipped is None else skipped
    left = max_bytes
    for source in sources:
        for document in source_documents(source, skipped, text_field, advance):
            if left is not None:
                if left <= 0:
                    return
                document = document[:left]
                left -= len(document)
            yield source, document


def corpus_chunks(
    sources: Iterable[Source],
    max_bytes: int | None = None,
    skipped: Skipped | None = None,
    text_field: str = "text",
    advance: Advance = _nothing,
) -> Iterator[tuple[Source, bytes]]:
    """The corpus's bytes: each document (a text file, or a record of a ``.jsonl`` or
    ``.parquet`` file), ``SEPARATOR`` between two, cut after ``max_bytes``.

    Yields each document with its file and piece (separator first, but for the first
    document), so a corpus larger than memory can be written as it is read. A file that is not a
    readable regular text file is skipped and counted in ``skipped``, unless the user named it
    (an error then).
    """
    _check_cap(max_bytes)
    left = max_bytes
    first = True
    for source, document in corpus_documents(sources, None, skipped, text_field, advance):
        if left is not None and left <= 0:
            return
        piece = document if first else SEPARATOR + document
        first = False
        if left is not None:
            piece = piece[:left]
            left -= len(piece)
        yield source, piece
