"""The runtime on real process groups (gloo, spawned processes): exact gradients for every schedule,
memory as the simulator predicts, emulated timing as the simulator predicts, no hangs."""

import json

import pytest
import runtime_workers as workers

from cutpipe.launch import run

EXACT = {
    2: [
        ("gpipe", 3, "sum"), ("1f1b", 4, "sum"), ("1f1b", 3, "mean"), ("interleaved", 5, "sum"),
        ("zbh1", 3, "sum"), ("zbh2", 5, "sum"), ("zbv", 3, "sum"), ("zbv", 4, "mean"),
        ("dualpipe", 3, "sum"), ("dualpipe", 4, "mean"), ("dualpipev", 3, "sum"),
        ("dualpipev", 4, "sum"), ("loopedbfs", 3, "sum"), ("interleavedzb", 5, "sum"),
        ("interleaved:chunks=3", 4, "mean"), ("interleavedzb:chunks=3", 3, "sum"),
    ],
    4: [
        ("gpipe", 5, "sum"), ("1f1b", 8, "sum"), ("1f1b", 5, "mean"), ("interleaved", 6, "sum"),
        ("zbh1", 7, "sum"), ("zbh2", 9, "sum"), ("zbv", 7, "sum"), ("zbv", 8, "mean"),
        ("dualpipe", 5, "sum"), ("dualpipe", 8, "mean"), ("dualpipev", 7, "sum"),
        ("dualpipev", 9, "sum"), ("loopedbfs", 5, "sum"), ("loopedbfs", 4, "mean"),
        ("interleavedzb", 8, "sum"), ("interleavedzb", 9, "mean"),
    ],
}  # fmt: skip


#: Every kind of schedule once: at 8 microbatches, the V schedules at 16 (a steady state between
#: the warm-up and cool-down that make up each rank's whole step at 8).
EMULATED = [*((name, 8) for name in ("1f1b", "zbh1", "dualpipe")), ("zbv", 16), ("dualpipev", 16)]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    """The 4-rank emulated timelines and exactness cases, from one launch (the timing first)."""
    return run(workers.four_ranks, 4, (EMULATED, 0.1, EXACT[4]), timeout=380)


