"""The cutpipe command: simulate, compare, schedule; JSON keys; errors say what to change."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cutpipe.cli.main import main
from cutpipe.schedule import generate, parse_op


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_json_has_the_documented_keys(capsys):
    code, out, _ = run(
        capsys, "simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json"
    )
    assert code == 0
    data = json.loads(out)
    for key in (
        "schedule",
        "ranks",
        "stages",
        "microbatches",
        "makespan",
        "bubble_ratio",
        "bubble_ratio_span",
        "idle_per_rank",
        "peak_activations_per_rank",
        "params_per_rank",
        "p2p_sends",
        "p2p_bytes",
    ):
        assert key in data
    assert data["schedule"] == "1f1b" and data["stages"] == 4
    assert round(data["bubble_ratio"], 4) == 0.2727
    assert data["idle_per_rank"] == [9.0] * 4
    assert data["peak_activations_per_rank"] == [4, 3, 2, 1]
    assert data["p2p_sends"] == 2 * 3 * 8


def test_simulate_costs_and_timeline_file(capsys, tmp_path):
    path = tmp_path / "t.json"
    code, out, _ = run(
        capsys,
        "simulate",
        "-s",
        "dualpipe",
        "-r",
        "8",
        "-m",
        "20",
        "--costs",
        "F=1,B=1,W=1,FB=2",
        "--json",
        "--timeline",
        str(path),
    )
    assert code == 0 and json.loads(out)["makespan"] == 52
    assert json.loads(path.read_text())["format"] == "cutpipe-timeline"
    assert json.loads(out)["params_per_rank"] == [0.25] * 8  # 2 of 8 stages: stored twice


def test_simulate_prints_tables(capsys):
    code, out, _ = run(capsys, "simulate", "-s", "zbv", "-r", "2", "-m", "4")
    assert code == 0 and "bubble ratio (span)" in out and "peak activations" in out


def test_simulate_steps_prints_the_steady_state_beside_makespan_and_span(capsys):
    args = ["simulate", "-s", "zbv", "-r", "4", "-m", "8", "--steps", "3", "--optimizer", "2",
            "--reduction", "1"]  # fmt: skip
    code, out, _ = run(capsys, *args, "--json")
    steps = json.loads(out)["steps"]
    assert code == 0 and set(steps) == {"sync", "overlap"}
    assert (steps["sync"]["steady"], steps["overlap"]["steady"]) == (51 + 1 + 2, 48 + 2)
    assert steps["overlap"]["per_step"] == [53, 50, 50] and steps["overlap"]["settled"] == 1
    assert steps["sync"]["makespan"] == 51 and steps["sync"]["span"] == 48
    code, out, _ = run(capsys, *args, "--boundary", "overlap")
    assert code == 0 and "steady per step" in out and "longest span 48" in out
    assert "│ overlap  │ 50" in out and "│ sync" not in out


def test_compare_defaults_to_the_reports_lineup_and_agrees_with_the_forms(capsys):
    code, out, _ = run(capsys, "compare", "--json")
    rows = json.loads(out)
    assert [r["schedule"] for r in rows] == ["1f1b", "dualpipe", "dualpipev", "zbh1", "zbv"]
    assert all(r["agrees"] for r in rows)
    params = {r["schedule"]: r["params_x"] for r in rows}
    assert params == {"1f1b": 1, "dualpipe": 2, "dualpipev": 1, "zbh1": 1, "zbv": 1}
    traffic = {r["schedule"]: r["pp_traffic_x"] for r in rows}
    assert traffic["dualpipev"] == 2 and traffic["dualpipe"] == 1
    code, out, _ = run(capsys, "compare")
    assert code == 0 and "Cut-in-half" in out and "DualPipe" in out


def test_compare_marks_where_published_form_and_simulation_differ(capsys):
    _, out, _ = run(capsys, "compare", "--costs", "F=1,B=1,W=0.5,FB=2,comm=0.05", "--json")
    rows = {r["schedule"]: r for r in json.loads(out)}
    assert rows["1f1b"]["agrees"] is False  # communication is outside every form
    _code, out, _ = run(capsys, "compare", "--costs", "F=1,B=1,W=0.5,FB=2,comm=0.05")
    assert " *" in out


def test_compare_reports_schedules_that_cannot_run(capsys):
    _code, out, _ = run(capsys, "compare", "-r", "8", "-m", "10", "--json")
    rows = {r["schedule"]: r for r in json.loads(out)}
    assert "microbatches >= 2*ranks - 1" in rows["dualpipev"]["error"]
    assert rows["1f1b"]["error"] is None


def test_schedule_prints_torch_notation_one_rank_per_line(capsys):
    _code, out, _ = run(capsys, "schedule", "-s", "dualpipev", "-r", "2", "-m", "4")
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2
    expected = generate("dualpipev", 2, 4)
    for r, line in enumerate(lines):
        ops = [parse_op(token) for token in line.split(": ", 1)[1].split()]
        assert ops == list(expected.actions[r])
    assert "(0F3;3B1)OVERLAP_F_B" in lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "-s", "zb3", "-r", "4", "-m", "8"], "known schedules: gpipe"),
        (["simulate", "-s", "dualpipev", "-r", "4", "-m", "3"], "microbatches >= 2*ranks - 1"),
        (
            ["simulate", "-s", "1f1b", "-r", "0", "-m", "3"],
            "--ranks/-r: must be a whole number >= 1",
        ),
        (["schedule", "-s", "dualpipe", "-r", "3", "-m", "8"], "even number of ranks"),
        (
            ["simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--reduction", "1"],
            "--reduction needs --steps K",
        ),
        (
            ["simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--steps", "2", "--optimizer", "-1"],
            "--optimizer: must be a finite number >= 0",
        ),
    ],
)
def test_errors_exit_2_and_say_what_to_change(capsys, args, message):
    code, _, err = run(capsys, *args)
    assert code == 2 and message in err


def test_bad_costs_are_a_usage_error(capsys):
    code, _, err = run(capsys, "simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--costs", "F=x")
    assert code == 2
    assert err.count("\n") == 1 and "not a number" in err


def test_installed_entry_point():
    beside = Path(sys.executable).parent / "cutpipe"  # the environment running the tests
    exe = str(beside) if beside.exists() else shutil.which("cutpipe")
    assert exe, "the cutpipe entry point is not installed"
    result = subprocess.run(
        [exe, "schedule", "-s", "1f1b", "-r", "2", "-m", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "rank 1: 1F0 1B0 1F1 1B1" in result.stdout


@pytest.mark.timeout(180)
def test_train_runs_local_processes_and_the_loss_goes_down(capfd):
    """The default model, the example MLP, under the elastic agent (its workers print)."""
    code, out, _ = run(capfd, "train", "-s", "1f1b", "-n", "2", "--steps", "6")
    assert code == 0
    summary = next(line for line in out.splitlines() if line.startswith("6 steps"))
    first, last = (float(v.split()[0]) for v in summary.split("loss ")[1].split(" -> "))
    assert last < first / 2 and "mean squared error" in summary


@pytest.mark.timeout(180)
def test_train_emulate_shows_measured_beside_simulated_and_writes_a_trace(capfd, tmp_path):
    from cutpipe.sim import Timeline

    trace = tmp_path / "trace.json"
    code, out, _ = run(
        capfd, "train", "-s", "zbh1", "-n", "2", "-m", "4", "--emulate", "--steps", "1",
        "--time-unit", "0.01", "--trace", str(trace),
    )  # fmt: skip
    assert code == 0 and "measured" in out and "simulated" in out
    timeline = Timeline.load(trace)
    assert timeline.source == "measured" and timeline.schedule.name == "zbh1"


def test_train_rejects_a_shape_before_starting_processes(capsys):
    code, _, err = run(capsys, "train", "-s", "dualpipe", "-n", "3")
    assert code == 2 and "even number of ranks" in err


def test_version_and_python_dash_m(capsys):
    import subprocess
    import sys

    from cutpipe import __version__

    printed = subprocess.run(
        [sys.executable, "-m", "cutpipe", "--version"], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0 and printed.stdout.strip() == f"cutpipe {__version__}"


def test_every_option_has_help_and_no_help_text_shows_rest_markup():
    import argparse

    from cutpipe.cli.main import _subparsers, build_parser

    top = build_parser()
    texts, missing = [], []
    for parser in (top, *_subparsers(top)):
        texts.append(parser.description or "")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                texts += [choice.help or "" for choice in action._choices_actions]
                continue
            if action.help is None or not action.help.strip():
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
            elif action.help != argparse.SUPPRESS:
                texts.append(action.help)
    assert not missing, missing
    assert not [text for text in texts if "`" in text]
