"""``cutpipe train``: train a model with a schedule, for real.

With ``--model FILE`` (a cutpipe model file or a Hugging Face ``config.json``) it trains that
transformer on text (``--data``, by default the Python standard library's sources) with AdamW,
warm-up and cosine decay, clipping, checkpoints and a metrics log, its ``--nproc`` workers
started by torch's elastic agent (``cutpipe.launch.elastic``; the same command runs under
``torchrun -m cutpipe train``). docs/training.md covers every option.

Without ``--model`` it is a quick look at a schedule running: ``--nproc`` local processes train
a stack of Linear(``--width``) + tanh blocks on a synthetic regression task with SGD;
``--emulate`` replaces every op's compute with a sleep of its cost and prints the measured
timeline's metrics beside the simulator's; ``--trace FILE`` writes the last step's measured
timeline (for ``cutpipe draw``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from cutpipe.cli.common import (
    SCHEDULE_HELP,
    description,
    fmt,
    output_file,
    parse_costs,
    positive_float,
    positive_int,
    readable_file,
    real,
    require_torch,
    schedule_name,
    whole,
)

if TYPE_CHECKING:
    from cutpipe.train.options import TrainOptions

#: Local processes ``train`` starts at most: more only oversubscribe the machine's cores.
MAX_PROCESSES = 64
#: Numbers the built-in model and its data may hold (weights and one batch): 1 GiB of fp32.
MAX_MODEL_ELEMENTS = 2**28


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train", help="train a model file on text, or run a schedule on a built-in toy model",
        description=description(__doc__),
    )  # fmt: skip
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--schedule", "-s", type=schedule_name, metavar="NAME", help=SCHEDULE_HELP)
    source.add_argument("--from", dest="schedule_file", type=readable_file, metavar="FILE",
                        help="a schedule file (.json from cutpipe schedule -o or tune -o, or a "
                        ".csv of torch's) for exactly --nproc x --nnodes ranks")  # fmt: skip
    parser.add_argument("--nproc", "-n", type=whole(1, MAX_PROCESSES),
                        help=f"pipeline ranks on this machine (at most {MAX_PROCESSES}); under "
                        "torchrun, torchrun's own")  # fmt: skip
    parser.add_argument("--microbatches", "-m", type=positive_int,
                        help="default: the schedule's minimum, at least 2 x nproc")  # fmt: skip
    parser.add_argument(
        "--steps", type=positive_int, default=10, help="optimizer steps (default 10)"
    )
    parser.add_argument("--batch", type=positive_int,
                        help="samples per step (default: 8 per microbatch)")  # fmt: skip
    parser.add_argument("--width", type=positive_int, default=128,
                        help="toy model: features of every Linear block (default 128)")  # fmt: skip
    parser.add_argument("--blocks", type=positive_int,
                        help="Linear+tanh blocks (default: 16, or one per stage)")  # fmt: skip
    parser.add_argument("--lr", type=positive_float,
                        help="learning rate (default 3e-3 with --model, 1.0 for the toy model)")  # fmt: skip
    parser.add_argument(
        "--emulate", action="store_true", help="sleep for each op's cost instead of computing"
    )
    parser.add_argument("--costs", type=parse_costs, default=None, metavar="K=V,...",
                        help="per-stage costs for --emulate (default F=B=W=1)")  # fmt: skip
    parser.add_argument("--time-unit", type=positive_float, default=0.02,
                        help="seconds per cost unit with --emulate")  # fmt: skip
    parser.add_argument("--trace", type=output_file(), metavar="FILE",
                        help="write the last step's measured timeline as JSON")  # fmt: skip
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="torch.distributed backend: gloo (CPU) or nccl (one GPU per rank)")  # fmt: skip
    parser.add_argument("--timeout", type=positive_float,
                        help="stop every process after this long (seconds; default 600 for the toy "
                        "model, none with --model)")  # fmt: skip
    parser.add_argument("--step-timeout", type=real(1.0, exclusive=False, unit="seconds"), default=60.0, metavar="SECONDS",
                        help="stop every rank when one completes no op for this long "
                        "(default 60, at least 1)")  # fmt: skip
    add_training_arguments(parser)
    parser.set_defaults(run=run)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a real training run (``--model``)."""
    from cutpipe.sim.steps import BOUNDARIES
    from cutpipe.train.options import DP_MODES, DTYPES, RECOMPUTE

    real_run = parser.add_argument_group("training a model file (--model)")
    add = real_run.add_argument
    add("--model", type=readable_file, metavar="FILE",
        help="cutpipe model YAML/JSON or a Hugging Face config.json")  # fmt: skip
    add("--data", nargs="+", default=[], metavar="PATH",
        help="text files, folders or a prepared token file (default: Python's standard library)")  # fmt: skip
    add("--seq-len", type=positive_int, help="tokens per sequence (default: the model file's)")
    add("--seed", type=whole(0, 2**63 - 1), default=0,
        help="seeds the weights and the order of the data (default 0)")  # fmt: skip
    add("--warmup", type=whole(0, 10**9), help="warm-up steps (default: 5%% of --steps)")
    add("--min-lr-ratio", type=real(0.0, 1.0, exclusive=False), default=0.1,
        help="cosine decay ends at this fraction of --lr")  # fmt: skip
    add("--weight-decay", type=real(0.0, exclusive=False), default=0.1,
        help="AdamW weight decay (default 0.1)")  # fmt: skip
    add("--clip", type=positive_float, default=1.0, help="clip the global gradient norm to this")
    add("--grad-accum", type=positive_int, default=1, help="pipeline steps per optimizer step")
    add("--step-boundary", choices=BOUNDARIES, default="sync",
        help="sync: every rank waits for the global gradient norm before stepping; overlap: each "
        "rank steps at once, a step that should have been clipped or skipped is redone")  # fmt: skip
    add("--skip-nonfinite", action="store_true",
        help="skip a step whose gradients hold a NaN or infinity instead of stopping")  # fmt: skip
    add("--dtype", choices=DTYPES, default="fp32", help="bf16: autocast, fp32 master weights")
    add("--recompute", choices=RECOMPUTE, default="none", help="activation recompute per layer")
    add("--checkpoint-dir", metavar="DIR", help="save checkpoints here (DCP, asynchronous)")
    add("--checkpoint-every", type=whole(0, 10**9), default=0, metavar="STEPS",
        help="steps between checkpoints (default: only after the last step)")  # fmt: skip
    add("--keep", type=positive_int, default=2, help="complete checkpoints kept")
    add(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir",
    )
    add("--log", type=output_file(), metavar="FILE", help="write metrics as JSON lines")
    add("--profile-steps", type=step_range, metavar="A:B", help="torch.profiler over steps A..B")
    add("--profile-dir", default="profile", metavar="DIR", help="where profiler traces go")
    add("--dp", type=whole(1, 10**4), default=1,
        help="data-parallel replicas: the processes form pipelines of (nproc x nnodes) / dp ranks")  # fmt: skip
    add("--dp-mode", choices=DP_MODES, default="allreduce",
        help="allreduce: every replica keeps all optimizer state; zero1: optimizer state sharded "
        "over the replicas; fsdp: parameters, gradients and optimizer state sharded (FSDP2)")  # fmt: skip
    add("--nnodes", type=whole(1, 10**4), default=1, help="machines (agents) in the run")
    add("--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous shared by every node")
    add("--rdzv-id", metavar="ID", help="run id shared by every node")
    add("--max-restarts", type=whole(0, 1000), default=0,
        help="restart the workers this often after a failure (they resume from the latest checkpoint)")  # fmt: skip
    add("--quiet", action="store_true", help="no progress line")


