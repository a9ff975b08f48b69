"""The HTML page says what the pictures should: parameter copies per panel, only the kinds
present, which rows repeat which; and, in headless Chromium, round time ticks, a memory axis and
the legend as drawn."""

import json
import math
import re
import time
from itertools import pairwise

import pytest
from conftest import headless_chromium

from cutpipe import Costs, generate, simulate
from cutpipe.viz import html, scene
from cutpipe.viz.html import _runs

STORY_COSTS = Costs.parse("F=1,B=1,W=1,FB=2.5")


def story():
    """The README's comparison: DualPipe on 8 ranks, Cut-in-half and ZB-V on 4."""
    shapes = (("dualpipe", 8, 20), ("dualpipev", 4, 10), ("zbv", 4, 10))
    timelines = [simulate(generate(n, r, m), STORY_COSTS) for n, r, m in shapes]
    return scene(timelines, STORY_COSTS)


def single(name, ranks, microbatches):
    return scene([simulate(generate(name, ranks, microbatches), STORY_COSTS)], STORY_COSTS)


def embedded(page: str) -> dict:
    """The JSON the page carries, read back the way its script reads it."""
    found = re.search(r'<script id="scene" type="application/json">(.*?)</script>', page, re.S)
    assert found, "the page has no embedded scene"
    return json.loads(found.group(1))


# -- the embedded data ---------------------------------------------------------------------------


def test_parameters_are_copies_per_panel_and_shares_per_rank():
    data = embedded(html.page(story()))
    dual, cut, zbv = data["panels"]
    assert [p["parameter_copies"] for p in data["panels"]] == [2, 1, 1]
    assert dual["parameters"] == "2x an even 1/8 split"
    assert cut["parameters"] == "1x an even 1/4 split"
    assert "params 2x" in dual["title"] and "params 1x" in cut["title"]
    # the same 25% of the model is 2x an even split on 8 ranks and 1x on 4
    assert dual["metrics"]["params_per_rank"] == [0.25] * 8
    assert cut["metrics"]["params_per_rank"] == [0.25] * 4
    assert zbv["display"] == "ZB-V" and cut["display"] == "Cut-in-half (DualPipeV)"


@pytest.mark.parametrize(("name", "copies"), [("dualpipe", 2), ("dualpipev", 1)])
def test_a_single_schedule_page_carries_its_parameter_copies(name, copies):
    data = embedded(html.page(single(name, 4, 10)))
    assert data["panels"][0]["parameter_copies"] == copies


def test_legend_lists_only_the_kinds_present():
    zbv = embedded(html.page(single("zbv", 4, 8)))
    assert zbv["kinds"] == ["F", "B", "W"]
    assert [e["kind"] for e in zbv["legend"]] == ["F", "B", "W", "leg", "idle"]
    assert zbv["legend"][3]["name"] == "second leg of the V"
    # box kinds index the kinds present, not a fixed list of five
    assert set(zbv["panels"][0]["boxes"]["kind"]) == {0, 1, 2}

    onefoneb = embedded(html.page(single("1f1b", 4, 8)))
    assert [e["kind"] for e in onefoneb["legend"]] == ["F", "BW", "idle"]  # no second leg

    cut = embedded(html.page(single("dualpipev", 4, 10)))
    assert "FB" in cut["kinds"]
    pair = next(e for e in cut["legend"] if e["kind"] == "FB")
    assert "forward mb / backward mb" in pair["name"]


def test_rows_repeating_an_earlier_panel_are_marked():
    data = embedded(html.page(story()))
    dual, cut, zbv = data["panels"]
    assert cut["same_as"] == [[0, 0], [0, 1], [0, 2], [0, 3]]
    assert dual["same_as"] == [None] * 8 and zbv["same_as"] == [None] * 4
    assert data["shared"] == [
        {
            "panel": 1,
            "rows": [0, 3],
            "source": 0,
            "source_rows": [0, 3],
            "note": "rows 0-3 = DualPipe rows 0-3, box for box",
            "source_note": "rows 0-3 repeat as Cut-in-half (DualPipeV) rows 0-3",
        }
    ]


def test_runs_of_shared_rows_break_where_the_source_rows_stop_following():
    same_as = (None, (0, 0), (0, 1), (0, 3), (1, 4), None, (1, 5))
    assert _runs(same_as) == [(1, 2, 0, 0), (3, 3, 0, 3), (4, 4, 1, 4), (6, 6, 1, 5)]


