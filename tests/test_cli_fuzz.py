"""Random command lines, mixing valid values with a vocabulary of bad ones.

Every run must exit 0 or 2, print no traceback, say what is wrong in one line when it exits 2,
print strict JSON when asked for JSON, and end within 10 s. Most runs go through
``cutpipe.cli.main.main`` in this process (fast); a few through a real process, to show the
boundary holds end to end. ``train`` and ``bench moe`` only validate here: their runs, which start
processes, are replaced by their argument checks (what must refuse bad values before any process
starts).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cutpipe import generate, simulate
from cutpipe.cli import bench, train
from cutpipe.cli.main import main

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
SECONDS = 60.0  # a hang guard, not a timing claim: a loaded 2-core machine runs 5x slower

#: Values no option should accept, or should accept only where they make sense.
BAD = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "0", "1e308", "-1e308", "1e-320",
       "99999999999999999999", str(2**63), "abc", "", " ", "1.5", "0x10", "-0"]  # fmt: skip
SMALL = ["1", "2", "3", "4", "8"]
SCHEDULE_NAMES = ["1f1b", "zbv", "dualpipe", "dualpipev", "gpipe", "zbh1", "zbh2", "interleaved",
                  "loopedbfs", "interleavedzb:chunks=3", "Interleaved1F1B:chunks=4", "DualPipeV",
                  "ZBV", "zb9", "1f1b,zbv", ",", "1f1b,,zbh1", "interleaved:chunks=0",
                  "interleaved:chunks=x", "1f1b:chunks=2", "zbh1,interleaved:chunks=3,zbv",
                  "interleaved:chunks=99999"]  # fmt: skip
#: The names that make one schedule (the rest are lists or wrong).
ONE_SCHEDULE = SCHEDULE_NAMES[:12]
COSTS = ["F=1,B=1,W=1", "F=2,B=2,W=1,FB=2.5,comm=0.1", "F=0,B=0,W=0", "", "params=1", "F=inf",
         "F=nan", "F=1,f=2", "X=1", "F", "F=", "fb=none", "f=none", "w_memory=2", "F=-1",
         "F=1e308,B=1e308", "comm=1e15", "ep_f=1,ep_b=1", "activation=0"]  # fmt: skip
GPUS = ["A100", "H100", "h200", "B200", "V100", ""]


def workspace_paths(root: Path) -> dict[str, str]:
    """Files the path options draw from: good, missing, malformed, folders."""
    (root / "tiny.yaml").write_text(
        "layers: 4\nhidden: 64\nheads: 4\nffn: 128\nvocab: 300\nseq_len: 32\n"
    )
    (root / "bad.yaml").write_text("layers: [1, 2\n")
    (root / "huge.yaml").write_text(
        "layers: 1000000000\nhidden: 64\nheads: 4\nffn: 128\nvocab: 300\nseq_len: 32\n"
    )
    (root / "garbage.json").write_text('{"format": "cutpipe-timeline", "version": 1}')
    (root / "folder").mkdir(exist_ok=True)
    simulate(generate("zbv", 2, 4)).save(root / "timeline.json")
    return {"root": str(root)} | {name: str(root / name) for name in
            ("tiny.yaml", "bad.yaml", "huge.yaml", "garbage.json", "folder", "timeline.json",
             "missing.yaml", "nodir/out.json")}  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return workspace_paths(tmp_path_factory.mktemp("fuzz"))


def commands(paths: dict[str, str]) -> dict[str, tuple[list[str], dict[str, list], set[str]]]:
    """command -> (its words, {option: valid values (None: a flag)}, required options)."""
    inputs = [paths[n] for n in ("tiny.yaml", "bad.yaml", "huge.yaml", "missing.yaml", "folder")]
    dense = str(EXAMPLES / "dense-7b.yaml")
    folder = Path(paths["folder"])
    outputs = [str(folder / f"out{suffix}") for suffix in (".png", ".svg", ".html", ".json")]
    shape = {"--schedule": ONE_SCHEDULE, "--ranks": SMALL, "--microbatches": SMALL}
    model = {"--model": [dense, *inputs], "--gpu": GPUS, "--memory-gb": ["80", "1", "1e6"]}
    return {
        "simulate": (["simulate"], {**shape, "--costs": COSTS, "--json": [None],
                                    "--timeline": outputs}, set(shape)),
        "compare": (["compare"], {"--ranks": SMALL, "--microbatches": SMALL, "--costs": COSTS,
                                  "--schedules": SCHEDULE_NAMES, "--json": [None]}, set()),
        "schedule": (["schedule"], shape, set(shape)),
        "draw": (["draw"], {"--schedule": ONE_SCHEDULE, "--compare": SCHEDULE_NAMES,
                            "--timeline": [paths["timeline.json"], paths["garbage.json"], *inputs],
                            "--ranks": [*SMALL, "2,4", "1,2,3"], "--microbatches": [*SMALL, "4,8"],
                            "--costs": COSTS, "--vs-sim": [None], "--output": outputs},
                 {"--output"}),
        "tune": (["tune"], {"--placement": ["linear", "v", "x"], "--ranks": SMALL[:4],
                            "--microbatches": SMALL, "--costs": COSTS, "--memory-cap": ["4", "1"],
                            "--objective": ["makespan", "span", "speed"], "--seconds": ["0", "0.1"],
                            "--output": outputs, "--json": [None]},
                 {"--ranks", "--microbatches"}),
        "partition": (["partition"], {**shape, **model, "--ep": ["1", "2"], "--json": [None],
                                      "--output": outputs}, {*shape, "--gpu"}),
        "recommend": (["recommend"], {"--devices": [*SMALL, "16"], **model,
                                      "--global-batch": ["8", "64", "1"],
                                      "--schedules": SCHEDULE_NAMES, "--top": SMALL,
                                      "--output": outputs, "--json": [None]},
                      {"--devices", "--gpu"}),
        "profile": (["profile"], {"--model": [paths["tiny.yaml"], *inputs],
                                  "--output": outputs, "--device": ["cpu", "cuda", "cuda:9", "tpu"],
                                  "--dtype": ["fp32", "fp64"], "--repeats": ["1"],
                                  "--warmup": ["0", "1"], "--json": [None]},
                    {"--model", "--output"}),
        "train": (["train"], {"--schedule": ONE_SCHEDULE, "--nproc": ["2", "4", "65"],
                              "--microbatches": SMALL, "--steps": SMALL, "--global-batch": ["8", "32", "7"],
                              "--model": ["mlp", paths["tiny.yaml"], *inputs], "--lr": ["0.1"],
                              "--emulate": [None], "--costs": COSTS, "--time-unit": ["0.01"],
                              "--trace": outputs, "--backend": ["gloo", "mpi"],
                              "--timeout": ["60"]}, {"--schedule", "--nproc"}),
        "bench": (["bench", "moe"], {"--pp": ["2", "4"], "--ep": ["1", "2"],
                                     "--microbatches": SMALL, "--steps": SMALL, "--timeout": ["60"],
                                     "--sim-only": [None], "--gpu": GPUS, "--devices": SMALL,
                                     "--sim-pp": SMALL, "--sim-ep": SMALL, "--batch": ["64", "1024"],
                                     "--model": [dense, *inputs], "--json": [None]}, set()),
    }  # fmt: skip


def bad_paths(paths: dict[str, str]) -> list[str]:
    """A folder, a missing file, a missing folder, endings no writer knows."""
    folder = Path(paths["folder"])
    return [paths["folder"], paths["missing.yaml"], paths["nodir/out.json"],
            str(folder / "out.pdf"), str(folder / "out")]  # fmt: skip


#: Options of which a command takes exactly one.
EXCLUSIVE = {"draw": ["--schedule", "--compare", "--timeline"]}


@st.composite
def command_lines(draw, paths: dict[str, str], name: str) -> list[str]:
    """``name``'s words, then options: required ones mostly present, others sometimes; each
    value valid or drawn from the bad vocabulary; now and then an unknown or repeated option."""
    words, options, required = commands(paths)[name]
    argv = list(words)
    badness = draw(st.sampled_from([0.0, 0.0, 0.1, 0.3, 0.7]))  # some lines wholly valid
    chosen = draw(st.sampled_from(EXCLUSIVE.get(name, [None])))
    for option, valid in options.items():
        if option in EXCLUSIVE.get(name, ()):
            chance = 0.9 if option == chosen else 0.05
        else:
            chance = 0.95 if option in required else 0.1 if option == "--vs-sim" else 0.35
        if draw(st.floats(0, 1)) >= chance:
            continue
        if valid == [None]:
            argv.append(option)
            continue
        bad = [*BAD, *bad_paths(paths)]
        pick = bad if draw(st.floats(0, 1)) < badness else valid
        value = draw(st.sampled_from(pick))
        argv += [option, value]
    extra = draw(st.sampled_from([None, None, None, "--bogus", "-h"]))
    if extra is not None:
        argv.insert(draw(st.integers(1, len(argv))), extra)
    return argv


def validate_train(args) -> int:
    """``train`` without starting processes: every check its run makes first."""
    train.check(train.options_from(args))
    return 0


#: commands whose run is replaced by its argument checks here: they print nothing
MOCKED = ("train", "bench")


def validate_bench(args) -> int:
    """``bench moe`` without the real runs or the simulation: its settings' checks."""
    bench._settings(args)
    return 0


