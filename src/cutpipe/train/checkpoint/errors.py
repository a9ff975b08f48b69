"""The errors a checkpoint raises, and how one rank's error reaches the others.

A save or a load is collective, so an error must stop every rank alike: a rank that raised alone
would leave the others waiting in their next collective forever. A rank that catches an error
sends it on as a ``Failure``, and every rank raises from the records it gathered.
"""

from __future__ import annotations

from dataclasses import dataclass


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or completed; every rank raises the same message."""


@dataclass(frozen=True)
class Failure:
    """An exception one rank caught, as a value the other ranks can receive.

    Ranks gather this record rather than the exception: an exception whose class takes other
    arguments than its message may fail to unpickle, and a traceback never travels. Every rank
    then raises an exception built from the same record, so all report the same message."""

    kind: str  # the exception's class name, e.g. "NotADirectoryError"
    message: str

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        return cls(type(error).__name__, str(error))

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    def exception(self, *known: type[Exception], otherwise: type[Exception]) -> Exception:
        """The exception to raise for it on any rank, with the message the rank caught: of the
        class among ``known`` whose name is ``kind``, else of the class ``otherwise``."""
        for exception_class in known:
            if exception_class.__name__ == self.kind:
                return exception_class(self.message)
        return otherwise(self.message)


def one_line(error: BaseException, most: int = 300) -> str:
    """``error`` as one line: its class and message, whitespace collapsed, cut at ``most``."""
    text = " ".join(str(error).split())
    line = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return line if len(line) <= most else line[: most - 3] + "..."


def by_ranks(texts: dict[int, str]) -> str:
    """What each rank said, once per distinct message: ``"rank 1: X; ranks 0, 2: Y"``, or just
    ``"X"`` when every rank said the same."""
    if len(set(texts.values())) == 1:
        return next(iter(texts.values()))
    said: dict[str, list[int]] = {}
    for rank, text in sorted(texts.items()):
        said.setdefault(text, []).append(rank)
    parts = []
    for text, ranks in said.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {text}")
    return "; ".join(parts)


def cause(error: BaseException) -> str:
    """One line for what went wrong. DCP raises a ``CheckpointException`` (a ``BaseException``)
    whose text holds every failed rank's traceback: it is unwrapped to each rank's exception."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        texts = {}
        for rank, failure in failures.items():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            texts[rank] = one_line(inner) if isinstance(inner, BaseException) else str(inner)
        return by_ranks(texts)
    return one_line(error)
