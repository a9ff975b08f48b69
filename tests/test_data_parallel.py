"""Data parallelism next to the pipeline: each stage's gradients averaged over its replicas as
soon as its last backward has run, exact against one process (docs/runtime.md)."""

import dp_workers as workers
import pytest

from cutpipe import generate
from cutpipe.launch import run
from cutpipe.runtime.program import RankProgram, halves
from cutpipe.schedule.codes import F_CODE

CASES = [
    ("dualpipev", 4, "allreduce"), ("zbv", 3, "allreduce"), ("dualpipe", 4, "allreduce"),
    ("dualpipev", 4, "zero1"), ("zbv", 4, "zero1"),
]  # fmt: skip


@pytest.mark.timeout(240)
def test_pp2_x_dp2_gradients_and_three_adamw_steps_match_one_process():
    for rank in run(workers.pp_x_dp, 4, (CASES,), timeout=200):
        for result in rank:
            assert result["grad_error"] <= 1e-6, result["case"]
            assert result["param_error"] <= 1e-6, result["case"]


@pytest.mark.parametrize("name", ["1f1b", "zbh1", "zbv", "dualpipev", "dualpipe", "interleaved"])
def test_a_stage_is_done_after_its_last_weight_gradient(name):
    for ranks in (2, 4):
        schedule = generate(name, ranks, 2 * ranks)
        for rank in range(ranks):
            program = RankProgram(schedule, rank)
            done = {s: i for i, stages in program.grads_done.items() for s in stages}
            assert set(done) == set(program.stages)
            for stage, index in done.items():
                later = [
                    h for op in program.ops[index + 1 :] for h in halves(op) if h.stage == stage
                ]
                assert (all(h.kind == F_CODE for h in later) and not later) or not later
                assert any(
                    h.stage == stage and h.kind != F_CODE for h in halves(program.ops[index])
                )


@pytest.mark.timeout(120)
def test_reductions_start_inside_the_cool_down_not_after_it():
    """ZB-V on rank 0 holds stages 0 and 3: stage 3's last W runs well before the step ends,
    and its reduction starts right then; only stage 0's waits for the last op."""
    ranks = run(workers.reduction_points, 4, ("zbv", 4), timeout=100)
    ops = [len(generate("zbv", 2, 4).actions[r]) for r in range(2)]
    for coordinate, calls in enumerate(ranks):
        pp_rank = coordinate // 2
        starts = dict(calls[:-1])
        assert calls[-1][0] == "finish" and calls[-1][1] >= ops[pp_rank]
        assert sorted(starts) == sorted(generate("zbv", 2, 4).placement.stages_of(pp_rank))
        assert min(starts.values()) < ops[pp_rank]  # one stage's reduction overlaps the rest
        assert max(starts.values()) == ops[pp_rank]
