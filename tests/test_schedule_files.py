"""Schedule files: cutpipe's versioned JSON and torch's CSV, written and read back exactly, and
``--from FILE`` in every command that takes a schedule."""

import json

import pytest
from conftest import named_shapes
from hypothesis import given

from cutpipe.cli.main import main
from cutpipe.schedule import Placement, ScheduleError, generate
from cutpipe.schedule.fileformat import (
    FORMAT,
    VERSION,
    dumps,
    infer_placement,
    load_schedule,
    loads,
    save_schedule,
)


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@given(named_shapes(max_ranks=6, extra_microbatches=6))
def test_json_round_trips_every_schedule_exactly(shape):
    schedule = generate(*shape)
    text = dumps(schedule, "json")
    record = json.loads(text)
    assert (record["format"], record["version"]) == (FORMAT, VERSION)
    back = loads(text, "json")
    assert back == schedule and back.name == schedule.name


@given(named_shapes(max_ranks=6, extra_microbatches=6))
def test_csv_round_trips_every_single_pipe_schedule(shape):
    schedule = generate(*shape)
    if schedule.placement.num_pipes > 1:
        with pytest.raises(ValueError, match="two ranks"):
            dumps(schedule, "csv")
        return
    back = loads(dumps(schedule, "csv"), "csv", name="x")
    assert (back.placement.pipes, back.codes) == (schedule.placement.pipes, schedule.codes)
    if schedule.num_ranks > 1:  # one rank with two stages is a V and interleaved alike
        assert back == schedule  # linear, v and interleaved placements are named


def test_files_round_trip_by_their_ending(tmp_path):
    for name, ending in (("dualpipe", ".json"), ("dualpipev", ".json"), ("zbv", ".csv")):
        schedule = generate(name, 4, 10)
        path = tmp_path / f"{name}{ending}"
        save_schedule(schedule, path)
        assert load_schedule(path) == schedule
    with pytest.raises(ValueError, match=r"name it \.json"):
        save_schedule(schedule, tmp_path / "s.yaml")


def test_a_placement_is_inferred_and_named_when_known():
    assert infer_placement(4, (0, 1, 2, 3)).kind == "linear"
    assert infer_placement(2, (0, 1, 1, 0)).kind == "v"
    assert infer_placement(2, (0, 1, 0, 1)).kind == "interleaved"
    odd = infer_placement(2, (1, 0))
    assert (odd.kind, odd.pipes) == ("custom", ((1, 0),))


def test_bad_files_say_what_is_wrong(tmp_path):
    good = json.loads(dumps(generate("zbv", 2, 4)))
    cases = {
        "not json": "not JSON",
        json.dumps({**good, "version": 7}): "version 7 is not one",
        json.dumps({**good, "format": "cutpipe.timeline"}): "not a schedule",
        json.dumps({"format": FORMAT, "version": 1}): "lacks 'placement'",
    }
    for index, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{index}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_schedule(path)
    # a file from an earlier cutpipe (tune -o wrote no header) still reads
    legacy = {key: value for key, value in good.items() if key not in ("format", "version")}
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    assert load_schedule(tmp_path / "legacy.json") == generate("zbv", 2, 4)


def test_a_csv_that_would_deadlock_or_shares_a_stage_is_refused():
    with pytest.raises(ScheduleError):  # rank 1 waits for 0F0's output before 0 computes it
        loads("0B0,0F0\n1F0,1B0\n", "csv")
    with pytest.raises(ValueError, match="stage 0 runs on ranks"):
        loads("0F0,0B0\n0F1,0B1\n", "csv")
    with pytest.raises(ValueError, match="rank 1: cannot parse action"):
        loads("0F0,0B0\n1X0\n", "csv")


def test_schedule_writes_csv_and_json_and_reports_it(tmp_path, capsys):
    csv_path, json_path = tmp_path / "s.csv", tmp_path / "s.json"
    code, out, _ = run(capsys, "schedule", "-s", "dualpipev", "-r", "4", "-m", "10",
                       "--format", "csv", "-o", str(csv_path))  # fmt: skip
    assert code == 0 and "wrote" in out
    assert load_schedule(csv_path) == generate("dualpipev", 4, 10)
    code, out, _ = run(capsys, "schedule", "--from", str(csv_path), "-o", str(json_path), "--json")
    report = json.loads(out)
    assert (
        code == 0
        and report["format"] == "json"
        and report["ops"] == generate("dualpipev", 4, 10).num_ops
    )
    assert report["metrics"]["bubble_ratio"] > 0
    assert load_schedule(json_path) == generate("dualpipev", 4, 10)
    code, out, _ = run(capsys, "schedule", "--from", str(json_path))  # text, for people
    assert code == 0 and out.splitlines()[1].startswith("rank 0: 0F0 0F1")


