"""What a path in a corpus is, and reading a text file without ever hanging on it.

A folder may hold entries that are not files: named pipes (FIFOs), sockets, devices. Opening a
pipe for reading waits for a writer, maybe forever, and reading ``/dev/zero`` never ends, so an
entry is looked at with ``os.stat`` first and only a regular file is opened (without blocking,
and checked again once open, in case the entry was swapped in between). A regular file is binary
when its first block holds a NUL byte, so a huge sparse file is recognised after one block.

Inside a folder what is left out is counted by reason (``Skipped``), so a command can report it
in one line; a path the user named that is not a readable text file is an error that names it.
No imports from the rest of cutpipe and no torch.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

#: Bytes read to tell a binary file (a NUL byte among them) before reading the rest.
FIRST_BLOCK = 64 * 2**10
#: What an entry that is not a regular file is, by its kind (``kind_of``).
WHAT = {
    "folder": "a folder",
    "pipe": "a named pipe (FIFO)",
    "socket": "a socket",
    "device": "a device",
    "special": "not a regular file",
}
#: Why an entry was skipped -> (singular, plural), in the order reports list them.
REASONS = {
    "binary": ("binary file", "binary files"),
    "pipe": ("named pipe", "named pipes"),
    "socket": ("socket", "sockets"),
    "device": ("device", "devices"),
    "special": ("special file", "special files"),
    "unreadable": ("unreadable file", "unreadable files"),
    "unreadable folder": ("unreadable folder", "unreadable folders"),
}
_NUL = b"\0"
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)


def kind_of(mode: int) -> str | None:
    """None for a regular file; else which kind of entry ``mode`` (an ``st_mode``) is."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special"


def describe(path: str | os.PathLike) -> str:
    """What ``path`` is, for a message that refuses it: "is a folder", "does not exist", ..."""
    try:
        kind = kind_of(os.stat(path).st_mode)
    except FileNotFoundError:
        return "does not exist"
    except OSError as error:
        return f"cannot be looked at ({error.strerror})"
    return "is a regular file" if kind is None else f"is {WHAT[kind]}"


@dataclass
class Skipped:
    """The entries one walk of a corpus left out, counted by reason (a key of ``REASONS``)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        """The counts in ``REASONS``' order, for JSON."""
        return {reason: self.counts[reason] for reason in REASONS if reason in self.counts}

    def __str__(self) -> str:
        """``2 binary files, 1 named pipe``; ``nothing`` when nothing was skipped."""
        parts = [
            f"{count:,} {REASONS[reason][count != 1]}"
            for reason in REASONS
            if (count := self.counts.get(reason, 0))
        ]
        return ", ".join(parts) or "nothing"


def open_regular(path: Path, name: str, named: bool, skipped: Skipped) -> BinaryIO | None:
    """``path`` opened for reading if it is a readable regular file (looked at before it is
    opened, and again once open), else None, counted in ``skipped`` (or, ``named``, an error)."""
    try:
        kind = kind_of(os.stat(path).st_mode)
    except OSError as error:  # a broken link, or removed since the walk
        return _left_out(name, named, skipped, "unreadable", error)
    if kind is not None:
        return _left_out(name, named, skipped, kind)
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except OSError as error:
        return _left_out(name, named, skipped, "unreadable", error)
    file = open(descriptor, "rb")  # noqa: SIM115 - the caller closes it
    try:
        kind = kind_of(os.fstat(descriptor).st_mode)
    except OSError as error:
        file.close()
        return _left_out(name, named, skipped, "unreadable", error)
    if kind is not None:  # swapped for a pipe or a device since the stat above
        file.close()
        return _left_out(name, named, skipped, kind)
    return file


def read_text(path: Path, name: str, named: bool, skipped: Skipped) -> bytes | None:
    """The bytes of the text file at ``path``, or None where it is left out (counted in
    ``skipped``): not a regular file, unreadable, or binary. Where the user ``named`` the file
    itself, leaving it out is a ValueError naming it (``name``) instead."""
    file = open_regular(path, name, named, skipped)
    if file is None:
        return None
    with file:
        try:
            first = file.read(FIRST_BLOCK)
            if _NUL in first:
                return _left_out(name, named, skipped, "binary")
            rest = file.read()
        except OSError as error:
            return _left_out(name, named, skipped, "unreadable", error)
    if _NUL in rest:
        return _left_out(name, named, skipped, "binary")
    return first + rest


def _left_out(
    name: str, named: bool, skipped: Skipped, reason: str, error: OSError | None = None
) -> None:
    """Count ``reason`` in ``skipped``; or, for a file the user named, raise saying why."""
    if not named:
        skipped.add(reason)
        return None
    if reason == "binary":
        raise ValueError(
            f"{name} is not a text file (it holds NUL bytes): give text files, or a folder, "
            "where binary files are skipped"
        )
    if reason == "unreadable":
        why = error.strerror if error is not None and error.strerror else "unreadable"
        raise ValueError(f"cannot read {name}: {why}: make it readable, or leave it out")
    raise ValueError(f"{name} is {WHAT[reason]}, not a file: give text files or folders")
