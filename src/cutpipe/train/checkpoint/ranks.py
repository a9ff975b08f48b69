"""The process group a checkpoint is saved or loaded over, or none at all.

A save or a load is collective: every rank of the group takes part, and the ranks swap a few small
values (what each holds, what went wrong) so that they all decide alike. The same code runs in a
single process without a group, where DCP must be told so.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """This process's place in the checkpoint's process group (or alone, without one)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Ranks:
        if group is None:
            return cls(None, 0, 1)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a small pickled object each)."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.group)
        return values


def default_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or the whole world when there is one and no group was given."""
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


@contextmanager
def alone_quietly(alone: bool) -> Iterator[None]:
    """DCP warns that it assumes a single process whenever it runs without a process group; here
    that is the intent, so the warning is dropped (in this thread's calls only)."""
    if not alone:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
