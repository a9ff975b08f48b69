"""The MoE comparison run for real: local gloo processes, PP x EP, a small MoE transformer.

Every schedule trains the same model (same initial weights) on the same batches, each pipeline on its share.
All runners are built first and take their steps in rotating order, round after round, so that
the machine's noise falls on every schedule alike. Per schedule:

- throughput: the global batch over the median step time (the slowest rank's, after a barrier);
- peak memory per rank: parameters, gradients and Adam's state, plus the activation peak of one
  step measured from the tensors autograd saves (``cutpipe.runtime.compute.memory``);
- bubble: from the measured timeline of the median step, the idle share of the most idle rank
  (taken per pipeline, the largest over pipelines);
- communication: the seconds a rank waited for all-to-alls (counted by the stages), over the
  step time, the most exposed rank.

DualPipeV also runs with its overlap hook switched off (the pair's halves one after the other),
side by side with the hooked run: the ratio of their step times is what the hook buys here.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from cutpipe.bench.report import LINEUP, Row
from cutpipe.plan.costs.model import gpu, model_items
from cutpipe.plan.partition import rank_balanced_sizes
from cutpipe.schedule.registry import generate, schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.metrics import p2p_sends
from cutpipe.spec import ModelSpec

#: Small enough for 4 CPU processes, large enough that every V stage holds an MoE layer.
BENCH_MODEL = ModelSpec(
    name="bench-moe", layers=6, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16,
    microbatch_size=2, experts=4, top_k=2,
)  # fmt: skip
HOOK_OFF = "dualpipev-no-hook"


@dataclass(frozen=True)
class RealSetting:
    """The local run: process layout, model, microbatches per pipeline, measured steps."""

    pp: int = 2
    ep: int = 2
    model: ModelSpec = BENCH_MODEL
    microbatches: int = 8
    steps: int = 5
    schedules: tuple[str, ...] = LINEUP
    hook_off: bool = True  # also run DualPipeV without the overlap hook

    @property
    def processes(self) -> int:
        return self.pp * self.ep

    def check(self) -> None:
        """A ValueError saying what to change, before any process starts."""
        from cutpipe.parallel.mesh import Layout

        Layout(self.pp, self.ep).check(
            self.processes, self.model.experts, self.model.top_k if self.model.moe else None
        )
        for name in self.schedules:
            generate(name, self.pp, self.microbatches)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["model"] = asdict(self.model)
        return data


def partition(setting: RealSetting, schedule: Schedule) -> list[int]:
    """Stage sizes evening out the ranks' layers (the simulation's rule, on this model's items)."""
    items = model_items(setting.model, gpu("A100"), ep=setting.ep)
    return rank_balanced_sizes(items, schedule)


def _runner(name: str, setting: RealSetting, mesh: Any, overlap: bool) -> tuple[Any, Any, Any]:
    """(runner, optimizer, expert parameters) for one schedule on this rank."""
    import torch

    from cutpipe.models import LanguageModelLoss, language_model
    from cutpipe.parallel.expert_parallel import expert_parameters, shard_experts
    from cutpipe.parallel.moe_stage import moe_stages
    from cutpipe.runtime import PipelineRunner

    schedule = generate(name, setting.pp, setting.microbatches)
    model = shard_experts(language_model(setting.model, seed=0), mesh.ep_group)
    stages = moe_stages(
        model,
        schedule.num_stages,
        schedule.placement.stages_of(mesh.pp_rank),
        partition=partition(setting, schedule),
        overlap=overlap,
    )
    runner = PipelineRunner(
        schedule, stages, LanguageModelLoss(), group=mesh.pp_group, loss_reduction="mean",
        record_timeline=True,
    )  # fmt: skip
    optimizer = torch.optim.Adam(runner.parameters(), lr=1e-3)
    return runner, optimizer, expert_parameters(model)


