"""``cutpipe train``: train a model with a schedule, for real.

One path for every run: the options (``cutpipe.train.options``, from which this command's
parser is generated) are checked here, before any process starts, then ``--nproc`` workers are
started by torch's elastic agent (``cutpipe.launch.elastic``; the same command runs under
``torchrun -m cutpipe train``) and each runs ``cutpipe.train.trainer.train``. ``--model`` is a
cutpipe model file, a Hugging Face ``config.json``, or ``mlp``, the example MLP on synthetic
data (the default: a quick look at a schedule running). ``--emulate`` replaces every op's
compute with a sleep of its cost and prints the measured step beside the simulator's; ``--trace
FILE`` writes the last step's measured timeline (for ``cutpipe draw``). docs/training.md covers
every option.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from cutpipe.arguments import add_arguments, from_arguments
from cutpipe.cli.common import description, fmt, require_torch

if TYPE_CHECKING:
    from cutpipe.train.footprint import Footprint
    from cutpipe.train.options import TrainOptions


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train", help="train a model (a model file, or the example MLP) with a schedule",
        description=description(__doc__),
    )  # fmt: skip
    add_train_arguments(parser)
    parser.set_defaults(run=run)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a run, and the config file they may come from."""
    from cutpipe.arguments import ReadableFile
    from cutpipe.train.options import TrainOptions  # torch-free, as the train layer's options

    add_arguments(parser, TrainOptions, required=False)  # the schedule may be in --config
    files = parser.add_argument_group("config files")
    files.add_argument(
        "--config", type=ReadableFile().argument_type(), metavar="FILE",
        help="read options from a .toml or .yaml file (keys: the option names, e.g. seq_len or "
        "seq-len); options given on the command line win",
    )  # fmt: skip
    files.add_argument(
        "--print-config", action="store_true",
        help="print the resolved options as a TOML file for --config and exit",
    )  # fmt: skip


def given_on_command_line(argv: list[str]) -> set[str]:
    """The options ``cutpipe train``'s arguments in ``argv`` name (not those at a default)."""
    from cutpipe.train.config_file import option_fields

    parser = argparse.ArgumentParser(add_help=False)
    add_train_arguments(parser)
    unset = object()  # what an option not given keeps (argparse fills in only missing ones)
    start = argparse.Namespace(**dict.fromkeys([*option_fields(), "config", "print_config"], unset))
    words = argv[argv.index("train") + 1 :] if "train" in argv else argv
    given, _ = parser.parse_known_args(words, namespace=start)
    return {name for name, value in vars(given).items() if value is not unset}


def options_from(args: argparse.Namespace) -> TrainOptions:
    """The run the command line asks for, over a ``--config`` file's options; a schedule
    file's path made absolute (workers may start elsewhere)."""
    from cutpipe.train.options import TrainOptions

    if getattr(args, "config", None):
        from cutpipe.train.config_file import overridden, read_config

        explicit = given_on_command_line(getattr(args, "argv", []))
        for name, value in read_config(args.config).items():
            if not overridden(name, explicit):
                setattr(args, name, value)
    if not (args.schedule or args.schedule_file or args.plan):
        raise ValueError(
            "give the schedule: --schedule NAME, --from FILE or --plan FILE (on the command "
            "line or in --config)"
        )
    options = from_arguments(TrainOptions, args)
    for name in ("schedule_file", "plan"):
        path = getattr(options, name)
        if path is not None:
            options = options.replace(**{name: os.path.abspath(path)})
    if options.schedule_file is not None:
        from cutpipe.train.options import is_schedule_file

        if not is_schedule_file(options.schedule_file):
            raise ValueError(f"--from {options.schedule_file}: name a .json or .csv schedule file")
    return options


def run(args: argparse.Namespace) -> int:
    """Train: as a worker under torchrun or the elastic agent, or by starting the workers."""
    from cutpipe.launch.elastic import is_worker

    options = options_from(args)
    if getattr(args, "print_config", False):
        from cutpipe.train.config_file import to_toml

        print(to_toml(options), end="", flush=True)
        return 0
    debug = bool(getattr(args, "debug", False)) or os.environ.get("CUTPIPE_DEBUG") == "1"
    if is_worker():
        return work(options, debug)
    require_torch()
    footprint = check(options)
    return start(options, args.argv, debug, footprint)


