"""The planner against Megatron-LM's published runs (cutpipe.plan.costs.megatron).

First the data: each row's published figures agree with one another and with the model shapes.
Then the predictions as they stand: each run's ratio pinned near its present value, so that a
change to the cost model shows here, and the whole band. ``TARGET`` is where the team wants
every run; the test for it is marked to fail until the cost model gets there.
"""

from __future__ import annotations

import pytest

from cutpipe.plan.costs.megatron import (
    KORTHIKANTI_RUNS,
    NARAYANAN_RUNS,
    RUNS,
    breakdown,
    counted_flops,
    measured_step,
    paper_parameters,
    predict,
    what_ifs,
)

PEAK = 312e12  # A100 dense fp16/bf16
TARGET = 0.10  # every run's predicted step within 10 % of the measured one
PINNED = 0.005  # how far a ratio may move from its present value before this file is updated
#: The planner's figure over the published one, in the paper's unit, as of this commit
#: (``python benchmarks/megatron_calibration.py`` prints them).
PRESENT_RATIOS = {
    "1.7B": 1.058, "3.6B": 1.089, "7.5B": 1.079, "18.4B": 1.190, "39.1B": 1.174,
    "76.1B": 1.258, "145.6B": 1.218, "310.1B": 1.239, "529.6B": 1.224, "1008B": 1.167,
    "22B full": 0.845, "22B selective": 0.878, "175B full": 0.878, "175B selective": 0.914,
    "530B full": 0.895, "530B selective": 0.905, "1T full": 0.929, "1T selective": 0.952,
}  # fmt: skip


@pytest.fixture(scope="module")
def predictions():
    return {run.label: predict(run) for run in RUNS}


@pytest.mark.parametrize("run", NARAYANAN_RUNS, ids=lambda r: r.label)
def test_narayanan_rows_agree_with_themselves(run):
    """Per-GPU TFLOP/s x GPUs is the aggregate petaFLOP/s, and over the peak the percentage,
    within the rounding of the figures (TFLOP/s to 1, petaFLOP/s to 0.1, percent to 1)."""
    half = 0.5 * run.gpus / 1e3 + 0.05
    assert abs(run.measured * run.gpus / 1e3 - run.aggregate) <= half
    assert abs(100 * run.measured * 1e12 / PEAK - run.percent_of_peak) <= 0.5 + 50e12 / PEAK
    assert (
        run.gpus == run.tp * run.pp * run.dp
        and run.batch % (run.dp * run.model.microbatch_size) == 0
    )
    assert run.model.layers % (run.pp * run.chunks) == 0  # whole layers per virtual stage


@pytest.mark.parametrize("run", NARAYANAN_RUNS, ids=lambda r: r.label)
def test_narayanan_sizes_are_their_equation_2_to_the_published_digit(run):
    assert round(paper_parameters(run.model) / 1e9, 1) == run.billions


@pytest.mark.parametrize("run", KORTHIKANTI_RUNS, ids=lambda r: r.label)
def test_korthikanti_sizes_within_1_percent_of_the_shapes(run):
    assert paper_parameters(run.model) / 1e9 == pytest.approx(run.billions, rel=0.01)


@pytest.mark.parametrize("run", [r for r in KORTHIKANTI_RUNS if r.mfu], ids=lambda r: r.label)
def test_korthikanti_utilisation_follows_from_the_iteration_times(run):
    """MFU from ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))``, HFU with ``s/(3h)`` (the recomputed
    attention), over the time's rounding (2 decimals) and the percentage's (1 decimal)."""
    for published, hardware in ((run.mfu, False), (run.hfu, True)):
        low, high = (
            100 * counted_flops(run, hardware) / (t * run.gpus * PEAK)
            for t in (run.measured + 0.005, run.measured - 0.005)
        )
        assert low - 0.05 <= published <= high + 0.05, (published, low, high)


def test_the_two_papers_ran_the_same_1t_pipeline_8_percent_apart():
    """TP 8, PP 64, 512 microbatches of 1, full recomputation: Narayanan's 163 TFLOP/s over six
    pipelines is a 102.6 s iteration, Korthikanti's baseline 94.42 s on one. The gradient
    all-reduce over six pipelines takes about 0.3 s, so most of the gap is the software's."""
    narayanan, korthikanti = NARAYANAN_RUNS[-1], KORTHIKANTI_RUNS[-2]
    assert narayanan.microbatches == korthikanti.microbatches == 512
    assert measured_step(narayanan) == pytest.approx(102.6, abs=0.05)
    assert measured_step(narayanan) / measured_step(korthikanti) == pytest.approx(1.087, abs=1e-3)


@pytest.mark.parametrize("label", PRESENT_RATIOS)
def test_each_run_predicted_as_it_stands(predictions, label):
    assert predictions[label].ratio == pytest.approx(PRESENT_RATIOS[label], abs=PINNED)


def test_every_run_predicted_too_fast_by_5_to_21_percent(predictions):
    """The band as it stands: the planner's step is 0.79 to 0.96 of the measured one."""
    steps = [p.step_ratio for p in predictions.values()]
    assert min(steps) > 0.79 and max(steps) < 0.96


@pytest.mark.xfail(
    strict=True,
    reason="the cost model leaves out what docs/plan.md's analysis lists (no sequence "
    "parallelism, blocking sends, NCCL's bandwidth): up to 20.5 % fast today",
)
def test_every_run_within_the_target(predictions):
    for label, p in predictions.items():
        assert abs(p.step_ratio - 1) <= TARGET, label


def test_breakdown_adds_up_to_the_step_and_what_ifs_touch_only_their_runs(predictions):
    for label, p in predictions.items():
        parts = breakdown(p)
        assert sum(parts.values()) == pytest.approx(p.step), label
        assert min(parts.values()) >= -1e-9, label
        changed = what_ifs(p)
        assert changed["all"] - p.step == pytest.approx(
            sum(changed[k] - p.step for k in changed if k != "all")
        )
        run = p.run
        assert (changed["blocking sends"] > p.step) == (run.pp > 1), label
        assert (changed["no SP"] > p.step) == (not run.sequence_parallel and run.tp > 1), label
        assert (changed["DDP overlap"] < p.step) == run.overlapped_allreduce, label
        assert (parts["tp"] > 0) == (run.tp > 1), label
