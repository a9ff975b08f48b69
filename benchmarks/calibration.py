"""The analytic cost model against the zero-bubble paper's profiled A100 passes.

Prints, for the two models whose pass times the paper lists (GPT-style, plain 4h MLP, no flash
attention, sequences of 1024, three layers per stage, A100-80GB), cutpipe's predicted F, B, W
and pipeline transfer beside the profiled ones, and the bubble rates the simulator gives for
1F1B, ZB-H1 and ZB-H2 fed either set of costs. This is the table of docs/plan.md, "Calibration".

    python benchmarks/calibration.py
"""

from __future__ import annotations

from cutpipe.plan.costs import layer_cost, p2p_time
from cutpipe.plan.hardware import gpu
from cutpipe.schedule.registry import generate
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec


def gpt(name: str, layers: int, hidden: int, heads: int, microbatch: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, 4 * hidden, 50304, 1024,
                     microbatch_size=microbatch, gated_mlp=False, flash_attention=False)  # fmt: skip


#: (model, pipeline ranks, microbatches, profiled F, B, W, comm in microseconds)
PROFILED = [
    (gpt("1.5B", 22, 2304, 24, 6), 8, 24, (18522, 18086, 9337, 601)),
    (gpt("14.6B", 46, 5120, 64, 1), 16, 64, (11307, 11254, 8101, 379)),
]
LAYERS_PER_STAGE = 3


def bubbles(ranks: int, microbatches: int, costs: Costs) -> list[float]:
    out = []
    for name in ("1f1b", "zbh1", "zbh2"):
        result = metrics(simulate(generate(name, ranks, microbatches), costs), costs)
        out.append(result.bubble_ratio_span if name == "zbh2" else result.bubble_ratio)
    return out


def main() -> None:
    a100 = gpu("A100-80GB")
    print("| model | pass | profiled (us) | predicted (us) | error |")
    print("|---|---|---|---|---|")
    rows = []
    for model, ranks, m, measured in PROFILED:
        layer = layer_cost(model, a100, 0)
        predicted = (
            LAYERS_PER_STAGE * layer.forward * 1e6,
            LAYERS_PER_STAGE * layer.backward * 1e6,
            LAYERS_PER_STAGE * layer.weight * 1e6,
            p2p_time(model, a100, within_node=True) * 1e6,
        )
        for name, want, got in zip(("F", "B", "W", "comm"), measured, predicted, strict=True):
            print(f"| {model.name} | {name} | {want} | {got:.0f} | {got / want - 1:+.1%} |")
        print(f"| {model.name} | W/F | {measured[2] / measured[0]:.3f} | "
              f"{predicted[2] / predicted[0]:.3f} | |")  # fmt: skip
        rows.append((model, ranks, m, measured, predicted))
    print()
    print("| model | R | m | costs | 1F1B | ZB-H1 | ZB-H2 (span) |")
    print("|---|---|---|---|---|---|---|")
    for model, ranks, m, measured, predicted in rows:
        for label, (f, b, w, comm) in (("profiled", measured), ("predicted", predicted)):
            values = bubbles(ranks, m, Costs(f=f, b=b, w=w, comm=comm))
            cells = " | ".join(f"{v:.4f}" for v in values)
            print(f"| {model.name} | {ranks} | {m} | {label} | {cells} |")
    thin = PROFILED[1][0]
    wide = ModelSpec(**{**thin.__dict__, "microbatch_size": 2})

    def per_token(spec: ModelSpec) -> float:
        layer = layer_cost(spec, a100, 0)
        return (layer.forward + layer.backward + layer.weight) / spec.tokens

    print()
    print(f"14.6B, microbatch 1 -> 2: {per_token(thin) / per_token(wide) - 1:.1%} faster per token")


if __name__ == "__main__":
    main()