def step_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        pair = (int(first), int(last if sep else first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (steps), got {text!r}") from None
    if pair[0] < 1 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"expected 1 <= A <= B, got {text!r}")
    return pair


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting checked (and torch found) before any process starts."""
    if args.nproc is None:
        raise ValueError("give the number of processes: --nproc N")
    if args.dp != 1 or args.dp_mode != "allreduce":
        raise ValueError("--dp and --dp-mode train a model file: add --model FILE")
    from cutpipe.train.options import resolve_schedule

    # checks the shape (or the file) before any process starts
    schedule = resolve_schedule(_schedule(args), args.nproc, args.microbatches)
    m = schedule.num_microbatches
    blocks = max(16, schedule.num_stages) if args.blocks is None else args.blocks
    if blocks < schedule.num_stages:
        raise ValueError(
            f"--blocks {blocks} cannot fill {schedule.num_stages} stages: use at least that many"
        )
    batch = 8 * m if args.batch is None else args.batch
    if batch % m:
        raise ValueError(
            f"--batch {batch} does not split into {m} microbatches: use a multiple of {m}"
        )
    if not args.emulate:
        elements = blocks * args.width**2 + 2 * batch * args.width
        if elements > MAX_MODEL_ELEMENTS:
            raise ValueError(
                f"the built-in model and data hold {elements:,} numbers ({blocks} blocks of "
                f"{args.width} x {args.width}, a batch of {batch} x {args.width}), over the limit "
                f"of {MAX_MODEL_ELEMENTS:,} (1 GiB of fp32): use a smaller --width, --blocks or --batch"
            )
    require_torch()
    return {
        "schedule": _schedule(args), "microbatches": m, "steps": args.steps, "batch": batch,
        "width": args.width, "blocks": blocks, "emulate": args.emulate,
        "costs": args.costs, "time_unit": args.time_unit, "trace": args.trace,
        "backend": args.backend, "step_timeout": args.step_timeout,
        "lr": 1.0 if args.lr is None else args.lr,
    }  # fmt: skip


def train_rank(rank: int, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``cutpipe train`` (runs in a spawned process)."""
    import torch
    from torch import nn

    from cutpipe.models import mlp
    from cutpipe.runtime import PipelineRunner
    from cutpipe.sim import Costs
    from cutpipe.train.options import resolve_schedule

    schedule = resolve_schedule(options["schedule"], world, options["microbatches"])
    record = options["emulate"] or options["trace"] is not None
    device = torch.device("cpu")
    if options["backend"] == "nccl":  # one GPU per rank
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if options["emulate"]:
        costs = options["costs"] or Costs()
        runner = PipelineRunner(
            schedule, None, emulate=costs, time_unit=options["time_unit"], record_timeline=True,
            step_timeout=options["step_timeout"],
        )  # fmt: skip
        optimizer = None
        x = y = None
    else:
        model = mlp(options["blocks"], options["width"], seed=0).to(device)
        runner = PipelineRunner.from_sequential(schedule, model, nn.MSELoss(), record_timeline=record,
                                                step_timeout=options["step_timeout"])  # fmt: skip
        parameters = runner.parameters()
        optimizer = torch.optim.SGD(parameters, lr=options["lr"])
        generator = torch.Generator().manual_seed(1)
        teacher = (
            torch.randn(options["width"], options["width"], generator=generator)
            / options["width"] ** 0.5
        )
        x = torch.randn(options["batch"], options["width"], generator=generator)
        y = torch.tanh(x @ teacher)
        x, y = x.to(device), y.to(device)
    losses, seconds = [], []
    progress = None
    if rank == 0:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"),
                            TimeElapsedColumn())  # fmt: skip
        progress.start()
        task = progress.add_task(
            f"{schedule.name} on {world} ranks", total=options["steps"], status=""
        )
    timeline = None
    for _ in range(options["steps"]):
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        loss = runner.step(x, y)
        if optimizer is not None:
            optimizer.step()
        seconds.append(time.perf_counter() - start)
        if record:
            timeline = runner.timeline()
        if loss is not None:
            losses.append(float(loss))
        if progress is not None:
            status = f"step {seconds[-1] * 1e3:.1f} ms" + (
                f"  loss {losses[-1]:.5f}" if losses else ""
            )
            progress.update(task, advance=1, status=status)
    if progress is not None:
        progress.stop()
    runner.close()
    result: dict[str, Any] = {"losses": losses, "seconds": seconds}
    if rank == 0 and timeline is not None:
        if options["trace"]:
            timeline.save(options["trace"])
        result["timeline"] = timeline.to_dict()
    return result


