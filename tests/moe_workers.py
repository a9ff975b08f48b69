"""Functions the multi-process MoE tests run on every rank (spawned processes import them)."""

from __future__ import annotations

import copy
import statistics

import torch
from torch import nn

from cutpipe import generate
from cutpipe.models import LanguageModelLoss, RoutingOptions, language_model
from cutpipe.parallel.expert_parallel import expert_parameters, moe_layers, shard_experts
from cutpipe.parallel.mesh import build_mesh
from cutpipe.parallel.moe_stage import moe_stages
from cutpipe.parallel.routing import routing_statistics, update_routing_bias
from cutpipe.runtime import PipelineRunner
from cutpipe.spec import ModelSpec

TINY = ModelSpec(
    name="tiny-moe", layers=6, hidden=16, heads=2, ffn=24, vocab=32, seq_len=8,
    microbatch_size=2, experts=4, top_k=2, shared_experts=1,
)  # fmt: skip


def tokens(batch: int, spec: ModelSpec, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=generator)
    y = torch.randint(0, spec.vocab, (batch, spec.seq_len), generator=generator)
    return x, y


def reference(model: nn.Module, x, y, replicas: int, m: int, reduction: str) -> list[float]:
    """Without expert parallelism, in one process: each replica's microbatches one after the
    other; gradients of the mean over replicas of each replica's loss. Returns those losses."""
    loss_fn = LanguageModelLoss()
    losses = []
    for xs, ys in zip(x.chunk(replicas), y.chunk(replicas), strict=True):
        total = 0.0
        for xi, yi in zip(xs.chunk(m), ys.chunk(m), strict=True):
            loss = loss_fn(model(xi), yi)
            scale = 1.0 / replicas / (m if reduction == "mean" else 1)
            (loss * scale).backward()
            total += float(loss)
        losses.append(total / m if reduction == "mean" else total)
    return losses


def relative_error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    a = torch.zeros(()) if a is None else a
    b = torch.zeros(()) if b is None else b
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def grad_error(held: list[nn.Parameter], names: dict[int, str], twin: nn.Module) -> float:
    twins = dict(twin.named_parameters())
    return max(relative_error(p.grad, twins[names[id(p)]].grad) for p in held)


def expert_parallel_only(rank: int, world: int, dtype: torch.dtype = torch.float32) -> dict:
    """EP over the whole world, no pipeline: the MoE's blocking differentiable exchanges."""
    mesh = build_mesh(1, world, experts=TINY.experts, top_k=TINY.top_k)
    model = language_model(TINY, seed=2).to(dtype)
    twin = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    shard_experts(model, mesh.ep_group)
    x, y = tokens(4 * world, TINY)
    loss = LanguageModelLoss()(model(mesh.shard(x)), mesh.shard(y))
    loss.backward()
    mesh.reduce_gradients(model.parameters(), expert_parameters(model))
    expected = reference(twin, x, y, mesh.replicas, 1, "sum")
    return {
        "loss": float(loss),
        "expected": expected[mesh.replica],
        "grad_error": grad_error(list(model.parameters()), names, twin),
        "experts_held": len(expert_parameters(model)) // 3,  # up, gate, down per expert
        "mean_loss": float(mesh.average(loss)),
        "expected_mean": sum(expected) / len(expected),
    }


def routing_over_ranks(rank: int, world: int) -> dict:
    """EP over the whole world with a capacity that drops and a routing bias: the loss, the
    statistics summed over the ranks and the moved bias against the model without EP."""
    mesh = build_mesh(1, world, experts=TINY.experts, top_k=TINY.top_k)
    model = language_model(TINY, seed=2, routing=RoutingOptions(capacity_factor=0.75, bias=True))
    twin = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    shard_experts(model, mesh.ep_group)
    steps = []
    for seed in (11, 12):  # the second step routes with the moved bias
        x, y = tokens(4 * world, TINY, seed)
        for held in (model, twin):
            held.zero_grad()
        loss = LanguageModelLoss()(model(mesh.shard(x)), mesh.shard(y))
        loss.backward()
        mesh.reduce_gradients(model.parameters(), expert_parameters(model))
        expected = reference(twin, x, y, mesh.replicas, 1, "sum")
        stats = routing_statistics(model, reduce=mesh.sum_over_replicas, reset=True)
        twin_stats = routing_statistics(twin, reset=True)
        update_routing_bias(model, 0.01, reduce=mesh.sum_over_replicas)
        update_routing_bias(twin, 0.01)
        steps.append(
            {
                "loss": float(loss),
                "expected": expected[mesh.replica],
                "grad_error": grad_error(list(model.parameters()), names, twin),
                "loads": [layer.load for layer in stats.layers.values()],
                "expected_loads": [layer.load for layer in twin_stats.layers.values()],
                "dropped": [layer.dropped for layer in stats.layers.values()],
                "expected_dropped": [layer.dropped for layer in twin_stats.layers.values()],
                "balance": [layer.balance_loss for layer in stats.layers.values()],
                "expected_balance": [layer.balance_loss for layer in twin_stats.layers.values()],
                "bias_equal": all(
                    torch.equal(a.routing_bias, b.routing_bias)
                    for a, b in zip(moe_layers(model), moe_layers(twin), strict=True)
                ),
                "bias_moved": all(moe.routing_bias.any() for moe in moe_layers(model)),
            }
        )
    return steps


