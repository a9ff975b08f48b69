"""The Cut-in-half report's MoE experiment at its own scale, simulated from the model's FLOPs and
bytes.

The report (docs/formulas.md) trains a 40-layer MoE with 8 experts on 8 GPUs (batch 1024
sequences of 2048 tokens) with 1F1B, DualPipe and Cut-in-half; the model is ``moe-40l.yaml``
beside this module. The GPUs are split into pipeline x expert parallelism (by default PP 4 x
EP 2, so the all-to-alls run inside a node). Every item of the model (embedding,
layers, head) gets its forward, backward, weight-gradient and all-to-all times and its
activation and parameter bytes from ``cutpipe.plan.costs.model``; the items are cut into each
schedule's stages so that every rank's compute is as even as one layer's granularity allows
(``cutpipe.plan.partition.rank_balanced_sizes``); the simulator then times a step and counts
memory:

- throughput: the batch over the simulated step time;
- peak memory: training state (16 bytes per stored parameter: DualPipe stores each stage twice)
  plus the simulator's peak activation bytes, on the rank where their sum is largest;
- bubble: the idle share of the step on the most idle rank;
- communication: the share of the step a rank spends in all-to-alls nothing hides (outside an
  overlapped F&B pair, or longer than the other half's compute), the most exposed rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

from cutpipe.bench.report import LINEUP, Row
from cutpipe.plan.costs.model import (
    STATE_BYTES_PER_PARAMETER,
    boundary_bytes,
    gpu,
    model_items,
    p2p_time,
    w_memory,
)
from cutpipe.plan.partition import rank_balanced_sizes, stage_costs
from cutpipe.schedule.actions import Kind, Overlap
from cutpipe.schedule.registry import generate, schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics, p2p_sends
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

#: The report's model, shipped with cutpipe (examples/models/moe-40l.yaml links to it).
MODEL_FILE = "moe-40l.yaml"


def default_model() -> ModelSpec:
    """The report's 40-layer, 8-expert MoE, read from the file shipped beside this module."""
    with resources.as_file(resources.files("cutpipe.bench") / MODEL_FILE) as path:
        return ModelSpec.load(path)


