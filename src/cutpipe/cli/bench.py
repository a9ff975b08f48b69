"""``cutpipe bench moe``: the Cut-in-half report's 1F1B / DualPipe / Cut-in-half (and ZB-V) MoE
comparison.

Runs the schedules for real through the trainer on local gloo processes (PP x EP, a small MoE
transformer; each rank's memory beside the simulator's prediction of it; DualPipe and Cut-in-half
also in time emulation, hook on and off, beside the simulator's step) and simulates them at the report's scale (8 devices, 40 layers, 8 experts, batch 1024 of 2048 tokens,
costs from the model's FLOPs and bytes on ``--gpu``), then prints one table in the report's layout
(throughput, peak memory, bubble share, communication share) and says where the figures agree
with the report's claims and where not, and why (docs/formulas.md). Then it sets the report's own
measured figures (its Table 2) beside the simulation at the report's setting and the real run,
and explains each metric on which they differ from the simulated step's seconds and bytes
(``cutpipe.bench.published``). ``--sim-only`` skips the real runs.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from cutpipe.cli.common import (
    description,
    positive_float,
    positive_int,
    print_json,
    real,
    require_torch,
    whole_number,
)
from cutpipe.plan.recommend.recommend import MAX_DEVICES

#: Local processes (PP x EP) the real runs start at most.
MAX_PROCESSES = 64


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "bench", help="benchmarks: bench moe is the Cut-in-half report's MoE comparison",
        description="Benchmarks shipped with cutpipe.",
    )  # fmt: skip
    kinds = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    moe = kinds.add_parser(
        "moe", help="1F1B vs DualPipe vs Cut-in-half vs ZB-V on an MoE: real runs and at scale",
        description=description(__doc__),
    )  # fmt: skip
    runs = moe.add_argument_group("real runs (this machine, gloo)")
    runs.add_argument("--pp", type=whole_number(1, MAX_PROCESSES), default=2,
                      help="pipeline ranks (default 2)")  # fmt: skip
    runs.add_argument("--ep", type=whole_number(1, MAX_PROCESSES), default=2,
                      help="expert-parallel ranks (default 2)")  # fmt: skip
    runs.add_argument("--microbatches", "-m", type=positive_int, default=8,
                      help="per pipeline (default 8)")  # fmt: skip
    runs.add_argument("--steps", type=positive_int, default=5, help="measured steps per schedule")
    runs.add_argument("--time-unit", type=real(0.0, exclusive=False), default=0.05,
                      help="seconds per cost unit of the emulated DualPipe and Cut-in-half steps "
                      "(default 0.05; 0 skips them)")  # fmt: skip
    runs.add_argument("--timeout", type=positive_float, default=600.0,
                      help="stop the processes after this many seconds")  # fmt: skip
    runs.add_argument("--sim-only", action="store_true", help="skip the real runs")
    sim = moe.add_argument_group("simulation at the report's scale")
    sim.add_argument("--gpu", default="A100", help="A100 (default), H100 or H200")
    sim.add_argument(
        "--devices", type=whole_number(1, MAX_DEVICES), default=8, help="GPUs (default 8)"
    )
    sim.add_argument("--sim-pp", type=positive_int, default=4, help="pipeline ranks (default 4)")
    sim.add_argument("--sim-ep", type=positive_int, default=2,
                     help="expert-parallel ranks (default 2)")  # fmt: skip
    sim.add_argument("--batch", type=positive_int, default=1024,
                     help="sequences per step (default 1024)")  # fmt: skip
    sim.add_argument(
        "--model", metavar="FILE", help="a model YAML/JSON (default: the report's, moe-40l)"
    )
    moe.add_argument("--json", action="store_true", help="print the figures as JSON")
    moe.set_defaults(run=run)


def _settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """Both settings, checked before any process starts."""
    from cutpipe.bench.measured import RealSetting
    from cutpipe.bench.simulated import SimulatedSetting, default_model
    from cutpipe.spec import ModelSpec

    model = ModelSpec.load(args.model) if args.model is not None else default_model()
    scaled = SimulatedSetting(model, args.gpu, args.devices, args.sim_pp, args.sim_ep, args.batch)
    scaled.check()
    real = RealSetting(
        pp=args.pp, ep=args.ep, microbatches=args.microbatches, steps=args.steps,
        emulate_unit=args.time_unit,
    )  # fmt: skip
    if not args.sim_only:
        require_torch()  # the real runs need it; --sim-only does not
        real.check()
    return scaled, real


def run(args: argparse.Namespace) -> int:
    from cutpipe.bench.report import render, verdicts
    from cutpipe.bench.simulated import simulate_at_scale

    scaled, setting = _settings(args)
    simulated = simulate_at_scale(scaled)
    measured, ratio, memory, emulated = [], math.nan, [], []
    if not args.sim_only:
        from cutpipe.bench.measured import run_real

        results = run_real(setting, timeout=args.timeout)
        measured, ratio = results.rows, results.hook_ratio
        memory, emulated = results.memory, results.emulated
    checks = verdicts(measured, simulated)
    published = _published(scaled, simulated, measured)
    if args.json:
        print_json(
            {
                "measured": [row.to_dict() for row in measured],
                "simulated": [row.to_dict() for row in simulated],
                "hook_step_ratio": None if math.isnan(ratio) else ratio,
                "memory": [row.to_dict() for row in memory],
                "emulated": emulated,
                "verdicts": [check.__dict__ for check in checks],
                "published": published,
                "settings": {
                    "real": setting.to_dict(),
                    "simulated": {**scaled.__dict__, "model": scaled.model.__dict__},
                },
            }
        )
        return 0
    from rich.console import Console

    console = Console()
    model, real = scaled.model, setting
    title = (
        f"here: gloo, PP {real.pp} x EP {real.ep} processes, {real.model.layers}-layer MoE "
        f"(hidden {real.model.hidden}, {real.model.experts} experts), {real.microbatches} "
        f"microbatches | sim.: {scaled.devices} x {scaled.gpu} as PP {scaled.pp} x EP {scaled.ep}"
        f"{f' x DP {scaled.dp}' if scaled.dp > 1 else ''}, {model.layers}-layer MoE, "
        f"{model.experts} experts, batch {scaled.batch} x {model.seq_len} tokens"
    )
    console.print(render(measured, simulated, title))
    console.print(
        "throughput: samples per second. peak memory: parameters, gradients, optimizer state "
        "and the activation peak on the rank with the most (here measured from the tensors "
        "held; sim.: 16 bytes per stored parameter plus the simulated activation bytes). bubble: "
        "idle share of the step on the most idle rank. comm.: share of the step spent waiting "
        "for all-to-alls that nothing hides, on the most exposed rank."
    )
    if not math.isnan(ratio):
        console.print(
            f"Overlap hook, measured side by side: DualPipeV steps take {ratio:.3f}x the time "
            f"with the hook than without ({1 / ratio:.2f}x the throughput)."
        )
    if memory:
        _print_memory(console, memory)
    if emulated:
        _print_emulated(console, emulated, setting)
    console.print("\nAgainst the Cut-in-half report's claims (its measured figures: after these):")
    for check in checks:
        console.print(check.text())
    _print_published(console, published)
    return 0


def _print_memory(console: Any, rows: list) -> None:
    from cutpipe.bench.memory import render

    console.print(render(rows, "Memory per rank, measured by the trainer beside the prediction"))
    console.print(
        "predicted: 16 bytes per parameter of the stages a rank holds (the planner's count); "
        "the simulator's live activations fed the bytes each stage's forward left and the share "
        "its W kept, as measured in the same step. The simulator counts an overlapped pair's F "
        "whole before its B frees; with the hook the halves interleave, so a pair's measured "
        'peak is lower (docs/moe.md, "Memory, measured").'
    )


def _print_emulated(console: Any, steps: list, setting: Any) -> None:
    from cutpipe.bench.emulated import COSTS, hook_ratios, render

    console.print(
        render(
            steps,
            f"Emulated (--emulate --ep {setting.ep}, {setting.emulate_unit * 1e3:g} ms per unit): "
            f"F={COSTS.f:g} B={COSTS.b:g} per stage, all-to-alls half of each",
        )
    )
    for name, (measured, simulated) in hook_ratios(steps).items():
        console.print(
            f"{name}: a step with the hook takes {measured:.3f}x the step without it "
            f"(simulated {simulated:.3f}x)."
        )


def _published(scaled: Any, simulated: list, measured: list) -> dict[str, Any]:
    """The report's Table 2 beside the simulation at its setting and the real run (JSON-ready)."""
    from cutpipe.bench import published as table_2
    from cutpipe.bench.simulated import SimulatedSetting, simulate_at_scale

    differences = table_2.setting_differences(scaled)
    at_report, rows = scaled, simulated
    if differences:  # the comparison needs the report's setting: simulate it apart
        at_report = SimulatedSetting()
        rows = simulate_at_scale(at_report)
    comparisons = table_2.compare(rows, measured)
    explanations = table_2.explain(comparisons, rows, measured, at_report)
    return {
        "source": table_2.SOURCE,
        "setting": table_2.REPORT_SETTING,
        "figures": table_2.PUBLISHED,
        "table_1": table_2.TABLE_1,
        "conclusions": list(table_2.CONCLUSIONS),
        "tolerance": table_2.TOLERANCE,
        "simulated_setting": {
            "gpu": at_report.gpu,
            "devices": at_report.devices,
            "pp": at_report.pp,
            "ep": at_report.ep,
            "batch": at_report.batch,
            "model": at_report.model.name,
        },
        "simulation_above_differs": differences,
        "comparisons": [c.to_dict() for c in comparisons],
        "explanations": [e.to_dict() for e in explanations],
    }


