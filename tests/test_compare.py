"""The comparison trains one model on the same devices in every row: each schedule's stages
cost ranks / stages of a device share, whatever its placement."""

import json
from dataclasses import replace

import pytest

from cutpipe.cli.main import main
from cutpipe.schedule.registry import generate
from cutpipe.sim.compare import DEFAULT_COSTS, compare, stage_costs

LINEUP = ("1f1b", "interleaved", "zbv", "dualpipe", "dualpipev", "zbh1")


def work(row) -> float:
    return sum(row.metrics.busy_per_rank)


@pytest.mark.parametrize(("ranks", "m"), [(4, 8), (8, 32)])
def test_every_schedule_does_the_same_work(ranks, m):
    """With an F&B pair costing its two halves, every row does F + B + W per device share and
    microbatch (DualPipe runs each microbatch on one of its two copies of the model)."""
    costs = replace(DEFAULT_COSTS, fb=None)
    rows = {row.schedule: row for row in compare(ranks, m, costs, LINEUP)}
    for name in LINEUP:
        assert work(rows[name]) == pytest.approx(3 * ranks * m), name


def test_interleaved_holds_its_published_activation_peak():
    """Interleaved 1F1B with v chunks keeps R(1 + (R-1)/(vR)) device-share activations on its
    first rank (docs/formulas.md): 5.5 at R = 4, v = 2, not the 11 of full-size stages."""
    (row,) = compare(4, 8, DEFAULT_COSTS, ("interleaved",))
    assert row.activations == pytest.approx(5.5)
    assert row.params_x == 1


@pytest.mark.parametrize(("name", "factor"), [("1f1b", 1), ("interleaved", 0.5), ("zbv", 0.5),
                                              ("dualpipe", 1), ("dualpipev", 0.5)])  # fmt: skip
def test_stage_costs_scale_by_ranks_over_stages(name, factor):
    costs = stage_costs(generate(name, 4, 8), DEFAULT_COSTS)
    assert (costs.f, costs.b, costs.w, costs.fb) == (factor, factor, factor, 2.5 * factor)


def test_cli_json_gives_interleaved_the_work_of_1f1b(capsys):
    code = main(["compare", "--schedules", "1f1b,interleaved,zbv", "-r", "4", "-m", "8", "--json"])
    assert code == 0
    rows = {row["schedule"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["interleaved"]["work"] == rows["1f1b"]["work"] == rows["zbv"]["work"] == 96
    assert rows["interleaved"]["activations"] == 5.5
