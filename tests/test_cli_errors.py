"""The cutpipe command's error boundary: one line, a documented status, no traceback, no loss.

Each case names an input that used to end in a traceback, a hang, a silent wrong answer or a
lost result (docs/cli.md, "Errors and exit status" and "Limits").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cutpipe.cli import main as main_module
from cutpipe.cli import schedule as schedule_command
from cutpipe.cli.main import main

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
DENSE = str(EXAMPLES / "dense-7b.yaml")
TINY_DENSE = str(EXAMPLES / "tiny-dense.yaml")
TINY_MOE = str(EXAMPLES / "tiny-moe.yaml")
PARTITION = ["partition", "-s", "1f1b", "-r", "2", "-m", "2", "--gpu", "A100", "--model", DENSE]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(err: str) -> None:
    assert "Traceback" not in err
    assert err.count("\n") == 1, err


# -- every number is checked, before any work ---------------------------------------------

BAD_NUMBERS = [
    (["simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--costs", "params=1"], "KEY one of f, b"),
    (["simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--costs", "F=inf", "--json"], "finite"),
    (["simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--costs", "F=nan"], "finite"),
    (["simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--costs", "F=1e308"], "between 0 and"),
    (["compare", "--costs", "F=1,B=2,f=3"], "given twice"),
    (["compare", "-r", "0"], "--ranks/-r: must be a whole number >= 1"),
    (["compare", "-m", "-4"], "--microbatches/-m: must be a whole number >= 1"),
    (["compare", "--schedules", ","], "give at least one schedule"),
    (["compare", "--schedules", "1f1b,zb9"], "unknown schedule 'zb9'"),
    (["schedule", "-s", "1f1b", "-r", "abc", "-m", "2"], "got 'abc'"),
    (["draw", "-s", "1f1b", "-r", "0", "-m", "2", "-o", "x.png"], "whole numbers >= 1"),
    (["tune", "-r", "2", "-m", "4", "--seconds", "inf"], "--seconds: must be a finite number"),
    (["tune", "-r", "2", "-m", "4", "--memory-cap", "nan"], "--memory-cap: must be a finite"),
    (["recommend", "-n", "8", "--gpu", "A100", "--model", DENSE, "--memory-gb", "nan"], "finite"),
    (["recommend", "-n", "8", "--gpu", "A100", "--model", DENSE, "--memory-gb", "inf"], "finite"),
    (["recommend", "-n", "8", "--gpu", "A100", "--model", DENSE, "--memory-gb", "0"], "> 0"),
    (["recommend", "-n", "8", "--gpu", "A100", "--model", DENSE, "--top", "0"], "--top"),
    (["recommend", "-n", "0", "--gpu", "A100", "--model", DENSE], "--devices/-n"),
    (["recommend", "-n", "8", "--gpu", "A100", "--model", DENSE, "--global-batch", "0"], "batch"),
    ([*PARTITION, "--ep", "0"], "--ep"),
    (["profile", "--model", DENSE, "-o", "p.json", "--repeats", "0"], "--repeats"),
    (["profile", "--model", DENSE, "-o", "p.json", "--device", "gpu7"], "cpu, cuda or cuda:N"),
    (["bench", "moe", "--pp", "0"], "--pp"),
    (["bench", "moe", "--timeout", "nan"], "--timeout"),
    (["train", "-s", "1f1b", "-n", "2", "--lr", "nan"], "--lr: must be a finite number > 0"),
    (["train", "-s", "1f1b", "-n", "2", "--time-unit", "-inf"], "--time-unit"),
    (["train", "-s", "1f1b", "-n", "2", "--timeout", "0"], "--timeout"),
    (["train", "-s", "1f1b", "-n", "2", "-m", "0"], "--microbatches/-m"),  # was: the default
    (
        ["train", "-s", "1f1b", "-n", "2", "--global-batch", "0"],
        "--global-batch",
    ),  # was: the default
    (["train", "-s", "1f1b", "-n", "0"], "--nproc/-n"),
    (["train", "-s", "1f1b", "-n", "100000"], "between 1 and 64"),
    (["train", "-s", "1f1b", "-n", "2", "--step-timeout", "0.5"], "--step-timeout"),
]


@pytest.mark.parametrize(("args", "message"), BAD_NUMBERS)
def test_bad_numbers_are_refused_in_one_line(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert_one_line(err)
    assert err.startswith(f"cutpipe {args[0]}") and ": error: " in err
    assert message in err


# -- sizes: an answer within 5 s of CPU and under 1 GB ---------------------------------------

MEASURE = textwrap.dedent(
    """
    import resource, subprocess, sys
    def capped():  # should the guard ever break, fail here instead of exhausting the machine
        resource.setrlimit(resource.RLIMIT_AS, (1_500_000_000, 1_500_000_000))
    done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120,
                          preexec_fn=capped)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(done.returncode, usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
    sys.stderr.write(done.stderr)
    """
)


def measured(tmp_path: Path, *args: str) -> tuple[int, float, float, str]:
    """Exit status, CPU seconds, peak memory (bytes) and stderr of ``cutpipe args`` run alone."""
    command = [sys.executable, "-m", "cutpipe.cli.main", *args]
    result = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True,
                            text=True, timeout=180, cwd=tmp_path)  # fmt: skip
    code, seconds, kilobytes = result.stdout.split()
    return int(code), float(seconds), float(kilobytes) * 1024, result.stderr


@pytest.mark.parametrize(
    "args",
    [["compare", "--ranks", "100000"], ["schedule", "-s", "1f1b", "-r", "2", "-m", "1000000000"],
     ["simulate", "-r", "64", "-m", "100000000", "-s", "1f1b"],
     ["draw", "-s", "zbv", "-r", "64", "-m", "4096", "-o", "x.png"],
     ["tune", "-r", "100000", "-m", "100000"],
     ["recommend", "-n", "8", "--gpu", "A100", "--model", DENSE, "--global-batch", "1000000000"],
     ["partition", "-s", "zbv", "-r", "8", "-m", "100000", "--gpu", "A100", "--model", DENSE]],
)  # fmt: skip
def test_absurd_sizes_are_answered_quickly_in_little_memory(tmp_path, args):
    # CPU time, not wall time: another process on the machine does not make this flaky
    code, seconds, memory, err = measured(tmp_path, *args)
    assert code == 2 and "limit" in err and "Traceback" not in err
    assert seconds < 5 and memory < 1e9, (seconds, memory)


def test_the_benchmark_shape_is_still_allowed(capsys):
    code, out, _ = run(capsys, "simulate", "-s", "zbv", "-r", "64", "-m", "1024", "--json")
    assert code == 0 and json.loads(out)["stages"] == 128


def test_simulate_lists_at_most_256_ranks_in_its_table(capsys):
    code, out, _ = run(capsys, "simulate", "-s", "1f1b", "-r", "300", "-m", "1")
    assert code == 0 and "ranks 256..299 left out of this table" in out


def test_pictures_have_a_lower_limit_than_schedules(capsys, tmp_path):
    code, _, err = run(capsys, "draw", "-s", "zbh1", "-r", "32", "-m", "1024", "-o",
                       str(tmp_path / "x.png"))  # fmt: skip
    assert code == 2 and "50,000 boxes" in err and "write .html" in err
    assert not (tmp_path / "x.png").exists()


# -- outputs: checked before the work, strict JSON ------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["tune", "-r", "4", "-m", "8", "-o", "nodir/x.json"],
     ["simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--timeline", "nodir/t.json"],
     ["draw", "-s", "1f1b", "-r", "2", "-m", "2", "-o", "nodir/x.png"],
     ["profile", "--model", DENSE, "-o", "nodir/p.json"],
     [*PARTITION, "-o", "nodir/plan.json"],
     ["recommend", "-n", "8", "--gpu", "A100", "--model", DENSE, "-o", "nodir/plan.json"],
     ["train", "-s", "1f1b", "-n", "2", "--trace", "nodir/t.json"]],
)  # fmt: skip
def test_an_unwritable_output_is_refused_before_any_work(capsys, monkeypatch, tmp_path, args):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *args)
    assert code == 2 and "the folder nodir does not exist" in err
    assert_one_line(err)


def test_a_picture_with_an_unknown_ending_is_refused_before_any_work(capsys, tmp_path):
    code, _, err = run(capsys, "draw", "-s", "1f1b", "-r", "2", "-m", "2", "-o",
                       str(tmp_path / "x.pdf"))  # fmt: skip
    assert code == 2 and "use one of .png, .svg, .html, .json" in err


def strict_json(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in --json output"))


def test_json_output_is_strict_even_for_zero_costs(capsys):
    for args in (["simulate", "-s", "zbv", "-r", "2", "-m", "4"], ["compare"]):
        code, out, _ = run(capsys, *args, "--costs", "F=0,B=0,W=0,FB=0", "--json")
        assert code == 0
        strict_json(out)


# -- the boundary itself -------------------------------------------------------------------


def test_an_unexpected_error_is_one_line_that_says_bug_and_how_to_see_more(capsys, monkeypatch):
    def broken(args):
        raise KeyError("a slot the code forgot")

    monkeypatch.setattr(schedule_command, "run", broken)
    monkeypatch.delenv(main_module.DEBUG_VARIABLE, raising=False)
    code, _, err = run(capsys, "schedule", "-s", "1f1b", "-r", "2", "-m", "2")
    assert code == 1
    assert_one_line(err)
    assert "bug" in err and "--debug" in err and "KeyError" in err
    code, _, err = run(capsys, "--debug", "schedule", "-s", "1f1b", "-r", "2", "-m", "2")
    assert code == 1 and "Traceback" in err and "a slot the code forgot" in err
    code, _, err = run(capsys, "schedule", "-s", "1f1b", "-r", "2", "-m", "2", "--debug")
    assert code == 1 and "Traceback" in err
    monkeypatch.setenv(main_module.DEBUG_VARIABLE, "1")
    code, _, err = run(capsys, "schedule", "-s", "1f1b", "-r", "2", "-m", "2")
    assert code == 1 and "Traceback" in err


@pytest.mark.parametrize(("raised", "status"), [(KeyboardInterrupt(), 130), (MemoryError(), 1)])
def test_interrupts_and_memory_errors(capsys, monkeypatch, raised, status):
    def stopped(args):
        raise raised

    monkeypatch.setattr(schedule_command, "run", stopped)
    code, _, err = run(capsys, "schedule", "-s", "1f1b", "-r", "2", "-m", "2")
    assert code == status and "Traceback" not in err
    assert err == "" if status == 130 else "ran out of memory" in err


def test_a_system_exit_from_below_passes_through_unchanged(monkeypatch):
    def signalled(args):
        raise SystemExit(143)  # what the launcher raises on SIGTERM

    monkeypatch.setattr(schedule_command, "run", signalled)
    with pytest.raises(SystemExit) as exit_:
        main(["schedule", "-s", "1f1b", "-r", "2", "-m", "2"])
    assert exit_.value.code == 143


def test_a_missing_input_file_is_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "draw", "--timeline", str(tmp_path / "none.json"), "-o",
                       str(tmp_path / "x.png"))  # fmt: skip
    assert code == 2 and "does not exist" in err
    assert_one_line(err)


def test_help_and_usage_errors(capsys):
    assert main(["--help"]) == 0
    code, _, err = run(capsys, "simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--bogus")
    assert code == 2 and err == "cutpipe simulate: error: unrecognized arguments: --bogus\n"
    code, _, err = run(capsys)
    assert code == 2 and "required: COMMAND" in err
    assert_one_line(err)


def test_a_closed_pipe_is_quiet():
    command = [sys.executable, "-m", "cutpipe.cli.main", "schedule", "-s", "1f1b", "-r", "64",
               "-m", "4096"]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout.readline().startswith(b"#")
        process.stdout.close()  # as `| head -1` does
        err = process.stderr.read()
        status = process.wait(timeout=120)
    assert status == 141 and err == b""


NO_TORCH = "import sys; sys.modules['torch'] = None\nfrom cutpipe.cli.main import main\nsys.exit(main(sys.argv[1:]))"  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [["train", "-s", "1f1b", "-n", "2"], ["profile", "--model", DENSE, "-o", "p.json"],
     ["bench", "moe", "--pp", "2"]],
)  # fmt: skip
def test_commands_that_need_torch_say_how_to_install_it(tmp_path, args):
    result = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert_one_line(result.stderr)
    assert "needs PyTorch" in result.stderr and "pip install torch" in result.stderr
    assert "cutpipe[torch]" in result.stderr


def test_the_simulated_part_of_bench_moe_runs_without_torch(tmp_path):
    result = subprocess.run([sys.executable, "-c", NO_TORCH, "bench", "moe", "--sim-only",
                             "--json"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert strict_json(result.stdout)["simulated"]


def test_the_installed_command_keeps_the_boundary(tmp_path):
    exe = Path(sys.executable).parent / "cutpipe"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "cutpipe.cli.main"]
    result = subprocess.run([*command, "simulate", "-s", "1f1b", "-r", "2", "-m", "2", "--costs",
                             "F=nan"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CUTPIPE_DEBUG": ""})  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert_one_line(result.stderr)


@pytest.mark.parametrize(
    ("fields", "message"),
    [("blocks: 0", "blocks must be a whole number >= 1"),
     ("width: 100000", "use a smaller width or fewer blocks"),
     ("depth: 3", "unknown fields ['depth']")],
)  # fmt: skip
def test_an_mlp_model_file_is_checked_before_any_process_starts(capsys, tmp_path, fields, message):
    model = tmp_path / "mlp.yaml"
    model.write_text(f"family: mlp\n{fields}\n")
    code, _, err = run(capsys, "train", "-s", "1f1b", "-n", "2", "--model", str(model))
    assert code == 2 and message in err
    assert_one_line(err)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--ep", "2"], "the example MLP) has no experts: drop --ep"),
     (["--model", TINY_DENSE, "--ep", "2"], "EP 2 needs an MoE model"),
     (["--model", TINY_MOE, "--ep", "3", "-n", "3"], "does not divide the 4 experts"),
     (["--model", TINY_MOE, "--ep", "4", "-n", "2"], "do not split into --dp 1 x --ep 4"),
     (["--emulate", "--ep", "2"], "give W=0 and the whole backward as B (B=2)"),
     (["--emulate", "--ep", "2", "--costs", "F=0,B=2,W=0"], "give F > 0"),
     (["--emulate", "--ep", "2", "--costs", "F=1,B=2,W=0,FB=2"], "drop FB"),
     (["--emulate", "--ep", "2", "--costs", "F=1,B=2,W=0,comm=0.1"], "drop comm")],
)  # fmt: skip
def test_expert_parallelism_is_checked_before_any_process_starts(capsys, args, message):
    argv = ["train", "-s", "1f1b", "-n", "2", *args]
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err, err
    assert_one_line(err)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["train", "-s", "1f1b", "-n", "1", "--init-from", "{empty}"], "no model.safetensors"),
     (["train", "-s", "1f1b", "-n", "1", "--init-from", "{empty}", "--model", TINY_DENSE],
      "is a directory without a config.json"),
     (["export", "--checkpoint", "{empty}", "-o", "{empty}/x.bin"], "ending"),
     (["export", "--checkpoint", "{empty}", "-o", "{empty}/out", "--format", "hf"],
      "--format hf needs --model FILE"),
     (["export", "--checkpoint", "{empty}", "-o", "{empty}/x.pt", "--model", TINY_DENSE],
      "--model is for --format hf")],
)  # fmt: skip
def test_hugging_face_weights_in_and_out_say_what_to_change(capsys, tmp_path, args, message):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "intermediate_size": 48, "vocab_size": 256, '
        '"max_position_embeddings": 32}'
    )
    if "--model" in args:  # a folder without the config: another model's folder
        (tmp_path / "config.json").unlink()
    argv = [a.replace("{empty}", str(tmp_path)) for a in args]
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err, err
    assert_one_line(err)