def test_page_title_uses_display_names():
    page = html.page(story())
    assert "<title>DualPipe / Cut-in-half (DualPipeV) / ZB-V - cutpipe</title>" in page


# -- the page in headless Chromium ---------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    yield from headless_chromium(tmp_path_factory.mktemp("chromium"), 1000, 800)


def opened(driver, drawn, path):
    html.save(drawn, path)
    driver.get(path.as_uri())
    deadline = time.monotonic() + 30
    while not driver.execute_script("return !!(window.cutpipe && window.cutpipe.ready)"):
        assert time.monotonic() < deadline, "the page never finished drawing"
        time.sleep(0.05)
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
    return driver


def assert_round_steps(labels: list[str], low: float, high: float):
    """Ticks inside [low, high], evenly spaced by 1, 2 or 5 times a power of ten."""
    values = [float(label) for label in labels]
    assert len(values) >= 2, labels
    assert low - 1e-9 <= values[0] and values[-1] <= high + 1e-9, (labels, low, high)
    steps = {round(b - a, 9) for a, b in pairwise(values)}
    assert len(steps) == 1, labels
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    assert round(mantissa, 6) in (1, 2, 5), (labels, step)
    assert all(abs(v / step - round(v / step)) < 1e-6 for v in values), labels


@pytest.mark.parametrize(
    ("low", "high", "count", "expected"),
    [
        (0, 63, 7, ["0", "10", "20", "30", "40", "50", "60"]),
        (0, 415, 10, ["0", "50", "100", "150", "200", "250", "300", "350", "400"]),
        (10.3, 12.1, 5, ["10.5", "11.0", "11.5", "12.0"]),
        (0.0123, 0.0456, 4, ["0.02", "0.03", "0.04"]),
        (-3, 3, 3, ["-2", "0", "2"]),
    ],
)
def test_tick_function_gives_round_values(chromium, tmp_path, low, high, count, expected):
    if not chromium.execute_script("return !!window.cutpipe"):  # any page has the function
        opened(chromium, single("1f1b", 2, 2), tmp_path / "ticks.html")
    labels = chromium.execute_script(f"return window.cutpipe.niceTicks({low}, {high}, {count})")
    assert labels == expected
    assert_round_steps(labels, low, high)


def test_compare_page_axis_legend_memory_and_notes(chromium, tmp_path):
    drawn = story()
    page = opened(chromium, drawn, tmp_path / "story.html")
    shown = page.execute_script("return window.cutpipe.shown()")
    assert_round_steps(shown["axis"], 0, drawn.end)
    # zoomed in to an awkward range the ticks stay round
    page.execute_script("window.cutpipe.view(10.37, 12.21)")
    assert_round_steps(page.execute_script("return window.cutpipe.shown().axis"), 10.37, 12.21)

    legend = [e.text for e in page.find_elements("css selector", "#legend span")]
    assert legend[0] == "F forward" and legend[-1] == "idle"
    assert any("forward mb / backward mb" in entry for entry in legend)

    memory = [m["label"] for m in shown["memory"] if m["panel"] == 0]
    assert memory == ["0", "5", "10"]  # peak 9 of the unit, on a round scale

    notes = {(n["panel"], n["text"]) for n in shown["notes"]}
    assert (1, "rows 0-3 = DualPipe rows 0-3, box for box") in notes
    assert (0, "rows 0-3 repeat as Cut-in-half (DualPipeV) rows 0-3") in notes
    first_cut_box = 0  # rank 0's first op: its row is DualPipe rank 0's
    assert "DualPipe rank 0" in page.execute_script(
        f"return window.cutpipe.describe(1, {first_cut_box})"
    )

    params = [cell.text for cell in page.find_elements("css selector", "td.params")]
    assert params == ["2x an even 1/8 split", "1x an even 1/4 split", "1x an even 1/4 split"]


def test_many_ranks_get_a_heat_map_with_rank_labels(chromium, tmp_path):
    page = opened(chromium, single("zbv", 32, 64), tmp_path / "zbv32.html")
    memory = [m["label"] for m in page.execute_script("return window.cutpipe.shown().memory")]
    assert memory == ["rank 0", "rank 8", "rank 16", "rank 24", "rank 31"]
    rows = page.find_elements("css selector", "table.ranks tr")
    assert [r.text.split()[:2] for r in rows[1:]] == [["ranks", "0-31"]]  # alike ranks: one row
