"""Many trial splits of one schedule weighed at once, to skip the moves that cannot help.

``rank_balanced_sizes`` tries moving one item between two stages, S x (S-1) moves per pass,
and keeps the first whose score (memory over the cap, the stages' work largest first, the
busiest rank's work, the sum of squares of the ranks' work) is below the best so far. Scoring
every move in Python costs O(S) each, which at a hundred stages is most of ``recommend``'s time.
Here a batch of moves is weighed with numpy and only those that may beat the best are scored
exactly by the caller, so the search takes the same steps and ends on the same split:

- the stages' and ranks' work are the same sums as the exact score's, in the same order, so
  the busiest rank's work is bit-identical and compared exactly;
- the stages' work, sorted, is compared before the exact score's rounding to 12 digits, and a
  move is skipped only where that rounding cannot change the outcome;
- memory and the sum of squares are summed in another order, so a move is skipped for them
  only when it is worse by far more than any rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Stage work, as a share of the whole, that the exact score's rounding to 12 digits cannot
#: turn around: two shares further apart than this round apart, in the same order.
ROUNDING = 1e-11
#: Relative error allowed between numpy's sums of squares of the ranks' work and the exact ones.
SQUARES_TOLERANCE = 1e-10
#: Relative error allowed between numpy's memory sums and the exact ones.
MEMORY_TOLERANCE = 1e-9


class Screen:
    """Weighs moves of one schedule's split (``runs``: (stage, rank) pairs, in the exact
    score's order) for items with work ``prefix`` (running sums, from 0); with ``live``
    (``cutpipe.sim.memory.live_profile``) and the items' running activation and state bytes,
    also their memory against ``capacity``."""

    def __init__(
        self, runs: Sequence[tuple[int, int]], ranks: int, prefix: Sequence[float],
        by_chunk: bool, memory: tuple | None = None, capacity: float | None = None,
    ) -> None:  # fmt: skip
        self.runs, self.ranks, self.by_chunk = list(runs), ranks, by_chunk
        self.prefix = np.asarray(prefix, dtype=float)
        self.scale = float(self.prefix[-1]) or 1.0
        self.capacity = capacity
        if memory is not None:
            live, held, stored = memory
            self.held = np.asarray(held, dtype=float)
            self.stored = np.asarray(stored, dtype=float)
            self.live = [
                (np.asarray(stages, dtype=np.intp), np.asarray(frontier, dtype=float))
                for stages, frontier in live
            ]

    def trials(self, sizes: Sequence[int], moves: Sequence[tuple[int, int]]) -> np.ndarray:
        """One row of stage sizes per (giver, taker) move; rows whose giver has one item are
        left out by the caller (``givable``)."""
        giver, taker = np.asarray(moves, dtype=np.intp).T
        rows = np.tile(np.asarray(sizes, dtype=np.intp), (len(moves), 1))
        index = np.arange(len(moves))
        rows[index, giver] -= 1
        rows[index, taker] += 1
        return rows

    @staticmethod
    def givable(sizes: Sequence[int], moves: Sequence[tuple[int, int]]) -> np.ndarray:
        giver = np.asarray(moves, dtype=np.intp)[:, 0]
        return np.asarray(sizes, dtype=np.intp)[giver] > 1

    def _bounds(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ends = np.cumsum(rows, axis=1)
        return ends - rows, ends

    def stage_work(self, rows: np.ndarray) -> np.ndarray:
        starts, ends = self._bounds(rows)
        return self.prefix[ends] - self.prefix[starts]

    def rank_work(self, per_stage: np.ndarray) -> np.ndarray:
        ranks = np.zeros((per_stage.shape[0], self.ranks))
        for stage, rank in self.runs:  # the exact score's order of additions
            ranks[:, rank] += per_stage[:, stage]
        return ranks

    def memory(self, rows: np.ndarray) -> np.ndarray:
        """Each row's memory per rank, to within ``MEMORY_TOLERANCE``."""
        starts, ends = self._bounds(rows)
        activation = self.held[ends] - self.held[starts]
        state = self.stored[ends] - self.stored[starts]
        out = np.empty((rows.shape[0], len(self.live)))
        for rank, (stages, frontier) in enumerate(self.live):
            peaks = activation[:, stages] @ frontier.T
            out[:, rank] = np.maximum(peaks.max(axis=1), 0.0) + state[:, stages].sum(axis=1)
        return out

    def slack(self, values: np.ndarray) -> float:
        return MEMORY_TOLERANCE * max(1.0, float(np.abs(values).max(initial=0.0)))

    def maybe_better(
        self, sizes: Sequence[int], moves: Sequence[tuple[int, int]], best: tuple
    ) -> list[int]:
        """The indices of ``moves`` (in order) whose exact score may be below ``best``, the
        exact score of ``sizes``; every other move's is not."""
        rows = self.trials(sizes, moves)
        possible = self.givable(sizes, moves)
        per_stage = self.stage_work(rows)
        ranks = self.rank_work(per_stage)
        busiest = ranks.max(axis=1)
        over, _, most, squares = best
        same = np.ones(len(moves), dtype=bool)  # the components so far surely equal best's
        worse = np.zeros(len(moves), dtype=bool)  # surely above best's
        if self.capacity is not None and over == 0:  # over 0 stays 0 well under the cap
            peak = self.memory(rows).max(axis=1)
            slack = self.slack(peak)
            worse |= peak > self.capacity + slack
            same &= peak < self.capacity - slack
        elif self.capacity is not None:
            same[:] = False  # no screening on the memory: every move scored exactly
        if self.by_chunk:
            shares = -np.sort(-(per_stage / self.scale), axis=1)  # largest first
            current = -np.sort(-(self.stage_work(np.asarray([sizes])) / self.scale))
            diff = shares - current
            width = diff.shape[1]
            below = np.where((diff < 0).any(axis=1), (diff < 0).argmax(axis=1), width)
            above = np.where((diff > ROUNDING).any(axis=1), (diff > ROUNDING).argmax(axis=1), width)
            # up to the first share that rounds above best's, none fell below: surely worse
            worse |= same & (above < below)
            same &= (diff == 0).all(axis=1)
        worse |= same & (busiest > most)
        # the sum of squares in another order: surely above only by more than its rounding
        same &= busiest == most
        worse |= same & ((ranks * ranks).sum(axis=1) > squares * (1 + SQUARES_TOLERANCE))
        return np.flatnonzero(possible & ~worse).tolist()

    def least_peaks(self, rows: np.ndarray) -> list[int]:
        """The rows (in order) whose largest rank memory may be the least of all rows."""
        peak = self.memory(rows).max(axis=1)
        return np.flatnonzero(peak <= peak.min() + 2 * self.slack(peak)).tolist()
