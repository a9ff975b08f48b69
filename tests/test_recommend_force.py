"""``recommend`` with parts of the layout fixed, ``--explain``'s step breakdown, MFU, the
busiest-rank bubble and the chunk search (docs/plan.md, "Recommendations")."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from cutpipe.cli.main import main
from cutpipe.model_config import load_model_config
from cutpipe.plan.costs.hardware import gpu
from cutpipe.plan.costs.model import Training, p2p_time, w_memory
from cutpipe.plan.partition import stage_costs
from cutpipe.plan.plan_file import PlanFile
from cutpipe.plan.recommend.breakdown import PARTS
from cutpipe.plan.recommend.evaluate import job_items
from cutpipe.plan.recommend.plans import Rejected, chunk_choices
from cutpipe.plan.recommend.recommend import Job, Layout, Plan, evaluate, recommend
from cutpipe.schedule.registry import generate
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
TINY = load_model_config(EXAMPLES / "tiny-dense.yaml")  # 8 layers, 128-token sequences
MOE = load_model_config(EXAMPLES / "tiny-moe.yaml")  # 4 experts
H100 = gpu("H100")


@pytest.mark.parametrize(
    ("model", "fixed", "check"),
    [
        (TINY, {"pp": 2}, lambda p: p.pp == 2),
        (TINY, {"dp": 2}, lambda p: p.dp == 2),
        (TINY, {"tp": 2}, lambda p: p.tp == 2),
        (TINY, {"cp": 2}, lambda p: p.cp == 2 and p.pp * p.dp * p.tp == 4),
        (MOE, {"ep": 2}, lambda p: p.ep == 2),
        (TINY, {"chunks": 2, "pp": 2}, lambda p: p.schedule == "interleaved:chunks=2"),
        (TINY, {"microbatch_size": 2}, lambda p: p.microbatches * p.dp * 2 == 64),
        (TINY, {"zero": 0}, lambda p: p.training.zero == 0),
        (TINY, {"recompute": "full"}, lambda p: p.training.recompute == "full"),
        (TINY, {"precision": "fp8"}, lambda p: p.training.fp8),
        (TINY, {"sequence_parallel": False}, lambda p: not p.training.sequence_parallel),
    ],
)
def test_a_fixed_dimension_holds_in_every_plan(model, fixed, check):
    schedules = ["interleaved"] if "chunks" in fixed else ["1f1b", "zbv", "interleaved"]
    plans = recommend(model, H100, 8, schedules=schedules, keep=2, **fixed)
    assert plans and all(check(plan) for plan in plans), [p.layout() for p in plans]


def test_cp_shows_in_the_layout_and_the_plan_file(tmp_path):
    plan = recommend(TINY, H100, 8, schedules=["1f1b"], cp=2, pp=2, keep=1)[0]
    assert plan.layout() == "PP=2 DP=2 CP=2" and plan.shape()[-1] == 2
    assert Rejected(2, 2, 1, "1f1b", 4, "why", 1, cp=4).layout() == "PP=2 DP=2 CP=4"
    path = tmp_path / "plan.json"
    plan.to_plan_file(TINY, H100).save(path)
    saved = json.loads(path.read_text())
    assert saved["layout"]["cp"] == 2 and saved["training"]["sequence_parallel"] is True
    assert PlanFile.load(path).cp == 2
    del saved["layout"]["cp"], saved["training"]["sequence_parallel"]  # a file from before them
    path.write_text(json.dumps(saved))
    old = PlanFile.load(path)
    assert (old.cp, old.sequence_parallel) == (1, True)


def test_train_refuses_a_plan_with_context_parallelism(tmp_path):
    from cutpipe.train.layout import with_plan
    from cutpipe.train.options import TrainOptions

    path = tmp_path / "plan.json"
    PlanFile(model="tiny-dense", layers=8, schedule="1f1b", microbatches=4,
             stage_sizes=(5, 5), pp=2, cp=2).save(path)  # fmt: skip
    with pytest.raises(ValueError, match=r"uses CP=2 \(context parallelism\), which cutpipe"):
        with_plan(TrainOptions.build(plan=str(path), model=str(EXAMPLES / "tiny-dense.yaml")))


@pytest.mark.parametrize(
    ("model", "devices", "fixed", "message"),
    [
        (TINY, 64, {"pp": 7}, "PP=7 does not divide the 64 devices"),
        (TINY, 8, {"dp": 3}, "DP=3 does not divide the 8 devices"),
        (TINY, 8, {"pp": 4, "dp": 4}, "PP=4 x DP=4 = 16 does not divide the 8 devices"),
        (TINY, 8, {"pp": 2, "dp": 2, "tp": 1}, "PP=2 x DP=2 x TP=1 is 4 devices, not the 8"),
        (TINY, 6, {"cp": 3}, "CP=3 cuts each sequence into 2*CP=6 equal chunks"),
        (TINY, 8, {"ep": 2}, "EP=2 needs routed experts, and tiny-dense has none"),
        (MOE, 8, {"ep": 8}, "EP=8 does not divide the 4 experts"),
        (MOE, 8, {"ep": 4, "dp": 2}, "EP=4 does not divide DP=2"),
        (TINY, 8, {"chunks": 4}, "chunks=4 fixes the chunks of schedules that take them"),
    ],
)
def test_a_fixed_value_that_allows_nothing_is_refused_by_name(model, devices, fixed, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        recommend(model, H100, devices, schedules=["1f1b", "zbv"], **fixed)


def test_a_search_that_finds_nothing_names_what_was_fixed():
    with pytest.raises(ValueError, match="none of zbv runs on any layout of 8 devices with PP=8"):
        recommend(TINY, H100, 8, schedules=["zbv"], pp=8)  # 16 stages, 10 items


def test_chunks_given_twice_are_refused():
    with pytest.raises(ValueError, match="interleaved:chunks=2 names its chunks and chunks=4"):
        recommend(TINY, H100, 8, schedules=["interleaved:chunks=2"], chunks=4)


def test_the_cli_names_the_forced_value(capfd):
    code = main(["recommend", "--devices", "64", "--gpu", "H100", "--model",
                 str(EXAMPLES / "tiny-dense.yaml"), "--pp", "7"])  # fmt: skip
    assert code == 2 and "PP=7 does not divide the 64 devices" in capfd.readouterr().err


EXPLAIN = ["recommend", "--devices", "8", "--gpu", "H100", "--model",
           str(EXAMPLES / "tiny-moe.yaml"), "--pp", "2", "--dp", "4", "--ep", "2", "--zero", "1",
           "--recompute", "selective", "--schedules", "dualpipe"]  # fmt: skip


def test_explain_breaks_the_step_into_parts_that_add_up(capfd):
    assert main([*EXPLAIN, "--explain", "--json"]) == 0
    (plan,) = json.loads(capfd.readouterr().out)["plans"]
    parts = plan["breakdown"]
    assert list(parts) == list(PARTS)
    assert sum(parts.values()) == pytest.approx(plan["step_time"], rel=1e-9)
    assert parts["forward"] > 0 and parts["ep_alltoall"] > 0 and parts["dp_reduction"] > 0
    assert all(value >= 0 for value in parts.values()), parts
    assert main([*EXPLAIN, "--explain"]) == 0
    out = capfd.readouterr().out
    for words in ("forward compute (F)", "expert all-to-all, exposed", "pipeline bubble",
                  "gradient reduction over DP", "optimizer step", "activations", "MFU"):  # fmt: skip
        assert words in out, out


def test_explain_names_what_is_not_fixed(capfd):
    assert main([*EXPLAIN[:9], "--explain"]) == 2  # PP and the model only
    err = capfd.readouterr().err
    assert "also give --dp, --tp, --ep, --zero, --recompute, --schedules (one)" in err, err


def test_breakdowns_add_up_under_both_step_measures_and_every_setting():
    for boundary in ("sync", "overlap"):
        plans = recommend(TINY, H100, 8, step_boundary=boundary, tp=2, recompute="full", keep=3,
                          schedules=["1f1b", "zbv", "interleaved"])  # fmt: skip
        for plan in plans:
            assert sum(plan.breakdown.values()) == pytest.approx(plan.step_time, rel=1e-9)
        assert plans[0].breakdown["tp_collectives"] > 0 and plans[0].breakdown["recompute"] > 0
    plan = recommend(TINY, H100, 8, zero=3, pp=1, keep=1)[0]
    assert plan.breakdown["zero3_gathers"] > 0


def test_mfu_is_model_flops_over_the_peak():
    """tiny-dense: per layer attention 4h^2 + causal scores s*h (2*s*h halved), gated MLP
    3*h*f; head h*V; times 2 FLOPs per multiply-add and 3 for F, B and W."""
    h, s, f, layers, vocab = 64, 128, 192, 8, 256
    per_token = 6 * (layers * (4 * h * h + s * h + 3 * h * f) + h * vocab)
    assert per_token == 3_047_424
    plan = recommend(TINY, H100, 8, keep=1)[0]
    tflops = per_token * plan.tokens_per_second / 8 / 1e12
    assert plan.model_tflops_per_gpu == pytest.approx(tflops, rel=1e-12)
    assert plan.mfu == pytest.approx(tflops * 1e12 / H100.bf16_flops, rel=1e-12)
    assert plan.hfu == plan.mfu  # no recompute
    full = recommend(TINY, H100, 8, recompute="full", keep=1)[0]
    assert full.hfu == pytest.approx(full.mfu * 4 / 3, rel=1e-12)  # the forward once more
    fp8 = recommend(TINY, H100, 8, precision="fp8", keep=1)[0]
    assert fp8.mfu * H100.fp8_flops == pytest.approx(fp8.model_tflops_per_gpu * 1e12)


def test_the_bubble_is_the_busiest_ranks_idle_share():
    job = Job(TINY, H100, devices=4, global_batch=32)
    layout = Layout(pp=4, dp=1, ep=1, schedule="1f1b", microbatches=8)
    plan = evaluate(job, layout, Training())
    assert isinstance(plan, Plan)
    items = job_items(job, 1)
    costs = stage_costs(items, plan.stage_sizes, p2p_time(TINY, H100, True), w_memory(TINY))
    result = metrics(simulate(generate("1f1b", 4, 8), costs), costs)
    busy = max(result.busy_per_rank)
    assert plan.bubble == pytest.approx(1 - busy / result.makespan, rel=1e-9)
    assert plan.bubble < result.bubble_ratio  # the least busy rank idles more
    assert result.busy_per_rank[plan.busiest_rank] == busy
    idle = plan.breakdown["bubble"] + plan.breakdown["pipeline_sends"]
    assert idle == pytest.approx(result.makespan - busy, rel=1e-9)


def test_the_chunk_search_tries_every_count_dividing_the_layers_per_rank():
    assert chunk_choices(4, 32) == [2, 4, 8]
    assert chunk_choices(8, 61) == [2, 4]  # 8 layers per rank; 8 chunks: 64 stages, 63 items
    assert chunk_choices(16, 61) == [2]
    assert chunk_choices(32, 32) == [2]  # none fits: 2, and a refusal says why
    dense = load_model_config(EXAMPLES / "dense-7b.yaml")
    plans = recommend(dense, H100, 4, schedules=["interleaved"], pp=4, keep=3)
    assert [p.schedule for p in plans] == [
        "interleaved:chunks=8",
        "interleaved:chunks=4",
        "interleaved:chunks=2",
    ]


def test_microbatch_size_replaces_the_models():
    plan = recommend(replace(TINY, microbatch_size=1), H100, 8, microbatch_size=8, keep=1)[0]
    assert plan.microbatches * plan.dp * 8 == 64
    with pytest.raises(ValueError, match="microbatch_size must be"):
        recommend(TINY, H100, 8, microbatch_size=0)
