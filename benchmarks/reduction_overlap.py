"""How much of the data-parallel gradient reduction the planner hides in the pipeline's
cool-down (cutpipe.plan.recommend.reduction; docs/plan.md, "What it predicts").

dense-7b on 32 H100s (four nodes: the reduction crosses the network), PP=4 x DP=8, 16
microbatches, no ZeRO: each schedule's step with each stage's reduction started once the stage
is done (cutpipe's runtime) beside one collective per rank after its last op (Megatron-LM's
non-overlapped DDP), and the reduction the step waits for in each.

    python benchmarks/reduction_overlap.py
"""

from __future__ import annotations

from pathlib import Path

from cutpipe.plan.costs.model import Training, gpu
from cutpipe.plan.recommend.recommend import Job, Layout, Plan, evaluate
from cutpipe.spec import ModelSpec

MODEL = Path(__file__).parent.parent / "examples" / "models" / "dense-7b.yaml"
SCHEDULES = ("1f1b", "zbh1", "interleaved:chunks=2", "zbv", "dualpipev", "dualpipe")


def step(schedule: str, start: str) -> Plan:
    job = Job(ModelSpec.load(MODEL), gpu("H100"), 32, reduction_start=start)
    plan = evaluate(job, Layout(4, 8, 1, schedule, 16), Training())
    if not isinstance(plan, Plan):
        raise SystemExit(f"{schedule}: {plan.reason}")
    return plan


def main() -> None:
    print(
        "| schedule | step, per stage (ms) | step, per rank (ms) | reduction waited for, per stage (ms) | per rank (ms) |"
    )
    print("|---|---|---|---|---|")
    for schedule in SCHEDULES:
        early, late = step(schedule, "stage"), step(schedule, "rank")
        print(
            f"| {schedule} | {early.step_time * 1e3:.1f} | {late.step_time * 1e3:.1f} | "
            f"{early.breakdown['dp_reduction'] * 1e3:.1f} | "
            f"{late.breakdown['dp_reduction'] * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
