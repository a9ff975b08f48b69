"""``cutpipe train --plan``: what ``recommend -o`` and ``partition -o`` chose is what trains, and a
plan that does not fit the run is refused before any process starts (docs/training.md, "Options
and plan files")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cutpipe.cli.main import main
from cutpipe.plan.plan_file import PlanFile

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
TINY = str(EXAMPLES / "tiny-dense.yaml")  # 8 layers: 10 blocks with the embedding and the head
MOE = str(EXAMPLES / "tiny-moe.yaml")


def run(capfd, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def partition_line(out: str) -> str:
    return next(line for line in out.splitlines() if "blocks per stage" in line)


@pytest.mark.timeout(240)
def test_partition_then_train_runs_that_partition(capfd, tmp_path):
    path = tmp_path / "plan.json"
    code, _, err = run(capfd, "partition", "--model", TINY, "--schedule", "zbv", "--ranks", "2",
                       "--microbatches", "4", "--gpu", "H100", "-o", str(path))  # fmt: skip
    assert code == 0, err
    plan = PlanFile.load(path)
    assert sum(plan.stage_sizes) == 10 and len(plan.stage_sizes) == 4
    code, out, err = run(capfd, "train", "--model", TINY, "--plan", str(path), "--nproc", "2",
                         "--steps", "1", "--seq-len", "32")  # fmt: skip
    assert code == 0, err
    sizes = ", ".join(map(str, plan.stage_sizes))
    assert f"zbv on 2 ranks, 4 microbatches, blocks per stage {sizes} (from " in partition_line(out)
    assert "1 steps: loss" in out


@pytest.mark.timeout(240)
def test_recommend_then_train_runs_the_winner(capfd, tmp_path):
    path = tmp_path / "plan.json"
    code, _, err = run(capfd, "recommend", "--model", TINY, "--devices", "2", "--gpu", "H100",
                       "--global-batch", "16", "-o", str(path))  # fmt: skip
    assert code == 0, err
    plan = PlanFile.load(path)
    code, out, err = run(capfd, "train", "--model", TINY, "--plan", str(path), "--nproc", "2",
                         "--steps", "1", "--seq-len", "32")  # fmt: skip
    assert code == 0, err
    line = partition_line(out)
    assert f"blocks per stage {', '.join(map(str, plan.stage_sizes))} (from " in line
    assert f"{plan.microbatches} microbatches" in line


def write(tmp_path: Path, **changes) -> str:
    fields = dict(model="tiny-dense", layers=8, schedule="zbv", microbatches=4,
                  stage_sizes=(3, 2, 2, 3), pp=2)  # fmt: skip
    path = tmp_path / "plan.json"
    PlanFile(**{**fields, **changes}).save(path)
    return str(path)


@pytest.mark.parametrize(
    ("changes", "args", "message"),
    [
        (
            {},
            ["--nproc", "4"],
            "is for 2 pipeline ranks x 1 replicas = 2 processes; this run has 4",
        ),
        ({"dp": 2}, ["--nproc", "2"], "is for 2 pipeline ranks x 2 replicas = 4 processes"),
        ({}, ["--nproc", "2", "--model", MOE], "cuts tiny-dense (8 layers), but --model is"),
        ({"ep": 2, "dp": 2}, ["--nproc", "4"], "EP 2 needs an MoE model"),
        ({}, ["--nproc", "2", "--microbatches", "8"], "drop --microbatches 8 (the plan says 4)"),
        ({"dp": 2}, ["--nproc", "4", "--dp", "4"], "drop --dp 4 (the plan says 2)"),
        ({"recompute": "full"}, ["--nproc", "2", "--recompute", "selective"], "--recompute"),
    ],
)
def test_a_plan_that_does_not_fit_the_run_is_refused_before_it_starts(
    capfd, tmp_path, changes, args, message
):
    path = write(tmp_path, **changes)
    model = [] if "--model" in args else ["--model", TINY]
    code, _, err = run(capfd, "train", "--plan", path, *model, *args)
    assert code == 2 and message in err, err
    assert err.count("\n") == 1, err


def test_a_plan_sets_what_it_fixes_and_keeps_the_rest(tmp_path):
    from cutpipe.train.layout import with_plan
    from cutpipe.train.options import TrainOptions

    path = write(tmp_path, dp=2, zero=1, recompute="selective")
    options = with_plan(TrainOptions.build(plan=path, model=TINY, lr=0.01))
    assert (options.dp, options.dp_mode, options.recompute) == (2, "zero1", "selective")
    assert options.microbatches == 4 and options.lr == 0.01
    assert json.loads(Path(path).read_text())["layout"]["dp"] == 2


def test_a_plans_expert_parallelism_is_carved_out_of_its_data_parallel_ranks(tmp_path):
    """recommend counts EP inside DP (DP 4 with EP 2 is 4 data-parallel ranks in EP pairs); the
    trainer's mesh holds them as DP 2 x EP 2."""
    from cutpipe.train.layout import with_plan
    from cutpipe.train.options import TrainOptions

    path = write(tmp_path, model="tiny-moe", dp=4, ep=2)
    options = with_plan(TrainOptions.build(plan=path, model=MOE))
    assert (options.dp, options.ep) == (2, 2)
    with pytest.raises(ValueError, match="ep 3 must divide dp 4"):
        write(tmp_path, dp=4, ep=3)
