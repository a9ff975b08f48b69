"""The PNG/SVG picture: checked on the matplotlib objects behind it (legend entries, annotations,
the memory strip's form) and on the SVG text, not on pixels."""

from dataclasses import replace
from xml.etree import ElementTree

import matplotlib
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.image import AxesImage

from cutpipe import Costs, generate, simulate
from cutpipe.viz import png, scene
from cutpipe.viz.style import MEMORY_UNIT, legend_name

COSTS = Costs.parse("F=1,B=1,W=1,FB=2.5")
#: The README's figure: DualPipe on 8 ranks, its cut-in-half on 4, ZB-V on 4.
README = (("dualpipe", 8, 20), ("dualpipev", 4, 10), ("zbv", 4, 10))


def picture(*shapes: tuple[str, int, int]):
    return scene([simulate(generate(*shape), COSTS) for shape in shapes], COSTS)


def drawn(figure):
    """``figure`` drawn with Agg, so text and legends have their final extents."""
    FigureCanvasAgg(figure).draw()
    return figure.canvas.get_renderer()


def legend_labels(figure) -> set[str]:
    (legend,) = figure.legends
    return {text.get_text() for text in legend.get_texts()}


def named_axes(figure, label: str):
    (found,) = [ax for ax in figure.axes if ax.get_label() == label]
    return found


def left_title(ax):
    """The title set with ``loc="left"`` (matplotlib keeps it apart from ``ax.title``)."""
    return ax._left_title


def shared_texts(figure):
    return [t for ax in figure.axes for t in ax.texts if (t.get_gid() or "").startswith("shared")]


def test_legend_lists_only_the_kinds_present():
    figure, _ = png.render(picture(("1f1b", 4, 8)))
    assert legend_labels(figure) == {"F forward", "BW full backward", "idle"}
    figure, _ = png.render(picture(("dualpipev", 4, 8)))
    assert legend_labels(figure) == {legend_name(kind) for kind in ("F", "B", "W", "BW", "FB")} | {
        "hatched: second leg of the V",
        "idle",
    }
    assert "F&B overlapped pair (label: forward mb / backward mb)" in legend_labels(figure)


def test_legends_titles_and_brackets_stay_off_the_data():
    figure, _ = png.render(picture(*README))
    renderer = drawn(figure)
    width = figure.bbox.width
    axes = [ax.get_window_extent(renderer) for ax in figure.axes]
    legends = [figure.legends[0], *(ax.get_legend() for ax in figure.axes if ax.get_legend())]
    assert len(legends) == 4  # the figure's and one per memory strip of lines
    for artist in [*legends, *shared_texts(figure)]:
        box = artist.get_window_extent(renderer)
        assert not any(box.overlaps(each) for each in axes), artist
        assert box.x0 >= 0 and box.x1 <= width, artist
    titled = [ax for ax in figure.axes if ax.get_title(loc="left")]
    assert len(titled) == 6  # a panel and its memory strip, three times
    for ax in titled:
        title = left_title(ax).get_window_extent(renderer)
        assert title.x0 >= 0 and title.x1 <= width
        assert not any(title.overlaps(each) for each in axes)


def test_long_titles_wrap_inside_the_figure():
    one = picture(("interleaved", 4, 8))
    title = (
        one.panels[0].title
        + ", and a tail long enough that the whole title cannot fit on one line at this figure width"
    )
    figure, _ = png.render(replace(one, panels=[replace(one.panels[0], title=title)]))
    renderer = drawn(figure)
    shown = left_title(named_axes(figure, "panel 0"))
    assert shown.get_text().count("\n") == 1
    assert shown.get_text().replace("\n", " ") == title
    assert shown.get_window_extent(renderer).x1 <= figure.bbox.width


def test_shared_rows_are_bracketed_in_the_comparison_only():
    figure, _ = png.render(picture(*README))
    (text,) = shared_texts(figure)
    assert text.axes is named_axes(figure, "panel 1")  # on Cut-in-half, right of its rows
    assert text.get_text() == "= DualPipe\nrows 0-3"
    assert text.get_position()[0] > 1  # in axes fractions: past the right edge of the data
    single, _ = png.render(picture(("dualpipev", 4, 10)))
    assert shared_texts(single) == []


def test_shared_runs_group_contiguous_rows_either_way():
    one = picture(("zbv", 4, 8)).panels[0]
    mirrored = replace(one, same_as=((0, 7), (0, 6), None, (1, 2)))
    assert [(r.first, r.last, r.panel, r.their_first, r.their_last) for r in
            png.shared_runs(mirrored)] == [(0, 1, 0, 7, 6), (3, 3, 1, 2, 2)]  # fmt: skip
    broken = replace(one, same_as=((0, 0), (0, 2), (0, 3), (0, 2)))
    assert [(r.first, r.last) for r in png.shared_runs(broken)] == [(0, 0), (1, 2), (3, 3)]


