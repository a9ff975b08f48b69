"""Balanced partitions, recommendations, the progress bar and the planning commands."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from cutpipe.cli.main import main
from cutpipe.plan import progress as progress_module
from cutpipe.plan.costs.model import gpu, model_items, optimizer_time, p2p_time, w_memory
from cutpipe.plan.partition import balance, evaluate, even_sizes, stage_costs
from cutpipe.plan.recommend.recommend import (
    USABLE_MEMORY,
    Job,
    Layout,
    reason,
    recommend,
    ring_allreduce,
)
from cutpipe.plan.recommend.recommend import evaluate as evaluate_plan
from cutpipe.schedule.registry import generate
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
BIG_VOCAB = ModelSpec(name="big-vocab", layers=24, hidden=2560, heads=20, ffn=6912, vocab=256000,
                      seq_len=4096)  # fmt: skip


def balanced_and_even(name: str, ranks: int, microbatches: int, cap: float | None = None):
    schedule = generate(name, ranks, microbatches)
    items = model_items(BIG_VOCAB, gpu("H100"))
    comm = p2p_time(BIG_VOCAB, gpu("H100"), within_node=True)
    best = balance(schedule, items, comm, w_memory(BIG_VOCAB), cap)
    even = evaluate(
        schedule, items, even_sizes(items, schedule.num_stages), comm, w_memory(BIG_VOCAB)
    )
    return schedule, best, even


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "1f1b"])
def test_balanced_split_beats_an_even_one_with_a_large_vocabulary(name):
    _, best, even = balanced_and_even(name, 4, 16)
    assert sum(best.sizes) == BIG_VOCAB.layers + 2
    assert best.step_time < 0.85 * even.step_time  # 23-35% shorter steps (docs/plan.md)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_rank_zero_holding_embedding_and_head_gets_fewer_layers(name):
    schedule, best, _ = balanced_and_even(name, 4, 16)
    layers = [size - (s == 0) - (s == len(best.sizes) - 1) for s, size in enumerate(best.sizes)]
    per_rank = [sum(layers[s] for s in schedule.placement.stages_of(r)) for r in range(4)]
    assert per_rank[0] < BIG_VOCAB.layers / 4
    assert per_rank[0] == min(per_rank)


def test_partition_respects_the_memory_cap_or_says_by_how_much_it_misses():
    _, free, even = balanced_and_even("1f1b", 4, 16)
    cap = max(free.memory) * 0.9  # the fastest split puts 9 layers and the embedding on rank 0
    _, capped, _ = balanced_and_even("1f1b", 4, 16, cap=cap)
    assert max(capped.memory) <= cap
    assert capped.sizes[0] < free.sizes[0]
    assert capped.step_time < even.step_time
    with pytest.raises(ValueError, match=r"fits 1.0 GB per device: the best needs .* GB over"):
        balanced_and_even("zbv", 4, 16, cap=1e9)


def test_recommend_seed_moe_on_eight_a100():
    model = ModelSpec.load(EXAMPLES / "moe-40l.yaml")
    plans = recommend(model, gpu("A100"), 8, global_batch=1024, zero=0, recompute="none", tp=1)
    assert plans == sorted(plans, key=lambda p: -p.tokens_per_second)
    assert all(p.pp * p.dp == 8 and p.dp % p.ep == 0 and 8 % p.ep == 0 for p in plans)
    assert all(p.peak_memory <= 80e9 * USABLE_MEMORY for p in plans)
    layouts = {(p.pp, p.schedule) for p in plans}
    assert (2, "dualpipev") in layouts and (4, "dualpipe") in layouts
    # the Cut-in-half claim, on the same devices: DualPipe stores every stage twice
    by = {(p.pp, p.ep, p.schedule): p for p in plans}
    assert by[(4, 2, "dualpipev")].peak_memory < by[(4, 2, "dualpipe")].peak_memory
    text = reason(plans, gpu("A100"))
    assert plans[0].layout() in text and f"{plans[0].tokens_per_second:,.0f} tokens/s" in text


def test_gradient_all_reduce_spares_experts_that_no_other_rank_holds():
    """With EP = DP every expert lives on one rank: only the dense parameters are all-reduced."""
    model, a100 = ModelSpec.load(EXAMPLES / "moe-40l.yaml"), gpu("A100")
    job = Job(model, a100, 8, memory=80e9, usable_memory=1.0)
    plan = evaluate_plan(job, Layout(pp=1, dp=8, ep=8, schedule="1f1b", microbatches=16))
    items = model_items(model, a100, ep=8)
    comm = p2p_time(model, a100, within_node=True)
    costs = stage_costs(items, [len(items)], comm, w_memory(model))
    makespan = metrics(simulate(generate("1f1b", 1, 16), costs), costs).makespan
    dense = sum(i.parameters - i.expert_parameters for i in items)
    bandwidth, latency = a100.link(within_node=True)
    optimizer = optimizer_time(sum(i.parameters for i in items), a100)
    expected = makespan + ring_allreduce(dense * 2, 8, bandwidth, latency) + optimizer
    assert plan.step_time == pytest.approx(expected)
    assert ring_allreduce(1e9, 1, bandwidth, latency) == 0.0


def test_recommend_refuses_what_cannot_fit_and_says_by_how_much():
    model = ModelSpec.load(EXAMPLES / "deepseek-v3-like.yaml")
    with pytest.raises(ValueError, match=r"does not fit on 16 x H100: .* GB over"):
        recommend(model, gpu("H100"), 16)
    small = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
    with pytest.raises(ValueError, match="does not fit"):
        recommend(small, gpu("H100"), 8, memory=1e9)
    quads = ModelSpec.from_dict({**small.__dict__, "microbatch_size": 4})
    with pytest.raises(ValueError, match="global batch divisible"):
        recommend(quads, gpu("H100"), 8, global_batch=6)
    with pytest.raises(ValueError, match="devices must be >= 1"):
        recommend(small, gpu("H100"), 0)


def test_progress_bar_appears_only_after_the_delay_and_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(progress_module.sys, "stderr", Terminal())
    with progress_module.progress("quick", total=3, delay=60) as tick:
        tick()
        assert tick._progress is None
    with progress_module.progress("slow", total=3, delay=0) as tick:
        tick(status="working")
        assert tick._progress is not None
    monkeypatch.setattr(progress_module.sys, "stderr", io.StringIO())
    with progress_module.progress("piped", total=3, delay=0) as tick:
        tick()
        assert tick._progress is None


def test_cli_recommend_prints_a_table_and_a_reason(capsys):
    model = str(EXAMPLES / "dense-7b.yaml")
    assert (
        main(["recommend", "--devices", "8", "--gpu", "H100", "--model", model, "--top", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "tok/s" in out and "is fastest" in out
    assert main(["recommend", "-n", "8", "--gpu", "H100", "--model", model, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plans"][0]["tokens_per_second"] >= data["plans"][-1]["tokens_per_second"]


def test_cli_partition_and_tune(capsys, tmp_path):
    model = tmp_path / "big.yaml"
    model.write_text(
        "layers: 24\nhidden: 2560\nheads: 20\nffn: 6912\nvocab: 256000\nseq_len: 4096\n"
    )
    args = ["partition", "-s", "zbv", "-r", "4", "-m", "16", "--gpu", "H100", "--model", str(model)]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gain"] > 0.15 and sum(data["layers_per_stage"]) == 24
    out = tmp_path / "tuned.json"
    tune = ["tune", "--placement", "linear", "-r", "4", "-m", "8", "--costs", "F=2,B=2,W=1"]
    assert main([*tune, "--seconds", "0", "-o", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert set(rows) == {"cost-aware", "1f1b", "zbh1", "zbh2"}
    assert rows["cost-aware"]["makespan"] <= rows["zbh1"]["makespan"]
    assert json.loads(out.read_text())["name"] == "cost-aware"


def test_cli_profile_then_recommend_with_it(capsys, tmp_path):
    model = tmp_path / "tiny.yaml"
    model.write_text("layers: 4\nhidden: 64\nheads: 4\nffn: 128\nvocab: 300\nseq_len: 32\n")
    profile = tmp_path / "tiny.json"
    assert main(["profile", "--model", str(model), "-o", str(profile), "--repeats", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["recommend", "-n", "4", "--gpu", "A100", "--profile", str(profile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["recommend", "-n", "8", "--gpu", "H100"], "give the model"),
        (["recommend", "-n", "8", "--gpu", "V100", "--model", "M"], "unknown GPU 'V100'"),
        (["recommend", "-n", "8", "--gpu", "H100", "--model", "M", "--memory-gb", "-1"], "--memory-gb: must be a finite number > 0"),
        (["recommend", "-n", "64", "--gpu", "H100", "--model", "DS"], "does not fit on 64 x H100"),
        (["tune", "-r", "4", "-m", "8", "--memory-cap", "1"], "below the smallest possible peak"),
        (["profile", "--model", "/nope.yaml", "-o", "x.json"], "cannot read model file"),
    ],
)  # fmt: skip
def test_cli_bad_input_exits_2_with_the_reason(capsys, args, message):
    replace = {"M": str(EXAMPLES / "dense-7b.yaml"), "DS": str(EXAMPLES / "deepseek-v3-like.yaml")}
    assert main([replace.get(a, a) for a in args]) == 2
    assert message in capsys.readouterr().err
