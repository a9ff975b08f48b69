"""One rank's memory at its peak, by what holds it: what ``recommend`` prints for its winner.

Parameters, gradients and optimizer state follow ``Training`` (bf16 weights and gradients, fp32
Adam master weights and moments, each sharded over the data-parallel ranks from its ZeRO stage
on); activations are the simulated peak of the schedule; buffers are the communication buffers
that live through the step: a send and a receive buffer for each pipeline direction, the
dispatch and combine buffers of one MoE layer's all-to-all, and tensor parallelism's gathered
input of one matmul.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cutpipe.plan.costs.model import Training, boundary_bytes
from cutpipe.spec import ModelSpec


@dataclass(frozen=True)
class Footprint:
    """Bytes on one rank at its peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def rows(self) -> list[tuple[str, float]]:
        """(what, bytes), in the order people read a memory budget."""
        return [(name, value) for name, value in asdict(self).items()] + [("total", self.total)]

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def footprint(
    parameters: float, activations: float, training: Training, buffers: float = 0.0,
    experts: float = 0.0, ep: int = 1,
) -> Footprint:  # fmt: skip
    """The footprint of a rank storing ``parameters`` (all copies it holds; ``experts`` of them
    routed experts, which ZeRO shards over the DP/EP ranks that replicate them) whose
    activations peak at ``activations`` bytes."""
    dense = parameters - experts

    def sharded(per_parameter: float, stage: int) -> float:
        if training.zero < stage:
            return per_parameter * parameters
        return per_parameter * (dense / training.sharding_ranks + experts / training.replicas(ep))

    return Footprint(
        parameters=sharded(2, 3),
        gradients=sharded(2, 2),
        optimizer=sharded(12, 1),
        activations=activations,
        buffers=buffers,
    )


def buffer_bytes(model: ModelSpec, training: Training, pp: int, ep: int) -> float:
    """Communication buffers that live through a step on one rank (see the module)."""
    pipeline = 4 * boundary_bytes(model, training) if pp > 1 else 0.0
    alltoall = 0.0
    if model.moe and ep > 1:
        alltoall = 2 * model.top_k * model.tokens * model.hidden * model.element_bytes
    gathered = model.tokens * model.hidden * model.element_bytes if training.tp > 1 else 0.0
    return pipeline + alltoall + gathered
