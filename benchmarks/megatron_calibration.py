"""The planner against Megatron-LM's published runs (cutpipe.plan.costs.megatron).

Prints three tables, those of docs/plan.md, "Calibration on Megatron-LM's runs": each run's
published figure beside the planner's (TFLOP/s per GPU counted the paper's way, or seconds per
iteration) and their ratio; where the predicted step goes on its busiest rank; and the
predicted over measured step with each effect the planner leaves out added
(``megatron.what_ifs``). Then the largest errors.

    python benchmarks/megatron_calibration.py
"""

from __future__ import annotations

from cutpipe.plan.costs.megatron import (
    RUNS,
    SECONDS,
    breakdown,
    measured_step,
    predict,
    what_ifs,
)


def main() -> None:
    predictions = [predict(run) for run in RUNS]
    print("| paper | model | layout | published | predicted | ratio | step ratio |")
    print("|---|---|---|---|---|---|---|")
    for p in predictions:
        run = p.run
        digits = 2 if run.unit == SECONDS else 0
        print(
            f"| {run.paper} | {run.label} | {run.describe()} | {run.measured:.{digits}f} "
            f"{run.unit} | {p.value:.{digits}f} | {p.ratio:.3f} | {p.step_ratio:.3f} |"
        )
    print()
    names = ("compute", "tp", "allreduce", "optimizer", "bubble")
    print("| paper | model | predicted step (s) | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for p in predictions:
        parts = breakdown(p)
        cells = " | ".join(f"{parts[name] / p.step:.1%}" for name in names)
        print(f"| {p.run.paper} | {p.run.label} | {p.step:.2f} | {cells} |")
    print()
    changes = tuple(what_ifs(predictions[0]))
    print("| paper | model | step ratio | " + " | ".join(f"+ {name}" for name in changes) + " |")
    print("|---|---|---|" + "---|" * len(changes))
    worst_all = 0.0
    for p in predictions:
        measured = measured_step(p.run)
        adjusted = what_ifs(p)
        worst_all = max(worst_all, abs(adjusted["all"] / measured - 1))
        cells = " | ".join(f"{adjusted[name] / measured:.3f}" for name in changes)
        print(f"| {p.run.paper} | {p.run.label} | {p.step_ratio:.3f} | {cells} |")
    print()
    worst = max(predictions, key=lambda p: abs(p.ratio - 1))
    slowest = max(predictions, key=lambda p: abs(p.step_ratio - 1))
    print(
        f"largest error in the papers' units: {worst.ratio - 1:+.1%} ({worst.run.paper}, "
        f"{worst.run.label}); in step time: {slowest.step_ratio - 1:+.1%}; with every "
        f"what-if added: {worst_all:.1%}"
    )
    speedups(predictions)


def speedups(predictions: list) -> None:
    """Korthikanti et al.'s gain from sequence parallelism and selective recomputation."""
    by_label = {p.run.label: p for p in predictions}
    for p in predictions:
        if p.run.recompute == "selective":
            full = by_label[p.run.label.replace("selective", "full")]
            print(
                f"{p.run.model.name}: full -> selective + SP {full.run.measured / p.run.measured:.3f}x "
                f"measured, {full.step / p.step:.3f}x predicted"
            )


if __name__ == "__main__":
    main()
