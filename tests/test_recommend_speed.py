"""What makes ``recommend`` fast changes nothing it returns: the balancer's numpy screen, the
caches of simulations and activation peaks, and the tighter throughput bound, each against
the slow path that scores every move alone and keeps nothing between candidates."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import cutpipe.plan.screen as screen_module
from cutpipe.plan.costs.model import Training, gpu, model_items, optimizer_time, w_memory
from cutpipe.plan.partition import rank_balanced_sizes, rank_memory, stage_costs, stage_state_bytes
from cutpipe.plan.recommend.recommend import (
    Job,
    Layout,
    Rejected,
    Search,
    candidate_layouts,
    expand,
    ranked_plans,
    throughput_bound,
)
from cutpipe.plan.screen import python_sum, replays_python_sum
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import activation_trace, peak_activations
from cutpipe.spec import ModelSpec

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
DENSE = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
MOE = ModelSpec.load(EXAMPLES / "moe-40l.yaml")
H100 = gpu("H100")
SCHEDULES = ["1f1b", "zbh1", "interleaved:chunks=2", "interleaved:chunks=4", "zbv", "dualpipe",
             "dualpipev"]  # fmt: skip


def uneven_items(model: ModelSpec, seed: int):
    """The model's items with each forward scaled at random: no two stages tie by symmetry."""
    rng = random.Random(seed)
    return [replace(i, forward=i.forward * rng.uniform(0.5, 1.5)) for i in model_items(model, H100)]


def split_cases():
    for seed, name in enumerate(SCHEDULES):
        info = schedule_info(name)
        for pp in (2, 4, 8):
            if pp * info.stages_per_rank <= 34 and info.accepts(pp, 4 * pp):
                yield seed, name, pp


@pytest.mark.parametrize(("seed", "name", "pp"), list(split_cases()))
def test_the_screened_balancer_takes_the_same_steps_as_scoring_every_move(seed, name, pp):
    """Uniform layers (ties everywhere, settled by rounding) and uneven ones, without a memory
    cap and with one 10 % under the compute-balanced split's peak (layers moved off the fullest
    rank first)."""
    schedule = schedule_info(name).generate(pp, 4 * pp)
    kept = w_memory(DENSE)
    for items in (model_items(DENSE, H100), uneven_items(DENSE, seed)):
        plain = rank_balanced_sizes(items, schedule, screened=False)
        assert rank_balanced_sizes(items, schedule) == plain
        costs = stage_costs(items, plain, 0.0, kept)
        peak = max(rank_memory(schedule, costs, stage_state_bytes(items, plain)))
        for cap in (0.9 * peak, 1.2 * peak):
            slow = rank_balanced_sizes(items, schedule, cap, 0.0, kept, screened=False)
            assert rank_balanced_sizes(items, schedule, cap, 0.0, kept) == slow


def test_the_screen_without_python_sums_replayed_falls_back_to_a_tolerance(monkeypatch):
    """On a Python whose ``sum`` the screen cannot replay, ties are scored exactly instead."""
    monkeypatch.setattr(screen_module, "replays_python_sum", lambda: False)
    items = uneven_items(DENSE, 7)
    for name in ("zbv", "interleaved:chunks=2", "dualpipe"):
        schedule = schedule_info(name).generate(4, 16)
        slow = rank_balanced_sizes(items, schedule, screened=False)
        assert rank_balanced_sizes(items, schedule) == slow


def test_python_sum_is_replayed_bit_for_bit():
    rows = np.random.default_rng(3).lognormal(0.0, 3.0, size=(200, 23))
    assert replays_python_sum()
    assert python_sum(rows).tolist() == [sum(row) for row in rows.tolist()]


def plans_of(model, devices, batch, schedules, keep, reference, boundary="sync"):
    job = Job(model, H100, devices, batch, step_boundary=boundary)
    search = Search.checked(None, None, "bf16", None, H100, model, None)
    dropped: list[Rejected] = []
    layouts = candidate_layouts(job, expand(schedules), search, dropped)
    return ranked_plans(job, layouts, search, keep, dropped, reference=reference), dropped