def bench_rank(rank: int, world: int, setting: RealSetting) -> dict[str, Any]:
    """One rank of the real runs (a spawned process): its figures for every schedule."""
    import torch
    import torch.distributed as dist

    from cutpipe.parallel.mesh import build_mesh
    from cutpipe.runtime.compute.memory import ActivationMeter, state_bytes
    from cutpipe.sim.metrics import metrics

    spec = setting.model
    mesh = build_mesh(setting.pp, setting.ep, experts=spec.experts, top_k=spec.top_k)
    names = list(setting.schedules) + ([HOOK_OFF] if setting.hook_off else [])
    runs = {
        name: _runner(name.split("-")[0], setting, mesh, overlap=name != HOOK_OFF) for name in names
    }
    generator = torch.Generator().manual_seed(1)
    per_pipeline = setting.microbatches * spec.microbatch_size
    shape = (mesh.replicas * per_pipeline, spec.seq_len)
    x = torch.randint(0, spec.vocab, shape, generator=generator)
    y = torch.randint(0, spec.vocab, shape, generator=generator)
    x, y = mesh.shard(x), mesh.shard(y)

    def step(name: str, meter: ActivationMeter | None = None) -> tuple[float, float]:
        runner, optimizer, experts = runs[name]
        for stage in runner.modules.values():
            stage.exposed_comm = 0.0
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        began = time.perf_counter()
        if meter is None:
            runner.step(x, y)
        else:
            with meter:
                runner.step(x, y)
        mesh.reduce_gradients(runner.parameters(), experts)
        optimizer.step()
        seconds = time.perf_counter() - began
        waited = sum(stage.exposed_comm for stage in runner.modules.values())
        return seconds, waited

    figures: dict[str, dict[str, Any]] = {name: {"seconds": [], "waited": [], "bubbles": []}
                                           for name in names}  # fmt: skip
    for name in names:  # learn shapes, create Adam's state
        step(name)
    for round_ in range(setting.steps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            seconds, waited = step(name)
            slowest = torch.tensor([seconds, waited / seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            figures[name]["seconds"].append(float(slowest[0]))
            figures[name]["waited"].append(float(slowest[1]))
            timeline = runs[name][0].timeline()  # on the pipeline's first rank
            bubble = torch.tensor(
                [metrics(timeline).bubble_ratio if timeline is not None else 0.0],
                dtype=torch.float64,
            )
            dist.all_reduce(bubble, op=dist.ReduceOp.MAX)
            figures[name]["bubbles"].append(float(bubble))
    results: dict[str, Any] = {}
    for name in names:
        runner, optimizer, _ = runs[name]
        meter = ActivationMeter(exclude=runner.parameters())
        step(name, meter)
        memory = {"activations": meter.peak, **state_bytes(runner.parameters(), optimizer)}
        runner.close()
        seconds = figures[name]["seconds"]
        median = statistics.median(seconds)
        middle = seconds.index(min(seconds, key=lambda s: abs(s - median)))
        results[name] = {
            "seconds": seconds,
            "median": median,
            "bubble": figures[name]["bubbles"][middle],
            "comm": statistics.median(figures[name]["waited"]),
            "memory": memory,
        }
    return results


def rows_from(results: list[dict[str, Any]], setting: RealSetting) -> list[Row]:
    """One Row per schedule from every rank's results (memory: the rank with the largest)."""
    batch = setting.ep * setting.microbatches * setting.model.microbatch_size  # all pipelines
    first = results[0]
    baseline = p2p_sends(generate("1f1b", setting.pp, setting.microbatches))
    rows = []
    for name, figures in first.items():
        schedule_name = name.split("-")[0]
        schedule = generate(schedule_name, setting.pp, setting.microbatches)
        totals = [sum(rank[name]["memory"].values()) for rank in results]
        peak = max(range(len(results)), key=totals.__getitem__)
        stored = sum(len(schedule.placement.stages_of(r)) for r in range(setting.pp))
        title = schedule_info(schedule_name).title + (" (hook off)" if name == HOOK_OFF else "")
        rows.append(
            Row(
                schedule=name,
                title=title,
                throughput=batch / figures["median"],
                memory=totals[peak],
                bubble=figures["bubble"],
                comm=figures["comm"],
                memory_parts=dict(results[peak][name]["memory"]),
                memory_per_rank=totals,
                params_x=stored / schedule.num_stages,
                pp_traffic_x=p2p_sends(schedule) / baseline,
                note=f"median step {figures['median'] * 1e3:.1f} ms, "
                f"stages {partition(setting, schedule)}",
            )
        )
    return rows


def run_real(setting: RealSetting, timeout: float = 600.0) -> tuple[list[Row], float]:
    """Launch the processes; the rows and the hook's step-time ratio (with / without)."""
    from cutpipe.launch.local import LaunchError, spawn

    setting.check()
    outcomes = spawn(bench_rank, setting.processes, (setting,), timeout=timeout)
    if not all(outcome.ok for outcome in outcomes):
        raise RuntimeError(str(LaunchError(outcomes)))
    results = [outcome.result for outcome in outcomes]
    rows = rows_from(results, setting)
    first = results[0]
    ratio = (
        first["dualpipev"]["median"] / first[HOOK_OFF]["median"]
        if "dualpipev" in first and HOOK_OFF in first
        else float("nan")
    )
    return rows, ratio
