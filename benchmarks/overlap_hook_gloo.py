"""DualPipe's F&B overlap on real gloo: DualPipeV steps with the overlap hook against without.

One pipeline rank x EP 2 (2 processes), a small MoE; three runners take turns round after round
(the hooked phased stages, the same stages unhooked, and plain stages with the MoE's blocking
exchanges), so neighbours in time share the machine's noise. Prints each one's median step and
the median of the per-round with/without ratios. On a CPU, gloo's copies are work on the same
cores as the compute, so only time spent waiting for the peer can hide: expect a modest gain on an
idle machine and none on a busy one (emulation, in the tests, is the load-free check).

With ``--capacity-factor F`` each runner has a twin whose MoE layers route with that capacity
(``RoutingOptions``), taking turns in the same rounds; the second line gives the twins' medians
and their median per-round ratios to the runners without a capacity. F = 2.0 is this model's
``experts / top_k``, a capacity of every token per expert: nothing is dropped and the models
compute the same, so the ratio is what the capacity's routing and exchange cost or save.

    python benchmarks/overlap_hook_gloo.py [--rounds 20] [--microbatches 12] [--capacity-factor F]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cutpipe import generate
from cutpipe.launch import run
from cutpipe.models import LanguageModelLoss, RoutingOptions, language_model
from cutpipe.parallel.expert_parallel import shard_experts
from cutpipe.parallel.mesh import build_mesh
from cutpipe.parallel.moe_stage import moe_stages
from cutpipe.runtime import PipelineRunner
from cutpipe.spec import ModelSpec

SIZES = {"layers": 4, "hidden": 32, "ffn": 128, "seq_len": 32, "microbatch_size": 4}


MODES = ("with", "without", "plain")


def step_times(rank: int, world: int, rounds: int, m: int, capacity_factor: float | None) -> dict:
    mesh = build_mesh(1, world, experts=4, top_k=2)
    spec = ModelSpec(name="moe-timing", heads=2, vocab=64, experts=4, top_k=2, **SIZES)
    schedule = generate("dualpipev", 1, m)
    held = schedule.placement.stages_of(mesh.pp_rank)
    routings = {"": RoutingOptions()}
    if capacity_factor is not None:
        routings["capacity"] = RoutingOptions(capacity_factor=capacity_factor)
    runners = {}
    for variant, routing in routings.items():
        for mode in MODES:
            model = shard_experts(language_model(spec, seed=4, routing=routing), mesh.ep_group)
            name = f"{mode} {variant}".strip()
            if mode == "plain":
                runners[name] = PipelineRunner.from_sequential(
                    schedule, model, LanguageModelLoss(), group=mesh.pp_group
                )
                continue
            stages = moe_stages(model, schedule.num_stages, held, overlap=mode == "with")
            runners[name] = PipelineRunner(
                schedule, stages, LanguageModelLoss(), group=mesh.pp_group
            )
    generator = torch.Generator().manual_seed(11)
    x = torch.randint(0, spec.vocab, (m * spec.microbatch_size, spec.seq_len), generator=generator)
    y = torch.randint(0, spec.vocab, (m * spec.microbatch_size, spec.seq_len), generator=generator)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for round_ in range(rounds + 1):
        turn = round_ % len(order)
        for name in order[turn:] + order[:turn]:
            torch.distributed.barrier()
            began = time.perf_counter()
            runners[name].step(x, y)
            torch.distributed.barrier()
            if round_:  # the first round learns shapes
                seconds[name].append(time.perf_counter() - began)
    for runner in runners.values():
        runner.close()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(seconds[a], seconds[b], strict=True))

    result = {name: statistics.median(values) for name, values in seconds.items()}
    result["ratio"] = ratio("with", "without")
    if capacity_factor is not None:
        result["capacity ratio"] = {mode: ratio(f"{mode} capacity", mode) for mode in MODES}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=12)
    parser.add_argument("--capacity-factor", type=float, default=None)
    args = parser.parse_args()
    arguments = (args.rounds, args.microbatches, args.capacity_factor)
    result = run(step_times, 2, arguments, timeout=600)[0]
    print(
        f"DualPipeV, 1 pipeline rank x EP 2, gloo, {args.rounds} rounds: median step with the "
        f"hook {result['with'] * 1e3:.1f} ms, without {result['without'] * 1e3:.1f} ms (median "
        f"per-round ratio {result['ratio']:.3f}); plain stages, blocking exchanges "
        f"{result['plain'] * 1e3:.1f} ms"
    )
    if args.capacity_factor is not None:
        ratios = result["capacity ratio"]
        print(
            f"capacity factor {args.capacity_factor}, the same rounds: with the hook "
            f"{result['with capacity'] * 1e3:.1f} ms, without "
            f"{result['without capacity'] * 1e3:.1f} ms, plain "
            f"{result['plain capacity'] * 1e3:.1f} ms; median per-round ratio to no capacity: "
            f"{ratios['with']:.3f}, {ratios['without']:.3f}, {ratios['plain']:.3f}"
        )


if __name__ == "__main__":
    main()
