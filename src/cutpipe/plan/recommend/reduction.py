"""When a pipeline rank's gradient reductions end, and how much of them the step waits for.

A stage's weight gradients are complete once its last op of the step has run (its last W, full
backward or overlapped pair). cutpipe's runtime starts that stage's data-parallel reduction
then, without waiting for the rest of the step (docs/runtime.md, "Data parallelism"), as
PyTorch's DDP and Megatron-LM's overlapped gradient reduction start each bucket once its
gradients are ready. On a rank that stores several stages (interleaved chunks, a V, DualPipe's
two directions) the first stages to finish are reduced while its last ones still compute, and
on every rank that finishes before the makespan the reduction runs in the others' cool-down.
What is left after the rank's last op is exposed, and so is the optimizer step after it.

Megatron-LM's non-overlapped ("local") DDP reduces a rank's gradients in one collective after
its last backward: ``Job.reduction_start = "rank"`` prices that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def reductions_end(done: Sequence[float], durations: Sequence[float]) -> float:
    """When the last of a rank's reductions ends: each starts once its stage is ``done`` and
    the one before it has ended (the rank's collectives run one at a time, in the order the
    stages finish)."""
    if len(done) != len(durations):
        raise ValueError(f"{len(done)} stage finishes for {len(durations)} reductions")
    end = 0.0
    for ready, duration in sorted(zip(done, durations, strict=True)):
        end = max(end, ready) + duration
    return end


@dataclass(frozen=True)
class Tail:
    """One rank's step after its pipeline: the gradient reduction and the optimizer step.

    ``after`` is when the step would end without them (the makespan when steps synchronise, the
    rank's last op when they overlap), ``reduced`` when its reductions end, ``optimizer`` its
    optimizer step's time and ``reduction`` the reductions' summed time (hidden or not)."""

    after: float
    reduced: float
    optimizer: float
    reduction: float

    @property
    def exposed_reduction(self) -> float:
        """The reductions' time past ``after``: the part the step waits for."""
        return max(0.0, self.reduced - self.after)

    @property
    def exposed_optimizer(self) -> float:
        """The optimizer step's time past ``after`` (it starts once the reductions end)."""
        return max(0.0, self.reduced + self.optimizer - max(self.after, self.reduced))

    @property
    def exposed(self) -> float:
        return self.exposed_reduction + self.exposed_optimizer
