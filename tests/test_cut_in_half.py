"""The Cut-in-half report's central claim in code: DualPipe with its mirrored half cut off is
DualPipeV."""

import pytest

from cutpipe import Costs, cut_in_half, generate, metrics, simulate
from cutpipe.schedule import Kind, units


@pytest.mark.parametrize("ranks", range(1, 17))
def test_cut_in_half_of_dualpipe_is_dualpipev_op_for_op(ranks):
    for m in range(2 * ranks - 1, 4 * ranks + 3):  # from the minimum to well past it
        cut = cut_in_half(generate("dualpipe", 2 * ranks, 2 * m))
        assert cut == generate("dualpipev", ranks, m), f"R={ranks} m={m}"
        assert cut.placement.kind == "v" and cut.num_microbatches == m


def test_the_cut_keeps_half_the_devices_and_stores_parameters_once():
    dual = generate("dualpipe", 8, 20)
    cut = cut_in_half(dual)
    costs = Costs(fb=3)
    d, c = metrics(simulate(dual, costs), costs), metrics(simulate(cut, costs), costs)
    assert cut.num_ranks == dual.num_ranks // 2
    # per device: the same two eighths of the model and the same bubble...
    assert d.params_per_rank == [0.25] * 8 and c.params_per_rank == [0.25] * 4
    assert max(d.idle_per_rank) == max(c.idle_per_rank) and d.makespan == c.makespan
    # ...but the model is stored once across the cut's devices, twice across DualPipe's
    assert sum(c.params_per_rank) == pytest.approx(1.0)
    assert sum(d.params_per_rank) == pytest.approx(2.0)
    # and the price: twice the pipeline traffic of 1F1B on the same devices
    one = metrics(simulate(generate("1f1b", 4, 10)))
    assert c.p2p_sends == 2 * one.p2p_sends


def test_the_upward_pipe_becomes_the_second_leg_of_the_v():
    dual = generate("dualpipe", 4, 6)  # pipe 0: microbatches 0-2, pipe 1: 3-5
    cut = cut_in_half(dual)
    for rank in range(2):
        before = [a for op in dual.actions[rank] for a in units(op)]
        after = [a for op in cut.actions[rank] for a in units(op)]
        assert [(a.kind, a.stage) for a in before] == [(a.kind, a.stage) for a in after]
        for a, b in zip(before, after, strict=True):
            up = a.microbatch >= 3
            assert b.microbatch == a.microbatch - 3 * up
            assert (b.stage >= 2) == up  # pipe 1's stages 2, 3 are the V's second leg
    assert {a.kind for op in cut.actions[0] for a in units(op)} == {Kind.F, Kind.B, Kind.W, Kind.BW}
