"""`cutpipe bench moe`: the Cut-in-half report's comparison, simulated at scale and run here."""

import itertools
import json
from pathlib import Path

import pytest

from cutpipe import Costs, generate
from cutpipe.bench.emulated import hook_ratios
from cutpipe.bench.measured import HOOK_OFF, RealSetting, bench_model_file, run_real
from cutpipe.bench.report import Row, verdicts
from cutpipe.bench.simulated import (
    MODEL_FILE,
    SimulatedSetting,
    default_model,
    exposed_alltoall,
    simulate_at_scale,
)
from cutpipe.cli.main import main
from cutpipe.plan.costs.model import gpu, model_items
from cutpipe.plan.partition import rank_balanced_sizes
from cutpipe.spec import ModelSpec

ROOT = Path(__file__).parents[1]


def test_the_default_model_is_one_file_shipped_in_the_package():
    """The example is a link to the packaged file, so there is one definition, found installed."""
    example = ROOT / "examples" / "models" / MODEL_FILE
    assert example.resolve() == (ROOT / "src" / "cutpipe" / "bench" / MODEL_FILE).resolve()
    model = default_model()
    assert model == ModelSpec.load(example) and model.name == "moe-40l"
    assert (model.layers, model.experts, model.top_k, model.seq_len) == (40, 8, 2, 2048)
    shipped = '"cutpipe.bench" = ["moe-40l.yaml", "bench-moe.yaml"]'
    assert shipped in (ROOT / "pyproject.toml").read_text()
    assert ModelSpec.load(bench_model_file()).moe  # what the real runs train, shipped too


@pytest.mark.parametrize("name", ["1f1b", "dualpipe", "dualpipev", "zbv"])
def test_stages_even_out_the_ranks(name):
    """Ranks, not stages: a V's rank 0 also holds the head, so its stages get fewer layers."""
    schedule = generate(name, 4, 64)
    items = model_items(default_model(), gpu("A100"), ep=2)
    work = [i.forward + i.backward + i.weight for i in items]
    sizes = rank_balanced_sizes(items, schedule)
    bounds = list(itertools.accumulate([0, *sizes]))
    stage = [sum(work[a:b]) for a, b in itertools.pairwise(bounds)]
    loads = [sum(stage[s] for s in schedule.placement.stages_of(r)) for r in range(4)]
    layer = max(work[1:-1])
    assert max(loads) - min(loads) <= 2 * layer


def test_exposed_alltoall_follows_the_pair_rule():
    costs = Costs(f=2, b=2, w=1, ep_f=0.5, ep_b=0.5)
    one_f_one_b = generate("1f1b", 4, 8)
    assert exposed_alltoall(one_f_one_b, costs) == [8.0] * 4  # every F and BW exposes its own
    dual = generate("dualpipev", 4, 10)
    exposed = exposed_alltoall(dual, costs)
    pairs = [sum(type(op).__name__ == "Overlap" for op in ops) for ops in dual.actions]
    singles = [len(ops) - p for ops, p in zip(dual.actions, pairs, strict=True)]
    assert all(p > 0 for p in pairs)
    # pairs hide theirs completely (1 of all-to-all under 4+ of compute); W ops expose none
    for rank, ops in enumerate(dual.actions):
        own = sum(0.5 for op in ops if type(op).__name__ != "Overlap" and op.kind.name != "W")
        assert exposed[rank] == own
    assert sum(singles) > 0


def test_simulated_table_shows_the_structural_facts():
    rows = {row.schedule: row for row in simulate_at_scale()}
    assert set(rows) == {"1f1b", "dualpipe", "dualpipev", "zbv"}
    assert rows["dualpipe"].params_x == 2 and rows["dualpipev"].params_x == 1
    assert rows["dualpipev"].pp_traffic_x == 2 and rows["1f1b"].pp_traffic_x == 1
    assert rows["dualpipev"].memory < rows["dualpipe"].memory
    # overlapped pairs hide the all-to-all that 1F1B and ZB-V expose in every op
    assert rows["dualpipev"].comm < rows["1f1b"].comm and rows["dualpipe"].comm < rows["zbv"].comm
    for row in rows.values():
        assert row.throughput > 0 and 0 <= row.bubble < 1 and 0 <= row.comm < 1
        assert row.memory == max(row.memory_per_rank)


def test_bench_moe_sim_only_json(capsys):
    assert main(["bench", "moe", "--sim-only", "--json", "--gpu", "H100"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["measured"] == [] and data["hook_step_ratio"] is None
    assert [row["schedule"] for row in data["simulated"]] == [
        "1f1b",
        "dualpipe",
        "dualpipev",
        "zbv",
    ]
    assert data["settings"]["simulated"]["gpu"] == "H100"
    claims = {v["claim"].split(" (")[0]: v["simulated"] for v in data["verdicts"]}
    assert claims["Cut-in-half stores the parameters once, DualPipe twice"] is True


def test_bench_moe_prints_the_table_and_the_claims(capsys):
    assert main(["bench", "moe", "--sim-only"]) == 0
    out = capsys.readouterr().out
    for text in (
        "Cut-in-half",
        "ZB-V",
        "samples/s",
        "Against the Cut-in-half report's claims",
        "simulated",
    ):
        assert text in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ep", "3"], "expert-parallel size 3 does not divide the 4 experts"),
        (["--sim-ep", "3"], "expert-parallel size 3 does not divide the 8 experts"),
        (["--sim-pp", "3"], "PP 3 x EP 2 does not divide 8 devices"),
        (["--gpu", "Z80"], "unknown GPU 'Z80'"),
        (["--batch", "1001"], "use a multiple of 2"),
        (["--microbatches", "2"], "dualpipev"),
    ],
)
def test_bench_moe_bad_input_fails_before_any_process_starts(capsys, args, message):
    assert main(["bench", "moe", *args]) == 2
    assert message in capsys.readouterr().err


