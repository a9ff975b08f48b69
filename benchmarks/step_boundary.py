"""Step boundaries: the time per step of many steps, optimizer step synchronous or overlapped.

Emulated runs (costs as sleeps, 4 gloo ranks) of ZB-V and DualPipeV beside the simulator's
steady state (``cutpipe.sim.steps.simulate_steps``) for both boundaries, and real gloo runs (an
MLP trained with AdamW, clipped by the global norm) of the same schedules. Each schedule runs
both boundaries in alternating rounds; the steady-state step is the median interval between the
pipeline's step ends over every round (``cutpipe.bench.boundaries``), and the ratio of overlap to
sync is what the boundary buys.

    python benchmarks/step_boundary.py [--steps 10] [--rounds 3] [--unit 0.02] [--width 256]
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from cutpipe.bench.boundaries import BoundarySetting, measure_rank, measured_steps
from cutpipe.launch import run
from cutpipe.schedule.registry import generate
from cutpipe.sim.steps import simulate_steps


def predicted(setting: BoundarySetting, name: str) -> dict[str, float]:
    schedule = generate(name, setting.ranks, setting.microbatches)
    return {
        boundary: simulate_steps(
            schedule, setting.stage_costs(name), steps=setting.steps, boundary=boundary
        ).steady
        * setting.unit
        for boundary in ("sync", "overlap")
    }


def measure(setting: BoundarySetting) -> dict[str, dict]:
    return measured_steps(run(measure_rank, setting.ranks, (setting,), timeout=1800), setting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--unit", type=float, default=0.02, help="seconds per cost unit")
    parser.add_argument("--width", type=int, default=256, help="the real runs' MLP width")
    args = parser.parse_args()
    common = dict(steps=args.steps, rounds=args.rounds, microbatches=args.microbatches)
    emulated = BoundarySetting(unit=args.unit, **common)
    real = BoundarySetting(width=args.width, **common)

    table = Table(title=f"{emulated.ranks} gloo ranks, m = {args.microbatches}, "
                  f"{args.steps} steps x {args.rounds} rounds per boundary (ms per step)")  # fmt: skip
    for column in ("run", "schedule", "sync", "overlap", "overlap / sync",
                   "simulated sync", "simulated overlap", "simulated ratio"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("run", "schedule") else "right")
    for name, result in measure(emulated).items():
        model = predicted(emulated, name)
        table.add_row(
            f"emulated ({args.unit * 1000:g} ms per unit)", name,
            f"{result['sync'] * 1000:.1f}", f"{result['overlap'] * 1000:.1f}",
            f"{result['ratio']:.3f}", f"{model['sync'] * 1000:.1f}",
            f"{model['overlap'] * 1000:.1f}", f"{model['overlap'] / model['sync']:.3f}",
        )  # fmt: skip
    for name, result in measure(real).items():
        table.add_row(
            f"real MLP (width {args.width}, {real.blocks} blocks)", name,
            f"{result['sync'] * 1000:.1f}", f"{result['overlap'] * 1000:.1f}",
            f"{result['ratio']:.3f}", "", "", "",
        )  # fmt: skip
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
