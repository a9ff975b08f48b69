"""``cost_aware`` on the planner's per-stage costs, and ``cutpipe tune`` fed by a model or a profile."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cutpipe.cli.main import main
from cutpipe.plan.costs.model import gpu, model_items, w_memory
from cutpipe.plan.costs.profile import Profile
from cutpipe.plan.search.caps import default_cap, within
from cutpipe.plan.search.tune import FIXED, cost_aware
from cutpipe.schedule.registry import schedule_info
from cutpipe.schedule.validate import validate
from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import peak_activations
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate
from cutpipe.spec import ModelSpec

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
DENSE = str(EXAMPLES / "dense-7b.yaml")


def makespan(schedule, costs: Costs) -> float:
    return metrics(simulate(schedule, costs), costs).makespan


def per_stage(draw, stages: int, low: float, high: float) -> list[float]:
    values = st.floats(low, high, allow_nan=False, allow_infinity=False)
    return draw(st.lists(values, min_size=stages, max_size=stages))


@st.composite
def planner_costs(draw) -> tuple[str, int, int, Costs]:
    """A placement, R, m and per-stage costs shaped like ``stage_costs``' (times in seconds,
    activations in bytes, all-to-all times, parameter counts)."""
    placement = draw(st.sampled_from(("linear", "v")))
    ranks = draw(st.integers(2, 4))
    microbatches = draw(st.integers(ranks, 3 * ranks))
    stages = ranks * (2 if placement == "v" else 1)
    costs = Costs(
        f=per_stage(draw, stages, 0.01, 0.1),
        b=per_stage(draw, stages, 0.01, 0.1),
        w=per_stage(draw, stages, 0.005, 0.1),
        comm=draw(st.floats(0.0, 0.01)),
        ep_f=per_stage(draw, stages, 0.0, 0.02),
        ep_b=per_stage(draw, stages, 0.0, 0.02),
        activation=per_stage(draw, stages, 1e8, 1e9),
        w_memory=draw(st.floats(0.0, 1.0)),
        params=per_stage(draw, stages, 1e6, 1e9),
    )
    return placement, ranks, microbatches, costs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=planner_costs(), headroom=st.sampled_from((1.0, 1.5)))
def test_cost_aware_on_per_stage_costs_fits_the_cap_and_beats_the_fixed_orders(shape, headroom):
    placement, ranks, m, costs = shape
    cap = default_cap(placement, ranks, costs) * headroom
    tuned = cost_aware(placement, ranks, m, costs, cap, search_seconds=5, search_evaluations=10)
    validate(tuned)
    assert within(max(peak_activations(tuned, costs)), cap)
    ours = makespan(tuned, costs)
    fitting = []
    for name in FIXED[placement]:
        info = schedule_info(name)
        if info.accepts(ranks, m):
            fixed = info.generate(ranks, m)
            if within(max(peak_activations(fixed, costs)), cap):
                fitting.append(name)
                assert ours <= makespan(fixed, costs) * (1 + 1e-9), name
    assert fitting  # 1F1B or ZB-V always fits the default cap


def test_a_fixed_order_at_the_cap_up_to_rounding_fits_it():
    """ZB-H1's peak here is the default cap, but its activations in bytes, added and freed in
    fractions (w_memory), come to a few units in the last place over: it must still fit."""
    costs = Costs(f=[1.0, 1.0], b=[1.0, 1.0], w=[1.0, 1.0], activation=[987654321.0, 5e8],
                  w_memory=0.3)  # fmt: skip
    zbh1 = schedule_info("zbh1").generate(2, 4)
    cap = default_cap("linear", 2, costs)
    assert max(peak_activations(zbh1, costs)) != cap  # rounding: not equal, but within
    tuned = cost_aware("linear", 2, 4, costs, search_seconds=0)
    assert makespan(tuned, costs) <= makespan(zbh1, costs)


def test_cost_aware_names_a_per_stage_list_of_the_wrong_length():
    with pytest.raises(ValueError, match="lists 4 values but the schedule has 8 stages"):
        cost_aware("v", 4, 8, Costs(activation=[1e9] * 4), search_seconds=0)


def tune(capsys, *args: str) -> dict:
    assert main(["tune", "-r", "4", "-m", "8", "--seconds", "0", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_tune_on_a_model_beats_1f1b_and_zbh1(capsys):
    report = tune(capsys, "--model", DENSE, "--gpu", "H100", "--placement", "linear")
    ours = report["cost-aware"]["makespan"]
    assert ours <= report["1f1b"]["makespan"] and ours <= report["zbh1"]["makespan"]
    plan = report["plan"]
    assert plan["model"] == "dense-7b" and plan["gpu"] == "H100" and plan["source"] == "model"
    assert sum(plan["layers_per_stage"]) == 32 and len(plan["layers_per_stage"]) == 4
    assert plan["memory_cap_unit"] == "bytes" and plan["memory_cap"] == plan["default_memory_cap"]
    assert max(report["cost-aware"]["peak_activations_per_rank"]) <= plan["memory_cap"] * 1.000001


def test_tune_on_a_model_on_a_v_beats_zbv(capsys):
    report = tune(capsys, "--model", DENSE, "--gpu", "H100", "--placement", "v")
    assert report["cost-aware-v"]["makespan"] <= report["zbv"]["makespan"]
    assert len(report["plan"]["layers_per_stage"]) == 8
    assert "lower_bound" not in report  # the bound needs equal stages


def test_tune_with_twice_the_memory_beats_zbh2(capsys):
    report = tune(capsys, "--model", DENSE, "--gpu", "H100", "--placement", "linear",
                  "--memory-cap-x", "2")  # fmt: skip
    assert report["cost-aware"]["makespan"] <= report["zbh2"]["makespan"]
    plan = report["plan"]
    assert plan["memory_cap"] == pytest.approx(2 * plan["default_memory_cap"])


def test_memory_cap_x_scales_scalar_costs_too(capsys):
    report = tune(capsys, "--costs", "F=1,B=1,W=1", "--placement", "linear", "--memory-cap-x",
                  "2")  # fmt: skip
    assert max(report["cost-aware"]["peak_activations_per_rank"]) <= 8
    assert report["cost-aware"]["makespan"] <= report["zbh2"]["makespan"]
    assert "plan" not in report


def test_tune_on_a_profile(capsys, tmp_path):
    model = ModelSpec(name="tiny", layers=8, hidden=64, heads=4, ffn=128, vocab=300, seq_len=32)
    items = model_items(model, gpu("A100"))
    measured = {
        "embedding": items[0],
        "dense_layer": replace(items[1], forward=2e-4, backward=3e-4, weight=1e-4),
        "head": replace(items[-1], forward=5e-4, backward=5e-4, weight=5e-4),
    }
    path = tmp_path / "tiny.json"
    Profile(model, "cpu", "fp32", measured, w_memory(model)).save(path)
    report = tune(capsys, "--profile", str(path), "--gpu", "A100", "--placement", "linear")
    assert report["plan"]["source"] == "profile" and sum(report["plan"]["layers_per_stage"]) == 8
    assert report["cost-aware"]["makespan"] <= report["zbh1"]["makespan"]
    assert main(["tune", "-r", "2", "-m", "4", "--seconds", "0", "--profile", str(path), "--gpu",
                 "A100"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "tiny (32-token sequences) on 2 x A100-80GB (profile)" in out and "GB" in out
    assert "makespan (ms)" in out


def test_tune_table_names_the_layers_per_stage_and_the_cap_in_bytes(capsys):
    argv = ["tune", "-r", "4", "-m", "8", "--seconds", "0", "--model", DENSE, "--gpu", "H100",
            "--placement", "linear", "--memory-cap-x", "1.5"]  # fmt: skip
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # the title as one line, however wrapped
    assert "layers per stage" in out and "GB" in out and "1.5x 1F1B's peak" in out
    assert "dense-7b (4,096-token sequences) on 4 x H100" in out
    assert main([*argv, "--seq-len", "512", "--json"]) == 0
    assert tune_json(capsys)["plan"]["seq_len"] == 512


def tune_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", DENSE], "--model needs --gpu"),
        (["--profile", DENSE], "--profile needs --gpu"),
        (["--model", DENSE, "--costs", "F=1", "--gpu", "H100"], "not allowed with argument"),
        (["--costs", "F=1", "--gpu", "H100"], "--gpu applies to --model or --profile"),
        (["--memory-cap", "4", "--memory-cap-x", "1"], "not both"),
        (["--memory-cap-x", "0"], "--memory-cap-x: must be a finite number > 0"),
        (["--model", DENSE, "--gpu", "H100", "-r", "40"], "needs at least 78 layers"),
        (["--model", "/nope.yaml", "--gpu", "H100"], "no such file"),
        (["--profile", DENSE, "--gpu", "H100"], "not JSON"),
        (["--costs", "F=1", "--seq-len", "64"], "--seq-len sets the length of --model's"),
    ],
)  # fmt: skip
def test_tune_refuses_bad_sources(capsys, args, message):
    argv = ["tune", "-r", "4", "-m", "8", "--seconds", "0", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_too_few_layers_for_the_stages(capsys, tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("layers: 2\nhidden: 64\nheads: 4\nffn: 128\nvocab: 300\nseq_len: 32\n")
    argv = ["tune", "-r", "4", "-m", "8", "--model", str(path), "--gpu", "H100"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "2 layers" in err and "8 stages" in err and "needs at least 6 layers" in err


def test_tune_reads_a_hugging_face_config(tmp_path, capsys):
    config = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2816,
              "vocab_size": 32000, "max_position_embeddings": 2048}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = ["tune", "--model", str(path), "--gpu", "H100", "-r", "2", "-m", "4", "--seconds", "0",
            "--placement", "linear", "--json"]  # fmt: skip
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["model"] == tmp_path.name  # a config.json is named after its folder
    assert sum(report["plan"]["layers_per_stage"]) == 8
