"""Where a training step's time goes outside the pipeline's own schedule.

The schedule accounts for the pipeline step (its ops and bubble); everything else a step does
(reading the batch, averaging the loss, gathering the measured timeline, the gradient norm's
collective, the optimizer, routing statistics) adds to every step. ``StepParts`` times those
parts so the log says how much each costs (``outside_ms`` in each record) and a benchmark can
tell bubble from imbalance from overhead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

#: the part that is the schedule's, not outside it
PIPELINE = "pipeline"


class StepParts:
    """Milliseconds spent in each named part of one step."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the time the block takes to ``part``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, (time.perf_counter() - start) * 1e3)

    def add(self, part: str, ms: float) -> None:
        self.ms[part] = self.ms.get(part, 0.0) + ms

    def outside(self) -> dict[str, float]:
        """Every part but the pipeline's, rounded to microseconds."""
        return {part: round(ms, 3) for part, ms in self.ms.items() if part != PIPELINE}

    @property
    def pipeline_ms(self) -> float | None:
        return None if PIPELINE not in self.ms else round(self.ms[PIPELINE], 3)
