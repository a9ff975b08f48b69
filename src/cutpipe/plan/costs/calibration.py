"""The cost model against the zero-bubble paper's measurements (docs/plan.md, "Calibration").

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), trained GPT-style models (a plain 4h
MLP, no flash attention, sequences of 1,024) with Megatron-LM on A100-80GB GPUs, pipeline only
(its Table 3), the first and last stages one layer short for the embedding and the loss. It
profiled each pass (Table 6) and measured samples per GPU per second for 1F1B, interleaved 1F1B
with a layer per chunk (1F1B-I), and its automatically searched schedules at the memory of
1F1B (ZB-1p) and twice that (ZB-2p) (Table 4). The model's matmul curve, elementwise traffic and
send cost are fitted to Table 6, its per-pass overhead to Table 4's ZB-2p column; the other
columns of Table 4 test it.

The runs are modelled as the paper ran them. Megatron-LM's 1F1B and interleaved schedules wait
for each send after each pass (``blocking_sends``); the zero-bubble schedules post their sends
and move on (the simulator's own model). A pipeline longer than a node pays the link between
nodes on every send, as ``recommend`` charges it (``slowest_send``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cutpipe.plan.costs.hardware import gpu
from cutpipe.plan.costs.model import (
    PASS_OVERHEAD,
    layer_cost,
    model_items,
    optimizer_time,
    p2p_time,
)
from cutpipe.plan.partition import stage_costs
from cutpipe.plan.search.caps import default_cap
from cutpipe.plan.search.tune import cost_aware
from cutpipe.schedule.registry import generate
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

SCHEDULES = ("1f1b", "1f1b-i", "zb-1p", "zb-2p")


@dataclass(frozen=True)
class Setup:
    """One model of the paper's Table 3, with its measurements."""

    model: ModelSpec
    ranks: int  # pipeline stages, one GPU each
    microbatches: tuple[int, int, int]
    profiled: tuple[
        float, float, float, float
    ]  # Table 6, the middle microbatch count: F, B, W, comm (ms)
    #: Table 4: samples per GPU per second, per schedule, per microbatch count
    measured: dict[str, tuple[float, float, float]]
    decimals: int  # of Table 4's figures for this model

    def measured_gain(self, schedule: str, column: int) -> tuple[float, float]:
        """The least and greatest gain over 1F1B that Table 4's rounded figures allow.

        The figures have two or three digits, so a gain read from them is uncertain by up to
        1.3 points (0.87 / 0.76 on the 28.3B model is anything from 13.1 % to 15.9 %).
        """
        half = 0.5 * 10.0**-self.decimals
        ours, base = self.measured[schedule][column], self.measured["1f1b"][column]
        return (ours - half) / (base + half) - 1, (ours + half) / (base - half) - 1

    @property
    def layers_per_stage(self) -> int:
        """Of a middle stage (the first and last hold one fewer, beside the embedding/loss)."""
        return (self.model.layers + 2) // self.ranks


def _gpt(name: str, layers: int, hidden: int, heads: int, microbatch: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, 4 * hidden, 50304, 1024,
                     microbatch_size=microbatch, gated_mlp=False, flash_attention=False)  # fmt: skip


SETUPS = (
    Setup(_gpt("1.5B", 22, 2304, 24, 6), 8, (24, 32, 64), (18.513, 18.086, 9.331, 0.626),
          {"zb-2p": (14.5, 14.8, 14.9), "zb-1p": (12.9, 13.4, 14.2),
           "1f1b": (11.8, 12.5, 13.6), "1f1b-i": (13.1, 13.4, 13.9)}, 1),
    Setup(_gpt("6.2B", 30, 4096, 32, 3), 8, (24, 32, 64), (29.802, 29.428, 19.530, 0.577),
          {"zb-2p": (4.32, 4.35, 4.39), "zb-1p": (3.88, 4.00, 4.20),
           "1f1b": (3.50, 3.70, 4.03), "1f1b-i": (4.01, 4.08, 4.19)}, 2),
    Setup(_gpt("14.6B", 46, 5120, 40, 1), 16, (48, 64, 128), (11.307, 11.254, 8.101, 0.379),
          {"zb-2p": (1.81, 1.83, 1.85), "zb-1p": (1.61, 1.67, 1.76),
           "1f1b": (1.40, 1.49, 1.64), "1f1b-i": (1.54, 1.59, 1.66)}, 2),
    Setup(_gpt("28.3B", 62, 6144, 48, 1), 32, (96, 128, 256), (10.408, 10.204, 7.703, 0.408),
          {"zb-2p": (0.99, 1.00, 1.00), "zb-1p": (0.87, 0.90, 0.96),
           "1f1b": (0.76, 0.80, 0.88), "1f1b-i": (0.82, 0.85, 0.90)}, 2),
)  # fmt: skip
A100 = gpu("A100-80GB")


