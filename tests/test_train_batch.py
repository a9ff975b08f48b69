"""The global batch is the command's, not the layout's: ``run_layout`` cuts the same number of
sequences per optimizer step on any number of processes, replicas and accumulated steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from cutpipe.train.layout import fitting_microbatches, run_layout
from cutpipe.train.options import GLOBAL_BATCH_MICROBATCHES, TrainOptions
from cutpipe.train.tasks import task_for

MODEL = """\
name: batch-lm
layers: 14
hidden: 32
heads: 2
ffn: 64
vocab: 256
seq_len: 32
microbatch_size: 2
"""


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "model.yaml"
    path.write_text(MODEL)
    return str(path)


def layout(world: int, **settings):
    options = TrainOptions.build(**settings)
    return run_layout(options, world, task_for(options))


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "dualpipev", "dualpipe", "interleaved"])
def test_the_default_global_batch_is_the_same_on_every_layout(model_file, schedule):
    got = {}
    for world, dp, accum in ((2, 1, 1), (4, 1, 1), (4, 2, 1), (8, 1, 1), (4, 1, 2), (8, 2, 1)):
        cut = layout(world, model=model_file, schedule=schedule, dp=dp, grad_accum=accum)
        got[(world, dp, accum)] = cut.batch * accum  # sequences per optimizer step
        per_pipeline = cut.batch // dp
        assert per_pipeline % cut.schedule.num_microbatches == 0
    assert set(got.values()) == {GLOBAL_BATCH_MICROBATCHES * 2}, got


def test_microbatches_follow_the_schedule_default_when_it_divides(model_file):
    # 2 ranks: 1F1B's default is 4, which divides 16 sequences
    assert layout(2, model=model_file, schedule="1f1b").schedule.num_microbatches == 4
    # 3 ranks: 6 does not divide 16, the nearest above that does is 8
    assert fitting_microbatches("1f1b", 3, 16, TrainOptions()) == 8
    # 8 ranks of DualPipeV with 4 sequences per pipeline: it needs 15 or more
    with pytest.raises(ValueError, match="use --global-batch 15 or a multiple"):
        fitting_microbatches("dualpipev", 8, 4, TrainOptions())
    # below the default, the largest the schedule accepts
    assert fitting_microbatches("1f1b", 4, 6, TrainOptions()) == 6


def test_a_global_batch_that_does_not_split_is_refused_with_what_to_give(model_file):
    with pytest.raises(ValueError, match=r"--global-batch 15 does not split into 2 replicas"):
        layout(4, model=model_file, schedule="1f1b", dp=2, global_batch=15)
    with pytest.raises(ValueError, match=r"x 2 accumulated steps: use a multiple of 4"):
        layout(4, model=model_file, schedule="1f1b", dp=2, grad_accum=2, global_batch=6)
    with pytest.raises(ValueError, match=r"do not split into 4 microbatches: use a multiple of 4"):
        layout(2, model=model_file, schedule="1f1b", microbatches=4, global_batch=10)
    assert layout(2, model=model_file, schedule="1f1b", global_batch=10).batch == 10
