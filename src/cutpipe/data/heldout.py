"""Validation batches: the same windows, in the same order, at every evaluation.

A validation set is cut into windows as the training loader cuts its tokens (``seq_len + 1``
tokens starting every ``seq_len``), but they are read in order, with no permutation: global batch
``i`` is windows ``i * batch`` to ``(i + 1) * batch - 1``. Every evaluation reads the first
``steps`` batches from the start, so evaluations at different steps see the same tokens and
their losses can be compared; the windows after them are never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from cutpipe.data.loader import check_windows, windows_of
from cutpipe.data.tokens import Tokens

if TYPE_CHECKING:
    import torch

#: Global batches an evaluation reads when none are asked for (fewer if the set is smaller).
DEFAULT_STEPS = 8


def evaluation_batches(
    tokens: int, seq_len: int, batch: int, steps: int | None, source: str
) -> int:
    """How many global batches of ``batch`` windows an evaluation of ``tokens`` tokens reads:
    ``steps``, or (None) every whole batch up to ``DEFAULT_STEPS``. A one-line ValueError naming
    ``source`` and the numbers when the set holds fewer."""
    windows = windows_of(tokens, seq_len)
    whole = windows // batch
    if steps is None:
        check_windows(tokens, seq_len, source, batch)  # at least one global batch
        return min(DEFAULT_STEPS, whole)
    if whole < steps:
        raise ValueError(
            f"{source} holds {windows:,} windows of {seq_len + 1} tokens, {whole} global "
            f"batch{'es' if whole != 1 else ''} of {batch}, fewer than --eval-steps {steps}: give "
            "fewer --eval-steps, a smaller batch or more validation data"
        )
    return steps


class HeldOutBatches:
    """The ``(inputs, targets)`` global batches of one evaluation, the same every time it is
    iterated (module docstring)."""

    def __init__(self, tokens: Tokens, seq_len: int, batch: int, steps: int | None = None) -> None:
        self.tokens, self.seq_len, self.batch = tokens, seq_len, batch
        self.steps = evaluation_batches(len(tokens), seq_len, batch, steps, tokens.source)

    @property
    def windows(self) -> int:
        """Windows one evaluation reads."""
        return self.steps * self.batch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        import torch

        offsets = torch.arange(self.seq_len + 1)
        for index in range(self.steps):
            first = index * self.batch
            starts = torch.arange(first, first + self.batch) * self.seq_len
            rows = self.tokens.values[starts[:, None] + offsets].long()
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