def predicted_passes(setup: Setup) -> tuple[float, float, float, float]:
    """The model's F, B, W of a middle stage and its send, in ms, as the paper profiled them
    (the passes themselves, without ``PASS_OVERHEAD`` between them)."""
    layer = layer_cost(setup.model, A100, 0)
    k = setup.layers_per_stage
    passes = [k * (t - PASS_OVERHEAD) * 1e3 for t in (layer.forward, layer.backward, layer.weight)]
    return (*passes, p2p_time(setup.model, A100, within_node=True) * 1e3)


def slowest_send(setup: Setup) -> float:
    """One pipeline send, across nodes when the pipeline is longer than a node.

    Only the sends between the last GPU of a node and the first of the next cross nodes, but
    the planner charges every send the slowest link its pipeline crosses (``recommend``), and
    so does this model: with blocking sends every rank moves at that link's pace, and with
    posted ones the tight schedules (1F1B's memory) wait on it.
    """
    within_node = setup.ranks <= A100.gpus_per_node
    return p2p_time(setup.model, A100, within_node=within_node)


def stage_costs_of(setup: Setup, chunks: int = 1) -> Costs:
    """The model's per-stage costs with the paper's split (``chunks`` stages per rank)."""
    items = model_items(setup.model, A100)
    per_stage = len(items) // (setup.ranks * chunks)
    comm = slowest_send(setup)
    kept = 32 / 34  # the paper's memory model: W keeps 32h of a layer's 34h per token
    return stage_costs(items, [per_stage] * (setup.ranks * chunks), comm, kept)


def blocking_sends(costs: Costs, stages: int) -> Costs:
    """``costs`` as Megatron-LM's 1F1B and interleaved schedules run them.

    After each pass a rank waits for its send/receive pair with a neighbour (Megatron's
    ``overlap_p2p_comm`` is off by default), so a pass that sends holds its GPU for the transfer
    and its output arrives when the held pass ends. Each exchange also waits for the
    neighbour's, so the ranks move in step at the pace of the slowest link, whose transfer
    ``costs.comm`` holds (``slowest_send``).
    """
    send = costs.comm
    f = [t + (send if s < stages - 1 else 0.0) for s, t in enumerate(costs.per_stage("f", stages))]
    b = [t + (send if s > 0 else 0.0) for s, t in enumerate(costs.per_stage("b", stages))]
    return replace(costs, f=f, b=b, comm=0.0)


def gain_error(setup: Setup, schedule: str, column: int, predicted: float) -> float:
    """How far the predicted gain over 1F1B lies outside the range Table 4 allows (0: inside)."""
    low, high = setup.measured_gain(schedule, column)
    return max(low - predicted, predicted - high, 0.0)


def predicted_throughput(setup: Setup, schedule: str, microbatches: int) -> float:
    """Samples per GPU per second the model predicts for one column of Table 4 (or for
    ``"zb-h1"``, the handcrafted schedule whose bubble rate the paper's ZB-1p had)."""
    p = setup.ranks
    if schedule in ("1f1b", "1f1b-i"):  # Megatron's: 1F1B-I with a layer per chunk, the ends
        chunks = setup.layers_per_stage if schedule == "1f1b-i" else 1  # included
        costs = blocking_sends(stage_costs_of(setup, chunks), p * chunks)
        name = f"interleaved:chunks={chunks}" if chunks > 1 else "1f1b"
        step = metrics(simulate(generate(name, p, microbatches), costs), costs).makespan
    else:  # ZB-1p / ZB-2p: cost-aware at 1x / 2x 1F1B's memory, steps overlapping
        costs = stage_costs_of(setup)
        if schedule == "zb-h1":  # handcrafted, the bubble rate of the paper's ZB-1p (Table 5)
            order = generate("zbh1", p, microbatches)
        else:
            cap = (1.0 if schedule == "zb-1p" else 2.0) * default_cap("linear", p, costs)
            span = lambda result: (result.bubble_ratio_span, result.makespan)  # noqa: E731
            order = cost_aware("linear", p, microbatches, costs, cap, span, search_seconds=0)
        step = max(metrics(simulate(order, costs), costs).span_per_rank)
    parameters = sum(item.parameters for item in model_items(setup.model, A100)) / p
    step += optimizer_time(parameters, A100)
    return microbatches * setup.model.microbatch_size / (step * p)
