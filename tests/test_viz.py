"""Pictures: checked on the data behind them (scenes, matplotlib collections, trace events), and
the HTML page in a real headless Chromium: its script runs cleanly and its tooltips are right."""

import json
import time

import pytest
from conftest import headless_chromium
from matplotlib.collections import PolyCollection

from cutpipe import Costs, generate, simulate
from cutpipe.cli.main import main
from cutpipe.sim import peak_activations
from cutpipe.sim.fit import fitted_costs
from cutpipe.viz import chrome_trace, html, png, scene


def ops(schedule) -> int:
    return sum(map(len, schedule.codes))


@pytest.mark.parametrize(
    ("name", "ranks", "m"), [("1f1b", 4, 8), ("zbv", 4, 8), ("dualpipe", 4, 8)]
)
def test_scene_has_one_box_per_op_at_the_timeline_times(name, ranks, m):
    schedule = generate(name, ranks, m)
    timeline = simulate(schedule, Costs(fb=2.5))
    drawn = scene([timeline], Costs(fb=2.5))
    boxes = drawn.panels[0].boxes
    assert len(boxes) == ops(schedule)
    for rank in range(ranks):
        mine = [b for b in boxes if b.rank == rank]
        assert [b.start for b in mine] == list(timeline.starts[rank])
        assert [b.end for b in mine] == list(timeline.ends[rank])
    peaks = [max(v for _, v in series) for series in drawn.panels[0].memory]
    assert peaks == peak_activations(schedule, Costs())


def test_legs_and_labels():
    dual = scene([simulate(generate("dualpipe", 4, 8))]).panels[0]
    # pipe 1 (microbatches 4-7) is the second direction, numbered 0-3 within it like pipe 0
    for box in dual.boxes:
        assert box.leg == (box.microbatch >= 4)
        assert int(box.label.split("/")[0]) == box.microbatch - 4 * box.leg
    v = scene([simulate(generate("zbv", 2, 4))]).panels[0]
    assert all(b.leg == (b.stage >= 2) for b in v.boxes)


def test_what_each_op_waited_for():
    costs = Costs(comm=0.5)
    boxes = scene([simulate(generate("1f1b", 2, 2), costs)], costs).panels[0].boxes
    first_on_rank_1 = next(b for b in boxes if b.rank == 1)
    assert first_on_rank_1.waited == "waited for 0F0 from rank 0 (ready at 1.5)"
    assert boxes[0].waited == "first op of the rank"
    assert boxes[1].waited.startswith("started when 0F0 ended")


def test_png_and_svg_hold_every_box(tmp_path):
    drawn = scene(
        [simulate(generate(n, 4, 8), Costs(fb=2.5)) for n in ("dualpipev", "zbh1")], Costs(fb=2.5)
    )
    figure, count = png.render(drawn)
    polygons = sum(
        len(c.get_paths())
        for axes in figure.axes
        for c in axes.collections
        if isinstance(c, PolyCollection) and c.get_facecolor().size  # op boxes, not the idle bars
    )
    assert count == polygons == drawn.box_count
    assert png.save(drawn, tmp_path / "t.png") == drawn.box_count
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.save(drawn, tmp_path / "t.svg")
    assert b"<svg" in (tmp_path / "t.svg").read_bytes()[:400]


def test_chrome_trace_events_follow_the_trace_event_format(tmp_path):
    schedule = generate("dualpipe", 4, 8)
    drawn = scene([simulate(schedule)])
    chrome_trace.save(drawn, tmp_path / "t.json")
    data = json.loads((tmp_path / "t.json").read_text())
    events = data["traceEvents"]
    for event in events:
        for key in chrome_trace.REQUIRED:
            assert key in event, (key, event)
        assert event["ph"] in ("X", "M", "s", "f", "C")  # slices, names, flows, counters
        assert isinstance(event["ts"], (int, float)) and event.get("dur", 0) >= 0
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == ops(schedule)
    assert {e["tid"] for e in complete} == set(range(4))


def test_measured_timeline_with_the_simulation_overlaid(tmp_path):
    schedule = generate("1f1b", 2, 4)
    measured = simulate(schedule, Costs(f=0.01, b=0.02, w=0.01))  # stands in for a runtime trace
    measured = type(measured)(schedule, measured.starts, measured.ends, unit="s", source="measured")
    fitted = fitted_costs(measured)
    assert fitted.per_stage("f", 2) == pytest.approx([0.01, 0.01])
    assert fitted.per_stage("b", 2) == pytest.approx([0.03, 0.03])  # a BW-only stage: B holds it
    path = tmp_path / "m.json"
    measured.save(path)
    assert main(["draw", "--timeline", str(path), "--vs-sim", "-o", str(tmp_path / "m.png")]) == 0
    overlaid = scene([measured], [fitted], [simulate(schedule, fitted)])
    assert len(overlaid.panels[0].ghost) == ops(schedule)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["-s", "1f1b", "-r", "2", "-m", "2", "-o", "x.pdf"],
            "use one of .png, .svg, .html, .json",
        ),
        (["-s", "zb9", "-r", "2", "-m", "2", "-o", "x.png"], "known schedules: gpipe"),
        (
            ["--compare", "1f1b,zbv", "-r", "2,2,2", "-m", "4", "-o", "x.png"],
            "lists 3 values for 2 schedules",
        ),
        (["-s", "1f1b", "-r", "2", "-m", "2", "--vs-sim", "-o", "x.png"], "use it with --timeline"),
        (["-s", "zbv", "-r", "2", "-m", "4", "--steps", "2", "-o", "x.html"], "as .png or .svg"),
        (
            ["--compare", "1f1b,zbv", "-r", "2", "-m", "4", "--steps", "2", "-o", "x.png"],
            "--steps draws one schedule",
        ),
        (
            ["-s", "zbv", "-r", "2", "-m", "4", "--boundary", "sync", "-o", "x.png"],
            "--boundary needs --steps K",
        ),
    ],
)
def test_draw_errors_say_what_to_change(capsys, tmp_path, args, message):
    assert main(["draw", *args]) == 2
    assert message in capsys.readouterr().err


