"""Output files: checked before the work that fills them, and written whole or not at all.

Every file cutpipe writes goes to a temporary file beside its target, is flushed to disk, and
is then renamed over the target (``os.replace``), so a crash, a full disk or Ctrl-C in the middle
leaves the previous file (or none), never a truncated one. ``check_output`` lets a command
refuse a path it cannot write before a long search or training run instead of after it.

No imports from the rest of cutpipe: anything may use this module.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


def check_output(path: str | os.PathLike, endings: Iterable[str] | None = None) -> Path:
    """``path`` as a Path if a file can be written there; else a ValueError saying why.

    Checks that the folder exists and is writable, that the path is not a folder, and, when
    ``endings`` is given (".png", ".json", ...), that the file name ends in one of them.
    """
    target = Path(path)
    if not str(path).strip():
        raise ValueError("the output file name is empty: give a file name")
    if endings is not None:
        endings = tuple(endings)
        if target.suffix.lower() not in endings:
            got = f"the ending {target.suffix!r}" if target.suffix else "a file without an ending"
            raise ValueError(f"cannot write {got} ({target}): use one of {', '.join(endings)}")
    if target.is_dir():
        raise ValueError(f"{target} is a folder: give a file name inside it")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(
            f"cannot write {target}: the folder {folder} does not exist; create it first"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {target}: the folder {folder} is not writable")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"cannot write {target}: the file exists and is read-only")
    return target


def _create_beside(target: Path) -> Path:
    """A new empty file in ``target``'s folder, created with the process's usual permissions.

    It keeps ``target``'s ending, so writers that pick a format by the ending (matplotlib) still
    do. ``os.open`` with mode 0o666 lets the umask apply, as an ordinary ``open`` would.
    """
    while True:
        candidate = target.with_name(
            f".{target.stem}.{secrets.token_hex(4)}.partial{target.suffix}"
        )
        try:
            os.close(os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return candidate


def flush_to_disk(path: Path) -> None:
    """Flush a file's contents, or a folder's entries (a rename, a new file), to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write; it replaces ``path`` when the block ends without an error.

    On an error (or Ctrl-C) the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    if target.is_symlink():  # write where the link points, keep the link
        target = target.resolve()
    temporary = _create_beside(target)
    try:
        yield temporary
        flush_to_disk(temporary)
        os.replace(temporary, target)
    except BaseException:
        with suppress(OSError):
            temporary.unlink()
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")


def write_with(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Let ``write(temporary_path)`` produce the file, then put it at ``path`` atomically."""
    with replacing(path) as temporary:
        write(temporary)
