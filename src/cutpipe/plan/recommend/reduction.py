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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cutpipe.schedule.placement import Placement
from cutpipe.sim.metrics import Metrics


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


def rank_tails(
    result: Metrics, placement: Placement, measure: str, start: str,
    reduction: Callable[[Sequence[int]], float], optimizer: Callable[[int], float],
) -> list[Tail]:  # fmt: skip
    """Each rank's reductions and optimizer step after its pipeline (``reduction``): each
    stage's reduction from when it is done (``start`` "stage"), or the rank's in one collective
    after its last op ("rank"). ``reduction(stages)`` prices one collective over the stages'
    gradients, ``optimizer(rank)`` the rank's optimizer step."""
    # an extrapolated makespan may lie past every rank's last op (it is never below the
    # busiest rank's busy time), and a rank's last op never ends before its busy time: the
    # finishes move with them
    late = result.makespan - max(max(done) for done in result.done_per_rank)
    tails = []
    for index, done in enumerate(result.done_per_rank):
        held = placement.stages_of(index)
        late_here = max(late, result.busy_per_rank[index] - max(done))
        done = [t + late_here for t in done]
        if start == "rank":
            reduced = max(done) + reduction(held)
        else:
            reduced = reductions_end(done, [reduction((stage,)) for stage in held])
        after = result.makespan if measure == "makespan" else max(done)
        tails.append(Tail(after, reduced, optimizer(index), reduction(held)))
    return tails
