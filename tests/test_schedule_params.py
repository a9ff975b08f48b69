"""Generator parameters: declared as data in the registry, given as keywords or as
``name:key=value``, checked with errors that say what to change, and counted by the size limit."""

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cutpipe.cli.common import schedule_name, schedule_names
from cutpipe.cli.main import main
from cutpipe.schedule import MAX_OPS, SCHEDULES, Kind, generate, schedule_info, validate
from cutpipe.schedule.builder import RankBuilder
from cutpipe.schedule.codes import Codec
from cutpipe.schedule.params import parse_spec, split_specs

CHUNKED = [name for name, info in SCHEDULES.items() if info.params]


def test_the_chunked_schedules_declare_chunks():
    assert CHUNKED == ["interleaved", "loopedbfs", "interleavedzb"]
    for name in CHUNKED:
        (param,) = SCHEDULES[name].params
        assert (param.name, param.default, param.least, param.stages_per_rank) == (
            "chunks",
            2,
            1,
            True,
        )


@given(st.sampled_from(CHUNKED), st.integers(1, 6), st.integers(1, 14), st.integers(1, 5))
def test_chunks_in_python_and_in_the_name_build_the_same_schedule(name, ranks, m, chunks):
    schedule = generate(name, ranks, m, chunks=chunks)
    validate(schedule)
    assert schedule == generate(f"{name}:chunks={chunks}", ranks, m)
    assert schedule.num_stages == ranks * chunks
    info = schedule_info(name, chunks=chunks)
    assert info.stages_per_rank == chunks and info.accepts(ranks, m)
    assert (
        schedule.num_ops
        <= info.ops_bound(ranks, m)
        == SCHEDULES[name].ops_bound(ranks, m, chunks=chunks)
    )
    assert schedule.name == info.spec == (name if chunks == 2 else f"{name}:chunks={chunks}")


def test_info_methods_take_the_parameters():
    info = SCHEDULES["interleaved"]
    assert info.ops_bound(4, 8, chunks=4) == 2 * info.ops_bound(4, 8)
    assert info.min_microbatches(4, chunks=3) == 1
    assert info.accepts(64, 1024) and not info.accepts(64, 1024, chunks=100)
    assert schedule_info("interleaved:chunks=4").title == "Interleaved 1F1B (chunks=4)"
    assert schedule_info("interleaved:chunks=2").title == "Interleaved 1F1B"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: generate("interleaved", 4, 8, chunks=0), ValueError,
         r"interleaved: chunks must be a whole number >= 1, got 0 \(e.g. interleaved:chunks=2\)"),
        (lambda: generate("interleaved:chunks=x", 4, 8), ValueError,
         "chunks must be a whole number >= 1, got 'x'"),
        (lambda: generate("loopedbfs", 4, 8, chunks=2.0), TypeError,
         r"loopedbfs: chunks must be an int, got 2.0 \(float\)"),
        (lambda: generate("interleaved", 4, 8, chunk=3), ValueError,
         "interleaved takes no parameter 'chunk'; it takes chunks .*default 2"),
        (lambda: generate("1f1b:chunks=2", 4, 8), ValueError, "1f1b takes no parameters"),
        (lambda: generate("interleaved:chunks=3", 4, 8, chunks=3), ValueError,
         "chunks is given in the name and as a keyword"),
        (lambda: generate("interleaved:chunks", 4, 8), ValueError,
         "write schedule parameters as key=value"),
        (lambda: generate("interleaved:chunks=3:chunks=4", 4, 8), ValueError, "given twice"),
    ],
)  # fmt: skip
def test_bad_parameters_say_what_to_change(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("name", CHUNKED)
def test_the_size_limit_counts_chunks(name):
    with pytest.raises(ValueError, match=f"limit of {MAX_OPS:,}: use at most .* or fewer chunks"):
        generate(name, 4, 8, chunks=50_000)
    with pytest.raises(ValueError, match="use fewer ranks or chunks"):
        generate(name, 4, 8, chunks=1_000_000)
    assert not SCHEDULES[name].accepts(4, 8, chunks=50_000)


def test_spec_text():
    assert parse_spec(" interleaved : Chunks = 4 ") == ("interleaved", {"chunks": "4"})
    assert parse_spec("1f1b") == ("1f1b", {})
    assert split_specs("1f1b,interleaved:chunks=4,,zbv") == ["1f1b", "interleaved:chunks=4", "zbv"]
    assert split_specs("x:a=1,b=2,zbv") == ["x:a=1,b=2", "zbv"]


def test_the_command_line_takes_parameters_and_torch_names():
    assert schedule_name("Interleaved1F1B:chunks=4") == "interleaved:chunks=4"
    assert schedule_name("ScheduleZBVZeroBubble") == "zbv"
    assert schedule_name("interleaved:chunks=2") == "interleaved"
    assert schedule_names("1f1b,interleaved:chunks=3,LoopedBFS") == (
        "1f1b", "interleaved:chunks=3", "loopedbfs"
    )  # fmt: skip
    for bad, message in [("interleaved:chunks=0", ">= 1, got 0"), ("zb9", "known schedules")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            schedule_names(f"1f1b,{bad}")


@pytest.mark.parametrize(
    "args",
    [
        ["schedule", "-s", "interleavedzb:chunks=3", "-r", "2", "-m", "4"],
        ["simulate", "-s", "LoopedBFS", "-r", "4", "-m", "8", "--json"],
        ["compare", "--schedules", "1f1b,interleaved:chunks=4,interleavedzb", "-r", "4", "-m", "8"],
    ],
)
def test_commands_run_the_new_schedules(capsys, args):
    assert main(args) == 0
    assert capsys.readouterr().out


def test_a_bad_parameter_on_the_command_line_is_one_line(capsys):
    assert main(["simulate", "-s", "interleaved:chunks=0", "-r", "4", "-m", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "chunks must be a whole number >= 1, got 0" in err


def test_draw_compares_chunk_counts(capsys, tmp_path):
    out = tmp_path / "chunks.svg"
    args = ["draw", "--compare", "interleaved,interleaved:chunks=4", "-r", "2", "-m", "4"]
    assert main([*args, "-o", str(out)]) == 0
    assert out.exists()


@pytest.mark.parametrize("steps", [0, 5])
def test_the_builder_takes_backwards_last_first_when_asked(steps):
    codec = Codec(1, 3)
    b = RankBuilder(codec, {0: range(3)}, steps=steps, reverse_backwards=True)
    for _ in range(max(3, steps)):
        b.forward(0)
    for _ in range(max(3, steps)):
        b.backward(0, split=True)
    b.weights()
    ops = [codec.decode(code) for code in b.codes]
    assert [(op.kind, op.microbatch) for op in ops] == [
        *[(Kind.F, i) for i in range(3)], *[(Kind.B, i) for i in (2, 1, 0)],
        *[(Kind.W, i) for i in (2, 1, 0)],
    ]  # fmt: skip
