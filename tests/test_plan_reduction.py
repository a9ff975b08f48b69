"""The data-parallel reduction in the planner's step: each stage's reduction starts once the
stage is done, so what runs in the cool-down is hidden (cutpipe.plan.recommend.reduction;
docs/plan.md, "Model and hardware")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cutpipe.plan.costs.model import Training, gpu
from cutpipe.plan.recommend.recommend import Job, Layout, Plan, evaluate
from cutpipe.plan.recommend.reduction import Tail, reductions_end
from cutpipe.schedule.actions import units
from cutpipe.schedule.registry import generate
from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
DENSE = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
H100 = gpu("H100")
#: 16 devices over two nodes: the gradient reduction crosses the network and takes its time
JOB = Job(DENSE, H100, 32)


def test_reductions_run_one_at_a_time_each_from_when_its_stage_is_done():
    assert reductions_end([5.0, 1.0], [2.0, 3.0]) == 7.0  # 1 -> 4 idle until 5 -> 7
    assert reductions_end([1.0, 1.5], [2.0, 2.0]) == 5.0  # the second waits for the first
    assert reductions_end([], []) == 0.0
    with pytest.raises(ValueError, match="2 stage finishes for 1 reductions"):
        reductions_end([1.0, 2.0], [1.0])


def test_only_what_runs_past_the_pipeline_is_exposed():
    late = Tail(after=10.0, reduced=12.0, optimizer=3.0, reduction=5.0)
    assert (late.exposed_reduction, late.exposed_optimizer, late.exposed) == (2.0, 3.0, 5.0)
    partly = Tail(after=10.0, reduced=8.0, optimizer=3.0, reduction=5.0)
    assert (partly.exposed_reduction, partly.exposed_optimizer) == (0.0, 1.0)
    hidden = Tail(after=10.0, reduced=5.0, optimizer=3.0, reduction=5.0)
    assert hidden.exposed == 0.0


def test_1f1b_stages_are_done_one_full_backward_apart_from_the_last_rank_up():
    costs = Costs(f=1.0, b=1.0, w=1.0)  # a full backward takes 2
    result = metrics(simulate(generate("1f1b", 4, 8), costs), costs)
    assert result.done_per_rank == [[result.makespan - 2.0 * rank] for rank in range(4)]


def test_a_v_finishes_its_second_stage_before_its_first():
    """ZB-V runs the second half's last W before the first half's: the V's later stage is
    ready for its reduction while the rank still computes the earlier one."""
    costs = Costs(f=1.0, b=1.0, w=1.0)
    schedule = generate("zbv", 4, 8)
    result = metrics(simulate(schedule, costs), costs)
    for rank, (first, second) in enumerate(result.done_per_rank):
        assert schedule.placement.stages_of(rank) == (rank, 7 - rank)
        assert second < first


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev", "interleaved:chunks=3", "zbh2"])
def test_stage_finishes_read_off_the_codes_match_the_ops(name):
    """``stages_done`` reads packed codes from the end; the ops themselves, F&B pairs split
    into their halves, say the same."""
    costs = Costs(f=1.0, b=1.5, w=0.5, comm=0.25)
    timeline = simulate(generate(name, 4, 8), costs)
    for rank, done in enumerate(metrics(timeline, costs).done_per_rank):
        last = {}
        for op, _, end in timeline.events(rank):
            for unit in units(op):
                last[unit.stage] = end
        stages = timeline.schedule.placement.stages_of(rank)
        assert done == [last[stage] - timeline.begin for stage in stages]


def plan(schedule: str, start: str, boundary: str = "sync") -> Plan:
    job = replace(JOB, reduction_start=start, step_boundary=boundary)
    found = evaluate(job, Layout(4, 8, 1, schedule, 16), Training())
    assert isinstance(found, Plan), found
    return found


def test_one_stage_per_rank_has_nothing_to_hide_on_the_rank_that_ends_last():
    """1F1B's rank 0 runs the step's last op: its reduction is all exposed either way."""
    by_stage, by_rank = plan("1f1b", "stage"), plan("1f1b", "rank")
    assert by_stage.step_time == by_rank.step_time
    assert by_stage.breakdown["dp_reduction"] > 0


@pytest.mark.parametrize("schedule", ["zbv", "interleaved:chunks=2"])
def test_stages_done_early_hide_their_reduction(schedule):
    by_stage, by_rank = plan(schedule, "stage"), plan(schedule, "rank")
    hidden = by_rank.step_time - by_stage.step_time
    assert 0 < hidden <= by_rank.breakdown["dp_reduction"]
    assert by_stage.breakdown["dp_reduction"] < by_rank.breakdown["dp_reduction"]
    for found in (by_stage, by_rank):
        assert sum(found.breakdown.values()) == pytest.approx(found.step_time)
        assert found.breakdown["waiting"] == 0.0  # steps synchronise: the tail is the step's


def test_when_steps_overlap_the_breakdown_still_adds_up():
    found = plan("zbv", "stage", boundary="overlap")
    assert sum(found.breakdown.values()) == pytest.approx(found.step_time)
    assert min(found.breakdown.values()) >= 0


def test_an_unknown_reduction_start_is_refused_by_name():
    with pytest.raises(ValueError, match="reduction_start must be one of 'stage', 'rank'"):
        Job(DENSE, H100, 32, reduction_start="bucket")