JOBS = [
    (DENSE, 16, None, ["1f1b", "zbh2", "interleaved", "zbv", "dualpipev"], "sync"),
    (DENSE, 8, None, ["zbv", "dualpipe"], "overlap"),
    (MOE, 8, 256, ["1f1b", "dualpipe", "dualpipev"], "sync"),
]


@pytest.mark.parametrize(("model", "devices", "batch", "schedules", "boundary"), JOBS)
def test_recommend_returns_what_the_slow_path_returns(model, devices, batch, schedules, boundary):
    """Every plan, in order, equal field for field (floats bit-identical), and so are the
    refusals; with ``keep`` the leaders are the same and none beats its bound."""
    slow, slow_dropped = plans_of(model, devices, batch, schedules, None, True, boundary)
    fast, fast_dropped = plans_of(model, devices, batch, schedules, None, False, boundary)
    assert fast == slow
    assert fast_dropped == slow_dropped
    pruned, _ = plans_of(model, devices, batch, schedules, 3, False, boundary)
    assert pruned[:3] == slow[:3]
    if boundary == "sync":
        job = Job(model, H100, devices, batch, step_boundary=boundary)
        search = Search.checked(None, None, "bf16", None, H100, model, None)
        for plan in slow:
            layout = Layout(plan.pp, plan.dp, plan.ep, plan.schedule, plan.microbatches, plan.tp)
            assert plan.tokens_per_second <= throughput_bound(job, layout, search, {})


def test_the_sync_bound_adds_the_average_ranks_all_reduce_and_optimizer_step():
    """Dense-7b on 32 H100s, PP 4 x DP 8 with 1F1B: the least work (no recompute) spread over
    the ranks, then a quarter of the parameters all-reduced in a ring of 8 over the network and
    stepped by ZeRO-1 over 8 shards; below the bound of compute alone, and it refuses layouts
    unsimulated when 12 are kept."""
    job = Job(DENSE, H100, 32)  # 8 sequences per device: 32 microbatches per pipeline
    search = Search.checked(None, None, "bf16", None, H100, DENSE, None)
    bound = throughput_bound(job, Layout(4, 8, 1, "1f1b", 32), search, {})
    training = Training(zero=1, dp=8)
    items = model_items(DENSE, H100, training=training)
    work = sum(i.forward + i.backward + i.weight for i in items)
    stored = sum(i.parameters for i in items) / 4
    bandwidth, _ = H100.link(within_node=False)
    allreduce = 2 * 7 / 8 * stored * DENSE.element_bytes / bandwidth
    step = 32 * work / 4 + allreduce + optimizer_time(stored, H100, training)
    assert bound == pytest.approx(DENSE.tokens * 32 * 8 / step, rel=1e-8)
    assert bound < DENSE.tokens * 32 * 8 / (32 * work / 4)
    plans, dropped = plans_of(DENSE, 32, None, ["1f1b", "zbv", "dualpipev"], 12, False)
    assert len(plans) >= 12 and any("even with no bubble" in r.reason for r in dropped)


@pytest.mark.parametrize(
    "name", ["1f1b", "zbh2", "interleaved:chunks=2", "zbv", "dualpipe", "dualpipev"]
)
def test_peak_activations_are_the_running_sums_peaks_bit_for_bit(name):
    """The numpy running sum adds the same changes in the same order as
    ``activation_trace`` (an overlapped pair's F before its backward), so the peaks are
    equal to the last bit, with uneven activations and a W that keeps 30 %."""
    schedule = schedule_info(name).generate(4, 12)
    rng = random.Random(5)
    costs = Costs(activation=[rng.uniform(1e6, 1e9) for _ in range(schedule.num_stages)],
                  w_memory=0.3)  # fmt: skip
    traced = [max(high for high, _ in rank) for rank in activation_trace(schedule, costs)]
    assert peak_activations(schedule, costs) == traced
