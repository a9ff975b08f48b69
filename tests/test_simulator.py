"""The event simulator: invariants over every generator and random costs, memory and traffic
figures, and the event rules checked op by op against an independent reading of the schedule."""

import pytest
from conftest import cost_models, named_shapes
from hypothesis import given
from hypothesis import strategies as st

from cutpipe.schedule import Kind, Overlap, generate, units
from cutpipe.schedule.registry import SCHEDULES
from cutpipe.sim import Costs, Timeline, activation_trace, metrics, peak_activations, simulate


def duration(op, costs: Costs) -> float:
    """The cost model, restated: what the simulator must charge for one op."""
    if type(op) is Overlap:
        if costs.fb is not None:
            return costs.fb
        grad = costs.b + costs.w if op.backward.kind is Kind.BW else costs.b
        return max(costs.f + grad, costs.ep_f + costs.ep_b)
    return {
        Kind.F: costs.f + costs.ep_f,
        Kind.B: costs.b + costs.ep_b,
        Kind.W: costs.w,
        Kind.BW: costs.b + costs.w + costs.ep_b,
    }[op.kind]


@given(named_shapes(max_ranks=6, extra_microbatches=12), cost_models())
def test_every_op_starts_as_soon_as_its_rank_and_inputs_allow(shape, costs):
    schedule = generate(*shape)
    timeline = simulate(schedule, costs)
    produced = {}  # ("F" | "G", stage, microbatch) -> end time
    for r in range(schedule.num_ranks):
        for op, _start, end in timeline.events(r):
            for a in units(op):
                if a.kind is not Kind.W:
                    produced["F" if a.kind is Kind.F else "G", a.stage, a.microbatch] = end
    for r in range(schedule.num_ranks):
        free = 0.0
        for op, start, end in timeline.events(r):
            assert end - start == pytest.approx(duration(op, costs))
            ready = free
            for a in units(op):
                if a.kind is Kind.F and a.stage > 0:
                    need = produced["F", a.stage - 1, a.microbatch]
                elif a.kind in (Kind.B, Kind.BW) and a.stage < schedule.num_stages - 1:
                    need = produced["G", a.stage + 1, a.microbatch]
                else:
                    continue
                ready = max(ready, need + (costs.comm if schedule.source(a) is not None else 0.0))
            assert start == pytest.approx(ready), f"rank {r}: {op} starts late or early"
            free = end


@given(named_shapes(max_ranks=6, extra_microbatches=12), cost_models())
def test_metrics_are_consistent(shape, costs):
    schedule = generate(*shape)
    timeline = simulate(schedule, costs)
    result = metrics(timeline, costs)
    assert result.makespan == pytest.approx(max(max(e) for e in timeline.ends if e))
    for r in range(schedule.num_ranks):
        busy = sum(duration(op, costs) for op in schedule.actions[r])
        assert result.busy_per_rank[r] == pytest.approx(busy)
        assert result.idle_per_rank[r] == pytest.approx(result.makespan - busy)
        assert 0 <= result.span_per_rank[r] <= result.makespan + 1e-9
    assert 0 <= result.bubble_ratio_span <= result.bubble_ratio + 1e-12 < 1
    crossing = sum(
        schedule.source(a) is not None for ops in schedule.actions for op in ops for a in units(op)
    )
    assert result.p2p_sends == crossing
    assert result.p2p_bytes == crossing * costs.p2p_bytes
    pairs = sum(type(op) is Overlap for ops in schedule.actions for op in ops)
    assert result.ep_alltoalls_overlapped == 2 * pairs


@given(named_shapes(max_ranks=6, extra_microbatches=12), st.sampled_from([0.0, 0.5, 1.0]))
def test_memory_trace_returns_to_zero_and_peaks_agree(shape, kept):
    schedule = generate(*shape)
    costs = Costs(w_memory=kept)
    traces = activation_trace(schedule, costs)
    assert peak_activations(schedule, costs) == [max(high for high, _ in t) for t in traces]
    for trace in traces:
        assert trace[-1][1] == pytest.approx(0.0)
        assert all(live >= -1e-12 for _, live in trace)