def check(options: TrainOptions) -> Footprint | None:
    """Everything that can be checked before any process starts, so that a broken model file,
    a shape the schedule refuses, a plan for other ranks or a model this machine cannot hold
    fails here, once, in one line; the run's memory estimate (CPU runs)."""
    from cutpipe.train.footprint import check_host_memory
    from cutpipe.train.layout import run_layout, with_plan
    from cutpipe.train.sinks import require
    from cutpipe.train.tasks import LanguageModelTask, task_for

    if options.nproc is None:
        raise ValueError("give the number of processes: --nproc N")
    require(options)  # --tensorboard, --wandb: their packages
    options = with_plan(options)
    task = task_for(options)
    layout = run_layout(options, options.nproc * options.nnodes, task)
    footprint = None
    if options.backend == "gloo" and not options.emulate:
        footprint = check_host_memory(task, layout, options)
    if options.checkpoint_dir:
        from cutpipe.train.checkpoint.folders import check_directory, start_mode

        mode = start_mode(
            resume=options.resume, resume_if_present=options.resume_if_present,
            overwrite=options.overwrite,
        )  # fmt: skip
        check_directory(options.checkpoint_dir, mode)
    if isinstance(task, LanguageModelTask) and not options.emulate:
        from cutpipe.data import check_data

        # the workers read the same: a global batch of windows must be there
        seq_len = task.tokens_per_sample
        summary = check_data(
            options.data, seq_len=seq_len, windows=layout.batch,
            tokenizer=task.tokenizer, vocab=task.spec.vocab,
        )  # fmt: skip
        if summary.skipped.total:
            print(summary, flush=True)
        if options.validates:
            check_validation(options, summary, seq_len, layout.batch, task)
    return footprint


def check_validation(options: TrainOptions, data: Any, seq_len: int, batch: int, task: Any) -> None:
    """The validation set holds the global batches an evaluation reads, and with
    ``--val-fraction`` the training part still holds one (``data``: ``--data``'s summary)."""
    from cutpipe.data import check_data
    from cutpipe.data.heldout import evaluation_batches
    from cutpipe.data.loader import check_windows
    from cutpipe.data.tokens import split_point

    if options.val_fraction is not None:
        fraction = options.val_fraction
        cut = split_point(data.tokens, fraction)
        check_windows(cut, seq_len, f"{data.corpus} without its held-out {fraction:g}", batch)
        held, source = data.tokens - cut, f"the held-out {fraction:g} of {data.corpus}"
    else:
        found = check_data(options.val_data, tokenizer=task.tokenizer, vocab=task.spec.vocab)
        if found.skipped.total:
            print(f"validation {found}", flush=True)
        held, source = found.tokens, f"--val-data {found.corpus}"
    evaluation_batches(held, seq_len, batch, options.eval_steps, source)


class WorkerInputError(ValueError):
    """Bad input that only the workers could find (the CLI's exit status 2)."""


def start(
    options: TrainOptions, argv: list[str], debug: bool = False, footprint: Footprint | None = None
) -> int:
    """Start the workers (they run this command again) and wait for them; what ended a failed
    run is one line (bad input found by a worker: a usage error, exit status 2; a worker the
    kernel's out-of-memory killer ended: said so, with the estimate)."""
    from cutpipe.launch.elastic import Launch, LaunchFailed, run_workers
    from cutpipe.train.footprint import oom_kills

    plan = Launch(
        nproc=options.nproc, nnodes=options.nnodes, rdzv_endpoint=options.rdzv_endpoint,
        rdzv_id=options.rdzv_id, max_restarts=options.max_restarts, timeout=options.timeout,
        debug=debug,
    )  # fmt: skip
    kills = oom_kills()
    try:
        run_workers(argv, plan)
    except LaunchFailed as failure:
        if failure.cause is not None and failure.cause.is_input_error:
            raise WorkerInputError(str(failure)) from None
        said = out_of_memory(failure, kills, oom_kills(), footprint, options) or str(failure)
        print(f"cutpipe train: {said}", file=sys.stderr)
        return 1
    return 0


def out_of_memory(
    failure: Any, before: int | None, after: int | None, footprint: Footprint | None,
    options: TrainOptions,
) -> str | None:  # fmt: skip
    """The line for a run whose worker the kernel's out-of-memory killer ended (its count of
    kills went up while a worker died of SIGKILL), or None."""
    cause = failure.cause
    if cause is None or cause.kind != "SIGKILL" or before is None or after is None:
        return None
    if after <= before:
        return None
    line = f"rank {cause.rank} ran out of memory (the kernel's out-of-memory killer ended it)"
    if footprint is not None:
        from cutpipe.train.footprint import available_memory

        needed = footprint.on_machine(options.nproc or 1, options.nnodes) / 2**30
        line += f"; the estimate was {needed:,.2f} GiB for the {options.nproc} processes"
        available = available_memory()
        if available is not None:
            line += f", and {available / 2**30:,.2f} GiB are available now"
    return line + ": use fewer processes per machine, --recompute full, or a smaller model"


