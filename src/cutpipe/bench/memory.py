"""A rank's memory measured by the trainer, beside the simulator's prediction of it.

Measured: parameters, gradients and Adam's state (``state_bytes``), and the activation peak of the
last step from the trainer's ``SavedMeter`` (every storage autograd saved, and what pending Ws
keep), which records every op too. Predicted:

- state: 16 bytes (an fp32 parameter, its gradient, Adam's two moments) per parameter of the
  stages the rank holds, counted by the planner (``cutpipe.plan.costs.model``), so DualPipe's two
  copies of every stage show as twice Cut-in-half's;
- activations: the simulator's live memory (``cutpipe.sim.memory``) fed what one forward of each
  stage left and the share of it a W kept, as the meter measured them in the same step
  (``stage_bytes``): its peak, and its peak between ops. The simulator counts an overlapped pair
  as its F allocated before its B frees anything; with the hook the halves interleave and the B's
  pieces free as the F's allocate, so the measured peak of a pair is lower (docs/moe.md).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

#: An fp32 parameter, its gradient and Adam's two moments.
STATE_BYTES_PER_PARAMETER = 16


@dataclass(frozen=True)
class MemoryRow:
    """One run on one rank: bytes measured and predicted."""

    run: str
    rank: int
    state: int  # parameters + gradients + optimizer state, measured
    state_predicted: float
    activation: int  # the measured peak
    activation_predicted: float  # the simulator's peak
    between_ops: int  # the measured peak after an op (what the simulator's model counts)
    between_ops_predicted: float

    @property
    def state_ratio(self) -> float:
        return self.state / self.state_predicted if self.state_predicted else float("nan")

    @property
    def activation_ratio(self) -> float:
        return (
            self.activation / self.activation_predicted
            if self.activation_predicted
            else float("nan")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "state_ratio": self.state_ratio,
            "activation_ratio": self.activation_ratio,
        }


def rank_memory(trainer: Any) -> dict[str, Any]:
    """This rank's measured and predicted bytes after the trainer's last step. A collective:
    every rank of the trainer's processes calls it (stages that ran no lone F here take the
    sizes other ranks measured)."""
    import torch.distributed as dist

    from cutpipe.runtime.compute.memory import state_bytes
    from cutpipe.runtime.compute.saved import stage_bytes
    from cutpipe.sim import Costs
    from cutpipe.sim.memory import activation_trace

    schedule, pp_rank = trainer.schedule, trainer.mesh.pp_rank
    ops = list(trainer.meter.ops)
    mine = {stage: (b.activation, b.w_share) for stage, b in stage_bytes(ops).items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    held = schedule.placement.stages_of(pp_rank)
    activation, w_memory = _stage_sizes(mine, every, held, schedule.num_stages)
    trace = activation_trace(schedule, Costs(activation=activation, w_memory=w_memory))[pp_rank]
    measured = {
        **state_bytes(trainer.runner.parameters(), trainer.optimizer),
        "activations": trainer.meter.peak,
    }
    return {
        "measured": measured,
        "between_ops": max((op.after for op in ops), default=0),
        "state_predicted": STATE_BYTES_PER_PARAMETER * _held_parameters(trainer, held),
        "activation_predicted": max((high for high, _ in trace), default=0.0),
        "between_ops_predicted": max((after for _, after in trace), default=0.0),
    }


def _stage_sizes(
    mine: dict[int, tuple[float, float | None]],
    every: list[dict[int, tuple[float, float | None]]],
    held: list[int],
    num_stages: int,
) -> tuple[list[float], float]:
    """Per stage, the bytes a forward leaves (this rank's measure, else the median of the ranks
    that measured it), and the share a W keeps (weighted over this rank's stages)."""
    activation = []
    for stage in range(num_stages):
        if stage in mine:
            activation.append(mine[stage][0])
            continue
        others = [sizes[stage][0] for sizes in every if stage in sizes]
        activation.append(float(statistics.median(others)) if others else 0.0)
    own = [(mine[s][0], mine[s][1]) for s in held if s in mine and mine[s][1] is not None]
    if own and sum(a for a, _ in own):
        share = sum(a * w for a, w in own) / sum(a for a, _ in own)
    else:
        shares = [w for sizes in every for _, w in sizes.values() if w is not None]
        share = float(statistics.median(shares)) if shares else 0.5
    return activation, min(1.0, max(0.0, share))


def _held_parameters(trainer: Any, held: list[int]) -> float:
    """The parameters of the stages this rank holds, as the planner counts the model's blocks
    (experts shared out over the EP group)."""
    from cutpipe.plan.costs.model import gpu, model_items

    items = model_items(trainer.task.spec, gpu("A100"), ep=trainer.options.ep)
    counts, start = [], 0
    for size in trainer.layout.stage_sizes:
        counts.append(sum(item.parameters for item in items[start : start + size]))
        start += size
    return float(sum(counts[stage] for stage in held))


def memory_rows(results: list[dict[str, Any]]) -> list[MemoryRow]:
    """Every run on every rank, from the ranks' results (``bench_rank``)."""
    rows = []
    for name in results[0]["runs"]:
        for rank, result in enumerate(results):
            memory = result["runs"][name]["memory"]
            measured = memory["measured"]
            rows.append(
                MemoryRow(
                    run=name, rank=rank,
                    state=measured["parameters"] + measured["gradients"] + measured["optimizer"],
                    state_predicted=memory["state_predicted"],
                    activation=measured["activations"],
                    activation_predicted=memory["activation_predicted"],
                    between_ops=memory["between_ops"],
                    between_ops_predicted=memory["between_ops_predicted"],
                )
            )  # fmt: skip
    return rows


def render(rows: list[MemoryRow], title: str) -> Any:
    """A rich Table: per run and rank, measured bytes beside predicted."""
    from rich.table import Table

    table = Table(title=title)
    for header in ("run", "rank"):
        table.add_column(header)
    for header in (
        "params + grads + Adam\nmeasured | predicted",
        "activation peak\nmeasured | predicted",
        "ratio",
        "between ops\nmeasured | predicted",
    ):
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(
            row.run, str(row.rank),
            f"{_kb(row.state)} | {_kb(row.state_predicted)}",
            f"{_kb(row.activation)} | {_kb(row.activation_predicted)}",
            f"{row.activation_ratio:.3f}",
            f"{_kb(row.between_ops)} | {_kb(row.between_ops_predicted)}",
        )  # fmt: skip
    return table


def _kb(value: float) -> str:
    return f"{value / 1e3:,.1f} KB"
