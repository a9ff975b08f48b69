"""``cutpipe draw``: pictures of simulated or measured timelines.

The output file's ending picks the format: .png or .svg (matplotlib), .html (an interactive page
that opens without network), .json (a Chrome trace for Perfetto or chrome://tracing). With --steps
K, K steps of one schedule back to back, one panel per step boundary (.png or .svg).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cutpipe.cli.common import (
    SCHEDULE_HELP,
    add_costs_argument,
    add_steps_arguments,
    description,
    load_schedule_file,
    output_file,
    print_json,
    readable_file,
    schedule_name,
    schedule_names,
    steps_from_args,
)
from cutpipe.schedule.registry import generate
from cutpipe.sim.costs import Costs
from cutpipe.sim.simulate import simulate
from cutpipe.sim.timeline import Timeline
from cutpipe.viz.scene import MAX_BOXES, MAX_IMAGE_BOXES, check_boxes

FORMATS = (".png", ".svg", ".html", ".json")


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "draw", help="draw a timeline as PNG, SVG, interactive HTML or a Chrome trace",
        description=description(__doc__),
    )  # fmt: skip
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--schedule",
        "-s",
        type=schedule_name,
        metavar="NAME",
        help=SCHEDULE_HELP,
    )
    what.add_argument(
        "--from",
        dest="schedule_file",
        type=readable_file,
        metavar="FILE",
        help="a schedule file: .json (cutpipe schedule -o, tune -o) or .csv (torch's format)",
    )
    what.add_argument(
        "--compare",
        type=schedule_names,
        metavar="A,B,...",
        help="several schedules stacked on one time axis (each as --schedule takes it)",
    )
    what.add_argument(
        "--timeline",
        metavar="FILE",
        help="a timeline written by simulate --timeline or train --trace",
    )
    what.add_argument(
        "--metrics",
        metavar="FILE",
        nargs="+",
        help="training runs' loss curves, from train --metrics (PNG or SVG); several files are "
        "drawn side by side, each named by its file",
    )
    parser.add_argument("--entropy", type=float, metavar="NATS",
                        help="with --metrics: draw this loss level (the corpus's unigram entropy)")  # fmt: skip
    parser.add_argument(
        "--ranks", "-r", help="ranks; with --compare one per schedule (a,b,c) or one for all"
    )
    parser.add_argument(
        "--microbatches", "-m", help="microbatches; with --compare one per schedule or one for all"
    )
    add_costs_argument(parser, "", "stage of each schedule")
    parser.add_argument("--json", action="store_true",
                        help="print what was written and each timeline's metrics as JSON")  # fmt: skip
    add_steps_arguments(parser, "with --schedule or --from: draw")
    parser.add_argument("--vs-sim", action="store_true",
                        help="with --timeline: overlay the simulator's prediction from the measured op times")  # fmt: skip
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        type=output_file(FORMATS),
        metavar="FILE",
        help=f"ending: {', '.join(FORMATS)}",
    )
    parser.set_defaults(run=run)


def _per_schedule(value: str | None, count: int, name: str) -> list[int]:
    if value is None:
        raise ValueError(f"--{name} is required to draw a schedule")
    try:
        numbers = [int(v) for v in value.split(",")]
    except ValueError:
        numbers = []
    if not numbers or any(n < 1 for n in numbers):
        raise ValueError(f"--{name} takes whole numbers >= 1 separated by commas, got {value!r}")
    if len(numbers) == 1:
        return numbers * count
    if len(numbers) != count:
        raise ValueError(
            f"--{name} lists {len(numbers)} values for {count} schedules: give one or one each"
        )
    return numbers


def _limit(suffix: str) -> tuple[int, str]:
    """The most boxes a picture of this format may hold, and what to call it."""
    if suffix in (".png", ".svg"):
        return MAX_IMAGE_BOXES, "a PNG or SVG image"
    return MAX_BOXES, "a picture"


def _simulated(args: argparse.Namespace, costs: Costs, suffix: str) -> list[Timeline]:
    """The schedules asked for, simulated; the picture's size is checked before simulating."""
    if args.vs_sim:
        raise ValueError(
            "--vs-sim overlays a simulation on a measured timeline: use it with --timeline"
        )
    limit, what = _limit(suffix)
    if args.schedule_file is not None:
        schedule = _from_file(args)
        check_boxes(schedule.num_ops, limit, what)
        return [simulate(schedule, costs)]
    names = [args.schedule] if args.schedule else list(args.compare)
    ranks = _per_schedule(args.ranks, len(names), "ranks")
    microbatches = _per_schedule(args.microbatches, len(names), "microbatches")
    schedules, ops = [], 0
    for name, r, m in zip(names, ranks, microbatches, strict=True):
        schedules.append(generate(name, r, m))
        ops += schedules[-1].num_ops
        check_boxes(ops, limit, what)
    return [simulate(schedule, costs) for schedule in schedules]