def work(options: TrainOptions, debug: bool = False) -> int:
    """One worker: train, then (rank 0) say how it went; a failure is recorded for the agent
    and said by the launcher (``cutpipe.launch.elastic.report_failure``)."""
    from cutpipe.doctor.report import startup_warnings
    from cutpipe.launch.elastic import report_failure
    from cutpipe.train.trainer import train

    if os.environ.get("LOCAL_RANK") == "0":  # once per node, however it was launched
        for line in startup_warnings():  # torchrun's variables give the node count
            print(line, file=sys.stderr, flush=True)
    try:
        result = train(options)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:
        return report_failure(error, debug)
    if result["rank"] == 0:
        report(result, options)
    return 0


def report(result: dict[str, Any], options: TrainOptions) -> None:
    """Rank 0's summary of a finished run (and, emulated, the step beside the simulator's)."""
    line = summary(result)
    if line:
        print(line, flush=True)
    if options.emulate and result["timeline"] is not None:
        from rich.console import Console

        from cutpipe.sim import Timeline

        timeline = Timeline.from_dict(result["timeline"])
        Console().print(emulation_table(timeline, options.simulated_costs, options.time_unit))
    if options.trace and result["timeline"] is not None:
        if not options.emulate:
            from rich.console import Console

            from cutpipe.sim import Timeline

            Console().print(replay_table(Timeline.from_dict(result["timeline"])))
        print(f"measured timeline written to {options.trace}", flush=True)


def summary(result: dict[str, Any]) -> str | None:
    """One line: the loss against what a context-free model reaches, and the throughput (for
    an emulated run, the step time)."""
    import math
    import statistics

    records = result["records"]
    if not records:
        return None
    steady = records[1:] or records
    if all(math.isnan(r["loss"]) for r in records):  # emulated
        step = statistics.median(r["step_time"] for r in steady)
        return f"{records[-1]['step']} steps (emulated), median step {step * 1e3:.1f} ms"
    line = (
        f"{records[-1]['step']} steps: loss {records[0]['loss']:.4f} -> "
        f"{records[-1]['loss']:.4f} {result['loss_words']}"
    )
    if result["entropy"] is not None:
        line += f" (the corpus's unigram entropy: {result['entropy']:.4f})"
    validation = result.get("validation")
    if validation is not None:
        line += (
            f"; validation loss {validation['val_loss']:.4f} (perplexity "
            f"{validation['val_ppl']:.2f}) after step {validation['step']}"
        )
    speed = statistics.median(r["tokens_per_s"] for r in steady)
    unit = "tokens/s" if result["entropy"] is not None else "samples/s"
    line += f"; median {speed:,.0f} {unit}"
    if result["resumed_from"] is not None:
        line += f"; resumed after step {result['resumed_from']}"
    if result["checkpoint_stall"]:
        stall = statistics.median(result["checkpoint_stall"])
        line += f"; checkpoint stall median {stall * 1e3:.1f} ms"
    return line


def replay_table(timeline: Any) -> Any:
    """The last step measured beside the simulator fed its measured op durations: what the
    schedule allows with those ops, and what transfers and waits between ops added."""
    from rich.table import Table

    from cutpipe.sim import metrics
    from cutpipe.sim.fit import replayed

    got, want = metrics(timeline), metrics(replayed(timeline))
    table = Table(title="the last step")
    for column in ("", "measured", "simulated from its op times"):
        table.add_column(column, justify="right")
    table.add_row("pipeline step (ms)", fmt(got.makespan * 1e3, 1), fmt(want.makespan * 1e3, 1))
    table.add_row("bubble ratio", fmt(got.bubble_ratio, 3), fmt(want.bubble_ratio, 3))
    for r in range(timeline.num_ranks):
        table.add_row(
            f"rank {r} busy / idle (ms)",
            f"{got.busy_per_rank[r] * 1e3:.1f} / {got.idle_per_rank[r] * 1e3:.1f}",
            f"{want.busy_per_rank[r] * 1e3:.1f} / {want.idle_per_rank[r] * 1e3:.1f}",
        )
    return table


def emulation_table(timeline: Any, costs: Any, time_unit: float) -> Any:
    """The last emulated step measured beside the simulator's prediction."""
    from rich.table import Table

    from cutpipe.sim import metrics, simulate

    got = metrics(timeline, costs)
    want = metrics(simulate(timeline.schedule, costs), costs)
    table = Table(title="emulated step: measured beside the simulator")
    for column in ("", "measured", "simulated"):
        table.add_column(column, justify="right")
    table.add_row("makespan (cost units)", fmt(got.makespan / time_unit, 3), fmt(want.makespan, 3))
    table.add_row("bubble ratio", fmt(got.bubble_ratio), fmt(want.bubble_ratio))
    table.add_row("bubble ratio (span)", fmt(got.bubble_ratio_span), fmt(want.bubble_ratio_span))
    for r in range(timeline.num_ranks):
        table.add_row(
            f"rank {r} idle (units)",
            fmt(got.idle_per_rank[r] / time_unit, 3),
            fmt(want.idle_per_rank[r], 3),
        )
    return table