def _schedule(args: argparse.Namespace) -> str:
    """The schedule the run uses: a name, or the path of --from (``resolve_schedule`` reads it)."""
    if args.schedule_file is None:
        return args.schedule
    from cutpipe.train.options import is_schedule_file

    if not is_schedule_file(args.schedule_file):
        raise ValueError(f"--from {args.schedule_file}: name a .json or .csv schedule file")
    return os.path.abspath(args.schedule_file)


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The run ``--model`` asks for, checked."""
    from cutpipe.train.options import TrainOptions

    return TrainOptions(
        model=args.model, schedule=_schedule(args), steps=args.steps, microbatches=args.microbatches,
        batch=args.batch, seq_len=args.seq_len, data=tuple(args.data), seed=args.seed,
        lr=3e-3 if args.lr is None else args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
        grad_accum=args.grad_accum, dtype=args.dtype, recompute=args.recompute,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep=args.keep, resume=args.resume, log=None if args.log is None else str(args.log),
        profile_steps=args.profile_steps, profile_dir=args.profile_dir,
        step_timeout=args.step_timeout, backend=args.backend, quiet=args.quiet, dp=args.dp,
        dp_mode=args.dp_mode, step_boundary=args.step_boundary, skip_nonfinite=args.skip_nonfinite,
    )  # fmt: skip


def run_model(args: argparse.Namespace) -> int:
    """Train ``--model``: as a worker under torchrun, or by starting the workers."""
    from cutpipe.launch.elastic import Launch, LaunchFailed, is_worker, run_workers
    from cutpipe.train.options import resolve_schedule

    options = train_options(args)
    if is_worker():
        from torch.distributed.elastic.multiprocessing.errors import record

        from cutpipe.doctor.report import startup_warnings
        from cutpipe.train.trainer import train

        if os.environ.get("LOCAL_RANK") == "0":  # once per node, however it was launched
            for line in startup_warnings():  # torchrun's variables give the node count
                print(line, file=sys.stderr, flush=True)

        report(record(train)(options))  # record: the agent reports this worker's error
        return 0
    if args.emulate or args.trace:
        raise ValueError("--emulate and --trace run the toy model: drop --model, or drop them")
    if args.nproc is None:
        raise ValueError("give the number of processes: --nproc N")
    from cutpipe.model_config import load_model_config

    load_model_config(options.model)  # a broken model file fails here, once
    # a shape the schedule refuses, or a file for other ranks, fails here, once
    processes = args.nproc * args.nnodes
    if processes % options.dp:
        raise ValueError(
            f"{processes} processes do not split into --dp {options.dp} replicas: start a "
            f"multiple of {options.dp} (--nproc x --nnodes)"
        )
    resolve_schedule(options.schedule, processes // options.dp, options.microbatches)
    for path in options.data:
        if not os.path.exists(path):
            raise ValueError(f"--data {path}: no such file or folder")
    require_torch()
    plan = Launch(
        nproc=args.nproc, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id, max_restarts=args.max_restarts, timeout=args.timeout,
    )  # fmt: skip
    try:
        run_workers(args.argv, plan)
    except LaunchFailed as failure:
        print(f"cutpipe train: {failure}", file=sys.stderr)
        return 1
    return 0


def report(result: dict[str, Any]) -> None:
    """Rank 0's summary of a finished run: loss against what a context-free model can reach."""
    if result["rank"] != 0 or not result["records"]:
        return
    records = result["records"]
    speeds = sorted(r["tokens_per_s"] for r in records[1:] or records)
    line = (
        f"{records[-1]['step']} steps: loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} "
        f"nats/token (the corpus's unigram entropy: {result['entropy']:.4f}); "
        f"median {speeds[len(speeds) // 2]:,.0f} tokens/s"
    )
    if result["resumed_from"] is not None:
        line += f"; resumed after step {result['resumed_from']}"
    if result["checkpoint_stall"]:
        stalls = sorted(result["checkpoint_stall"])
        line += f"; checkpoint stall median {stalls[len(stalls) // 2] * 1e3:.1f} ms"
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        return run_model(args)
    from rich.console import Console
    from rich.table import Table

    from cutpipe.launch.local import LaunchError, spawn
    from cutpipe.sim import Costs, Timeline, metrics, simulate

    options = _options(args)
    timeout = 600.0 if args.timeout is None else args.timeout
    outcomes = spawn(train_rank, args.nproc, (options,), backend=args.backend, timeout=timeout)
    if not all(o.ok for o in outcomes):
        failure = LaunchError(outcomes)
        print(f"cutpipe train: {failure.summary}", file=sys.stderr)
        if getattr(args, "debug", False) or os.environ.get("CUTPIPE_DEBUG") == "1":
            print(failure, file=sys.stderr)
        else:
            print("cutpipe train: run with --debug for every rank's log", file=sys.stderr)
        return 1
    first = outcomes[0].result
    console = Console()
    steady = first["seconds"][1:] or first["seconds"]
    summary = f"{options['steps']} steps, median step {statistics.median(steady) * 1e3:.1f} ms"
    if first["losses"]:
        summary += f", loss {first['losses'][0]:.5f} -> {first['losses'][-1]:.5f}"
    console.print(summary)
    if args.emulate:
        measured = Timeline.from_dict(first["timeline"])
        costs = options["costs"] or Costs()
        got, want = metrics(measured, costs), metrics(simulate(measured.schedule, costs), costs)
        unit = options["time_unit"]
        table = Table(title="emulated step: measured beside the simulator")
        for column in ("", "measured", "simulated"):
            table.add_column(column, justify="right")
        table.add_row("makespan (cost units)", fmt(got.makespan / unit, 3), fmt(want.makespan, 3))
        table.add_row("bubble ratio", fmt(got.bubble_ratio), fmt(want.bubble_ratio))
        table.add_row(
            "bubble ratio (span)", fmt(got.bubble_ratio_span), fmt(want.bubble_ratio_span)
        )
        for r in range(measured.num_ranks):
            table.add_row(
                f"rank {r} idle (units)",
                fmt(got.idle_per_rank[r] / unit, 3),
                fmt(want.idle_per_rank[r], 3),
            )
        console.print(table)
    if args.trace:
        console.print(f"measured timeline written to {args.trace}")
    return 0