def _print_published(console: Any, published: dict[str, Any]) -> None:
    from cutpipe.bench.published import Comparison, Explanation, render, tolerance_text

    at = published["simulated_setting"]
    console.print(
        f"\nBeside the report's measured figures ({published['source']}: 8 A100s, 40-layer MoE, "
        "8 experts, batch 1024 x 2048 tokens). sim.: cutpipe's simulation at that setting, "
        f"{at['devices']} x {at['gpu']} as PP {at['pp']} x EP {at['ep']}, {at['model']} (the "
        "split and the hidden sizes are cutpipe's: the report gives neither). here: the small "
        "real run, not to scale."
    )
    if published["simulation_above_differs"]:
        console.print(
            "The simulation above is not at the report's setting ("
            + ", ".join(published["simulation_above_differs"])
            + "); the rows below simulate the report's."
        )
    comparisons = [Comparison(**c) for c in published["comparisons"]]
    console.print(render(comparisons, "The Cut-in-half report's Table 2 beside cutpipe"))
    explanations = [Explanation(**e) for e in published["explanations"]]
    console.print(
        f"* outside the tolerance ({tolerance_text()}). Where they differ, why, from the "
        "simulation's own numbers:"
    )
    if not explanations:
        console.print("- every figure is within the tolerance.")
    for explanation in explanations:
        console.print(explanation.line())
