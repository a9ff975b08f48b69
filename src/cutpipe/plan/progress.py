"""A progress bar that appears only when a search takes longer than a second."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class _Ticker:
    def __init__(self, description: str, total: int | None, delay: float) -> None:
        self._description, self._total, self._delay = description, total, delay
        self._started = time.monotonic()
        self._done = 0
        self._progress = None
        self._task = None

    def __call__(self, advance: int = 1, status: str = "") -> None:
        self._done += advance
        if (
            self._progress is None
            and time.monotonic() - self._started > self._delay
            and sys.stderr.isatty()
        ):
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"),
                                      TimeElapsedColumn(), transient=True)  # fmt: skip
            self._progress.start()
            self._task = self._progress.add_task(
                self._description, total=self._total, completed=self._done, status=""
            )
        if self._progress is not None:
            self._progress.update(self._task, completed=self._done, status=status)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


@contextmanager
def progress(description: str, total: int | None = None, delay: float = 1.0) -> Iterator[_Ticker]:
    """Yield ``tick(advance=1, status="")``; a bar shows on a terminal after ``delay`` seconds."""
    ticker = _Ticker(description, total, delay)
    try:
        yield ticker
    finally:
        ticker.close()