def test_draw_steps_writes_both_boundaries(capsys, tmp_path):
    out = tmp_path / "steps.svg"
    code = main(["draw", "-s", "zbv", "-r", "2", "-m", "4", "--steps", "3", "--optimizer", "1",
                 "--json", "-o", str(out)])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and out.stat().st_size > 1000
    assert [run["boundary"] for run in report["steps"]] == ["sync", "overlap"]
    assert report["boxes"] == 2 * 3 * (ops(generate("zbv", 2, 4)) + 2)  # and 2 optimizer steps


def test_a_trace_from_another_tool_is_rejected(capsys, tmp_path):
    path = tmp_path / "perfetto.json"
    path.write_text(json.dumps({"traceEvents": []}))
    assert main(["draw", "--timeline", str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert "not a cutpipe timeline" in capsys.readouterr().err


# -- the HTML page in a real browser ------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    yield from headless_chromium(tmp_path_factory.mktemp("chromium"), 1400, 900)


def open_page(browser, path):
    browser.get(path.as_uri())
    deadline = time.monotonic() + 30
    while not browser.execute_script("return !!(window.cutpipe && window.cutpipe.ready)"):
        assert time.monotonic() < deadline, "the page never finished drawing"
        time.sleep(0.05)
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.timeout(120)
def test_html_page_draws_without_errors_and_tooltips_describe_the_box(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    drawn = scene([simulate(generate("dualpipev", 4, 8), Costs(fb=2.5))], Costs(fb=2.5))
    path = tmp_path / "page.html"
    html.save(drawn, path)
    open_page(browser, path)
    assert browser.execute_script("return window.cutpipe.boxes") == drawn.box_count
    boxes = drawn.panels[0].boxes
    canvas = browser.find_element("id", "canvas")
    for index in (0, len(boxes) // 2, len(boxes) - 1):
        centre = browser.execute_script(f"return window.cutpipe.centre(0, {index})")
        frame = browser.execute_script(
            "return arguments[0].getBoundingClientRect().toJSON()", canvas
        )
        # a real pointer move, by WebDriver, relative to the canvas's centre
        dx = round(centre["x"] - (frame["left"] + frame["width"] / 2))
        dy = round(centre["y"] - (frame["top"] + frame["height"] / 2))
        ActionChains(browser).move_to_element_with_offset(canvas, dx, dy).perform()
        shown = browser.find_element("id", "tooltip").text
        box = boxes[index]
        assert shown.startswith(box.name)
        assert f"rank {box.rank}, stage {box.stage}, microbatch {box.microbatch}" in shown
        assert box.waited in shown


@pytest.mark.timeout(120)
def test_a_25000_box_page_paints_quickly(browser, tmp_path):
    schedule = generate("zbh1", 32, 256)
    drawn = scene([simulate(schedule)])
    path = tmp_path / "big.html"
    started = time.perf_counter()
    html.save(drawn, path)
    written = time.perf_counter() - started
    open_page(browser, path)
    painted = browser.execute_script("return window.cutpipe.firstPaintMs")
    print(
        f"\n{drawn.box_count} boxes: page written in {written:.2f} s, first paint after {painted:.0f} ms"
    )
    assert drawn.box_count == ops(schedule) > 24000
    assert painted < 10_000


@pytest.mark.parametrize("suffix", [".png", ".svg", ".html", ".json"])
def test_draw_writes_every_format_from_the_command_line(capsys, tmp_path, suffix):
    out = tmp_path / f"story{suffix}"
    code = main(["draw", "--compare", "dualpipe,dualpipev,zbv", "-r", "8,4,4", "-m", "20,10,10",
                 "--costs", "F=1,B=1,W=1,FB=2.5", "-o", str(out)])  # fmt: skip
    assert code == 0 and out.stat().st_size > 1000
    expected = sum(
        ops(generate(n, r, m))
        for n, r, m in (("dualpipe", 8, 20), ("dualpipev", 4, 10), ("zbv", 4, 10))
    )
    assert f"wrote {out}: {expected} ops of 3 timeline(s)" in capsys.readouterr().out


def test_kinds_stay_apart_in_greyscale():
    """F lightest to FB darkest, at least 0.1 apart in relative luminance (style's promise)."""
    from itertools import pairwise

    from cutpipe.viz.style import KIND_COLOURS, relative_luminance

    order = [relative_luminance(KIND_COLOURS[kind]) for kind in ("F", "B", "W", "BW", "FB")]
    assert all(a - b >= 0.1 for a, b in pairwise(order))
