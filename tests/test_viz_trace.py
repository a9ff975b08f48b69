"""The Chrome trace for Perfetto: flow arrows for the transfers, memory counters, metadata.

Transfers are counted here from the placement alone (which stages sit on different ranks), not
with the writer's own walk, and flow binding is checked the way Perfetto's JSON importer does it.
"""

import json
from collections import Counter

import pytest

from cutpipe import Costs, generate, simulate
from cutpipe.cli.main import main
from cutpipe.schedule.actions import Kind, parse_action
from cutpipe.sim.metrics import overlapped_pairs
from cutpipe.viz import chrome_trace, scene

COSTS = Costs(fb=2.5)


def trace_of(name, ranks, m, costs=COSTS):
    drawn = scene([simulate(generate(name, ranks, m), costs)], costs)
    return drawn, chrome_trace.events(drawn)


def cross_rank_transfers(schedule) -> int:
    """Per microbatch, one activation forward and one gradient back over every stage boundary
    whose two stages sit on different ranks of the microbatch's pipe."""
    placement, m = schedule.placement, schedule.num_microbatches
    total = 0
    for pipe, ranks in enumerate(placement.pipes):
        crossings = sum(ranks[s] != ranks[s + 1] for s in range(schedule.num_stages - 1))
        total += 2 * crossings * len(placement.microbatches_of(pipe, m))
    return total


def flow_pairs(events):
    """{id: (the "s" event, the "f" event)}; fails on a missing, repeated or unmatched id."""
    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    by_id = {e["id"]: e for e in starts}
    assert len(by_id) == len(starts), "flow ids repeat"
    assert {e["id"] for e in ends} == set(by_id) and len(ends) == len(starts)
    return {e["id"]: (by_id[e["id"]], e) for e in ends}


def halves(slice_name: str) -> list[str]:
    """The actions of a slice: "3F1", or both of a pair "(0F7;7B3)"."""
    return slice_name.strip("()").split(";")


def bind_like_perfetto(events):
    """{flow id: (slice it leaves, slice it enters)} as Perfetto's JSON importer binds v1 flows.

    Events are taken in time order; a slice is pushed on its thread's stack and popped only when
    a later slice starts at or after its end; an "s" and an "f" with "bp": "e" bind to the top of
    their thread's stack, which must also enclose them (chrome://tracing's rule). The format does
    not order events of equal time, so ties go against the writer: an "f" before the slice that
    starts with it, an "s" after the slice that starts where its own ends.
    """
    worst_tie = {"f": 0, "X": 1, "s": 2}
    stacks: dict[tuple, list[dict]] = {}
    bound: dict[int, dict[str, dict]] = {}
    for event in sorted(events, key=lambda e: (e["ts"], worst_tie.get(e["ph"], 1))):
        track = (event["pid"], event["tid"])
        if event["ph"] == "X":
            stack = stacks.setdefault(track, [])
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            stack.append(event)
        elif event["ph"] in ("s", "f"):
            stack = stacks.get(track)
            assert stack, f"{event['name']} ({event['ph']}) has no slice on its thread"
            top = stack[-1]
            assert top["ts"] <= event["ts"] <= top["ts"] + top["dur"], (event, top)
            bound.setdefault(event["id"], {})[event["ph"]] = top
    return {ident: (ends["s"], ends["f"]) for ident, ends in bound.items()}


def test_1f1b_has_one_flow_pair_per_cross_rank_transfer():
    ranks, m = 4, 8
    drawn, events = trace_of("1f1b", ranks, m)
    pairs = flow_pairs(events)
    # every F but the last stage's sends an activation, every backward but the first's a gradient
    assert len(pairs) == 2 * (ranks - 1) * m == 48
    assert len(pairs) == cross_rank_transfers(drawn.panels[0].timeline.schedule)
    names = Counter(start["cat"] for start, _ in pairs.values())
    assert names == {"activation": (ranks - 1) * m, "gradient": (ranks - 1) * m}
    for start, end in pairs.values():
        assert end["ts"] >= start["ts"]
        assert start["tid"] != end["tid"] and start["pid"] == end["pid"]
        assert (start["name"], start["cat"]) == (end["name"], end["cat"])
        assert end["bp"] == "e"


