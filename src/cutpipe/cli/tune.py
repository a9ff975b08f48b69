"""``cutpipe tune``: a cost-aware zero-bubble schedule for given costs and memory cap."""

from __future__ import annotations

import argparse
from contextlib import suppress
from dataclasses import dataclass

from cutpipe.cli.common import (
    add_costs_argument,
    fmt,
    output_file,
    positive_int,
    print_json,
    readable_file,
    real,
    whole_number,
)
from cutpipe.plan.search.bounds import v_bubble_lower_bound
from cutpipe.plan.search.caps import default_cap, within
from cutpipe.plan.search.tune import DEFAULT_EVALUATIONS, FIXED, SEARCHED_OPS, cost_aware
from cutpipe.schedule.fileformat import ENDINGS, save_schedule
from cutpipe.schedule.registry import schedule_info
from cutpipe.sim.costs import MAX_COST, Costs
from cutpipe.sim.metrics import metrics
from cutpipe.sim.simulate import simulate

OBJECTIVES = {
    "makespan": lambda result: (result.makespan, result.bubble_ratio_span),
    "span": lambda result: (result.bubble_ratio_span, result.makespan),
}
#: The schedule whose placement the model's layers are balanced for (only its placement counts).
BALANCED_FOR = {"linear": "1f1b", "v": "zbv"}
#: The most a ``--memory-cap-x`` may multiply the default cap by.
MAX_CAP_FACTOR = 1e6
#: What ``--frontier -o`` draws to.
PICTURES = (".png", ".svg")