def test_many_ranks_get_a_heat_map_with_a_unit():
    many = picture(("zbv", 32, 64))
    figure, _ = png.render(many)
    memory = named_axes(figure, "memory 0")
    (image,) = memory.images
    assert isinstance(image, AxesImage) and not memory.lines and memory.get_legend() is None
    grid = image.get_array()
    assert grid.shape[0] == 32
    peaks = [max(value for _, value in series) for series in many.panels[0].memory]
    assert list(grid.max(axis=1)) == peaks  # every rank's peak survives the resampling
    colour_bar = named_axes(figure, "colour bar 0")
    assert colour_bar.get_ylabel().replace("\n", " ") == MEMORY_UNIT
    assert MEMORY_UNIT in memory.get_title(loc="left")


def test_few_ranks_get_a_line_per_distinct_rank():
    figure, _ = png.render(picture(("dualpipe", 8, 16)))
    memory = named_axes(figure, "memory 0")
    assert not memory.images
    labels = [text.get_text() for text in memory.get_legend().get_texts()]
    assert labels == ["ranks 0, 7", "ranks 1, 6", "ranks 2, 5", "ranks 3, 4"]  # mirrored ranks
    assert len(memory.lines) == 4
    assert MEMORY_UNIT in memory.get_title(loc="left")


def test_heat_grid_keeps_spikes_narrower_than_a_column():
    one = picture(("1f1b", 2, 2)).panels[0]
    spiky = replace(one, memory=[[(0.0, 0.0), (1.0, 5.0), (1.01, 1.0)], [(0.0, 2.0)]])
    grid = png.heat_grid(spiky, np.linspace(0.0, 4.0, 5))
    assert grid.tolist() == [[0.0, 5.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]


def test_svg_keeps_text_as_text_and_leaves_rcparams_alone(tmp_path):
    settings = ("svg.fonttype", "hatch.linewidth", "hatch.color")
    before = [matplotlib.rcParams[name] for name in settings]
    png.save(picture(*README), tmp_path / "t.svg")
    assert [matplotlib.rcParams[name] for name in settings] == before
    root = ElementTree.parse(tmp_path / "t.svg").getroot()
    texts = {
        "".join(element.itertext()) for element in root.iter("{http://www.w3.org/2000/svg}text")
    }
    for display, params in (("DualPipe", "2x"), ("Cut-in-half (DualPipeV)", "1x"), ("ZB-V", "1x")):
        assert any(t.startswith(f"{display}: ") and f"params {params}" in t for t in texts)
    assert "= DualPipe" in texts


@pytest.mark.parametrize("ranks", [8, 9])
def test_the_form_switches_past_eight_ranks(ranks):
    figure, _ = png.render(picture(("1f1b", ranks, ranks)))
    assert bool(named_axes(figure, "memory 0").images) == (ranks > png.MANY_RANKS)


def test_steps_show_their_numbers_boundaries_and_what_runs_between():
    from cutpipe.sim.steps import simulate_steps
    from cutpipe.viz.scene import steps_scene

    schedule = generate("zbv", 2, 4)
    runs = [simulate_steps(schedule, steps=3, boundary=b, optimizer=1, reduction=1)
            for b in ("sync", "overlap")]  # fmt: skip
    figure, count = png.render(steps_scene(runs))
    # every op of 3 steps twice; per step and rank an all-reduce and an optimizer step (sync)
    # or an optimizer step (overlap)
    assert count == 2 * 3 * schedule.num_ops + 3 * 2 * 2 + 3 * 2
    labels = legend_labels(figure)
    assert {legend_name("AR"), legend_name("OPT"), "lighter: odd steps"} <= labels
    assert "a rank's next step may start" in labels
    rows = named_axes(figure, "panel 1")
    assert [t.get_text() for t in rows.texts if t.get_text().startswith("step")] == [
        "step 0",
        "step 1",
        "step 2",
    ]
    assert left_title(rows).get_text().startswith("ZB-V (overlap)")


def test_loss_curves_of_several_runs_are_drawn_side_by_side(tmp_path):
    """cutpipe draw --metrics A.jsonl B.jsonl: one named curve each (a single run also gets its
    tokens/s); what cannot be drawn is one line."""
    import json

    from cutpipe.cli.main import main

    paths = []
    for name, start in (("dense", 5.0), ("moe", 5.5)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(
            json.dumps({"step": s, "loss": start - s / 10, "tokens_per_s": 100.0}) + "\n"
            for s in range(1, 6)
        ))  # fmt: skip
        paths.append(str(path))
    assert (
        main(["draw", "--metrics", *paths, "--entropy", "3.3", "-o", str(tmp_path / "a.png")]) == 0
    )
    assert (tmp_path / "a.png").stat().st_size > 0
    assert main(["draw", "--metrics", paths[0], "-o", str(tmp_path / "one.svg")]) == 0
    (tmp_path / "empty.jsonl").write_text("")
    assert (
        main(["draw", "--metrics", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "e.png")])
        == 2
    )
