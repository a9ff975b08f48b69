"""What ``recommend`` says: why a candidate was refused, why nothing fits, why the winner wins."""

from __future__ import annotations

import math
from collections.abc import Sequence

from cutpipe.plan.costs.hardware import GPUS
from cutpipe.plan.costs.model import Hardware, model_items
from cutpipe.plan.recommend.job import Job
from cutpipe.plan.recommend.plans import Plan, Rejected


def too_few_items(stages: int, pp: int, items: int) -> str:
    """Why a schedule with more stages than cost items cannot run."""
    per_rank = stages // pp
    need = f"{per_rank}*PP={stages}" if per_rank > 1 else f"PP={stages}"
    return (
        f"needs {need} stages, the model has {items - 2} layers + embedding + head = {items} items"
    )


def over_memory(memory: Sequence[float], capacity: float) -> str:
    """Why a candidate does not fit: the fullest rank's need against the usable bytes."""
    rank = max(range(len(memory)), key=memory.__getitem__)
    need = memory[rank]
    return (
        f"needs {need / 1e9:.1f} GB on rank {rank}, {capacity / 1e9:.1f} GB usable "
        f"({(need - capacity) / 1e9:.1f} GB over)"
    )


def does_not_fit(job: Job, closest: Rejected) -> str:
    """Nothing fits: the plan that came closest, by how much, and the cheapest change."""
    model, hardware, devices = job.model, job.hardware, job.devices
    capacity, usable_memory = job.capacity, job.usable_memory
    need = capacity + closest.excess
    gpu_memory = need / usable_memory
    bigger = sorted((g.memory, g.name) for g in GPUS.values() if g.memory * usable_memory >= need)
    suggestion = f"a GPU with at least {gpu_memory / 1e9:.0f} GB" + (
        f" (e.g. {bigger[0][1]}, {bigger[0][0] / 1e9:.0f} GB)" if bigger else ""
    )
    state = sum(item.parameters for item in model_items(model, hardware)) * 16
    floor = math.ceil(state / capacity)
    return (
        f"{model.name} does not fit on {devices} x {hardware.name}: the closest plan, "
        f"{closest.schedule_label()} on {closest.layout()} with {closest.training.describe()}, "
        f"{closest.reason}. Cheapest changes: {suggestion}; or more devices (its training "
        f"state alone, {state / 1e12:.2f} TB, needs at least {floor} of these even fully "
        "sharded); or shorter sequences"
    )


def reason(plans: Sequence[Plan], hardware: Hardware) -> str:
    """A paragraph on why the fastest plan wins, from the numbers of the others."""
    best = plans[0]
    text = (
        f"{best.schedule_title()} on {best.layout()} with {best.microbatches} microbatches per "
        f"pipeline is fastest: {best.tokens_per_second:,.0f} tokens/s, a step of {best.step_time:.2f} s "
        f"{'(span: steps overlap) ' if best.step_measure == 'span' else ''}"
        f"with a {best.bubble:.1%} bubble and {best.comm_share:.0%} of it in communication, "
        f"{best.peak_memory / 1e9:.1f} GB on the fullest {hardware.name}."
    )
    same_layout = [p for p in plans[1:] if p.shape() == best.shape()]
    if same_layout:
        other = same_layout[0]
        text += (
            f" On the same layout the next schedule, {other.schedule_title()}, is "
            f"{1 - other.tokens_per_second / best.tokens_per_second:.1%} slower (bubble {other.bubble:.1%}, "
            f"{other.peak_memory / 1e9:.1f} GB)."
        )
    other_layout = next((p for p in plans[1:] if p.shape() != best.shape()), None)
    if other_layout is not None:
        text += (
            f" The best other layout, {other_layout.layout()} with {other_layout.schedule_title()}, "
            f"is {1 - other_layout.tokens_per_second / best.tokens_per_second:.1%} slower."
        )
    pairs = [
        (cut, dual)
        for cut in plans
        for dual in plans
        if cut.schedule == "dualpipev" and dual.schedule == "dualpipe" and cut.pp > 1
        and cut.shape() == dual.shape()
    ]  # fmt: skip
    pairs.sort(key=lambda pair: pair[0].training != pair[1].training)  # like with like first
    if pairs:
        cut, dual = pairs[0]
        change = cut.tokens_per_second / dual.tokens_per_second - 1
        settings = (
            ""
            if cut.training == dual.training
            else f" (Cut-in-half with {cut.training.describe()}, DualPipe with "
            f"{dual.training.describe()})"
        )
        text += (
            f" On {cut.layout()}, Cut-in-half needs {cut.peak_memory / 1e9:.1f} GB where DualPipe "
            f"needs {dual.peak_memory / 1e9:.1f} GB (it stores every stage twice) and is "
            f"{abs(change):.1%} {'faster' if change >= 0 else 'slower'}{settings}."
        )
    return text