def pipeline_exactness(
    rank: int,
    world: int,
    layout: tuple[int, int, int],
    cases: list[tuple[str, int, str, bool]],
    routing: RoutingOptions | None = None,
) -> list[dict]:
    """PP x EP (x DP) with MoE stages: every case's loss and gradients against ``reference``."""
    pp, ep, dp = layout
    mesh = build_mesh(pp, ep, dp, experts=TINY.experts, top_k=TINY.top_k)
    results = []
    for name, m, reduction, overlap in cases:
        schedule = generate(name, pp, m)
        model = language_model(TINY, seed=3, routing=routing)
        twin = copy.deepcopy(model)
        names = {id(p): n for n, p in model.named_parameters()}
        shard_experts(model, mesh.ep_group)
        stages = moe_stages(
            model, schedule.num_stages, schedule.placement.stages_of(mesh.pp_rank), overlap=overlap
        )
        trace: list = []
        for stage in stages.values():
            stage.trace = trace
        # the replicas' average, each stage's started as soon as its last backward has run
        reducer = mesh.gradient_reducer(expert_parameters(model))
        runner = PipelineRunner(
            schedule, stages, LanguageModelLoss(), group=mesh.pp_group, loss_reduction=reduction,
            reducer=reducer,
        )  # fmt: skip
        x, y = tokens(mesh.replicas * m * TINY.microbatch_size, TINY)
        loss = runner.step(mesh.shard(x), mesh.shard(y))
        expected = reference(twin, x, y, mesh.replicas, m, reduction)
        with torch.no_grad():
            evaluated = runner.step(mesh.shard(x), mesh.shard(y))
        runner.close()
        results.append(
            {
                "case": f"{name} PPxEPxDP={pp}x{ep}x{dp} m={m} {reduction} overlap={overlap} "
                f"{routing}",
                "loss": float(loss),
                "eval": float(evaluated),
                "expected": expected[mesh.replica],
                "grad_error": grad_error(runner.parameters(), names, twin),
                "interleaved": interleaved(trace),
                "pairs": sum(
                    1 for op in schedule.actions[mesh.pp_rank] if type(op).__name__ == "Overlap"
                ),
                "coordinate": (mesh.pp_rank, mesh.dp_rank, mesh.ep_rank),
            }
        )
    return results


def interleaved(trace: list[tuple[str, str]]) -> int:
    """How many exchanges had the other half's compute run while they were in flight."""
    count, open_since = 0, {}
    for position, (half, event) in enumerate(trace):
        if event.startswith("start "):
            open_since[(half, event[6:])] = position
        elif event.startswith("wait "):
            began = open_since.pop((half, event[5:]), None)
            if began is not None and any(
                h != half and not e.startswith(("start", "wait")) for h, e in trace[began:position]
            ):
                count += 1
    return count


def emulated_pairs(rank: int, world: int, layers: int, costs: list[dict], m: int) -> list[dict]:
    """DualPipeV on one pipeline rank x EP ``world``, phases that sleep: F&B pair durations for
    each of ``costs``, in one launch."""
    mesh = build_mesh(1, world)
    return [_pair_times(mesh, world, layers, each, m) for each in costs]


