"""Published training layouts beside what ``recommend`` picks for the same model and devices.

- DeepSeek-V3 (technical report, section 3): 2,048 H800s, PP 16 (DualPipe) x DP 128 with EP 64,
  ZeRO-1, no TP; 15,360 sequences of 4,096 tokens per step; FP8 matmuls.
- Llama 3 405B (The Llama 3 Herd of Models, table 4): 8,192 H100s, TP 8 x PP 16 x DP 64 with
  interleaved 1F1B; 16 M tokens (2,048 sequences of 8,192) per step; bf16.

For each, the rank of the best plan on the published (PP, DP, EP, TP) among every plan
``recommend`` keeps (it searches schedule and setting per layout), in bf16. The table in
docs/plan.md.

    python benchmarks/deployments.py
"""

from __future__ import annotations

from pathlib import Path

from cutpipe.model_config import load_model_config
from cutpipe.plan.costs.model import gpu
from cutpipe.plan.recommend.recommend import recommend

MODELS = Path(__file__).parent.parent / "examples" / "models"
#: (name, model file, GPU, devices, sequences per step, published (PP, DP, EP, TP))
DEPLOYMENTS = [
    ("DeepSeek-V3", "deepseek-v3-like.yaml", "H800", 2048, 15360, (16, 128, 64, 1, 1)),
    ("Llama 3 405B", "llama3-405b.yaml", "H100", 8192, 2048, (16, 64, 1, 8, 1)),
]


def describe(plan) -> str:
    return f"{plan.schedule_label()} {plan.layout()}, {plan.training.short()}"


def main() -> None:
    print("| deployment | devices | recommend's pick | tokens/s | published layout, its best plan "
          "| tokens/s | its rank |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, file, gpu_name, devices, batch, shape in DEPLOYMENTS:
        model = load_model_config(MODELS / file)
        plans = recommend(model, gpu(gpu_name), devices, global_batch=batch)
        rank, mine = next((i, p) for i, p in enumerate(plans, 1) if p.shape() == shape)
        best = plans[0]
        print(f"| {name} | {devices} x {gpu_name} | {describe(best)} | "
              f"{best.tokens_per_second / 1e6:.2f} M | {describe(mine)} | "
              f"{mine.tokens_per_second / 1e6:.2f} M | {rank} of {len(plans)} |")  # fmt: skip


if __name__ == "__main__":
    main()
