"""``recommend`` ranks by the measure its step boundary implies, says why it leaves a candidate
out, balances interleaved stages per chunk, and takes the usable share of memory as an option."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from cutpipe.cli.main import main
from cutpipe.plan.costs.model import gpu, model_items, p2p_time, w_memory
from cutpipe.plan.partition import even_sizes, rank_balanced_sizes, stage_costs
from cutpipe.plan.recommend.recommend import (
    SINGLE_RANK,
    USABLE_MEMORY,
    Job,
    Layout,
    Plan,
    Rejected,
    divisors,
    evaluate,
    expand,
    recommend,
)
from cutpipe.schedule.registry import generate
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
DENSE = ModelSpec.load(EXAMPLES / "dense-7b.yaml")  # 32 layers: 34 cost items
H100 = gpu("H100")


#: The training setting fixed (no ZeRO, no recompute, no TP): these tests are about layouts
#: and schedules, not about the setting search (tests/test_plan_search.py).
PLAIN = {"zero": 0, "recompute": "none", "tp": 1}


def thirty_layers(layers: int = 30, vocab: int = 32000) -> ModelSpec:
    return ModelSpec(name=f"small-{layers}", layers=layers, hidden=512, heads=8, ffn=2048,
                     vocab=vocab, seq_len=256)  # fmt: skip


def by_layout(plans: list[Plan]) -> dict[tuple[int, int, str], Plan]:
    return {(p.pp, p.ep, p.schedule): p for p in plans}


# -- 1. the step measure follows the step boundary -------------------------------------------


def test_span_ranking_never_longer_and_shorter_where_a_rank_idles_at_the_ends():
    """dense-7b on 8 H100s: with overlapping steps a plan's step is its longest rank span (plus
    that rank's all-reduce), never more than the synchronised step, and shorter where no rank
    is busy from the first op to the last (DualPipe at PP=4)."""
    schedules = ["zbh2", "dualpipe", "zbv"]
    sync = recommend(DENSE, H100, 8, schedules=schedules, **PLAIN)
    overlap = recommend(DENSE, H100, 8, schedules=schedules, step_boundary="overlap", **PLAIN)
    assert {p.step_measure for p in sync} == {"makespan"}
    assert {p.step_measure for p in overlap} == {"span"}
    same = by_layout(sync)
    for plan in overlap:  # the span never exceeds the makespan, nor one rank's all-reduce the max
        assert plan.step_time <= same[(plan.pp, plan.ep, plan.schedule)].step_time + 1e-12
    dual = by_layout(overlap)[(4, 1, "dualpipe")]
    assert dual.step_time < same[(4, 1, "dualpipe")].step_time * (1 - 1e-3)


def test_overlap_step_is_the_longest_span_plus_its_rank_all_reduce_and_bubble_its_span_share():
    layout = Layout(pp=4, dp=2, ep=1, schedule="dualpipe", microbatches=32)
    plan = evaluate(Job(DENSE, H100, 8, memory=80e9, step_boundary="overlap"), layout)
    sync = evaluate(Job(DENSE, H100, 8, memory=80e9), layout)
    assert isinstance(plan, Plan) and isinstance(sync, Plan)
    items = model_items(DENSE, H100)
    costs = stage_costs(items, plan.stage_sizes, p2p_time(DENSE, H100, True), w_memory(DENSE))
    result = metrics(simulate(generate("dualpipe", 4, 32), costs), costs)
    assert max(result.span_per_rank) < result.makespan
    assert plan.step_time < sync.step_time
    busiest = max(range(4), key=result.busy_per_rank.__getitem__)
    busy = result.busy_per_rank[busiest]
    assert plan.bubble == pytest.approx(1 - busy / result.span_per_rank[busiest])
    assert sync.bubble == pytest.approx(1 - busy / result.makespan)


# -- 2. no silent drops ----------------------------------------------------------------------


def test_every_candidate_is_either_a_plan_or_rejected_with_a_reason():
    """8 H100s, a global batch of 12: DP=8 cannot split it, PP=1 does not fit, DualPipe and
    Cut-in-half need more microbatches at PP=8 than 12, and so on; each says so."""
    rejected: list[Rejected] = []
    plans = recommend(DENSE, H100, 8, global_batch=12, rejected=rejected, **PLAIN)
    assert rejected and all(r.reason for r in rejected)
    names = expand(["1f1b", "zbh1", "zbh2", "interleaved", "zbv", "dualpipe", "dualpipev"])
    covered = {(p.pp, p.schedule) for p in plans} | {(r.pp, r.schedule) for r in rejected}
    for pp in divisors(8):
        if 12 % (8 // pp):
            assert (pp, "") in covered  # the whole layout, for every schedule
            continue
        for name in names if pp > 1 else SINGLE_RANK:
            assert (pp, name) in covered, (pp, name)
    reasons = {(r.pp, r.schedule): r.reason for r in rejected}
    assert reasons[(1, "")] == "global batch 12 does not split into DP=8 equal shares"
    assert reasons[(8, "dualpipev")].startswith(
        "Cut-in-half runs on ranks >= 1, microbatches >= 2R-1"
    )
    assert "not PP=8 with 12 microbatches" in reasons[(8, "dualpipev")]
    assert any(
        r.reason.startswith("needs ") and "GB usable" in r.reason and "GB over)" in r.reason
        for r in rejected
    )


def test_a_schedule_with_up_to_two_stages_more_than_layers_runs():
    """ZB-V at PP=16 has 32 stages: a 30-layer model has 32 items with the embedding and the
    head, so each stage takes one; with 29 layers it is refused, and says why."""
    model = thirty_layers()
    plans = recommend(model, H100, 16, global_batch=32, schedules=["zbv", "1f1b"])
    zbv = by_layout(plans)[(16, 1, "zbv")]
    assert zbv.stage_sizes == [1] * 32  # stage 0 only the embedding, stage 31 only the head
    rejected: list[Rejected] = []
    recommend(thirty_layers(29), H100, 16, global_batch=32, schedules=["zbv"], rejected=rejected)
    assert [r.reason for r in rejected if r.pp == 16] == [
        "needs 2*PP=32 stages, the model has 29 layers + embedding + head = 31 items"
    ]
    refused = evaluate(Job(model, H100, 32, memory=80e9), Layout(32, 1, 1, "zbv", 64))
    assert isinstance(refused, Rejected) and "2*PP=64 stages" in refused.reason


@pytest.mark.parametrize("stages", [31, 32])
def test_balancing_handles_a_stage_holding_only_the_embedding_or_only_the_head(stages):
    model = thirty_layers(vocab=256000)  # a head as heavy as several layers
    items = model_items(model, H100)
    sizes = rank_balanced_sizes(items, generate("1f1b", stages, 4))
    assert sum(sizes) == 32 and min(sizes) >= 1 and len(sizes) == stages
    assert sizes[-1] == 1  # the head alone
    stage_costs(items, sizes, 1e-5, 0.5)  # every stage has costs
    even = even_sizes(items, stages)
    assert sum(even) == 32 and min(even) >= 1 and even[-1] == 1
    assert even_sizes(items, 32)[0] == 1  # the embedding alone too
    with pytest.raises(ValueError, match="30 layers \\+ embedding \\+ head = 32 items cannot fill"):
        even_sizes(items, 33)


# -- 3. interleaved: chunks, balanced per chunk ----------------------------------------------


def test_interleaved_tries_two_and_four_chunks_is_balanced_per_chunk_and_beats_1f1b():
    """dense-7b at PP=4, 16 microbatches: the interleaved bubble is 1/chunks of 1F1B's, so its
    step must be shorter; a split that evens out each rank's total left one chunk of 3 layers
    and others of 5, and with 4 chunks came out slower than 1F1B."""
    plans = recommend(DENSE, H100, 8, global_batch=32, schedules=["1f1b", "interleaved"])
    by = by_layout(plans)
    one = by[(4, 1, "1f1b")]
    for chunks in (2, 4):
        plan = by[(4, 1, f"interleaved:chunks={chunks}")]
        assert len(plan.stage_sizes) == 4 * chunks
        assert max(plan.stage_sizes) - min(plan.stage_sizes) <= 1
        assert plan.step_time < one.step_time
        assert plan.bubble < one.bubble
        assert plan.schedule_title() == f"Interleaved 1F1B (chunks={chunks})"
    sizes = rank_balanced_sizes(model_items(DENSE, H100), generate("interleaved", 4, 16, chunks=2))
    layers = [size - (s == 0) - (s == len(sizes) - 1) for s, size in enumerate(sizes)]
    assert layers == [4] * 8


def test_explicit_chunks_are_tried_as_given():
    assert expand(["interleaved"]) == ["interleaved:chunks=2", "interleaved:chunks=4"]
    assert expand(["Interleaved1F1B:chunks=8", "interleaved", "zbv"]) == [
        "interleaved:chunks=8", "interleaved:chunks=2", "interleaved:chunks=4", "zbv",
    ]  # fmt: skip
    rejected: list[Rejected] = []
    plans = recommend(DENSE, H100, 8, 32, schedules=["interleaved:chunks=8"], rejected=rejected)
    assert {p.schedule for p in plans if p.pp > 1} == {"interleaved:chunks=8"}
    assert any("needs 8*PP=64 stages" in r.reason for r in rejected)  # PP=8


# -- 4. the usable share of memory -----------------------------------------------------------


def test_usable_memory_decides_what_fits_and_the_reason_says_how_much_is_usable():
    """The zero-bubble paper ran layouts that peak at up to 92.5 % of the memory: at 95 % they
    fit, at 90 % they did not (dense-7b on 8 H100s has plans between 72 and 76 GB)."""
    assert USABLE_MEMORY == 0.95
    fits = by_layout(recommend(DENSE, H100, 8, **PLAIN))
    rejected: list[Rejected] = []
    tight = by_layout(recommend(DENSE, H100, 8, usable_memory=0.9, rejected=rejected, **PLAIN))
    assert set(tight) < set(fits)
    gained = [fits[key] for key in set(fits) - set(tight)]
    assert gained and all(72e9 < plan.peak_memory <= 76e9 for plan in gained)
    reasons = {(r.pp, r.ep, r.schedule): r.reason for r in rejected}
    for plan in gained:
        reason = reasons[(plan.pp, plan.ep, plan.schedule)]
        assert re.fullmatch(
            r"needs \d+\.\d GB on rank \d, 72\.0 GB usable \(\d\.\d GB over\)", reason
        )


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"usable_memory": 0}, ValueError, "usable_memory must be > 0 and <= 1"),
        ({"usable_memory": 1.5}, ValueError, "usable_memory must be > 0 and <= 1"),
        ({"usable_memory": math.nan}, ValueError, "usable_memory must be > 0 and <= 1"),
        ({"usable_memory": True}, TypeError, "usable_memory must be a fraction"),
        ({"step_boundary": "async"}, ValueError, "step_boundary must be one of 'sync', 'overlap'"),
        ({"step_boundary": ["sync"]}, ValueError, "step_boundary must be one of"),
        ({"rejected": ()}, TypeError, "rejected must be a list"),
    ],
)
def test_recommend_refuses_options_it_cannot_use(options, error, message):
    with pytest.raises(error, match=message):
        recommend(DENSE, H100, 8, **options)


# -- the command -----------------------------------------------------------------------------


def test_cli_prints_the_measure_and_the_candidates_left_out(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # reasons on one line each
    base = ["recommend", "-n", "8", "--gpu", "H100", "--model", str(EXAMPLES / "dense-7b.yaml"),
            "--global-batch", "12", "--top", "3", "--zero", "0", "--recompute", "none", "--tp", "1"]  # fmt: skip
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "ranked by makespan (steps synchronised)" in out
    assert "dense-7b (4,096-token sequences) on 8 x H100" in out  # the model file's length
    count = next(line for line in out.splitlines() if "did not fit or could not run" in line)
    assert count.endswith("candidates did not fit or could not run (--verbose lists them)")
    assert main([*base, "--step-boundary", "overlap", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "ranked by span (steps overlap)" in out
    assert "--verbose lists them" not in out and "every schedule" in out
    assert "does not split into DP=8" in out
    assert main([*base, "--json", "--usable-memory", "0.9"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_measure"] == "makespan" and data["usable_memory"] == 0.9
    assert {plan["step_measure"] for plan in data["plans"]} == {"makespan"}
    assert int(count.split()[0]) < len(data["rejected"])  # 90 % fits less than 95 %
    assert all(r["reason"] for r in data["rejected"])


@pytest.mark.parametrize("value", ["0", "1.5", "nan", "x"])
def test_cli_refuses_a_usable_memory_outside_zero_to_one(capsys, value):
    args = ["recommend", "-n", "8", "--gpu", "H100", "--model", str(EXAMPLES / "dense-7b.yaml"),
            "--usable-memory", value]  # fmt: skip
    assert main(args) == 2
    assert "must be a number > 0 and <= 1" in capsys.readouterr().err


def test_the_sequence_length_is_set_on_the_command_line_and_shown(capsys, tmp_path):
    """A Hugging Face config's max_position_embeddings is its longest context, not a training
    length: --seq-len sets it, and the title says which length was planned."""
    import json

    config = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8,
              "num_attention_heads": 8, "intermediate_size": 2816, "vocab_size": 32000,
              "max_position_embeddings": 163840}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    base = ["recommend", "-n", "4", "--gpu", "H100", "--model", str(tmp_path), "--top", "1"]
    assert main([*base, "--seq-len", "2048"]) == 0
    assert "(2,048-token sequences)" in capsys.readouterr().out
    assert main([*base, "--seq-len", "0"]) == 2
    assert "--seq-len: must be a whole number between 1 and" in capsys.readouterr().err