@pytest.mark.parametrize(
    ("name", "ranks", "m"),
    [("1f1b", 4, 8), ("zbh1", 4, 8), ("zbv", 4, 8), ("dualpipe", 4, 8), ("dualpipev", 4, 10),
     ("interleaved", 4, 8)],
)  # fmt: skip
def test_flows_bind_to_the_slices_that_make_and_read_the_value(name, ranks, m):
    drawn, events = trace_of(name, ranks, m)
    pairs = flow_pairs(events)
    assert len(pairs) == cross_rank_transfers(drawn.panels[0].timeline.schedule)
    bound = bind_like_perfetto(events)
    assert bound.keys() == pairs.keys()
    for ident, (maker, reader) in bound.items():
        flow = pairs[ident][0]["name"]  # "3F1 -> 4F1 activation"
        sender, arrow, receiver, what = flow.split(" ")
        assert arrow == "->" and what in ("activation", "gradient")
        assert sender in halves(maker["name"]) and receiver in halves(reader["name"]), flow
        assert maker["tid"] != reader["tid"]
        # what moved: an F's output to the next stage's F, a backward's input gradient to the
        # previous stage's backward
        made, read = parse_action(sender), parse_action(receiver)
        assert made.microbatch == read.microbatch
        if what == "activation":
            assert made.kind == read.kind == Kind.F and read.stage == made.stage + 1
        else:
            assert {made.kind, read.kind} <= {Kind.B, Kind.BW} and read.stage == made.stage - 1


def test_the_turn_of_a_v_is_no_arrow():
    ranks, m = 4, 10
    _, events = trace_of("dualpipev", ranks, m)
    pairs = flow_pairs(events)
    # 2R stages, every boundary crosses ranks but the turn (stage R-1 to R, both on rank R-1)
    assert len(pairs) == 2 * (2 * ranks - 2) * m == 120
    turn = {(ranks - 1, ranks), (ranks, ranks - 1)}
    for start, _ in pairs.values():
        sender, _, receiver, _ = start["name"].split(" ")
        stages = (parse_action(sender).stage, parse_action(receiver).stage)
        assert stages not in turn, start["name"]
    # and the overlapped pairs carry one input and one output per half
    assert any(len(halves(e["name"])) == 2 for e in events if e["ph"] == "X")


def test_pairs_move_each_halfs_input_and_output():
    _, events = trace_of("dualpipe", 4, 8)
    bound = bind_like_perfetto(events)
    into: Counter = Counter()
    out_of: Counter = Counter()
    for maker, reader in bound.values():
        out_of[id(maker)] += 1
        into[id(reader)] += 1
    pairs = [e for e in events if e["ph"] == "X" and e["cat"] == "FB"]
    assert pairs
    # a pair in the steady state reads an activation and a gradient from two other ranks
    assert max(into[id(e)] for e in pairs) == 2
    assert max(out_of[id(e)] for e in pairs) == 2


def test_memory_counter_per_rank_peaks_at_the_panels_peak():
    drawn, events = trace_of("dualpipev", 4, 10)
    panel = drawn.panels[0]
    counters = [e for e in events if e["ph"] == "C"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in counters} == set(range(4))
    for rank in range(4):
        mine = [e for e in counters if e["tid"] == rank]
        assert {e["name"] for e in mine} == {f"rank {rank}"}
        assert all(list(e["args"]) == ["activations"] for e in mine)
        values = [e["args"]["activations"] for e in mine]
        assert max(values) == panel.metrics.peak_activations_per_rank[rank]
        assert values[0] == 0.0 and values[-1] == pytest.approx(0.0)
        # the same time scale as the slices: every sample is at the start of the step or at a
        # start or end of one of the rank's ops
        ops = [e for e in slices if e["tid"] == rank]
        edges = {e["ts"] for e in ops} | {e["ts"] + e["dur"] for e in ops} | {0.0}
        assert all(min(abs(e["ts"] - t) for t in edges) < 1e-6 for e in mine)
        assert [e["ts"] for e in mine] == sorted(e["ts"] for e in mine)
    peak = max(e["args"]["activations"] for e in counters)
    assert peak == max(panel.metrics.peak_activations_per_rank)
    assert f"peak activations {peak:g}" in panel.title