def test_tune_then_draw_simulate_and_compare_read_the_same_file(tmp_path, capsys):
    tuned = tmp_path / "t.json"
    code, _, _ = run(capsys, "tune", "-r", "4", "-m", "8", "--memory-cap", "6", "--seconds", "0.2",
                     "--objective", "makespan", "-o", str(tuned))  # fmt: skip
    assert code == 0
    schedule = load_schedule(tuned)
    assert schedule.name == "cost-aware-v" and schedule.num_ranks == 4
    code, out, _ = run(
        capsys, "draw", "--from", str(tuned), "-o", str(tmp_path / "t.png"), "--json"
    )
    drawn = json.loads(out)
    assert code == 0 and drawn["ops"] == schedule.num_ops
    assert max(drawn["timelines"][0]["metrics"]["peak_activations_per_rank"]) <= 6
    code, out, _ = run(capsys, "simulate", "--from", str(tuned), "--json")
    assert code == 0 and json.loads(out)["schedule"] == "cost-aware-v"
    code, out, _ = run(capsys, "compare", "-r", "4", "-m", "8", "--schedules", "zbv",
                       "--from", str(tuned), "--json")  # fmt: skip
    rows = json.loads(out)
    assert code == 0 and [row["schedule"] for row in rows] == ["zbv", "cost-aware-v"]
    assert rows[1]["work"] == rows[0]["work"]  # the same model on the same devices


def test_from_refuses_a_shape_the_file_does_not_have(tmp_path, capsys):
    path = tmp_path / "z.json"
    save_schedule(generate("zbv", 2, 4), path)
    code, _, err = run(capsys, "simulate", "--from", str(path), "--ranks", "4")
    assert code == 2 and "not 4: drop --ranks" in err
    code, _, err = run(
        capsys, "draw", "--from", str(path), "-m", "5", "-o", str(tmp_path / "z.png")
    )
    assert code == 2 and "not 5: drop --microbatches" in err
    code, _, err = run(capsys, "simulate", "--from", str(path), "--schedule", "zbv")
    assert code == 2 and "not allowed with" in err
    code, _, err = run(capsys, "simulate", "--schedule", "zbv", "-r", "2")
    assert code == 2 and "--schedule needs --microbatches" in err
    code, out, _ = run(capsys, "compare", "-r", "4", "-m", "8", "--schedules", "1f1b",
                       "--from", str(path), "--json")  # fmt: skip
    assert "pass -r and -m to match" in json.loads(out)[1]["error"]


@pytest.mark.timeout(240)
def test_train_runs_a_schedule_file_on_as_many_processes_as_it_has_ranks(tmp_path, capfd):
    path = tmp_path / "v.json"
    save_schedule(generate("dualpipev", 2, 4), path)
    code, out, _ = run(capfd, "train", "--from", str(path), "--nproc", "2", "--steps", "2",
                       "--timeout", "200")  # fmt: skip
    assert code == 0 and "2 steps" in out
    code, _, err = run(capfd, "train", "--from", str(path), "--nproc", "4", "--steps", "1")
    assert code == 2 and "a schedule for 2 ranks, but the run has 4" in err


def test_the_placement_of_a_file_need_not_be_a_known_one():
    schedule = loads("1F0,1B0\n0F0,0B0\n", "csv", name="flipped")
    assert schedule.placement == Placement("custom", 2, ((1, 0),))
    assert schedule.num_microbatches == 1


@pytest.mark.timeout(60)
def test_an_oversized_file_is_refused_by_its_size_before_it_is_read(tmp_path, monkeypatch):
    from cutpipe.schedule.limits import MAX_FILE_BYTES, MAX_OPS

    assert MAX_FILE_BYTES == 13 * MAX_OPS  # the largest generated schedules write 11.8 MB
    path = tmp_path / "huge.json"
    with path.open("wb") as file:
        file.truncate(14 * 10**6)
    opened = []
    monkeypatch.setattr("builtins.open", lambda *args, **kw: opened.append(args) or 1 / 0)
    with pytest.raises(ValueError, match=r"huge.json is 14,000,000 bytes, more than a schedule "
                       r"file may be, 13,000,000 bytes \(1,000,000 ops of at most 13 bytes\): "
                       "give a schedule of fewer ops") as error:  # fmt: skip
        load_schedule(path)
    assert "\n" not in str(error.value) and opened == []


@pytest.mark.timeout(60)
def test_a_file_of_more_ops_than_the_limit_is_refused_after_parsing(tmp_path):
    from cutpipe.schedule.limits import MAX_OPS

    over = MAX_OPS + 1
    message = f"holds {over:,} ops, more than the limit of {MAX_OPS:,}"
    (tmp_path / "many.csv").write_text("0F0," * over + "\n")
    with pytest.raises(ValueError, match=f"many.csv: the schedule {message}"):
        load_schedule(tmp_path / "many.csv")
    good = json.loads(dumps(generate("1f1b", 1, 1)))
    with pytest.raises(ValueError, match=message):
        loads(json.dumps({**good, "actions": [["0F0"] * over]}), "json")


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no named pipes here")
@pytest.mark.timeout(60)
def test_a_pipe_or_folder_named_as_a_schedule_file_is_refused_unread(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "pipe.json")
    (tmp_path / "folder.json").mkdir()
    with pytest.raises(ValueError, match=r"pipe.json is not a regular file \(a pipe\?\)"):
        load_schedule(tmp_path / "pipe.json")
    with pytest.raises(ValueError, match="folder.json is a folder: give a schedule file"):
        load_schedule(tmp_path / "folder.json")
    with pytest.raises(ValueError, match="cannot read schedule file .*none.json: No such file"):
        load_schedule(tmp_path / "none.json")
    code, out, err = run(capsys, "simulate", "--from", str(tmp_path / "pipe.json"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "not a regular file" in err
