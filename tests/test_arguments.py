"""Options declared once (cutpipe.arguments): one field gives the command line's flag, help and
check and the same check in code; the train parser is generated from TrainOptions' groups."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from cutpipe.arguments import (
    Choice,
    Real,
    Whole,
    add_arguments,
    check_fields,
    flags_of,
    from_arguments,
    option,
    option_of,
)
from cutpipe.train.options import GROUPS, TrainOptions


@dataclass(frozen=True)
class Sizes:
    """the sizes"""

    count: int = option(2, "how many", Whole(1, 9), flags=("--count", "-c"))
    scale: float = option(1.5, "how much", Real(0.0))
    mode: str = option("a", "which", Choice(("a", "b")))
    names: tuple[str, ...] = option((), "what", many=True, metavar="NAME")
    loud: bool = option(False, "say more")


@dataclass(frozen=True)
class Job:
    sizes: Sizes = field(default_factory=Sizes)


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(made, Job)
    return made


def test_a_field_is_a_flag_with_its_help_and_default():
    text = parser().format_help()
    assert "the sizes:" in text and "--count N, -c N" in text and "how many (default 2)" in text
    assert "{a,b}" in text and "--names NAME [NAME ...]" in text


def test_the_namespace_builds_the_dataclass_back():
    args = parser().parse_args(["-c", "3", "--names", "x", "y", "--loud", "--mode", "b"])
    assert from_arguments(Job, args) == Job(Sizes(3, 1.5, "b", ("x", "y"), True))
    assert from_arguments(Job, parser().parse_args([])) == Job()


@pytest.mark.parametrize(
    ("args", "message"),
    [(["-c", "10"], "must be a whole number between 1 and 9, got '10'"),
     (["--scale", "nan"], "must be a finite number > 0, got 'nan'"),
     (["--scale", "x"], "must be a finite number > 0, got 'x'")],
)  # fmt: skip
def test_the_command_line_is_checked_by_the_kind(args, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        parser().parse_args(args)


def test_the_same_kind_checks_values_given_in_code():
    problems = check_fields(Sizes(count=0, scale=-1.0, mode="c", names=("x", 3)))
    assert problems == [
        "count must be a whole number between 1 and 9, got 0",
        "scale must be a finite number > 0, got -1.0",
        "mode must be one of a, b, got 'c'",
        "names must be text, got 3",
    ]
    assert check_fields(Sizes()) == []


def test_every_train_option_is_declared_once():
    """Each option is one field of one group, with help and a flag of its own; the train parser
    has exactly these flags (and -h)."""
    fields = [f for group in GROUPS.values() for f in dataclasses.fields(group)]
    names = [f.name for f in fields]
    assert len(names) == len(set(names))
    assert all(option_of(f) is not None and option_of(f).help for f in fields)
    made = argparse.ArgumentParser()
    add_arguments(made, TrainOptions)
    flags = {flag for action in made._actions for flag in action.option_strings} - {"-h", "--help"}
    assert flags == {flag for f in fields for flag in flags_of(f)}


def test_train_options_take_any_option_by_name():
    options = TrainOptions.build(schedule="zbv", steps=3, dp=2, data=["a"])
    assert (options.schedule, options.steps, options.dp, options.data) == ("zbv", 3, 2, ("a",))
    assert options.replace(steps=4).steps == 4 and options.replace(steps=4).dp == 2
    with pytest.raises(TypeError, match="no option 'stepz'"):
        TrainOptions.build(stepz=3)
    with pytest.raises(ValueError, match="warmup 9 is longer than the 3 steps"):
        TrainOptions.build(steps=3, warmup=9)