def test_ops_say_how_many_all_to_alls_they_hold():
    drawn, events = trace_of("dualpipev", 4, 10)
    result = drawn.panels[0].metrics
    slices = [e for e in events if e["ph"] == "X"]
    assert sum(e["args"].get("all_to_alls", 0) for e in slices) == result.ep_alltoalls
    hidden = sum(
        e["args"]["all_to_alls"] for e in slices if e["args"].get("all_to_alls_overlapped")
    )
    assert (
        hidden
        == result.ep_alltoalls_overlapped
        == 2 * overlapped_pairs(drawn.panels[0].timeline.schedule)
    )
    assert all("all_to_alls" not in e["args"] for e in slices if e["cat"] == "W")


def test_panels_keep_their_names_and_ranks_sort_by_number(tmp_path):
    lineup = (("dualpipe", 8, 20), ("dualpipev", 4, 10), ("zbv", 4, 10))
    costs = Costs(fb=2.5)
    drawn = scene([simulate(generate(n, r, m), costs) for n, r, m in lineup], costs)
    chrome_trace.save(drawn, tmp_path / "t.json")
    with open(tmp_path / "t.json") as file:
        data = json.load(file)
    events = data["traceEvents"]
    for event in events:
        for key in chrome_trace.REQUIRED:
            assert key in event, (key, event)
    meta = [e for e in events if e["ph"] == "M"]
    titles = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert len(titles) == 3
    assert list(titles.values()) == [p.title for p in drawn.panels]
    assert any(t.startswith("Cut-in-half (DualPipeV)") for t in titles.values())
    assert all("params" in t for t in titles.values())
    for pid, panel in zip(titles, drawn.panels, strict=True):
        sort = {e["tid"]: e["args"]["sort_index"] for e in meta
                if e["pid"] == pid and e["name"] == "thread_sort_index"}  # fmt: skip
        threads = {e["tid"]: e["args"]["name"] for e in meta
                   if e["pid"] == pid and e["name"] == "thread_name"}  # fmt: skip
        assert sort == {rank: rank for rank in range(panel.ranks)}
        assert threads == {rank: f"rank {rank}" for rank in range(panel.ranks)}
        assert pid not in threads  # Perfetto would list the thread whose tid is the pid first
    process_order = {e["pid"]: e["args"]["sort_index"] for e in meta
                     if e["name"] == "process_sort_index"}  # fmt: skip
    assert list(process_order.values()) == [0, 1, 2]
    pairs = flow_pairs(events)  # ids unique over the whole file
    assert len(pairs) == sum(cross_rank_transfers(p.timeline.schedule) for p in drawn.panels)
    assert all(s["pid"] == f["pid"] for s, f in pairs.values())
    assert {e["ph"] for e in events} == {"M", "X", "s", "f", "C"}


def test_measured_seconds_are_drawn_in_microseconds():
    schedule = generate("1f1b", 2, 4)
    simulated = simulate(schedule, Costs(f=0.01, b=0.02, w=0.01))
    measured = type(simulated)(schedule, simulated.starts, simulated.ends, unit="s",
                               source="measured")  # fmt: skip
    events = chrome_trace.events(scene([measured]))
    bound = bind_like_perfetto(events)
    assert len(bound) == cross_rank_transfers(schedule) == 8
    first = next(e for e in events if e["ph"] == "X")
    assert first["dur"] == pytest.approx(0.01e6)


def test_flows_and_counters_can_be_left_out():
    drawn, _ = trace_of("1f1b", 2, 2)
    plain = chrome_trace.events(drawn, flows=False, counters=False)
    assert {e["ph"] for e in plain} == {"M", "X"}


def test_draw_writes_a_trace_with_flows_and_counters(capsys, tmp_path):
    out = tmp_path / "t.json"
    assert main(["draw", "--schedule", "dualpipev", "-r", "4", "-m", "10", "-o", str(out)]) == 0
    with open(out) as file:
        events = json.load(file)["traceEvents"]
    kinds = Counter(e["ph"] for e in events)
    assert kinds["s"] == kinds["f"] == 120
    assert kinds["X"] == sum(map(len, generate("dualpipev", 4, 10).codes))
    assert {e["tid"] for e in events if e["ph"] == "C"} == set(range(4))
    assert "ops of 1 timeline(s)" in capsys.readouterr().out