def count_argument(text: str) -> int:
    """An argparse ``type``: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "tune",
        help="search a cost-aware schedule under a memory cap",
        description="Place F, B and W passes (and, on a V, the order of chunks) by simulated time "
        "for the given costs, under a per-rank activation cap, and compare with the fixed orders. "
        "The costs are scalars (--costs), or per stage from a model (--model) or a profile "
        "(--profile) on a GPU (--gpu), its layers balanced over the placement's stages.",
    )
    parser.add_argument("--placement", choices=("linear", "v"),
                        help="one stage per rank (linear) or two folded into a V (default v; "
                        "with --frontier, both)")  # fmt: skip
    parser.add_argument("--ranks", "-r", type=positive_int, required=True, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=positive_int, required=True,
                        help="microbatches per step")  # fmt: skip
    source = parser.add_mutually_exclusive_group()
    add_costs_argument(source, "", "stage (a V stage is half a rank's layers)")
    source.add_argument(
        "--model",
        type=readable_file,
        metavar="FILE",
        help="a cutpipe model file (YAML or JSON): per-stage costs in seconds and bytes from the "
        "analytic model on --gpu, the layers balanced over the placement's stages",
    )
    source.add_argument(
        "--profile",
        type=readable_file,
        metavar="FILE",
        help="measured costs from cutpipe profile, balanced likewise (links from --gpu)",
    )
    parser.add_argument(
        "--gpu",
        metavar="NAME",
        help="a GPU preset (H100, ...) or a GPU file: the devices, with --model or --profile",
    )
    parser.add_argument("--seq-len", type=whole_number(1, 2**24), metavar="N",
                        help="with --model: tokens per sequence (default: the model file's; a "
                        "Hugging Face config's max_position_embeddings)")  # fmt: skip
    parser.add_argument(
        "--memory-cap",
        type=real(0.0, MAX_COST, unit="units of the costs' activation"),
        metavar="A",
        help="activation memory a rank may hold, in the units of the costs' activation: stage "
        "activations with --costs, bytes with --model or --profile (default: 1F1B's peak, "
        "R units on a linear placement and 2R on a V)",
    )
    parser.add_argument(
        "--memory-cap-x",
        type=real(0.0, MAX_CAP_FACTOR, unit="times 1F1B's peak"),
        metavar="X",
        help="the cap as X times the default, 1F1B's peak (ZB-H1's is 1, ZB-H2's 2), with "
        "any costs; instead of --memory-cap",
    )
    parser.add_argument("--objective", choices=tuple(OBJECTIVES), default="makespan",
                        help="what to minimise: the step (makespan) or the span bubble")  # fmt: skip
    parser.add_argument("--evaluations", type=count_argument, metavar="N",
                        help="local-search budget, in simulated candidates (default "
                        f"{DEFAULT_EVALUATIONS}, fewer above {SEARCHED_OPS // DEFAULT_EVALUATIONS:,} ops"
                        "): the same command gives the same schedule on every machine")  # fmt: skip
    parser.add_argument("--seed", type=count_argument, default=0,
                        help="where the local search starts on each rank (default 0)")  # fmt: skip
    parser.add_argument("--seconds", type=real(0.0, exclusive=False, unit="seconds"),
                        help="also stop the local search after this long (then the result "
                        "depends on the machine; 0: no local search)")  # fmt: skip
    parser.add_argument(
        "--frontier",
        action="store_true",
        help="sweep caps from 1x to 2x 1F1B's peak (or to --memory-cap-x) on both placements "
        "(or --placement's; --costs per V stage, a linear stage is two) and print the best span "
        "bubble at each, with the lower bounds and the fixed schedules at their peaks; -o draws "
        "it (.png, .svg)",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="also solve the problem exactly (OR-Tools CP-SAT, pip install 'cutpipe[exact]'; "
        "small shapes only) and report the optimum beside the search",
    )
    parser.add_argument(
        "--polish",
        type=real(0.0, unit="solver seconds per round"),
        metavar="EFFORT",
        help="after the search, re-time every op within a window of its start with OR-Tools "
        "CP-SAT (pip install 'cutpipe[exact]'), EFFORT of the solver's deterministic seconds "
        "per round (about one second each here), on one worker: the same on every machine; "
        "with --frontier, every point above its bound",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=output_file(tuple(ENDINGS) + PICTURES),
        metavar="FILE",
        help="write the tuned schedule: .json (cutpipe's format, for --from in simulate, draw, "
        "compare and train) or .csv (torch's); with --frontier, its picture (.png, .svg)",
    )
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class Planned:
    """Where per-stage costs came from: a model (or its profile) on a GPU, split into stages."""

    source: str  # "model" or "profile"
    model: str
    gpu: str
    sizes: list[int]  # cost items per stage (the first holds the embedding, the last the head)
    seq_len: int = 0  # tokens per sequence the costs are for

    @property
    def layers(self) -> list[int]:
        last = len(self.sizes) - 1
        return [size - (s == 0) - (s == last) for s, size in enumerate(self.sizes)]


def planned_costs(args: argparse.Namespace) -> tuple[Costs, Planned]:
    """Per-stage costs (seconds, bytes) of ``--model`` or ``--profile`` on ``--gpu``: the
    model's items balanced over the placement's stages, as ``cutpipe partition`` does."""
    from cutpipe.model_config import load_model_config
    from cutpipe.plan.costs.model import gpu, model_items, p2p_time, w_memory
    from cutpipe.plan.costs.profile import Profile
    from cutpipe.plan.partition import rank_balanced_sizes, stage_costs

    option = "--model" if args.model is not None else "--profile"
    if args.seq_len is not None and args.model is None:
        raise ValueError(
            f"--seq-len sets the length of --model's sequences: {option} fixes its own"
        )
    if args.gpu is None:
        raise ValueError(
            f"{option} needs --gpu NAME (e.g. H100, or a GPU file): the costs depend on it"
        )
    hardware = gpu(args.gpu)
    if args.profile is not None:
        profile = Profile.load(args.profile)
        model, items, kept = profile.model, profile.items_for(hardware), profile.w_memory
    else:
        model = load_model_config(args.model, seq_len=args.seq_len)
        items, kept = model_items(model, hardware), w_memory(model)
    ranks = args.ranks
    stages = ranks * (2 if args.placement == "v" else 1)
    if len(items) < stages:
        raise ValueError(
            f"{model.name} has {len(items) - 2} layers (with its embedding and head, "
            f"{len(items)} items), too few for the {stages} stages of a {args.placement} "
            f"placement on {ranks} ranks: that needs at least {stages - 2} layers; use fewer ranks"
        )
    shape = schedule_info(BALANCED_FOR[args.placement]).generate(ranks, args.microbatches)
    sizes = rank_balanced_sizes(items, shape)
    comm = p2p_time(model, hardware, within_node=ranks <= hardware.gpus_per_node)
    costs = stage_costs(items, sizes, comm, kept)
    source = "model" if args.model is not None else "profile"
    return costs, Planned(source, model.name, hardware.name, sizes, model.seq_len)


def run(args: argparse.Namespace) -> int:
    R, m = args.ranks, args.microbatches
    if args.seq_len is not None and args.model is None:
        raise ValueError(
            "--seq-len sets the length of --model's sequences: give --model FILE, or drop it"
        )
    picture = args.output is not None and args.output.suffix.lower() in PICTURES
    if args.frontier:
        return run_frontier(args)
    args.placement = args.placement or "v"
    if picture:
        raise ValueError(
            f"-o {args.output}: a picture is drawn for --frontier only; a tuned schedule is "
            "written as .json or .csv"
        )
    if args.memory_cap is not None and args.memory_cap_x is not None:
        raise ValueError(
            "give the cap once: --memory-cap A (absolute, in the units of the costs' activation) "
            "or --memory-cap-x X (times 1F1B's peak), not both"
        )
    planned = None
    if args.model is not None or args.profile is not None:
        costs, planned = planned_costs(args)
    elif args.gpu is not None:
        raise ValueError(
            "--gpu applies to --model or --profile: --costs gives the costs themselves"
        )
    else:
        costs = args.costs
    default = default_cap(args.placement, R, costs)
    if args.memory_cap_x is not None:
        cap = args.memory_cap_x * default
    else:
        cap = args.memory_cap if args.memory_cap is not None else default
    objective = OBJECTIVES[args.objective]
    tuned = cost_aware(args.placement, R, m, costs, cap, objective, args.seconds,
                       args.evaluations, args.seed)  # fmt: skip
    rows = [(tuned.name, metrics(simulate(tuned, costs), costs))]
    if args.polish is not None:
        from cutpipe.plan.search.polish import polish

        tuned = polish(tuned, costs, cap, args.objective, effort=args.polish)
        rows.append((f"{tuned.name}, polished", metrics(simulate(tuned, costs), costs)))
    if args.exact:
        from cutpipe.plan.search.exact import exact_schedule

        solved = exact_schedule(args.placement, R, m, costs, cap, args.objective)
        label = "exact (optimal)" if solved.optimal else "exact (best found, not proven)"
        rows.append((label, metrics(simulate(solved.schedule, costs), costs)))
    for name in FIXED[args.placement]:
        info = schedule_info(name)
        if info.accepts(R, m):
            fixed = info.generate(R, m)
            rows.append((name, metrics(simulate(fixed, costs), costs)))
    floor = None
    if args.placement == "v":
        with suppress(ValueError):  # per-stage costs, all-to-alls: the bound does not cover them
            floor = v_bubble_lower_bound(R, m, costs, cap)
    if args.output is not None:
        save_schedule(tuned, args.output)
    if args.json:
        report = {name: result.to_dict() for name, result in rows}
        if floor is not None:
            report["lower_bound"] = {"bubble_ratio_span": floor}
        if planned is not None:
            report["plan"] = {
                "source": planned.source,
                "model": planned.model,
                "gpu": planned.gpu,
                "seq_len": planned.seq_len,
                "layers_per_stage": planned.layers,
                "memory_cap": cap,
                "memory_cap_unit": "bytes",
                "default_memory_cap": default,
            }
        print_json(report)
        return 0
    print_table(args, rows, cap, planned, floor)
    return 0


def print_table(args: argparse.Namespace, rows: list, cap: float, planned: Planned | None,
                floor: float | None) -> None:  # fmt: skip
    from rich.console import Console
    from rich.table import Table

    R, m = args.ranks, args.microbatches
    factor = f" ({fmt(args.memory_cap_x)}x 1F1B's peak)" if args.memory_cap_x is not None else ""
    if planned is None:
        title = f"{args.placement} placement, R={R}, m={m}, activation cap {fmt(cap)}{factor}"
        time_unit, time_scale, memory_unit, memory_scale = "", 1.0, "", 1.0
    else:
        layers = ",".join(map(str, planned.layers))
        title = (
            f"{planned.model} ({planned.seq_len:,}-token sequences) on {R} x {planned.gpu} "
            f"({planned.source}): {args.placement} "
            f"placement, m={m}, layers per stage {layers} (+embedding, +head), activation cap "
            f"{cap / 1e9:.3f} GB{factor}"
        )
        time_unit, time_scale, memory_unit, memory_scale = " (ms)", 1e3, " (GB)", 1e-9
    table = Table(title=title)
    for column in ("schedule", f"makespan{time_unit}", "bubble (abs)", "bubble (span)",
                   f"peak activations{memory_unit}"):  # fmt: skip
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for name, result in rows:
        peak = max(result.peak_activations_per_rank)
        table.add_row(name, fmt(result.makespan * time_scale), fmt(result.bubble_ratio),
                      fmt(result.bubble_ratio_span), fmt(peak * memory_scale)
                      + ("" if within(peak, cap) else " (over)"))  # fmt: skip
    console = Console()
    console.print(table)
    if floor is not None:
        console.print(f"No V schedule has a span bubble below {floor:.6f} with these costs and this "
                      "cap (cutpipe.plan.search.bounds).")  # fmt: skip


def run_frontier(args: argparse.Namespace) -> int:
    """``tune --frontier``: the best span bubble at every cap from 1x to 2x (or to --memory-cap-x),
    on both placements or --placement's."""
    from rich.console import Console
    from rich.table import Table

    from cutpipe.plan.search.frontier import FACTORS, frontier, marks

    for option, given in (("--memory-cap", args.memory_cap), ("--model", args.model),
                          ("--profile", args.profile), ("--exact", args.exact or None)):  # fmt: skip
        if given is not None:
            raise ValueError(
                f"--frontier sweeps its own caps from --costs (per V stage): drop {option}"
            )
    if args.output is not None and args.output.suffix.lower() not in PICTURES:
        raise ValueError(f"-o {args.output}: --frontier draws a picture, .png or .svg")
    top = FACTORS[-1] if args.memory_cap_x is None else args.memory_cap_x
    if top < 1:
        raise ValueError(
            f"--memory-cap-x {top:g} with --frontier is the highest cap it sweeps from 1x: give "
            "1 or more"
        )
    factors = [f for f in FACTORS if f < top - 1e-9] + [top]
    placements = ("linear", "v") if args.placement is None else (args.placement,)
    R, m, costs = args.ranks, args.microbatches, args.costs
    console = Console(stderr=True)
    with console.status("frontier") as status:
        points = frontier(R, m, costs, factors, placements, evaluations=args.evaluations,
                          seed=args.seed,
                          progress=lambda text: status.update(f"frontier: {text}"),
                          polish_effort=args.polish or 0.0)  # fmt: skip
    fixed = [mark for mark in marks(R, m, costs)
             if mark.placement in placements and mark.peak <= top + 1e-9]  # fmt: skip
    if args.json:
        print_json({
            "points": [{"placement": p.placement, "memory_x": p.factor, "bubble_span": p.bubble,
                        "makespan": p.makespan, "peak_x": p.peak, "lower_bound": p.bound}
                       for p in points],
            "fixed": [{"schedule": f.name, "placement": f.placement, "peak_x": f.peak,
                       "bubble_span": f.bubble} for f in fixed],
        })  # fmt: skip
    else:
        table = Table(title=f"span bubble against memory, R={R}, m={m} (memory x 1F1B's peak)")
        for column in ("memory", *(f"{pl}{end}" for pl in placements for end in ("", " bound"))):
            table.add_column(column, justify="right")
        table.add_column("fixed schedules here")
        by = {(p.placement, p.factor): p for p in points}
        for i, factor in enumerate(factors):  # increasing, as swept
            upper = factors[i + 1] if i + 1 < len(factors) else float("inf")
            here = [f"{f.name} {f.bubble:.4f} ({f.peak:g}x)" for f in fixed
                    if factor <= f.peak + 1e-9 < upper]  # fmt: skip
            cells = []
            for placement in placements:
                point = by[(placement, factor)]
                cells += [f"{point.bubble:.4f}", f"{point.bound:.4f}"]
            table.add_row(f"{factor:g}x", *cells, ", ".join(here))
        Console().print(table)
    if args.output is not None:
        from cutpipe.viz.frontier import save_frontier

        lines = {pl: [(p.factor, p.bubble) for p in points if p.placement == pl]
                 for pl in placements}  # fmt: skip
        bounds = {pl: [(p.factor, p.bound) for p in points if p.placement == pl]
                  for pl in placements}  # fmt: skip
        save_frontier(lines, bounds, [(f.name, f.placement, f.peak, f.bubble) for f in fixed],
                      args.output, f"R={R}, m={m}")  # fmt: skip
    return 0
