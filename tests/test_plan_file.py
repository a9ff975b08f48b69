"""Plan files (cutpipe.plan.plan_file): the round trip, refusals that say what to change, and the
files ``cutpipe recommend -o`` and ``cutpipe partition -o`` write (docs/plan.md, "Plan files")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cutpipe.cli.main import main
from cutpipe.plan.plan_file import PlanFile
from cutpipe.schedule.fileformat import save_schedule
from cutpipe.schedule.registry import generate

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
TINY = str(EXAMPLES / "tiny-dense.yaml")  # 8 layers: 10 blocks with the embedding and the head


def named(**changes) -> PlanFile:
    fields = dict(model="tiny-dense", layers=8, schedule="interleaved:chunks=2", microbatches=8,
                  stage_sizes=(3, 2, 2, 3), pp=2, dp=4, ep=1, tp=1, zero=1, recompute="full",
                  fp8=False, predicted={"step_time": 0.5, "tokens_per_second": 1e5,
                                        "peak_memory": 2.5e9, "hardware": "H100"})  # fmt: skip
    return PlanFile(**{**fields, **changes})


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_named_schedule_round_trips(tmp_path):
    plan = named()
    plan.save(tmp_path / "plan.json")
    loaded = PlanFile.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.to_dict() == plan.to_dict()
    assert loaded.predicted == plan.predicted
    assert loaded.resolve().num_stages == len(loaded.stage_sizes) == 4


def test_a_whole_schedule_round_trips(tmp_path):
    schedule = generate("zbv", 4, 8)
    plan = named(schedule=schedule, pp=4, dp=1, stage_sizes=(1, 1, 1, 1, 1, 1, 1, 3))
    plan.save(tmp_path / "plan.json")
    loaded = PlanFile.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.resolve().codes == schedule.codes


def test_a_list_of_stage_sizes_is_the_same_plan_as_a_tuple():
    assert named(stage_sizes=[3, 2, 2, 3]) == named()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"stage_sizes": (3, 2, 2, 2)}, "hold 9 blocks, but tiny-dense has 10"),
        ({"stage_sizes": (3, 0, 4, 3)}, "stage_sizes must be whole numbers >= 1"),
        ({"pp": 0}, "pp must be a whole number >= 1"),
        ({"dp": 2.0}, "dp must be a whole number >= 1"),
        ({"zero": 4}, "zero must be one of"),
        ({"recompute": "some"}, "recompute must be one of none, selective, full"),
        ({"schedule": generate("zbv", 4, 8)}, "the schedule is for 4 ranks, the layout has pp=2"),
    ],
)
def test_a_bad_plan_is_refused_with_what_to_change(changes, message):
    with pytest.raises(ValueError, match=message):
        named(**changes)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="cutpipe-timeline"), "format is 'cutpipe-timeline'"),
        (lambda d: d.update(version=2), "version 2 is not 1: write it again"),
        (lambda d: d["layout"].pop("pp"), "layout lacks 'pp'"),
        (lambda d: d["layout"].update(tp=0), "layout.tp must be >= 1"),
        (lambda d: d.pop("stage_sizes"), "lacks 'stage_sizes'"),
        (lambda d: d.update(stage_sizes=[5, 5, 1]), "hold 11 blocks"),
        (lambda d: d["training"].update(fp8="yes"), "training.fp8 must be true or false"),
    ],
)
def test_a_bad_file_is_refused_with_what_to_change(tmp_path, edit, message):
    data = named().to_dict()
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        PlanFile.load(path)


def test_a_missing_or_garbled_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read plan file"):
        PlanFile.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        PlanFile.load(tmp_path / "bad.json")


def test_resolving_checks_the_stage_count():
    with pytest.raises(ValueError, match="stage_sizes has 2 stages, but .* has 4"):
        named(stage_sizes=(5, 5)).resolve()


def test_recommend_writes_the_winning_plan(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "recommend", "--devices", "8", "--gpu", "H100", "--model", TINY,
                       "--global-batch", "64", "--json", "-o", str(path))  # fmt: skip
    assert code == 0
    report = json.loads(out)
    best = report["plans"][0]
    plan = PlanFile.load(path)
    assert report["plan_file"] == str(path)
    assert (plan.model, plan.layers) == ("tiny-dense", 8)
    assert plan.schedule == best["schedule"] and plan.microbatches == best["microbatches"]
    assert list(plan.stage_sizes) == best["stage_sizes"]
    training = best["training"]
    assert (plan.pp, plan.dp, plan.ep, plan.tp) == (best["pp"], best["dp"], best["ep"],
                                                     training["tp"])  # fmt: skip
    assert (plan.zero, plan.recompute, plan.fp8) == (training["zero"], training["recompute"],
                                                     training["fp8"])  # fmt: skip
    assert plan.predicted == {"step_time": best["step_time"], "hardware": "H100",
                              "tokens_per_second": best["tokens_per_second"],
                              "peak_memory": best["peak_memory"]}  # fmt: skip
    assert plan.resolve().num_stages == len(plan.stage_sizes)


def test_recommend_says_where_the_plan_went(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "recommend", "--devices", "4", "--gpu", "H100", "--model", TINY,
                       "-o", str(path))  # fmt: skip
    assert code == 0 and f"wrote the winning plan to {path}" in out and path.exists()


@pytest.mark.parametrize("name", ["interleaved", "zbv", "1f1b"])
def test_partition_writes_the_balanced_split(capsys, tmp_path, name):
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "partition", "-s", name, "-r", "2", "-m", "4", "--gpu", "H100",
                       "--model", TINY, "--json", "-o", str(path))  # fmt: skip
    assert code == 0
    report = json.loads(out)
    plan = PlanFile.load(path)
    layers = report["layers_per_stage"]
    blocks = [n + (s == 0) + (s == len(layers) - 1) for s, n in enumerate(layers)]
    assert list(plan.stage_sizes) == blocks
    assert plan.schedule == {"interleaved": "interleaved:chunks=2"}.get(name, name)
    assert (plan.microbatches, plan.pp, plan.dp) == (4, 2, 1)
    assert plan.predicted["step_time"] == report["step_time"]
    assert plan.resolve().num_stages == len(plan.stage_sizes)


def test_partition_from_a_file_keeps_the_whole_schedule(capsys, tmp_path):
    schedule = generate("zbv", 2, 4)
    save_schedule(schedule, tmp_path / "zbv.json")
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "partition", "--from", str(tmp_path / "zbv.json"), "--gpu", "H100",
                       "--model", TINY, "-o", str(path))  # fmt: skip
    assert code == 0 and f"wrote the partition to {path}" in out
    plan = PlanFile.load(path)
    assert plan.resolve().codes == schedule.codes and plan.microbatches == 4
    assert plan.resolve().num_stages == len(plan.stage_sizes) == 4


@pytest.mark.parametrize(
    "args",
    [["recommend", "--devices", "4", "--gpu", "H100", "--model", TINY],
     ["partition", "-s", "1f1b", "-r", "2", "-m", "2", "--gpu", "H100", "--model", TINY]],
)  # fmt: skip
@pytest.mark.parametrize(
    "target, message",
    [("nodir/plan.json", "the folder nodir does not exist"), ("plan.yaml", "use one of .json")],
)
def test_a_bad_plan_path_is_refused_before_the_work(capsys, monkeypatch, tmp_path, args, target,
                                                    message):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *args, "-o", target)
    assert code == 2 and message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
