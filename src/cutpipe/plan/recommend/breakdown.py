"""Where a plan's step goes, on its busiest rank, and how much of the GPU's peak it uses.

The busiest pipeline rank (the most busy time in the simulated step) is the one the others wait
for. Its step is cut into parts (``PARTS``) that add up to the plan's step time:

- ``forward``, ``backward``, ``weight``: the compute of its F, B and W passes (every microbatch
  through every stage it holds), without the communication inside them;
- ``recompute``: what activation recompute adds to its B passes (the rerun forward, or the
  rerun norms and scores);
- ``ep_alltoall``: expert all-to-alls not hidden in an overlapped F&B pair (its busy time less
  its compute);
- ``tp_collectives``, ``cp_exchanges``, ``zero3_gathers``: communication inside F and B, each
  what the cost model would save with that traffic free: tensor parallelism's all-gathers and
  reduce-scatters on the node's fabric, context parallelism's exchanges (on the network, and
  on the node's fabric when there is no TP: where TP and CP share a node their fabric's time
  is counted as TP's), ZeRO-3's weight gathers;
- ``pipeline_sends``: the idle time the transfers of activations and gradients add: the
  pipeline time less the same step simulated without transfer time (``evaluate``'s
  ``split_idle``; ``recommend`` does this for the plans it keeps). Without that second
  simulation, the transfer time of what the rank receives, at most its idle time;
- ``bubble``: the rest of its idle time in the pipeline (the makespan, or its span when steps
  overlap);
- ``dp_reduction``: the gradient reduction over the data-parallel ranks that the step waits for
  after the pipeline, ``optimizer``: the Adam step after it. Each stage's reduction starts once
  the stage is done, so what runs in the cool-down is hidden
  (``cutpipe.plan.recommend.reduction``). When steps synchronise these are the rank's whose
  reduction and optimizer step end last, when they overlap the busiest rank's own;
- ``waiting``: when steps overlap, the wait for the rank whose span and tail end last.

The bubble ``recommend`` reports is this rank's idle share of its pipeline time,
``1 - busy / makespan`` (``/ span`` when steps overlap).

Model FLOPs utilisation: ``model_tflops_per_gpu = training_flops_per_token(model) x tokens/s /
devices`` (F, B and W of every token, recompute not counted), ``mfu`` = that over the GPU's
dense peak in the plan's precision (FP8 where it trains in FP8), and ``hfu`` the same with the
FLOPs recompute adds (the whole forward again for full recompute, the attention scores for
selective recompute without flash attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cutpipe.plan.costs.model import Hardware, ItemCost, Training, training_flops_per_token
from cutpipe.plan.partition import groups
from cutpipe.schedule.placement import Placement
from cutpipe.sim.metrics import Metrics
from cutpipe.spec import ModelSpec

#: The parts of ``Plan.breakdown``, in the order ``--explain`` prints them.
PARTS = (
    "forward", "backward", "weight", "recompute", "pipeline_sends", "ep_alltoall",
    "tp_collectives", "cp_exchanges", "zero3_gathers", "dp_reduction", "optimizer", "bubble",
    "waiting",
)  # fmt: skip
#: A link's bandwidth, in bytes/s, that makes its transfers free to within rounding.
FREE_BANDWIDTH = 1e30

#: ``items(training, hardware)``: the cost items of the plan's layout under a setting, on a
#: variant of the job's hardware (None: the job's own).
Items = Callable[[Training, "Hardware | None"], Sequence[ItemCost]]


@dataclass(frozen=True)
class Rank:
    """What the simulated step says of one pipeline rank."""

    index: int
    busy: float  # seconds its ops run, exposed all-to-alls included
    pipeline: float  # the makespan, or its span when steps overlap
    receives: int  # activations and gradients it receives from other ranks
    reduction: float  # the gradient reduction the step waits for after the pipeline
    optimizer: float  # the optimizer step after it
    quiet: float | None = None  # ``pipeline`` simulated without transfer time, where known


def busiest_of(result: Metrics) -> int:
    return max(range(result.ranks), key=result.busy_per_rank.__getitem__)


def receives(placement: Placement, rank: int, microbatches: int) -> int:
    """Tensors ``rank`` receives from other ranks in a step: an activation into every stage it
    holds from another rank, a gradient from the next stage, for every microbatch."""
    count = 0
    for pipe, ranks in enumerate(placement.pipes):
        through = len(placement.microbatches_of(pipe, microbatches))
        for boundary in range(len(ranks) - 1):
            if placement.is_cross_rank(pipe, boundary):
                count += through * ((ranks[boundary + 1] == rank) + (ranks[boundary] == rank))
    return count


def passes(placement: Placement, rank: int, microbatches: int) -> list[int]:
    """Microbatches through each stage on ``rank`` (0 for the stages it does not hold)."""
    counts = [0] * placement.num_stages
    for pipe, ranks in enumerate(placement.pipes):
        through = len(placement.microbatches_of(pipe, microbatches))
        for stage, holder in enumerate(ranks):
            if holder == rank:
                counts[stage] += through
    return counts


def free_links(hardware: Hardware, within_node: bool) -> Hardware:
    """``hardware`` with the node's fabric (or the network) infinitely fast."""
    if within_node:
        return replace(hardware, intra_bandwidth=FREE_BANDWIDTH, intra_latency=0.0)
    return replace(hardware, inter_bandwidth=FREE_BANDWIDTH, inter_latency=0.0)