def _from_file(args: argparse.Namespace):
    """The schedule of --from; --ranks / --microbatches, if given, must agree with it."""

    def given(value: str | None, option: str) -> int | None:
        return None if value is None else _per_schedule(value, 1, option)[0]

    return load_schedule_file(
        args.schedule_file, given(args.ranks, "ranks"), given(args.microbatches, "microbatches")
    )


def _draw_metrics(args: argparse.Namespace, output: Path) -> int:
    from cutpipe.train.metrics import read_metrics
    from cutpipe.viz.curve import save_loss_curves

    if output.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"a loss curve is drawn as .png or .svg, not {output.suffix}")
    runs = {}
    for path in args.metrics:
        try:
            runs[Path(path).stem] = read_metrics(path)
        except OSError as error:
            raise ValueError(f"cannot read --metrics {path}: {error.strerror}") from None
    if len(runs) != len(args.metrics):
        raise ValueError(
            "--metrics names two files of the same name: each run is named by its file"
        )
    from cutpipe.viz.curve import run_title

    # titled by what ran, as the log says; an older log's single run by its file
    title = run_title(runs) or (next(iter(runs)) if len(runs) == 1 else "")
    count = save_loss_curves(runs, output, args.entropy, title)
    if args.json:
        print_json({"written": str(output), "format": output.suffix.lower().lstrip("."),
                    "steps": count})  # fmt: skip
    else:
        print(f"wrote {output}: the loss of {count} steps")
    return 0


def _draw_steps(args: argparse.Namespace, output: Path) -> int:
    """K steps of one schedule, a panel per boundary: where steps overlap and where they wait."""
    from cutpipe.viz import png
    from cutpipe.viz.scene import steps_scene

    if args.schedule is None and args.schedule_file is None:
        raise ValueError("--steps draws one schedule: give --schedule NAME or --from FILE")
    if output.suffix.lower() not in (".png", ".svg"):
        raise ValueError(
            f"--steps is drawn as .png or .svg (step shading and boundaries), not {output.suffix}"
        )
    if args.schedule_file is not None:
        schedule = _from_file(args)
    else:
        ranks = _per_schedule(args.ranks, 1, "ranks")[0]
        schedule = generate(
            args.schedule, ranks, _per_schedule(args.microbatches, 1, "microbatches")[0]
        )
    boundaries = 1 if args.boundary in ("sync", "overlap") else 2
    check_boxes(schedule.num_ops * args.steps * boundaries, *_limit(output.suffix.lower()))
    runs = steps_from_args(args, schedule, args.costs)
    drawing = steps_scene(runs, args.costs)
    count = png.save(drawing, output)
    if args.json:
        print_json({"written": str(output), "format": output.suffix.lower().lstrip("."),
                    "boxes": count, "steps": [run.to_dict() for run in runs]})  # fmt: skip
    else:
        steady = ", ".join(f"{run.boundary} {run.steady:g}" for run in runs)
        print(f"wrote {output}: {args.steps} steps of {schedule.name} ({steady} per step)")
    return 0


def run(args: argparse.Namespace) -> int:
    from cutpipe.viz import scene

    output: Path = args.output
    if args.steps is not None:
        return _draw_steps(args, output)
    if args.metrics is not None:
        return _draw_metrics(args, output)
    if any(getattr(args, name) is not None for name in ("boundary", "optimizer", "reduction")):
        steps_from_args(args, None, args.costs)  # says which option needs --steps
    suffix = output.suffix.lower()
    costs: Costs = args.costs
    ghosts = None
    if args.timeline is not None:
        timeline = Timeline.load(args.timeline)
        limit, what = _limit(suffix)
        check_boxes(timeline.schedule.num_ops * (2 if args.vs_sim else 1), limit, what)
        timelines, per_costs = [timeline], [costs]
        if args.vs_sim:
            from cutpipe.sim.fit import fitted_costs

            fitted = fitted_costs(timeline, costs)
            ghosts = [simulate(timeline.schedule, fitted)]
            per_costs = [fitted]
    else:
        timelines = _simulated(args, costs, suffix)
        per_costs = [costs] * len(timelines)
    drawing = scene(timelines, per_costs, ghosts)
    if suffix in (".png", ".svg"):
        from cutpipe.viz import png

        count = png.save(drawing, output)
    elif suffix == ".html":
        from cutpipe.viz import html

        count = html.save(drawing, output)
    else:
        from cutpipe.viz import chrome_trace

        count = chrome_trace.save(drawing, output)
    if args.json:
        print_json(
            {
                "written": str(output),
                "format": suffix.lstrip("."),
                "ops": count,
                "timelines": [
                    {"schedule": p.timeline.schedule.name, "title": p.title,
                     "source": p.timeline.source, "metrics": p.metrics.to_dict()}
                    for p in drawing.panels
                ],
            }
        )  # fmt: skip
    else:
        print(f"wrote {output}: {count} ops of {len(timelines)} timeline(s)")
    return 0
