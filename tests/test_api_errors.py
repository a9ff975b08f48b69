"""The Python API answers wrong input with a TypeError or ValueError that names the argument.

Every case here used to fail late (an AttributeError, a KeyError, a TypeError deep inside) or,
worse, to return a wrong result (NaN tables, a 139 GB plan for an 80 GB GPU).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cutpipe import (
    Costs,
    Placement,
    Schedule,
    Timeline,
    cut_in_half,
    generate,
    metrics,
    simulate,
    validate,
)
from cutpipe.plan.costs.model import Training, gpu
from cutpipe.plan.costs.profile import Profile
from cutpipe.plan.partition import MAX_BALANCED_OPS, balance
from cutpipe.plan.recommend.recommend import Job, Layout, evaluate, recommend
from cutpipe.plan.search.tune import MAX_SEARCHED_OPS, cost_aware
from cutpipe.schedule import MAX_OPS, SCHEDULES
from cutpipe.schedule.generators import interleaved, zbv
from cutpipe.spec import ModelSpec
from cutpipe.viz import scene
from cutpipe.viz.scene import MAX_BOXES

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
TINY = ModelSpec(name="tiny", layers=4, hidden=64, heads=4, ffn=128, vocab=300, seq_len=32)


# -- generate -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, 3, b"1f1b"])
def test_generate_names_the_schedule_argument(name):
    with pytest.raises(TypeError, match="schedule name must be a str"):
        generate(name, 4, 8)


@pytest.mark.parametrize(
    ("ranks", "microbatches", "named"),
    [("4", 8, "ranks"), (4.0, 8, "ranks"), (True, 8, "ranks"), (4, 8.5, "microbatches"),
     (4, None, "microbatches")],
)  # fmt: skip
def test_generate_names_the_count_of_the_wrong_type(ranks, microbatches, named):
    with pytest.raises(TypeError, match=f"{named} must be an int"):
        generate("1f1b", ranks, microbatches)


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches"),
    [("1f1b", 2, 1_000_000_000), ("zbv", 64, 4096), ("1f1b", 100_000, 32), ("zbv", 2000, 1),
     ("dualpipe", 10**6, 2 * 10**6), ("interleaved", 10**9, 1)],
)  # fmt: skip
def test_generate_refuses_schedules_over_the_size_limit_before_building(name, ranks, microbatches):
    with pytest.raises(ValueError, match=f"more than the limit of {MAX_OPS:,}") as error:
        generate(name, ranks, microbatches)
    assert "use " in str(error.value)  # says what to change


def test_the_size_limit_leaves_the_benchmark_shape_alone():
    for name, info in SCHEDULES.items():
        assert info.ops_bound(64, 1024) <= MAX_OPS, name
        assert generate(name, 64, 1024).num_ops <= info.ops_bound(64, 1024)


def test_generators_called_directly_check_too():
    with pytest.raises(ValueError, match="limit"):
        zbv(64, 10**7)
    with pytest.raises(TypeError, match="chunks must be an int"):
        interleaved(4, 8, chunks=2.0)


# -- Costs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e308, -1.0])
def test_costs_refuse_values_that_are_not_finite_or_in_range(value):
    with pytest.raises(ValueError, match="cost f must be a finite number"):
        Costs(f=value)
    with pytest.raises(ValueError, match=r"cost b\[1\] must be a finite number"):
        Costs(b=[1.0, value])


@pytest.mark.parametrize("value", [True, "1", None, {"a": 1}])
def test_costs_refuse_values_of_the_wrong_type_naming_the_field(value):
    with pytest.raises(TypeError, match="cost comm must be a number"):
        Costs(comm=value)


def test_costs_parse_refuses_unknown_duplicate_and_unparsed_keys():
    with pytest.raises(ValueError, match="KEY one of f, b, w, fb, comm"):
        Costs.parse("params=1")  # used to be a TypeError deep in the simulator
    with pytest.raises(ValueError, match="cost f is given twice"):
        Costs.parse("F=1,f=2")
    with pytest.raises(ValueError, match="not a number"):
        Costs.parse("f=none")
    assert Costs.parse("fb=none").fb is None


def test_costs_refuse_params_without_a_positive_total():
    with pytest.raises(ValueError, match="positive total"):
        Costs(params=[0.0, 0.0])
    with pytest.raises(TypeError, match="per-stage sizes"):
        Costs(params=1.0)


# -- Schedule, Placement, Timeline from dicts and files --------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [({}, "schedule lacks 'placement', 'num_microbatches', 'actions'"),
     ([], "schedule must be a JSON object"),
     ({"placement": {"kind": "linear", "num_ranks": 2, "pipes": [[0, 1]]}, "num_microbatches": "2",
       "actions": [[], []]}, "num_microbatches must be a whole number"),
     ({"placement": {"kind": "linear", "num_ranks": 2, "pipes": [[0, 1]]}, "num_microbatches": 1,
       "actions": [["0F0"]]}, "actions lists 1 items, expected 2"),
     ({"placement": {"kind": "linear", "num_ranks": 1, "pipes": [[0]]}, "num_microbatches": 1,
       "actions": [[7]]}, "must be strings")],
)  # fmt: skip
def test_schedule_from_dict_names_what_is_missing_or_wrong(data, message):
    with pytest.raises(ValueError, match=message):
        Schedule.from_dict(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [({}, "placement lacks 'kind', 'num_ranks', 'pipes'"),
     ({"kind": "linear", "num_ranks": "2", "pipes": [[0, 1]]}, "num_ranks must be a whole number"),
     ({"kind": "linear", "num_ranks": 2, "pipes": [[0, "x"]]}, "rank must be a whole number"),
     ({"kind": "linear", "num_ranks": 2, "pipes": 5}, "pipes must be a list")],
)  # fmt: skip
def test_placement_from_dict_names_what_is_missing_or_wrong(data, message):
    with pytest.raises(ValueError, match=message):
        Placement.from_dict(data)


def _timeline_dict() -> dict:
    return simulate(generate("1f1b", 2, 2)).to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [(lambda d: d.pop("ends"), "timeline lacks 'ends'"),
     (lambda d: d["ends"][0].__setitem__(1, -5.0), r"ends at -5, before it starts"),
     (lambda d: d["starts"][1].__setitem__(0, math.nan), "must be a finite number"),
     (lambda d: d["ends"][0].pop(), "ends lists 3 items, expected 4"),
     (lambda d: d["starts"].pop(), "starts lists 1 items, expected 2"),
     (lambda d: d["starts"][0].__setitem__(0, "0"), "must be a number")],
)  # fmt: skip
def test_timeline_from_dict_refuses_malformed_times(change, message):
    data = _timeline_dict()
    change(data)
    with pytest.raises(ValueError, match=message):
        Timeline.from_dict(data)


def test_timeline_load_names_a_missing_file_and_a_file_with_nan(tmp_path):
    with pytest.raises(FileNotFoundError, match="timeline file .*nope.json does not exist"):
        Timeline.load(tmp_path / "nope.json")
    data = _timeline_dict()
    data["ends"][0][0] = math.nan
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(data))  # Python writes NaN, which json.loads reads back
    with pytest.raises(ValueError, match=r"nan.json: timeline rank 0 end 0 must be a finite"):
        Timeline.load(path)


def test_timeline_json_is_strict(tmp_path):
    path = tmp_path / "t.json"
    simulate(generate("zbv", 2, 4)).save(path)
    json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))


# -- other entry points a new user calls --------------------------------------------------


def test_simulate_metrics_and_cut_in_half_name_a_wrong_argument():
    schedule = generate("1f1b", 2, 2)
    with pytest.raises(TypeError, match="simulate takes a Schedule"):
        simulate("1f1b")
    with pytest.raises(TypeError, match="costs must be a Costs"):
        simulate(schedule, {"f": 1})
    with pytest.raises(TypeError, match="metrics takes a Timeline"):
        metrics(schedule)
    with pytest.raises(TypeError, match="validate takes a Schedule"):
        validate([["0F0"]])
    with pytest.raises(TypeError, match="cut_in_half takes a Schedule"):
        cut_in_half("dualpipe")
    with pytest.raises(ValueError, match="needs a bidirectional"):
        cut_in_half(schedule)


def test_scene_refuses_more_boxes_than_a_picture_can_show():
    timeline = simulate(generate("1f1b", 100, 1001))  # 200,200 ops
    with pytest.raises(ValueError, match=f"over the limit of {MAX_BOXES:,} boxes"):
        scene([timeline])


@pytest.mark.parametrize("memory", [math.nan, math.inf, -1.0, 0.0])
def test_recommend_refuses_memory_that_is_not_a_positive_finite_number(memory):
    # a NaN capacity used to make every comparison false: 139 GB plans for an 80 GB GPU
    model = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
    with pytest.raises(ValueError, match="memory must be a positive finite number"):
        recommend(model, gpu("A100"), 8, memory=memory)


def test_recommend_names_other_wrong_arguments():
    model = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
    with pytest.raises(TypeError, match="devices must be an int"):
        recommend(model, gpu("A100"), 8.0)
    with pytest.raises(ValueError, match="global_batch must be >= 1"):
        recommend(model, gpu("A100"), 8, global_batch=0)  # not silently the default
    with pytest.raises(TypeError, match="schedules must be a list"):
        recommend(model, gpu("A100"), 8, schedules="1f1b")
    with pytest.raises(ValueError, match="use a smaller global batch"):
        recommend(model, gpu("A100"), 8, global_batch=10**9)


def test_evaluate_refuses_a_layout_that_is_not_the_jobs():
    model = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
    job = Job(model, gpu("A100"), 8)
    with pytest.raises(ValueError, match="PP=2 x DP=2 x TP=1 x CP=1 is 4 devices, the job has 8"):
        evaluate(job, Layout(2, 2, 1, "1f1b", 8))
    with pytest.raises(ValueError, match="the layout has TP=1, its training setting TP=2"):
        evaluate(job, Layout(2, 4, 1, "1f1b", 8), Training(tp=2))
    with pytest.raises(ValueError, match="ZeRO-1 shards over the layout's DP=4"):
        evaluate(job, Layout(2, 4, 1, "1f1b", 8), Training(zero=1, dp=2))
    with pytest.raises(ValueError, match="layout: pp must be >= 1"):
        Layout(0, 4, 1, "1f1b", 8)
    with pytest.raises(ValueError, match="step_boundary must be one of"):
        Job(model, gpu("A100"), 8, step_boundary="async")


def test_plan_searches_refuse_absurd_sizes_before_searching():
    with pytest.raises(ValueError, match=f"limit of {MAX_SEARCHED_OPS:,}"):
        cost_aware("v", 64, 100_000, Costs())
    with pytest.raises(ValueError, match="memory_cap must be a finite number"):
        cost_aware("v", 2, 4, Costs(), memory_cap=math.nan)
    schedule = generate("1f1b", 8, 2048)
    with pytest.raises(ValueError, match=f"limit of {MAX_BALANCED_OPS:,}"):
        balance(schedule, [], 0.0, 0.5)


@pytest.mark.parametrize(
    ("fields", "error"),
    [({"layers": 10**9}, "layers must be at most"), ({"hidden": 2**60}, "hidden must be at most"),
     ({"layers": 2.5}, "layers must be a whole number"), ({"layers": True}, "whole number")],
)  # fmt: skip
def test_model_specs_refuse_absurd_or_mistyped_sizes(fields, error):
    with pytest.raises((TypeError, ValueError), match=error):
        ModelSpec(**{**TINY.__dict__, **fields})


def test_profile_load_names_malformed_files(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "cutpipe-profile/1"}))
    with pytest.raises(ValueError, match="profile lacks 'model'"):
        Profile.load(path)
    good = {
        "format": "cutpipe-profile/1", "model": TINY.__dict__, "device": "cpu", "dtype": "fp32",
        "w_memory": 0.5,
        "items": {kind: {"name": kind, "forward": 1.0, "backward": 1.0, "weight": 1.0,
                         "activation": 1.0, "parameters": 1.0}
                  for kind in ("embedding", "dense_layer", "head")},
    }  # fmt: skip
    path.write_text(json.dumps(good))
    assert Profile.load(path).model == TINY
    good["items"]["head"]["forward"] = math.nan
    path.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="head forward must be a finite number"):
        Profile.load(path)
    good["items"]["head"] = {"name": "head", "speed": 1}
    path.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="profile item head lacks 'forward'"):
        Profile.load(path)