def step_breakdown(
    items: Items, training: Training, hardware: Hardware, sizes: Sequence[int],
    placement: Placement, microbatches: int, rank: Rank, comm: float, step: float,
) -> dict[str, float]:  # fmt: skip
    """Seconds of ``rank``'s step by part (see the module); they add up to ``step``."""
    counts = passes(placement, rank.index, microbatches)

    def total(variant: Sequence[ItemCost], field: str) -> float:
        per_stage = [sum(getattr(i, field) for i in part) for part in groups(variant, sizes)]
        return sum(n * t for n, t in zip(counts, per_stage, strict=True))

    def fb(variant: Sequence[ItemCost]) -> float:
        return total(variant, "forward") + total(variant, "backward")

    # each variant only where it differs: the search prices hundreds of settings
    plan = items(training, None)
    once = replace(training, recompute="none")
    once_items = plan if once == training else items(once, None)
    kept = replace(once, zero=min(once.zero, 2))  # no per-pass weight gathers
    kept_items = once_items if kept == once else items(kept, None)
    intra = inter = 0.0
    bare = kept_items
    if training.tp > 1 or training.cp > 1:  # collectives on the node's fabric
        intra = fb(kept_items) - fb(items(kept, free_links(hardware, True)))
        bare = items(kept, free_links(hardware, True))
    if training.cp > 1:  # and on the network (TP stays in a node)
        inter = fb(kept_items) - fb(items(kept, free_links(hardware, False)))
        bare = items(kept, free_links(free_links(hardware, True), False))
    compute = fb(plan) + total(plan, "weight")
    parts = dict.fromkeys(PARTS, 0.0)
    parts["forward"] = total(bare, "forward")
    parts["weight"] = total(plan, "weight")
    parts["recompute"] = fb(plan) - fb(once_items)
    parts["zero3_gathers"] = fb(once_items) - fb(kept_items)
    parts["tp_collectives" if training.tp > 1 else "cp_exchanges"] += intra
    parts["cp_exchanges"] += inter
    inside = ("forward", "recompute", "zero3_gathers", "tp_collectives", "cp_exchanges")
    parts["backward"] = fb(plan) - sum(parts[name] for name in inside)
    parts["ep_alltoall"] = max(0.0, rank.busy - compute)
    idle = max(0.0, rank.pipeline - rank.busy)
    if rank.quiet is not None:  # what the transfers add to the idle time, as simulated
        parts["pipeline_sends"] = min(idle, max(0.0, rank.pipeline - rank.quiet))
    else:
        parts["pipeline_sends"] = min(idle, rank.receives * comm)
    parts["bubble"] = idle - parts["pipeline_sends"]
    parts["dp_reduction"] = rank.reduction
    parts["optimizer"] = rank.optimizer
    waiting = step - sum(parts.values())
    parts["waiting"] = 0.0 if abs(waiting) < 1e-9 * step else waiting  # not -1e-16
    return parts


def recompute_flops_per_token(model: ModelSpec, recompute: str) -> float:
    """FLOPs per token recompute adds: the forward again (a third of F+B+W) for ``full``; the
    attention score matmuls for ``selective`` without flash attention (with it, flash attention
    recomputes them anyway and selective recompute adds no matmuls)."""
    if recompute == "full":
        return training_flops_per_token(model) / 3
    if recompute == "selective" and not model.flash_attention:
        return model.layers * 2 * 2 * model.seq_len * model.hidden
    return 0.0


def utilisation(
    model: ModelSpec, hardware: Hardware, training: Training, tokens_per_second: float,
    devices: int,
) -> tuple[float, float, float]:  # fmt: skip
    """(model TFLOP/s per GPU, MFU, HFU) of a plan (see the module)."""
    flops = training_flops_per_token(model) * tokens_per_second / devices
    peak = hardware.peak(training.fp8)
    extra = recompute_flops_per_token(model, training.recompute) * tokens_per_second / devices
    return flops / 1e12, flops / peak, (flops + extra) / peak