@dataclass(frozen=True)
class SimulatedSetting:
    """Devices, how they split, the batch, and the GPU the costs are derived for."""

    model: ModelSpec = field(default_factory=default_model)
    gpu: str = "A100"
    devices: int = 8
    pp: int = 4
    ep: int = 2
    batch: int = 1024  # sequences per step, over all pipelines

    @property
    def dp(self) -> int:
        return self.devices // (self.pp * self.ep)

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline and step."""
        return self.batch // (self.dp * self.ep * self.model.microbatch_size)

    def check(self) -> None:
        """A ValueError saying what to change."""
        gpu(self.gpu)
        if self.pp < 2:
            raise ValueError(
                f"the comparison runs pipelines: the pipeline size must be >= 2, got {self.pp}"
            )
        if self.ep < 1 or (self.model.moe and self.model.experts % self.ep):
            raise ValueError(
                f"expert-parallel size {self.ep} does not divide the {self.model.experts} "
                "experts: use a divisor of the expert count"
            )
        if self.pp < 1 or self.ep < 1 or self.devices % (self.pp * self.ep):
            raise ValueError(
                f"PP {self.pp} x EP {self.ep} does not divide {self.devices} devices: choose "
                f"sizes whose product divides {self.devices}"
            )
        per = self.dp * self.ep * self.model.microbatch_size
        if self.batch % per:
            raise ValueError(
                f"a batch of {self.batch} does not split into microbatches of "
                f"{self.model.microbatch_size} over {self.dp * self.ep} pipelines: use a multiple "
                f"of {per}"
            )


def _alltoall_per_rank(schedule: Schedule, costs: Costs, hidden: bool) -> list[float]:
    """Per rank, the all-to-all seconds of a step; with ``hidden``, only what an F&B pair does
    not hide behind the other half's compute (the simulator's own pair rule)."""
    S = schedule.num_stages
    f, b, w, ep_f, ep_b = (costs.per_stage(n, S) for n in ("f", "b", "w", "ep_f", "ep_b"))
    per_rank = []
    for ops in schedule.actions:
        total = 0.0
        for op in ops:
            if type(op) is Overlap:
                fs, back = op.forward.stage, op.backward
                both = ep_f[fs] + ep_b[back.stage]
                if hidden:
                    grad = b[back.stage] + (w[back.stage] if back.kind == Kind.BW else 0.0)
                    both = max(0.0, both - (f[fs] + grad))
                total += both
            elif op.kind == Kind.F:
                total += ep_f[op.stage]
            elif op.kind in (Kind.B, Kind.BW):
                total += ep_b[op.stage]
        per_rank.append(total)
    return per_rank


def exposed_alltoall(schedule: Schedule, costs: Costs) -> list[float]:
    """Per rank, the all-to-all seconds nothing hides (the simulator's own pair rule)."""
    return _alltoall_per_rank(schedule, costs, hidden=True)


def alltoall_seconds(schedule: Schedule, costs: Costs) -> list[float]:
    """Per rank, every all-to-all second of a step, hidden in a pair or not."""
    return _alltoall_per_rank(schedule, costs, hidden=False)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def simulate_at_scale(
    setting: SimulatedSetting | None = None, schedules: Sequence[str] = LINEUP
) -> list[Row]:
    """Each schedule at the report's scale (default: its setting): a ``Row`` of simulated figures."""
    setting = setting or SimulatedSetting()
    setting.check()
    hardware = gpu(setting.gpu)
    within_node = setting.pp * setting.ep * setting.dp <= hardware.gpus_per_node
    items = model_items(setting.model, hardware, ep=setting.ep, ep_within_node=within_node)
    comm = p2p_time(setting.model, hardware, within_node)
    m = setting.microbatches
    baseline = p2p_sends(generate("1f1b", setting.pp, m))
    rows = []
    for name in schedules:
        schedule = generate(name, setting.pp, m)
        sizes = rank_balanced_sizes(items, schedule)
        costs = stage_costs(items, sizes, comm, w_memory(setting.model),
                            p2p_bytes=boundary_bytes(setting.model))  # fmt: skip
        timeline = simulate(schedule, costs)
        result = metrics(timeline, costs)
        params = costs.params or []
        activations = peak_activations(schedule, costs)
        state = [
            STATE_BYTES_PER_PARAMETER * sum(params[s] for s in schedule.placement.stages_of(r))
            for r in range(setting.pp)
        ]
        peak_rank = max(range(setting.pp), key=lambda r: state[r] + activations[r])
        exposed = exposed_alltoall(schedule, costs)
        stored = sum(state) / STATE_BYTES_PER_PARAMETER / sum(params)  # copies count
        S = schedule.num_stages
        detail = {
            "ranks": setting.pp,
            "stages": S,
            "microbatches": m,
            "makespan": result.makespan,  # seconds
            "busy_per_rank": result.busy_per_rank,  # compute plus exposed all-to-all
            "compute_per_rank": [b - e for b, e in zip(result.busy_per_rank, exposed, strict=True)],
            "alltoall_per_rank": alltoall_seconds(schedule, costs),  # hidden or not
            "p2p_per_rank": result.p2p_sends * costs.comm / setting.pp,  # mean over ranks
            # one stage's op on one microbatch, the mean over the stages (a V's are half stages)
            **{name: _mean(costs.per_stage(name, S)) for name in ("f", "b", "w")},
            "stage_activation": _mean(costs.per_stage("activation", S)),  # bytes
            "peak_rank": peak_rank,
        }
        rows.append(
            Row(
                schedule=name,
                title=schedule_info(name).title,
                throughput=setting.batch / result.makespan,
                memory=state[peak_rank] + activations[peak_rank],
                bubble=result.bubble_ratio,
                comm=max(exposed) / result.makespan,
                memory_parts={"state": state[peak_rank], "activations": activations[peak_rank]},
                memory_per_rank=[s + a for s, a in zip(state, activations, strict=True)],
                params_x=stored,
                pp_traffic_x=result.p2p_sends / baseline,
                note=f"stages {sizes}",
                detail=detail,
            )
        )
    return rows