@given(st.integers(1, 12), st.integers(1, 40))
def test_peak_activations_match_the_papers(ranks, m):
    def peaks(name, r=ranks, mb=m):
        return peak_activations(generate(name, r, mb), Costs())

    assert peaks("1f1b") == [min(ranks - r, m) for r in range(ranks)]
    assert max(peaks("zbh1")) == min(ranks, m)  # ZB-H1 keeps 1F1B's peak
    assert max(peaks("zbh2")) == min(2 * ranks - 1, m)
    assert max(peaks("zbv")) == 2 * min(ranks, m)  # half-size stages: R full activations
    if m >= 2 * ranks:  # PP+1 stage-microbatches on every rank
        assert set(peaks("dualpipev")) == {2 * ranks + 1}
        if ranks % 2 == 0:
            assert set(peaks("dualpipe")) == {ranks + 1}


@given(st.integers(1, 12), st.integers(1, 40))
def test_parameters_and_traffic(ranks, m):
    one = metrics(simulate(generate("1f1b", ranks, m)))
    v = metrics(simulate(generate("zbv", ranks, m)))
    assert one.params_per_rank == pytest.approx([1 / ranks] * ranks)
    assert v.params_per_rank == pytest.approx([1 / ranks] * ranks)
    assert one.p2p_sends == 2 * m * (ranks - 1)
    assert v.p2p_sends == 2 * one.p2p_sends  # the V crosses ranks twice as often
    if ranks % 2 == 0 and m >= 2 * ranks - 2:
        dual = metrics(simulate(generate("dualpipe", ranks, m)))
        assert dual.params_per_rank == pytest.approx([2 / ranks] * ranks)  # stored twice
        assert dual.p2p_sends == one.p2p_sends


def test_an_overlapped_pair_hides_the_smaller_of_compute_and_all_to_all():
    costs = Costs(ep_f=1.5, ep_b=1.5)  # all-to-all as long as compute: 3 vs F + BW = 3
    schedule = generate("dualpipev", 2, 8)
    timeline = simulate(schedule, costs)
    for r in range(2):
        for op, start, end in timeline.events(r):
            if type(op) is Overlap:
                assert end - start == 3.0  # max(3, 3), not 3 + 3
            elif op.kind is Kind.F:
                assert end - start == 2.5  # exposed: 1 + 1.5


def test_costs_per_stage_are_used_per_stage():
    costs = Costs(f=[1, 2, 3, 4], b=1, w=1)
    timeline = simulate(generate("1f1b", 4, 1), costs)
    assert [timeline.ends[r][0] - timeline.starts[r][0] for r in range(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="lists 4 values but the schedule has 8 stages"):
        simulate(generate("zbv", 4, 8), costs)


@pytest.mark.parametrize("text", ["F=-1", "X=1", "F=abc", "F"])
def test_bad_costs_are_rejected(text):
    with pytest.raises(ValueError, match="cost"):
        Costs.parse(text)


def test_costs_parse():
    costs = Costs.parse("F=1,b=2,W=0.5,FB=2.5,comm=0.1")
    assert (costs.f, costs.b, costs.w, costs.fb, costs.comm) == (1, 2, 0.5, 2.5, 0.1)


@given(named_shapes(max_ranks=5, extra_microbatches=8))
def test_timelines_round_trip_through_json(shape):
    timeline = simulate(generate(*shape), Costs(f=1.5))
    again = Timeline.from_dict(timeline.to_dict())
    assert again.schedule == timeline.schedule
    assert [list(s) for s in again.starts] == [list(s) for s in timeline.starts]


def test_foreign_json_is_rejected():
    with pytest.raises(ValueError, match="not a cutpipe timeline"):
        Timeline.from_dict({"traceEvents": []})


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_simulation_is_deterministic(name):
    info = SCHEDULES[name]
    ranks = 4
    m = max(8, info.min_microbatches(ranks))
    a = simulate(generate(name, ranks, m), Costs(f=1.25, b=0.75, comm=0.25))
    b = simulate(generate(name, ranks, m), Costs(f=1.25, b=0.75, comm=0.25))
    assert a.starts == b.starts and a.ends == b.ends