def test_simulated_setting_defaults_are_the_reports():
    setting = SimulatedSetting()
    assert (setting.devices, setting.pp * setting.ep, setting.batch) == (8, 8, 1024)
    assert setting.microbatches == 512  # per pipeline: 1024 over EP 2, one sequence each


@pytest.mark.timeout(150)
def test_real_runs_measure_every_figure_through_the_trainer():
    setting = RealSetting(steps=1, schedules=("1f1b", "dualpipev"), emulate_unit=0.005)
    results = run_real(setting, timeout=130)
    by_name = {row.schedule: row for row in results.rows}
    assert set(by_name) == {"1f1b", "dualpipev", HOOK_OFF}
    assert results.hook_ratio > 0
    for row in results.rows:
        assert row.throughput > 0 and 0 <= row.bubble < 1 and 0 <= row.comm < 1
        assert len(row.memory_per_rank) == 4 and row.memory == max(row.memory_per_rank)
        parts = row.memory_parts
        assert min(parts["parameters"], parts["gradients"], parts["activations"]) > 0
        assert parts["optimizer"] == pytest.approx(2 * parts["parameters"], rel=0.01)
    assert by_name["dualpipev"].pp_traffic_x == 2 and by_name["1f1b"].params_x == 1
    # memory is counted, not timed: the same on any machine
    assert len(results.memory) == 3 * 4
    for row in results.memory:
        assert row.state == pytest.approx(row.state_predicted, rel=1e-3), row  # Adam's steps
        # routing makes microbatches differ; an interleaved pair frees before it allocates
        assert 0.85 <= row.activation_ratio <= 1.1, row
        if row.run == "1f1b":  # no pairs: the simulator's model is the runtime's
            assert row.between_ops == row.activation
    v = {row.rank: row.state for row in results.memory if row.run == "dualpipev"}
    one = {row.rank: row.state for row in results.memory if row.run == "1f1b"}
    assert sum(v.values()) == pytest.approx(sum(one.values()), rel=0.01)  # stored once
    ratios = hook_ratios(results.emulated)
    assert set(ratios) == {"dualpipe", "dualpipev"}
    for step in results.emulated:  # sleeps never end early: the simulator is a lower bound
        assert step["agreement"] <= 1.01, step
        # fed the measured durations, it predicts the step: the runtime waits for nothing else
        assert step["replay_agreement"] >= 0.95, step
    for measured, simulated in ratios.values():  # a ratio from one run
        assert measured <= simulated + 0.1


def _rows(figures: dict[str, tuple[float, ...]]) -> list[Row]:
    """Rows from (throughput, memory, bubble, comm, params_x, pp_traffic_x) per schedule."""
    return [
        Row(name, name, *values[:4], params_x=values[4], pp_traffic_x=values[5])
        for name, values in figures.items()
    ]


HOLDS = _rows({
    "1f1b": (10, 5, 0.20, 0.3, 1, 1), "dualpipe": (11, 8, 0.05, 0.1, 2, 1),
    "dualpipev": (11, 6, 0.06, 0.1, 1, 2), "zbv": (10, 6, 0.05, 0.3, 1, 2),
})  # fmt: skip
FAILS = _rows({
    "1f1b": (12, 5, 0.20, 0.1, 1, 1), "dualpipe": (12, 6, 0.05, 0.1, 1, 1),
    "dualpipev": (10, 7, 0.20, 0.3, 1, 1), "zbv": (10, 6, 0.05, 0.1, 1, 2),
})  # fmt: skip


def test_each_verdict_explains_its_own_outcome():
    agree, disagree = verdicts(HOLDS, HOLDS), verdicts(FAILS, FAILS)
    for yes, no in zip(agree, disagree, strict=True):
        assert yes.here is yes.simulated is True and no.here is no.simulated is False
        assert yes.why != no.why, yes.claim
    here_only = {v.claim.split(" (")[0]: v.why for v in verdicts(FAILS, HOLDS)}
    simulated_only = {v.claim.split(" (")[0]: v.why for v in verdicts(HOLDS, FAILS)}
    bubble = "Cut-in-half has DualPipe's bubble, within 5 points of the step"
    assert "per-op cost" in here_only[bubble] and "per-op cost" not in simulated_only[bubble]
    assert "gloo" in here_only[next(c for c in here_only if c.startswith("Overlapped"))]


def test_a_claim_without_figures_says_so():
    quiet = [Row(r.schedule, r.title, r.throughput, r.memory, r.bubble, 0.0) for r in HOLDS]
    hides = verdicts(quiet, [])[4]
    assert hides.here is None and hides.simulated is None and "No figures" in hides.why
