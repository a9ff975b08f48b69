"""``recommend`` on the jobs of Megatron-LM's published runs: is any winner faster than A100s
have been measured to go?

For each job of the two papers (cutpipe.plan.costs.megatron: the model, the GPUs and the global
batch, with the published layout left open), ``recommend`` searches every layout, schedule and
setting, and this prints its winner's MFU beside the best MFU measured on A100s in those papers
(Korthikanti et al. 2022: 56.3 %, their 1 T run with sequence parallelism and selective
recompute) and beside the published run's own, as the planner predicts it. docs/plan.md,
"Calibration on Megatron-LM's runs", says which modelled effects let a winner go beyond.

    python benchmarks/megatron_winners.py [--runs 22B 175B 530B 1T]
"""

from __future__ import annotations

import argparse

from cutpipe.plan.costs.megatron import RUNS, predict
from cutpipe.plan.recommend.recommend import recommend

#: The best MFU measured on A100s in the two papers (Korthikanti et al. 2022, Table 4, 1 T).
BEST_MEASURED_MFU = 0.563


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", help="model labels (default: every job once)")
    args = parser.parse_args()
    seen = set()
    print("| job | published layout | its predicted MFU | recommend's winner | setting | MFU "
          "| over the best measured |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for run in RUNS:
        job = (run.model.name, run.gpus, run.batch)
        if job in seen or (args.runs and run.model.name not in args.runs):
            continue
        seen.add(job)
        published = predict(run).plan
        winner = recommend(run.model, run.job().hardware, run.gpus, run.batch, keep=1)[0]
        print(
            f"| {run.model.name} on {run.gpus:,} A100s, batch {run.batch:,} | {run.describe()} "
            f"| {published.mfu:.1%} | {winner.schedule_label()} {winner.layout()} "
            f"| {winner.training.short()} | {winner.mfu:.1%} "
            f"| {winner.mfu / BEST_MEASURED_MFU - 1:+.0%} |"
        )


if __name__ == "__main__":
    main()