@contextlib.contextmanager
def inside(folder: str) -> Iterator[None]:
    """Run in ``folder``: relative outputs ("nan", "abc.json") land there, not in the checkout."""
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def run_in_process(argv: list[str], folder: str) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with (
        inside(folder),
        mock.patch.object(train, "run", validate_train),
        mock.patch.object(bench, "run", validate_bench),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = main(argv)
        except SystemExit as done:  # only --help may end so
            code = done.code
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def check_answer(argv: list[str], code: int, out: str, err: str, seconds: float) -> None:
    shown = " ".join(repr(a) if " " in a or not a else a for a in argv)
    assert code in (0, 2), f"cutpipe {shown} exited {code}: {err}"
    assert "Traceback" not in err, f"cutpipe {shown}: {err}"
    assert seconds < SECONDS, f"cutpipe {shown} took {seconds:.1f} s"
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("cutpipe"), f"cutpipe {shown}: {err}"
    elif "--json" in argv and "-h" not in argv and "--help" not in argv and argv[0] not in MOCKED:
        json.loads(out, parse_constant=lambda constant: pytest.fail(f"{constant} in {shown}"))


@pytest.mark.parametrize("name", ["simulate", "compare", "schedule", "draw", "tune", "partition",
                                  "recommend", "profile", "train", "bench"])  # fmt: skip
def test_random_command_lines_get_a_clean_answer(paths, name):
    @settings(max_examples=80, deadline=None, derandomize=True, database=None)
    @given(command_lines(paths, name))
    def check(argv: list[str]) -> None:
        check_answer(argv, *run_in_process(argv, paths["root"]))

    check()


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_random_command_lines_through_a_real_process(paths, data):
    name = data.draw(st.sampled_from(["simulate", "compare", "schedule", "draw", "tune"]))
    argv = data.draw(command_lines(paths, name))
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "cutpipe.cli.main", *argv],
                            capture_output=True, text=True, timeout=120, cwd=paths["root"])  # fmt: skip
    seconds = time.monotonic() - start - 1.0  # leave out the interpreter's start on a busy machine
    check_answer(argv, result.returncode, result.stdout, result.stderr, seconds)
