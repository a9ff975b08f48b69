"""DeepSeek-V3's run on 2,048 H800s: what ``recommend`` picks, and its published layout beside it.

DeepSeek-V3 (technical report, section 3) trained on 2,048 H800s: PP 16 with DualPipe, EP 64
over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism, 15,360 sequences of 4,096 tokens
per step, recomputing RMSNorm and the MLA up-projections and running its matmuls in FP8. This
prints the fastest plans ``recommend`` finds for examples/models/deepseek-v3-like.yaml in bf16,
then the published layout under the same model (with the least recompute that fits it), and
the figures that separate them: compute per microbatch (matmul efficiency depends on how many
tokens each expert multiplies, ``T*k*EP/E``), recompute, the expert all-to-all and the link it
crosses, the bubble and the memory. The table and the comparison in docs/plan.md.

    python benchmarks/deepseek_v3.py
"""

from __future__ import annotations

import time
from pathlib import Path

from cutpipe.model_config import load_model_config
from cutpipe.plan.costs.model import Training, gpu, model_items
from cutpipe.plan.recommend.recommend import Job, Layout, Plan, evaluate, recommend

MODEL = Path(__file__).parent.parent / "examples" / "models" / "deepseek-v3-like.yaml"
DEVICES, BATCH = 2048, 15360


def figures(plan: Plan, model, hardware) -> dict[str, str]:
    within = plan.ep * plan.tp <= hardware.gpus_per_node
    items = model_items(model, hardware, plan.ep, within, plan.training)
    plain = model_items(model, hardware, plan.ep, within, Training(plan.training.zero, plan.dp,
                        "none", plan.training.fp8, plan.tp))  # fmt: skip
    work = sum(i.forward + i.backward + i.weight for i in items)
    extra = work - sum(i.forward + i.backward + i.weight for i in plain)
    moe = next(i for i in items if "MoE" in i.name)
    tokens = model.tokens * model.top_k * plan.ep / model.experts
    return {
        "layout": plan.layout(),
        "schedule": plan.schedule_title(),
        "setting": plan.training.describe(),
        "microbatches per pipeline": str(plan.microbatches),
        "tokens/s": f"{plan.tokens_per_second:,.0f}",
        "step": f"{plan.step_time:.2f} s",
        "GPU time per 1,000 tokens (F+B+W, TP ranks summed)": f"{work * plan.tp / model.tokens * 1e3:.3f} s "
        f"(recompute {extra * plan.tp / model.tokens * 1e3:.3f} s)",
        "tokens per expert matmul": f"{tokens:,.0f}",
        "MoE layer F / its all-to-all": f"{moe.forward * 1e3:.1f} / {moe.ep_forward * 1e3:.1f} ms "
        f"({'NVLink' if within else 'network'})",
        "bubble": f"{plan.bubble:.1%}",
        "communication share": f"{plan.comm_share:.0%}",
        "memory (fullest rank)": f"{plan.peak_memory / 1e9:.1f} GB",
    }


def main() -> None:
    model, hardware = load_model_config(MODEL), gpu("H800")
    start = time.perf_counter()
    plans = recommend(model, hardware, DEVICES, global_batch=BATCH, keep=12)
    seconds = time.perf_counter() - start
    print(f"recommend: {seconds:.0f} s")
    for rank, plan in enumerate(plans[:5], 1):
        print(f"{rank}. {plan.schedule_label()} {plan.layout()} {plan.training.short()}: "
              f"{plan.tokens_per_second:,.0f} tokens/s, bubble {plan.bubble:.1%}, "
              f"{plan.peak_memory / 1e9:.1f} GB")  # fmt: skip
    job, layout = (
        Job(model, hardware, DEVICES, BATCH),
        Layout(16, 128, 64, "dualpipe", BATCH // 128),
    )
    published = None
    for recompute in ("none", "selective", "full"):
        outcome = evaluate(job, layout, Training(zero=1, dp=128, recompute=recompute))
        print(f"published layout, recompute {recompute}: "
              + (f"{outcome.tokens_per_second:,.0f} tokens/s" if isinstance(outcome, Plan)
                 else outcome.reason))  # fmt: skip
        if isinstance(outcome, Plan):
            published = outcome
            break
    better = sorted([*plans, published], key=lambda p: -p.tokens_per_second)
    print(f"the published layout would rank {better.index(published) + 1} of {len(better)}")
    print()
    print("| | recommend's winner | DeepSeek-V3's layout |")
    print("|---|---|---|")
    left, right = figures(plans[0], model, hardware), figures(published, model, hardware)
    for key in left:
        print(f"| {key} | {left[key]} | {right[key]} |")


if __name__ == "__main__":
    main()
