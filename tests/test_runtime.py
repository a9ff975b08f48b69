"""The runtime on real process groups (gloo, spawned processes): exact gradients for every schedule,
memory as the simulator predicts, emulated timing as the simulator predicts, no hangs."""

import pytest
import runtime_workers as workers

from cutpipe.runtime import run

EXACT = {
    2: [
        ("gpipe", 3, "sum"), ("1f1b", 4, "sum"), ("1f1b", 3, "mean"), ("interleaved", 5, "sum"),
        ("zbh1", 3, "sum"), ("zbh2", 5, "sum"), ("zbv", 3, "sum"), ("zbv", 4, "mean"),
        ("dualpipe", 3, "sum"), ("dualpipe", 4, "mean"), ("dualpipev", 3, "sum"),
        ("dualpipev", 4, "sum"),
    ],
    4: [
        ("gpipe", 5, "sum"), ("1f1b", 8, "sum"), ("1f1b", 5, "mean"), ("interleaved", 6, "sum"),
        ("zbh1", 7, "sum"), ("zbh2", 9, "sum"), ("zbv", 7, "sum"), ("zbv", 8, "mean"),
        ("dualpipe", 5, "sum"), ("dualpipe", 8, "mean"), ("dualpipev", 7, "sum"),
        ("dualpipev", 9, "sum"),
    ],
}  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_the_single_process_reference(world):
    ranks = run(workers.exactness, world, (EXACT[world],), timeout=200)
    for results in ranks:
        for result in results:
            case = result["case"]
            assert result["grad_error"] <= 1e-6, case
            assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), case
            assert result["eval"] == pytest.approx(result["expected"], rel=1e-6), case
            assert result["peak"] == result["predicted_peak"], case  # the runtime's own count


@pytest.mark.timeout(120)
def test_boundary_shapes_and_dtypes_are_learned_and_relearned():
    losses = run(workers.shapes, 2, timeout=90)
    assert losses[0] == losses[1]  # every rank returns the same loss
    first, second, third = losses[0]
    assert first == third and first != second


EMULATED = [(name, m) for name in ("1f1b", "zbh1", "zbv", "dualpipe", "dualpipev") for m in (8, 16)]


@pytest.mark.timeout(240)
def test_emulated_timelines_match_the_simulator_within_2_points():
    results = run(workers.emulated, 4, (EMULATED, 0.1), timeout=200)[0]
    for result in results:
        print(
            f"{result['case']}: measured {result['measured']:.4f} simulated {result['simulated']:.4f}"
        )
    for result in results:
        assert abs(result["measured"] - result["simulated"]) <= 0.02, result["case"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("case", "culprit", "message"),
    [
        ("ranks", None, "is for 3 ranks but the process group has 2"),
        ("modules", None, "it was given modules for stages"),
        ("batch", 0, "does not split into 4 equal microbatches: use a batch size divisible by 4"),
        ("loss", 1, "loss_fn must return a scalar tensor, got (2, 8)"),
    ],
)
def test_bad_input_raises_a_message_that_says_what_to_change(case, culprit, message):
    results = run(workers.bad_inputs, 2, (case,), timeout=120)
    for rank, result in enumerate(results):
        assert message in result, result
        if culprit is None or rank == culprit:
            assert result.startswith("ValueError"), result
        else:  # a rank waiting for the culprit stops too, naming it
            assert result.startswith("PipelineError"), result
            assert f"rank {culprit} could not start step 1" in result or (
                f"rank {culprit} failed in step 1" in result
            ), result


@pytest.mark.timeout(120)
def test_an_overlap_hook_runs_every_pair_and_keeps_gradients_exact():
    for result in run(workers.overlap_hook, 2, timeout=90):
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
