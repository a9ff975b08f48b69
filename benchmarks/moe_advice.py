"""What ``recommend`` picks for the Cut-in-half report's 40-layer, 8-expert MoE on 8 to 64 GPUs.

The report's selection guide (docs/formulas.md): up to 8 devices prefer Cut-in-half (DualPipeV)
for its memory saving, 8 to 32 try ZB-V variants, beyond that combine pipeline with other
parallelism. This prints, for each device count and GPU, the simulated winner, the best plan that
uses a pipeline, and where Cut-in-half and ZB-V land, as the table in docs/plan.md. Nothing here
encodes the advice.

    python benchmarks/moe_advice.py [--global-batch 1024] [--gpus A100,H100] [--memory-gb G]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cutpipe.plan.costs.model import gpu
from cutpipe.plan.recommend.recommend import recommend
from cutpipe.spec import ModelSpec

MODEL = Path(__file__).parent.parent / "examples" / "models" / "moe-40l.yaml"


def describe(plan, best) -> str:
    if plan is None:
        return "does not fit"
    slower = 1 - plan.tokens_per_second / best.tokens_per_second
    return (
        f"{plan.schedule_label()} {plan.layout()} ({slower:.1%} slower)"
        if slower > 0
        else (f"{plan.schedule_label()} {plan.layout()}")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--gpus", default="A100,H100")
    parser.add_argument("--memory-gb", type=float)
    args = parser.parse_args()
    model = ModelSpec.load(MODEL)
    memory = args.memory_gb * 1e9 if args.memory_gb else None
    print("| GPU | devices | winner | best with a pipeline | best Cut-in-half | best ZB-V |")
    print("|---|---|---|---|---|---|")
    for name in args.gpus.split(","):
        for devices in (8, 16, 32, 64):
            plans = recommend(model, gpu(name), devices, args.global_batch, memory)
            best = plans[0]
            piped = next((p for p in plans if p.pp > 1), None)
            cut = next((p for p in plans if p.schedule == "dualpipev" and p.pp > 1), None)
            zbv = next((p for p in plans if p.schedule == "zbv"), None)
            cells = [describe(best, best), describe(piped, best), describe(cut, best),
                     describe(zbv, best)]  # fmt: skip
            print(f"| {name} | {devices} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
