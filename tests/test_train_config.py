"""``cutpipe train --config FILE`` / ``--print-config``, and where rank 0's records go besides the
JSON-lines log: TensorBoard (a real two-process run, read back) and W&B (a stand-in module)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest

from cutpipe.cli import train as train_command
from cutpipe.cli.main import build_parser, main
from cutpipe.train.config_file import to_toml
from cutpipe.train.metrics import read_metrics
from cutpipe.train.options import TrainOptions
from cutpipe.train.sinks import open_sinks, scalars
from cutpipe.train.trainer import StepRecord
from cutpipe.viz.curve import run_title

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def resolved(*argv: str) -> TrainOptions:
    """The options ``cutpipe train ARGV`` would run with."""
    words = ["train", *argv]
    args = build_parser().parse_args(words)
    args.argv = words
    return train_command.options_from(args)


TOML = """\
schedule = "ZBVZeroBubble"
steps = 20
seq-len = 16
data = ["a.txt", "b.txt"]
lr = 1e-3
metrics = "{log}"
profile_steps = [2, 3]
costs = {{ f = 1, b = 2 }}
no-overlap = true
"""

YAML = """\
schedule: ZBVZeroBubble
steps: 20
seq_len: 16
data: [a.txt, b.txt]
lr: 1e-3          # YAML reads this as text: taken as the flag would take it
log: {log}
profile_steps: "2:3"
costs: F=1,B=2
no_overlap: true
"""


@pytest.mark.parametrize("kind, text", [("toml", TOML), ("yaml", YAML)])
def test_a_config_file_gives_options_and_flags_win(tmp_path, kind, text):
    path = tmp_path / f"run.{kind}"
    path.write_text(text.format(log=tmp_path / "m.jsonl"))
    expected = dict(
        schedule="zbv", steps=20, seq_len=16, data=("a.txt", "b.txt"), lr=1e-3,
        log=str(tmp_path / "m.jsonl"), profile_steps=(2, 3), no_overlap=True,
    )  # fmt: skip
    from cutpipe.sim.costs import Costs

    got = resolved("--config", str(path))
    assert got == TrainOptions.build(**expected, costs=Costs(f=1.0, b=2.0))
    # a flag wins even when it gives the default value; the file's other keys stay
    flagged = resolved("--config", str(path), "--steps", "10", "-s", "1f1b", "--data", "c.txt")
    assert flagged == got.replace(steps=10, schedule="1f1b", data=("c.txt",))
    # a schedule source on the command line replaces the file's
    schedule = tmp_path / "s.json"
    assert main(["schedule", "-s", "1f1b", "-r", "2", "-m", "4", "-o", str(schedule)]) == 0
    sourced = resolved("--config", str(path), "--from", str(schedule))
    assert sourced == got.replace(schedule=None, schedule_file=str(schedule))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("a.toml", "setps = 3\n", "unknown option 'setps': did you mean steps?"),
        ("b.toml", "schedule = '1f1b'\nsteps = 0\n", "steps: must be a whole number >= 1, got 0"),
        ("c.toml", "lr = 1\nlearning_rate = 2\n", "unknown option 'learning_rate': did you mean"),
        ("d.yaml", "schedule: 1f1b\nclip: null\n", "clip: has no value: give one, or leave"),
        ("e.yaml", "- steps\n", "expected a table of option = value, got list"),
        ("f.toml", "log = 'x'\nmetrics = 'y'\n", "'log' and 'metrics' are the same option"),
        ("g.toml", "steps = [\n", "is not valid TOML"),
        ("h.json", "{{}}", "--config {path}: name a .toml, .yaml or .yml file"),
        ("i.toml", "data = 'a'\nresume = 1\n", "resume: must be true or false, got 1"),
        ("j.toml", "steps = 3\n", "give the schedule: --schedule NAME, --from FILE or --plan"),
        (
            "k.toml",
            "schedule = '1f1b'\nplan = '{path}'\n",
            "'schedule' and 'plan' exclude one another",
        ),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text.format(path=path))
    code, out, err = run_cli(capsys, "--config", str(path), "--nproc", "2")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("cutpipe train: error: "), err
    assert message.format(path=path) in err, err
    if "unknown" in message:
        assert f"{path}: unknown option" in err


ROUND_TRIPS = [
    ["-s", "dualpipev", "-m", "8", "--steps", "7", "--lr", "0.00031", "--warmup", "2",
     "--dtype", "bf16", "--recompute", "selective", "--data", "x y.txt", 'q"uote.txt',
     "--clip", "0.5", "--seed", "12", "--nproc", "4", "--dp", "2", "--dp-mode", "zero1",
     "--profile-steps", "3:5", "--quiet", "--tensorboard", "tb", "--wandb", "proj",
     "--no-overlap", "--timeout", "30.5", "--backend", "nccl"],
    ["-s", "Interleaved1F1B:chunks=2", "--emulate", "--costs", "F=1.5,B=2,W=0.25,comm=0.1",
     "--time-unit", "0.001", "--step-timeout", "5"],
    ["-s", "1f1b", "--checkpoint-dir", "ck", "--checkpoint-every", "2", "--resume-if-present",
     "--model", "model.yaml", "--seq-len", "64", "--capacity-factor", "1.25", "--ep", "2"],
]  # fmt: skip


@pytest.mark.parametrize("argv", ROUND_TRIPS)
def test_print_config_gives_back_the_same_run(tmp_path, capsys, argv):
    options = resolved(*argv)
    code, out, err = run_cli(capsys, *argv, "--print-config")
    assert code == 0 and err == "" and out == to_toml(options)
    path = tmp_path / "run.toml"
    path.write_text(out)
    assert resolved("--config", str(path)) == options


def test_scalars_are_every_finite_number_under_a_tidy_tag():
    record = {
        "step": 4, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.75, "tokens_per_s": 100,
        "step_time": 0.5, "bubble": None, "peak_activation_bytes": 4096, "dropped": 0,
        "expert_load": {"blocks.1.moe": 1.5}, "val_loss": 2.75, "val_ppl": math.exp(2.75),
        "flag": True, "note": "text", "run": {"model": "m"}, "grad_accum_x": math.nan,
    }  # fmt: skip
    assert scalars(record) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.75,
        "perf/tokens_per_s": 100.0, "perf/step_time": 0.5,
        "memory/peak_activation_bytes": 4096.0, "moe/dropped": 0.0,
        "moe/expert_load/blocks.1.moe": 1.5, "val/loss": 2.75, "val/ppl": math.exp(2.75),
    }  # fmt: skip


class _Validated(StepRecord):
    """A record with the validation fields another part of a run adds."""

    def to_dict(self):
        return {**super().to_dict(), "val_loss": 3.0}


def test_wandb_gets_each_record_through_its_documented_calls(monkeypatch, tmp_path):
    calls: dict = {"log": []}

    class Run:
        def log(self, data, step=None):
            calls["log"].append((data, step))

        def finish(self):
            calls["finished"] = True

    def init(**settings):
        calls["init"] = settings
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_MODE", "offline")
    options = TrainOptions.build(schedule="1f1b", wandb="proj", steps=2, log=str(tmp_path / "m"))
    run = {"model": "mlp", "schedule": "1F1B", "ranks": 2, "options": to_toml(options)}
    sinks = open_sinks(options, run, resumed=None)
    records = [
        StepRecord(1, 0.5, 3e-3, 0.25, 10.0, 0.1, 0.5, 64),
        _Validated(2, 0.25, 1e-3, 0.125, 20.0, 0.05, None, 64),
    ]
    for record in records:
        sinks.write(record)
    sinks.close()
    init = calls["init"]
    assert init["project"] == "proj" and init["mode"] == "offline"
    assert init["config"]["steps"] == 2 and init["config"]["schedule"] == "1F1B"
    assert init["config"]["lr"] == 3e-3 and "options" not in init["config"]
    assert calls["log"] == [
        ({"train/loss": 0.5, "train/lr": 3e-3, "train/grad_norm": 0.25,
          "perf/tokens_per_s": 10.0, "perf/step_time": 0.1, "perf/bubble": 0.5,
          "memory/peak_activation_bytes": 64.0}, 1),
        ({"train/loss": 0.25, "train/lr": 1e-3, "train/grad_norm": 0.125,
          "perf/tokens_per_s": 20.0, "perf/step_time": 0.05,
          "memory/peak_activation_bytes": 64.0, "val/loss": 3.0}, 2),
    ]  # fmt: skip
    assert calls["finished"]
    logged = read_metrics(tmp_path / "m")  # the JSON-lines log beside it: the run said once
    assert logged[0]["run"] == {"model": "mlp", "schedule": "1F1B", "ranks": 2}
    assert "run" not in logged[1] and logged[1]["val_loss"] == 3.0


@pytest.mark.parametrize(
    "flag, module, install",
    [("--tensorboard", "tensorboard", "pip install 'cutpipe[logging]'"),
     ("--wandb", "wandb", "pip install wandb")],
)  # fmt: skip
def test_a_missing_logging_package_is_one_line_before_any_worker(
    monkeypatch, capsys, tmp_path, flag, module, install
):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    code, out, err = run_cli(capsys, "-s", "1f1b", "--nproc", "2", flag, str(tmp_path / "x"))
    assert code == 2 and out == ""
    assert err == f"cutpipe train: error: {flag} needs the {module} package: {install}\n"


def test_the_loss_picture_is_titled_with_what_ran(tmp_path, capsys):
    run = {"model": "tiny", "schedule": "ZB-V", "ranks": 2, "lr_schedule": "lr 0.003, warm-up 1"}
    records = [
        {"step": 1, "loss": 3.0, "lr": 3e-3, "run": run},
        {"step": 2, "loss": 2.0, "lr": 1e-3},
    ]
    assert run_title({"a": records}) == "tiny, ZB-V on 2 ranks\nlr 0.003, warm-up 1"
    other = [{**records[0], "run": {**run, "schedule": "1F1B"}}, records[1]]
    assert run_title({"a": records, "b": other}) == "tiny"  # what the runs share
    assert run_title({"a": records[1:]}) == ""  # an older log: no run said
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["draw", "--metrics", str(path), "-o", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.png").stat().st_size > 0


@pytest.mark.timeout(400)
def test_a_config_file_runs_under_the_launcher_and_torchrun_with_tensorboard(tmp_path):
    """One config file, two launches: ``cutpipe train --config`` (its launcher and workers
    read it) writes TensorBoard events that hold the log's numbers; ``torchrun -m cutpipe
    train --config`` (each worker reads it) runs the same steps, a flag changing the log
    (``--metrics`` passes through torchrun, which would take ``--log`` for its ``--log-dir``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tmp_path / "run.toml"
    config.write_text(
        f'schedule = "1f1b"\nsteps = 3\nquiet = true\nmetrics = "{tmp_path / "a.jsonl"}"\n'
        f'tensorboard = "{tmp_path / "tb"}"\nmicrobatches = 4\n'
    )
    command = [sys.executable, "-m", "cutpipe", "train", "--config", str(config), "--nproc", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path / "a.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["run"]["model"] == "mlp" and records[0]["run"]["ranks"] == 2
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag, field in (("train/loss", "loss"), ("train/lr", "lr"), ("perf/bubble", "bubble")):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], pytest.approx(r[field], rel=1e-6)) for r in records], tag
    assert "train/grad_norm" in events.Tags()["scalars"]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "cutpipe", "train", "--config", str(config),
                "--metrics", str(tmp_path / "b.jsonl"), "--tensorboard", str(tmp_path / "tb2")]  # fmt: skip
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=280, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    again = read_metrics(tmp_path / "b.jsonl")
    assert [(r["step"], r["loss"], r["lr"]) for r in again] == [
        (r["step"], r["loss"], r["lr"]) for r in records
    ]


def test_the_progress_line_shows_the_learning_rate():
    from cutpipe.train.metrics import ProgressLine

    trainer = types.SimpleNamespace(
        task=types.SimpleNamespace(name="mlp"), schedule=types.SimpleNamespace(name="1F1B"),
        world=2, step=0,
    )  # fmt: skip
    line = ProgressLine(TrainOptions.build(schedule="1f1b", steps=2), trainer, None)
    line.update(StepRecord(1, 0.5, 2.5e-4, 0.25, 1234.0, 0.1, 0.125, 64))
    status = line._progress.tasks[0].fields["status"]
    line.close()
    assert status == "loss 0.5000  lr 2.50e-04  1,234 tok/s  bubble 12.5%"
