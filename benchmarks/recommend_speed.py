"""How long ``recommend`` takes on the largest jobs it is asked about, and how much it simulates.

Five workloads: dense 530B on 2,520 A100s, dense 1T on 3,072 A100s, Llama 3 405B's shape on
16,384 H100s (2,048 sequences), and the DeepSeek-V3-like MoE on 2,048 H800s (15,360 sequences)
and on 16,384 H800s (61,440 sequences: at 8 a device, 131,072, the layouts would hold more
ops than recommend simulates). Each is timed as the command runs it (the 12 best
kept, the rest refused by their throughput bound where it can), and the table gives the wall
seconds, the layouts weighed, how many of them were simulated and how many were refused
unsimulated.

    python benchmarks/recommend_speed.py [--only NAME ...] [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from cutpipe.model_config import load_model_config
from cutpipe.plan.costs.model import gpu
from cutpipe.plan.recommend.recommend import Rejected, recommend

ROOT = Path(__file__).parent.parent
KEEP = 12  # what ``cutpipe recommend`` keeps (its --top or 12)
UNSIMULATED = "even with no bubble"  # a throughput bound's refusal


@dataclass(frozen=True)
class Workload:
    name: str
    model: Path
    gpu: str
    devices: int
    global_batch: int | None


WORKLOADS = [
    Workload("dense-530b", ROOT / "benchmarks/models/dense-530b.yaml", "A100-80GB", 2520, 2520),
    Workload("dense-1t", ROOT / "benchmarks/models/dense-1t.yaml", "A100-80GB", 3072, 3072),
    Workload("llama3-405b", ROOT / "examples/models/llama3-405b.yaml", "H100", 16384, 2048),
    Workload("deepseek-v3 2k", ROOT / "examples/models/deepseek-v3-like.yaml", "H800", 2048, 15360),
    Workload(
        "deepseek-v3 16k", ROOT / "examples/models/deepseek-v3-like.yaml", "H800", 16384, 61440
    ),
]


def timed(workload: Workload) -> tuple[float, int, int, int, str]:
    """Seconds, layouts weighed, simulated, refused unsimulated, and the winner."""
    model = load_model_config(workload.model)
    rejected: list[Rejected] = []
    start = time.perf_counter()
    plans = recommend(model, gpu(workload.gpu), workload.devices, workload.global_batch,
                      rejected=rejected, keep=KEEP)  # fmt: skip
    seconds = time.perf_counter() - start
    bounded = sum(UNSIMULATED in r.reason for r in rejected)
    # layouts that reached the ranking: every plan, and every refusal of a layout with a schedule
    # that is not refused before (batch split, items, schedule shape): memory or the bound
    weighed = len(plans) + sum(
        1 for r in rejected if r.schedule and (UNSIMULATED in r.reason or r.excess > 0)
    )
    best = plans[0]
    winner = f"{best.schedule_label()} {best.layout()} {best.tokens_per_second:,.0f}"
    return seconds, weighed, weighed - bounded, bounded, winner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="workload names (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per workload (median shown)")
    args = parser.parse_args()
    chosen = [w for w in WORKLOADS if not args.only or w.name in args.only]
    print("| workload | devices | seconds | layouts | simulated | refused unsimulated | winner |")
    print("|---|---|---|---|---|---|---|")
    for workload in chosen:
        runs = [timed(workload) for _ in range(args.repeat)]
        seconds = statistics.median(run[0] for run in runs)
        _, weighed, simulated, bounded, winner = runs[0]
        print(f"| {workload.name} | {workload.devices} x {workload.gpu} | {seconds:.1f} | "
              f"{weighed} | {simulated} | {bounded} | {winner} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
