"""Many trial splits of one schedule weighed at once, to skip the moves that cannot help.

``rank_balanced_sizes`` tries moving one item between two stages, S x (S-1) moves per pass,
and keeps the first whose score (memory over the cap, the stages' work largest first, the
busiest rank's work, the sum of squares of the ranks' work) is below the best so far. Scoring
every move in Python costs O(S) each, which at a hundred stages is most of ``recommend``'s time.
Here a batch of moves is weighed with numpy and only those that may beat the best are scored
exactly by the caller, so the search takes the same steps and ends on the same split:

- the stages' and ranks' work are the same sums as the exact score's, in the same order, so
  the busiest rank's work is bit-identical and compared exactly;
- the stages' work as a share of the whole is rounded to 12 digits by Python's ``round``, as
  the exact score rounds it (a table of every run of items, built once), and compared exactly;
- memory and the sum of squares are summed in another order, so a move is skipped for them
  only when it is worse by far more than any rounding.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

#: Relative error allowed between numpy's sums of squares of the ranks' work and the exact ones.
SQUARES_TOLERANCE = 1e-10
#: Relative error allowed between numpy's memory sums and the exact ones.
MEMORY_TOLERANCE = 1e-9


class Screen:
    """Weighs moves of one schedule's split (``runs``: (stage, rank) pairs, in the exact
    score's order) for items with work ``prefix`` (running sums, from 0) of which a stage's
    share is taken of ``scale``, as the exact score takes it; with ``live``
    (``cutpipe.sim.memory.live_profile``) and the items' running activation and state bytes,
    also their memory against ``capacity``."""

    def __init__(
        self, runs: Sequence[tuple[int, int]], ranks: int, prefix: Sequence[float],
        scale: float, by_chunk: bool, memory: tuple | None = None,
        capacity: float | None = None,
    ) -> None:  # fmt: skip
        self.runs, self.ranks, self.by_chunk = list(runs), ranks, by_chunk
        self.exact = replays_python_sum()
        self.prefix = np.asarray(prefix, dtype=float)
        self.scale = scale
        self._rounded: np.ndarray | None = None
        self.capacity = capacity
        if memory is not None:
            live, held, stored = memory
            self.held = np.asarray(held, dtype=float)
            self.stored = np.asarray(stored, dtype=float)
            self.live = [
                (np.asarray(stages, dtype=np.intp), np.asarray(frontier, dtype=float))
                for stages, frontier in live
            ]

    def trials(self, sizes: Sequence[int], moves: np.ndarray) -> np.ndarray:
        """One row of stage sizes per (giver, taker) row of ``moves``; rows whose giver has
        one item are left out by the caller (``givable``)."""
        rows = np.tile(np.asarray(sizes, dtype=np.intp), (len(moves), 1))
        index = np.arange(len(moves))
        rows[index, moves[:, 0]] -= 1
        rows[index, moves[:, 1]] += 1
        return rows

    @staticmethod
    def givable(sizes: Sequence[int], moves: np.ndarray) -> np.ndarray:
        return np.asarray(sizes, dtype=np.intp)[moves[:, 0]] > 1

    def _bounds(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ends = np.cumsum(rows, axis=1)
        return ends - rows, ends

    def rank_work(self, per_stage: np.ndarray) -> np.ndarray:
        ranks = np.zeros((per_stage.shape[0], self.ranks))
        for stage, rank in self.runs:  # the exact score's order of additions
            ranks[:, rank] += per_stage[:, stage]
        return ranks

    def memory(self, rows: np.ndarray) -> np.ndarray:
        """Each row's memory per rank: bit-identical to ``rank_balanced_sizes``'s where
        ``exact`` (Python's sums replayed), else to within ``MEMORY_TOLERANCE``."""
        starts, ends = self._bounds(rows)
        activation = self.held[ends] - self.held[starts]
        state = self.stored[ends] - self.stored[starts]
        out = np.empty((rows.shape[0], len(self.live)))
        for rank, (stages, frontier) in enumerate(self.live):
            if self.exact:
                held = activation[:, stages]
                points = [python_sum(held * point) for point in frontier]
                peak = np.maximum(np.max(points, axis=0), 0.0)
                out[:, rank] = peak + python_sum(state[:, stages])
            else:
                peak = np.maximum((activation[:, stages] @ frontier.T).max(axis=1), 0.0)
                out[:, rank] = peak + state[:, stages].sum(axis=1)
        return out

    def slack(self, values: np.ndarray) -> float:
        if self.exact:
            return 0.0
        return MEMORY_TOLERANCE * max(1.0, float(np.abs(values).max(initial=0.0)))

    def maybe_better(self, sizes: Sequence[int], moves: np.ndarray, best: tuple) -> list[int]:
        """The indices of ``moves`` (in order) whose exact score may be below ``best``, the
        exact score of ``sizes``; every other move's is not."""
        rows = self.trials(sizes, moves)
        starts, ends = self._bounds(rows)
        ranks = self.rank_work(self.prefix[ends] - self.prefix[starts])
        busiest = ranks.max(axis=1)
        over, order, most, squares = best
        tied = np.ones(len(moves), dtype=bool)  # every component so far surely equals best's
        maybe = np.zeros(len(moves), dtype=bool)  # surely or possibly below best
        if self.capacity is not None and over == 0:  # over 0 stays 0 under the cap
            peak = self.memory(rows).max(axis=1)
            slack = self.slack(peak)
            if slack:
                maybe |= np.abs(peak - self.capacity) <= slack
                tied &= peak < self.capacity - slack
            else:
                tied &= peak <= self.capacity
        elif self.capacity is not None:  # no screening on the memory: every move scored
            maybe[:], tied[:] = True, False
        if self.by_chunk:  # the exact score's rounded shares, largest first, compared exactly
            shares = -np.sort(-self.rounded_shares()[starts, ends], axis=1)
            diff = shares - np.asarray(order)
            differs = diff != 0
            first = np.where(differs.any(axis=1), differs.argmax(axis=1), 0)
            sign = np.where(differs.any(axis=1), diff[np.arange(len(moves)), first], 0.0)
            maybe |= tied & (sign < 0)
            tied &= sign == 0
        maybe |= tied & (busiest < most)
        tied &= busiest == most
        if self.exact:  # Python's sum, replayed: compared exactly
            maybe |= tied & (python_sum(ranks * ranks) < squares)
        else:  # surely above only by more than the rounding of numpy's sum
            maybe |= tied & ((ranks * ranks).sum(axis=1) <= squares * (1 + SQUARES_TOLERANCE))
        return np.flatnonzero(self.givable(sizes, moves) & maybe).tolist()

    def rounded_shares(self) -> np.ndarray:
        """``round(work / scale, 12)`` of items ``a`` to ``b`` at ``[a, b]``, as the exact score
        rounds it (Python's ``round``, not numpy's), for every run of items: built once."""
        if self._rounded is None:
            prefix, count = self.prefix.tolist(), len(self.prefix)
            table = np.zeros((count, count))
            for a in range(count):
                table[a, a + 1 :] = [round((prefix[b] - prefix[a]) / self.scale, 12)
                                     for b in range(a + 1, count)]  # fmt: skip
            self._rounded = table
        return self._rounded

    def least_peaks(self, rows: np.ndarray) -> list[int]:
        """The rows (in order) whose largest rank memory may be the least of all rows (the
        least's alone where ``exact``)."""
        peak = self.memory(rows).max(axis=1)
        slack = self.slack(peak)
        if not slack:
            return [int(np.argmin(peak))]  # the first of the least, as a scan in order finds
        return np.flatnonzero(peak <= peak.min() + 2 * slack).tolist()


def python_sum(rows: np.ndarray) -> np.ndarray:
    """Per row, ``sum(row)`` as Python adds floats: in order, and from 3.12 on with Neumaier's
    compensation (``builtin_sum`` in CPython), so each row's result is bit-identical."""
    total = rows[:, 0].copy()
    if sys.version_info < (3, 12):
        for column in rows.T[1:]:
            total += column
        return total
    compensation = np.zeros_like(total)
    for column in rows.T[1:]:
        step = total + column
        compensation += np.where(
            np.abs(total) >= np.abs(column), (total - step) + column, (column - step) + total
        )
        total = step
    finite = np.isfinite(compensation) & (compensation != 0)
    return np.where(finite, total + compensation, total)


def replays_python_sum() -> bool:
    """Whether ``python_sum`` matches this Python's ``sum`` on sums that round differently
    in different orders (otherwise the screen falls back to a tolerance)."""
    probe = np.random.default_rng(0).uniform(0.0, 1e3, size=(64, 37)) ** 2
    expected = [sum(row) for row in probe.tolist()]
    return python_sum(probe).tolist() == expected