#: the bad inputs that leave the process group usable (a failure inside an op ends the
#: processes' pipeline: "loss" and "finite" run on their own)
RECOVERABLE = ["ranks", "modules", "not a module", "timeout", "batch", "empty", "targets",
               "local loss"]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The 2-rank exactness cases and the checks below that leave the group usable, from one
    launch."""
    return run(workers.two_ranks, 2, (EXACT[2], RECOVERABLE), timeout=300)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_the_single_process_reference(world, request):
    fixture = {2: "two_ranks", 4: "four_ranks"}[world]
    ranks = [rank["exactness"] for rank in request.getfixturevalue(fixture)]
    for results in ranks:
        for result in results:
            case = result["case"]
            assert result["grad_error"] <= 1e-6, case
            assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), case
            assert result["eval"] == pytest.approx(result["expected"], rel=1e-6), case
            assert result["peak"] == result["predicted_peak"], case  # the runtime's own count


@pytest.mark.timeout(360)
def test_boundary_shapes_and_dtypes_are_learned_and_relearned(two_ranks):
    losses = [rank["shapes"] for rank in two_ranks]
    assert losses[0] == losses[1]  # every rank returns the same loss
    first, second, third = losses[0]
    assert first == third and first != second


@pytest.mark.timeout(420)
def test_emulated_timelines_wait_no_longer_than_the_schedule_makes_them(four_ranks):
    """The simulator fed every op's measured duration and the median measured transfer latency
    and per-op overhead (a loaded machine stretches all three, and the replay keeps that)
    predicts the measured step: the runtime waits for nothing the schedule does not ask for."""
    results = four_ranks[0]["emulated"]
    for result in results:
        print(
            f"{result['case']}: measured {result['measured']:.4f} replayed "
            f"{result['replayed']:.4f} simulated {result['simulated']:.4f} latency "
            f"{result['latency'] * 1e3:.1f} ms overhead {result['overhead'] * 1e3:.1f} ms"
        )
    for result in results:
        assert abs(result["measured"] - result["replayed"]) <= 0.02, result
        assert result["makespan"] <= 1.02 * result["replayed_makespan"], result


BAD_INPUTS = {  # case: (the rank at fault, or None for all, its error, the message)
    "ranks": (None, "ValueError", "is for 3 ranks but the process group has 2"),
    "modules": (None, "ValueError", "it was given modules for stages"),
    "not a module": (None, "TypeError", "must be a torch.nn.Module, got str"),
    "timeout": (None, "ValueError", "step_timeout must be a positive number of seconds, got nan"),
    "batch": (0, "ValueError", "does not split into 4 equal microbatches: use a batch size divisible by 4"),
    "empty": (0, "ValueError", "inputs has an empty batch: pass a batch of 4 or more samples"),
    "targets": (None, "ValueError", "the inputs have a batch of 8 but the targets of 12"),
    "loss": (1, "ValueError", "loss_fn must return a scalar tensor, got (2, 8)"),
    "finite": (1, "FloatingPointError", "the loss of microbatch 0 is nan"),
}  # fmt: skip


@pytest.mark.timeout(360)
@pytest.mark.parametrize("cases", [RECOVERABLE, ["loss"], ["finite"]])
def test_bad_input_raises_a_message_that_says_what_to_change(cases, request):
    if cases == RECOVERABLE:
        results = [rank["bad_inputs"] for rank in request.getfixturevalue("two_ranks")]
    else:
        results = run(workers.bad_inputs, 2, (cases,), timeout=120)
    if "local loss" in cases:  # loss_on_every_rank=False: no all-reduce, None off the last stage
        cases = [case for case in cases if case != "local loss"]
        kept, everywhere = json.loads(results[1]["local loss"])
        assert kept == everywhere and json.loads(results[0]["local loss"]) == [None, everywhere]
    for case in cases:
        culprit, kind, message = BAD_INPUTS[case]
        for rank, outcomes in enumerate(results):
            result = outcomes[case]
            assert message in result, (case, result)
            if culprit is None or rank == culprit:
                assert result.startswith(kind), (case, result)
            else:  # a rank waiting for the culprit stops too, naming it
                assert result.startswith("PipelineError"), (case, result)
                assert f"rank {culprit} could not start step 1" in result or (
                    f"rank {culprit} failed in step 1" in result
                ), (case, result)


@pytest.mark.timeout(360)
def test_an_overlap_hook_runs_every_pair_and_keeps_gradients_exact(two_ranks):
    for result in (rank["overlap_hook"] for rank in two_ranks):
        assert result["hook_calls"] == result["pairs"] > 0
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
        assert result["grad_error"] <= 1e-6


@pytest.mark.timeout(180)
def test_runs_under_torchrun():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "torchrun_train.py"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "--schedule", "zbv", "--steps", "3"],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [
        float(line.split()[-1]) for line in result.stdout.splitlines() if line.startswith("step")
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.timeout(360)
def test_an_executor_and_a_transport_plug_in_through_the_options(two_ranks):
    for result in (rank["plugged"] for rank in two_ranks):
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
        assert result["grad_error"] <= 1e-6
        executor, transport = result["executor"], result["transport"]
        assert executor["forward"] == result["forwards"] and executor["weight"] == result["weights"]
        assert executor["begin_step"] == executor["end_step"] == 1
        assert transport["begin_step"] == transport["end_step"] == 1
        assert transport["send"] > 0 and transport["receive"] > 0


def test_runner_options_are_checked_and_unknown_ones_named():
    from cutpipe.runtime import RunnerOptions

    assert RunnerOptions.with_overrides(None, {"step_timeout": 30}).step_timeout == 30
    with pytest.raises(TypeError, match="unknown option.s. step_timout; known: loss_reduction"):
        RunnerOptions.with_overrides(None, {"step_timout": 30})
    with pytest.raises(ValueError, match="loss_reduction must be 'sum' or 'mean', got 'avg'"):
        RunnerOptions(loss_reduction="avg")
    with pytest.raises(ValueError, match="step_timeout .0.5 s. must be longer than the heartbeat"):
        RunnerOptions(step_timeout=0.5)
    with pytest.raises(ValueError, match="w_memory is a share of an activation in .0, 1., got 2"):
        RunnerOptions(w_memory=2)
    with pytest.raises(TypeError, match="make_executor must be callable, got int"):
        RunnerOptions(make_executor=3)


def test_a_step_after_close_says_the_runner_is_closed():
    import torch
    from torch import nn

    from cutpipe.runtime import PipelineRunner
    from cutpipe.schedule import generate

    runner = PipelineRunner(generate("1f1b", 1, 2), {0: nn.Linear(4, 4)}, nn.MSELoss())
    inputs, targets = torch.randn(4, 4), torch.randn(4, 4)
    assert runner.step(inputs, targets) is not None
    runner.close()
    runner.close()  # harmless
    with pytest.raises(RuntimeError) as error:
        runner.step(inputs, targets)
    assert str(error.value) == (
        "rank 0: the runner is closed: build a new PipelineRunner to run more steps"
    )
    with torch.no_grad(), pytest.raises(RuntimeError, match="the runner is closed"):
        runner.step(inputs, targets)