def _pair_times(mesh, world: int, layers: int, costs: dict, m: int) -> dict:
    from cutpipe.parallel.emulated_moe import EmulatedMoEStage, PhaseCosts

    phase_costs = PhaseCosts(**costs)
    schedule = generate("dualpipev", 1, m)
    measured = {}
    for overlap in (True, False):
        stages = {
            s: EmulatedMoEStage(layers, phase_costs, mesh.ep_group, overlap=overlap)
            for s in schedule.placement.stages_of(0)
        }
        runner = PipelineRunner(
            schedule, stages, lambda out, t: (out - t).pow(2).mean(), group=mesh.pp_group,
            record_timeline=True,
        )  # fmt: skip
        x = torch.ones(m * world, 4)
        runner.step(x, x)  # learn shapes
        runner.step(x, x)
        timeline = runner.timeline()
        runner.close()
        pairs = [
            end - start for op, start, end in timeline.events(0) if type(op).__name__ == "Overlap"
        ]
        measured[overlap] = statistics.median(pairs)
    layer = phase_costs.layer()
    compute = layers * (layer["forward"] + layer["backward"])
    comm = layers * 2 * layer["comm"]
    return {"with": measured[True], "without": measured[False], "compute": compute, "comm": comm}


def hook_against_sequential(rank: int, world: int, m: int) -> dict:
    """DualPipeV on PP x EP with the overlap hook and without: the two gradient sets compared."""
    mesh = build_mesh(world // 2, 2, experts=TINY.experts, top_k=TINY.top_k)
    schedule = generate("dualpipev", world // 2, m)
    x, y = tokens(mesh.replicas * m * TINY.microbatch_size, TINY)
    outcome = {}
    for overlap in (True, False):
        model = shard_experts(language_model(TINY, seed=5), mesh.ep_group)
        stages = moe_stages(
            model, schedule.num_stages, schedule.placement.stages_of(mesh.pp_rank), overlap=overlap
        )
        runner = PipelineRunner(schedule, stages, LanguageModelLoss(), group=mesh.pp_group)
        loss = float(runner.step(mesh.shard(x), mesh.shard(y)))
        outcome[overlap] = (loss, [p.grad.clone() for p in runner.parameters()])
        runner.close()
    (loss_on, grads_on), (loss_off, grads_off) = outcome[True], outcome[False]
    return {
        "losses": (loss_on, loss_off),
        "grad_error": max(relative_error(a, b) for a, b in zip(grads_on, grads_off, strict=True)),
        "identical": all(torch.equal(a, b) for a, b in zip(grads_on, grads_off, strict=True)),
    }


def bad_mesh(rank: int, world: int) -> list[str]:
    """Layouts that do not fit: each raises a ValueError before any group is created."""
    import torch.distributed as dist

    messages = []
    before = len(dist.distributed_c10d._world.pg_map)
    for pp, ep, experts, top_k in ((world, 2, 4, 2), (1, 3, 4, 2), (1, world, 4, 5)):
        try:
            build_mesh(pp, ep, experts=experts, top_k=top_k)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    messages.append(f"groups created: {len(dist.distributed_c10d._world.pg_map) - before}")
    return messages


def two_ranks(rank: int, world: int, layers: int, costs: list[dict], m: int) -> dict:
    """The 2-rank launches in one: ``emulated_pairs`` first (while nothing else has run), then
    ``expert_parallel_only`` in float32 and float64, ``routing_over_ranks``, then
    ``bad_mesh``."""
    return {
        "pairs": emulated_pairs(rank, world, layers, costs, m),
        "expert_parallel": {
            str(dtype): expert_parallel_only(rank, world, dtype)
            for dtype in (torch.float32, torch.float64)
        },
        "routing": routing_over_ranks(rank, world),
        "bad_mesh": bad_mesh(rank, world),
    }


def four_ranks(rank: int, world: int, cases: list, m: int, capacity_cases: list) -> dict:
    """The PP 2 x EP 2 launches in one: ``pipeline_exactness`` of ``cases``, then
    ``hook_against_sequential`` on ``m`` microbatches, then ``capacity_cases`` with a capacity
    factor that drops."""
    dropping = RoutingOptions(capacity_factor=0.75)
    return {
        "exactness": pipeline_exactness(rank, world, (2, 2, 1), cases),
        "hook": hook_against_sequential(rank, world, m),
        "capacity": pipeline_exactness(rank, world, (2, 2, 1), capacity_cases, dropping),
    }


def several_layouts(rank: int, world: int, runs: list[tuple[tuple[int, int, int], list]]) -> list:
    """``pipeline_exactness`` for several layouts of the same processes, one after the other."""
    return [pipeline_exactness(rank, world, layout, cases) for layout, cases in runs]
