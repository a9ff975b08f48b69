"""Expert parallelism, PP x EP (x DP) meshes, the overlap hook and its timing, on gloo processes.

Exactness: losses and gradients against the same model run without expert parallelism in one
process (fp32, relative error <= 1e-6; fp64 to rounding). Timing: the overlapped F&B pair in time
emulation, and DualPipeV on real gloo with the hook and without, measured side by side.
"""

import moe_workers as workers
import pytest
import torch

from cutpipe.launch import run
from cutpipe.models.transformer import MoE
from cutpipe.parallel.mesh import Layout, build_mesh
from cutpipe.runtime.compute.memory import ActivationMeter, state_bytes
from cutpipe.spec import ModelSpec

#: the emulated pairs: 2 MoE layers; communication below and above compute
LAYERS = 2
PAIR_COSTS = [{"route": 0.01, "experts": 0.01, "exchange": exchange} for exchange in (0.01, 0.02)]
#: 4 microbatches: DualPipeV on one rank runs 5 overlapped pairs a step (the median is kept)
PAIR_MICROBATCHES = 4


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The 2-process checks of this module, from one launch (the emulated timing first)."""
    return run(workers.two_ranks, 2, (LAYERS, PAIR_COSTS, PAIR_MICROBATCHES), timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expert_parallel_moe_matches_the_model_without_it(dtype, two_ranks):
    limit = 1e-6 if dtype == torch.float32 else 1e-12
    for result in (rank["expert_parallel"][str(dtype)] for rank in two_ranks):
        assert result["experts_held"] == workers.TINY.layers * workers.TINY.experts // 2
        assert result["loss"] == pytest.approx(result["expected"], rel=limit)
        assert result["mean_loss"] == pytest.approx(result["expected_mean"], rel=1e-6)
        assert result["grad_error"] <= limit


@pytest.mark.timeout(180)
def test_a_capacity_and_a_routing_bias_over_ep_ranks_match_the_model_without_ep(two_ranks):
    for steps in (rank["routing"] for rank in two_ranks):
        for step in steps:
            assert step["loss"] == pytest.approx(step["expected"], rel=1e-6)
            assert step["grad_error"] <= 1e-6
            assert step["loads"] == step["expected_loads"]  # summed over the EP ranks
            assert step["dropped"] == step["expected_dropped"] and min(step["dropped"]) > 0
            assert step["balance"] == pytest.approx(step["expected_balance"], rel=1e-6)
            assert step["bias_equal"] and step["bias_moved"]


CASES = [
    ("dualpipev", 5, "sum", True), ("dualpipev", 4, "mean", False), ("dualpipe", 4, "sum", True),
    ("1f1b", 4, "mean", True), ("zbv", 5, "sum", True),
]  # fmt: skip
#: the same pipelines with a capacity factor that drops (phased stages, counted dispatch)
CAPACITY_CASES = [("dualpipev", 4, "sum", True), ("1f1b", 4, "mean", True)]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    """The PP 2 x EP 2 checks of this module, from one launch."""
    return run(workers.four_ranks, 4, (CASES, 5, CAPACITY_CASES), timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("part", ["exactness", "capacity"])
def test_pp2_x_ep2_pipelines_match_the_reference_for_every_schedule(four_ranks, part):
    for rank in (ranks[part] for ranks in four_ranks):
        for result in rank:
            case = result["case"]
            assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), case
            assert result["eval"] == pytest.approx(result["expected"], rel=1e-6), case
            assert result["grad_error"] <= 1e-6, case
            if "overlap=True" in case and result["pairs"]:
                # every stage holds an MoE layer: each pair really interleaves its halves
                assert result["interleaved"] >= result["pairs"], case
            else:
                assert result["interleaved"] == 0, case


# PP 4 x EP 2 and PP 2 x EP 2 x DP 2 on 8 processes: tests/test_train_moe.py, in its one 8-process
# launch (test_eight_processes_as_pp4_x_ep2_and_pp2_x_ep2_x_dp2)


@pytest.mark.timeout(180)
def test_the_overlap_hook_gives_the_gradients_of_the_pair_run_one_after_the_other(four_ranks):
    for result in (rank["hook"] for rank in four_ranks):
        on, off = result["losses"]
        assert on == off
        assert result["identical"] and result["grad_error"] == 0.0


@pytest.mark.timeout(180)
def test_an_overlapped_pair_takes_about_max_of_compute_and_communication_in_emulation(two_ranks):
    for result in two_ranks[0]["pairs"]:
        compute, comm = result["compute"], result["comm"]
        print(
            f"emulated F&B pair: compute {compute * 1e3:.0f} ms, communication "
            f"{comm * 1e3:.0f} ms (max {max(compute, comm) * 1e3:.0f}, sum "
            f"{(compute + comm) * 1e3:.0f}); measured with the hook {result['with'] * 1e3:.1f} ms, "
            f"without {result['without'] * 1e3:.1f} ms"
        )
        # ratios from one run: a loaded machine stretches both pairs' sleeps alike
        assert result["without"] >= 0.97 * (compute + comm)  # sleeps never end early
        assert result["with"] / result["without"] <= max(compute, comm) / (compute + comm) + 0.1


def test_bad_layouts_say_what_to_change_before_any_process_group_exists():
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="expert-parallel size 3 does not divide the 8 experts"):
        Layout(pp=2, ep=3).check(6, experts=8, top_k=2)
    with pytest.raises(ValueError, match="does not match the world size 8: choose sizes"):
        Layout(pp=2, ep=2).check(8, experts=8, top_k=2)
    with pytest.raises(ValueError, match="top_k 9 is more than the 8 experts"):
        Layout(pp=1, ep=2).check(2, experts=8, top_k=9)
    with pytest.raises(ValueError, match="top_k 3 is more than the 2 experts"):
        ModelSpec(name="m", layers=1, hidden=8, heads=2, ffn=8, vocab=8, seq_len=4,
                  experts=2, top_k=3)  # fmt: skip
    with pytest.raises(ValueError, match="top_k 3 is more than the 2 experts"):
        MoE(8, 8, experts=2, top_k=3)
    with pytest.raises(ValueError, match="not initialized"):
        build_mesh(1, 1)
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(180)
def test_a_mesh_that_does_not_fit_raises_on_every_rank_and_creates_no_group(two_ranks):
    for messages in (rank["bad_mesh"] for rank in two_ranks):
        assert "does not match the world size 2" in messages[0]
        assert "expert-parallel size 3 does not divide the 4 experts" in messages[1]
        assert "top_k 5 is more than the 4 experts" in messages[2]
        assert messages[3] == "groups created: 0"


def test_the_activation_meter_counts_saved_storages_until_they_are_freed():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64, requires_grad=True)
    with ActivationMeter(exclude=[weight]) as meter:
        y = torch.tanh(x @ weight)  # saves x (counted), the weight (excluded) and y
    assert meter.peak == meter.current == 2 * 32 * 64 * 4
    y.sum().backward()
    del y
    assert meter.current == 32 * 64 * 4  # x is still alive, and was saved
    del x
    assert meter.current == 0 and meter.peak == 2 * 32 * 64 * 4
    optimizer = torch.optim.Adam([weight])
    optimizer.step()
    held = state_bytes([weight], optimizer)
    assert held == {"parameters": 64 * 64 * 4, "gradients": 64 * 64 * 4,
                    "optimizer": 2 * 64 * 64 * 4 + 4}  # fmt: skip
