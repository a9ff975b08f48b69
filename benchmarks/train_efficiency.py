"""Training efficiency: `cutpipe train` on R processes against one process doing the same work.

One process (one thread) trains the model with plain autograd and AdamW on the global batch
(the faster of all at once and the run's microbatches accumulated); `cutpipe train --nproc R`
(one thread per worker) trains the same model on the same global batch in M microbatches with
each schedule. Efficiency is tokens/s over R times the one process's. Beside it, the simulator
fed every op's duration each step measured (the log's `replay_ms`, `cutpipe.sim.fit.replayed`:
no transfer time, no overhead) gives the efficiency the schedule allows with those ops;
"measured / simulated" is the median over steps of the replay over the whole step. The measured
step splits into four factors whose product is about the efficiency (medians over steps):

- ops: the one process's step over the pipeline's summed op time (per-op overhead: smaller ops,
  the B/W split, transfers' copies);
- bubble: the ranks' summed op time over R x the simulated step (bubble and imbalance);
- runtime: the simulated step over the measured pipeline step (latency between ops);
- outside: the pipeline step over the whole step (data, loss, gradient norm, optimizer...).

Rounds alternate the runs, and each figure is the median over rounds ("rounds": the lowest and
highest efficiency of one round). Each run's efficiency is against the one process measured just
before it, so a neighbour's load that comes and goes moves both alike. Before the runs, R copies
of the one process run side by side: their step over the lone one's is the contention of R busy
cores sharing this machine's memory system and frequency, the part of "ops" no runtime can win
back.

    python benchmarks/train_efficiency.py [--ranks 2 4] [--schedules 1f1b zbv] [--steps 6]
        [--rounds 2] [--balance measured nominal] [--model examples/models/tiny-moe.yaml --ep 2]
        [--global-batch 32]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cutpipe.models.transformer import LanguageModelLoss, language_model
from cutpipe.sim import Timeline
from cutpipe.spec import ModelSpec

#: the model of issue 32: 8 layers, hidden 256, sequences of 128 bytes
MODEL = {
    "name": "efficiency-8l", "layers": 8, "hidden": 256, "heads": 4, "ffn": 768, "vocab": 256,
    "seq_len": 128, "microbatch_size": 8, "dtype": "fp32",
}  # fmt: skip
MICROBATCHES = 8
SCHEDULES = ("1f1b", "interleaved", "zbh1", "zbh2", "zbv", "dualpipev", "dualpipe")


def one_process_steps(
    spec: ModelSpec, batch: int, steps: int, pieces: int, start: Barrier | None = None
) -> list[float]:
    """Seconds per step of one process (one thread) training the whole model on the batch in
    ``pieces`` accumulated microbatches, after the first step (it allocates). ``start``: wait
    there before timing, to run side by side with other copies."""
    torch.set_num_threads(1)
    model = language_model(spec, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = LanguageModelLoss()
    generator = torch.Generator().manual_seed(0)
    if start is not None:
        start.wait()
    times = []
    for _ in range(steps):
        tokens = torch.randint(spec.vocab, (batch, spec.seq_len + 1), generator=generator)
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for chunk in tokens.chunk(pieces):
            (loss_fn(model(chunk[:, :-1]), chunk[:, 1:]) / pieces).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return times[1:]


def faster_pieces(spec: ModelSpec, batch: int, steps: int) -> int:
    """The one process's faster way: the whole batch at once or the run's microbatches (of the
    model's size) accumulated (on a CPU, small microbatches can be the faster: their
    activations stay in cache)."""
    return min(
        (1, max(1, batch // spec.microbatch_size)),
        key=lambda pieces: statistics.median(one_process_steps(spec, batch, steps, pieces)),
    )


def _copy(spec: ModelSpec, batch: int, steps: int, pieces: int, start: Barrier, out) -> None:
    out.put(statistics.median(one_process_steps(spec, batch, steps, pieces, start)))


def side_by_side(spec: ModelSpec, batch: int, steps: int, pieces: int, copies: int) -> float:
    """The median step of ``copies`` one-process runs started together, one per process."""
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(copies), context.Queue()
    workers = [
        context.Process(target=_copy, args=(spec, batch, steps, pieces, start, out))
        for _ in range(copies)
    ]
    for worker in workers:
        worker.start()
    medians = [out.get(timeout=1800) for _ in workers]
    for worker in workers:
        worker.join()
    return statistics.median(medians)


def pipeline_run(model: Path, schedule: str, ranks: int, ep: int, batch: int, steps: int,
                 balance: str, folder: Path) -> dict:  # fmt: skip
    """One `cutpipe train` run: its records and its last step's measured timeline."""
    metrics, trace = folder / "metrics.jsonl", folder / "trace.json"
    command = [
        sys.executable, "-m", "cutpipe", "train", "--nproc", str(ranks * ep), "-s", schedule,
        "--ep", str(ep), "--model", str(model), "-m", str(MICROBATCHES), "--global-batch", str(batch),
        "--steps", str(steps), "--metrics", str(metrics), "--trace", str(trace), "--quiet",
        "--balance", balance,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"records": records, "timeline": Timeline.load(trace)}


def factors(run: dict, ranks: int, ep: int) -> dict[str, float]:
    """The run's efficiency (over its ``ranks`` x ``ep`` processes) and its four factors.

    Every step's record carries its replay (``replay_ms``: the simulator fed that step's
    measured op durations), so "simulated", "runtime", "outside" and "measured / simulated" are
    medians over the steps after the first. "ops" and "bubble" need the ops themselves: they are
    from the last step's timeline (one pipeline's: each of the ``ep`` pipelines does the same
    share of the work), scaled to the median step's replay.
    """
    one_step = run["one_step"]
    steady = run["records"][1:] or run["records"][-1:]
    last = run["records"][-1]
    timeline: Timeline = run["timeline"]
    busy = sum(end - start for rank in range(timeline.num_ranks)
               for _, start, end in timeline.events(rank))  # fmt: skip
    busy *= statistics.median(r["replay_ms"] for r in steady) / last["replay_ms"]

    def median(value) -> float:
        return statistics.median(value(r) for r in steady)

    processes = ranks * ep
    simulated = median(lambda r: r["replay_ms"]) / 1e3
    return {
        "efficiency": one_step / (processes * median(lambda r: r["step_time"])),
        "simulated": one_step / (processes * simulated),
        "measured / simulated": median(lambda r: r["replay_ms"] / (1e3 * r["step_time"])),
        "ops": one_step / (ep * busy),
        "bubble": busy / (ranks * simulated),
        "runtime": median(lambda r: r["replay_ms"] / r["pipeline_ms"]),
        "outside": median(lambda r: r["pipeline_ms"] / (1e3 * r["step_time"])),
        "tokens/s": median(lambda r: r["tokens_per_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="a model file (default: 8 layers, hidden 256, microbatches of 8)"
    )
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel replicas (MoE models)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pipeline ranks")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--balance", nargs="+", default=["measured"],
                        choices=("measured", "nominal"))  # fmt: skip
    parser.add_argument("--global-batch", type=int,
                        help="sequences per step (default: M of the model's microbatches per pipeline)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is dropped)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if args.model is None:
            model = Path(scratch) / "model.json"
            model.write_text(json.dumps(MODEL))
        else:
            model = Path(args.model)
        spec = ModelSpec.load(model)
        # every pipeline runs M of the model's microbatches: 64 sequences for the default model
        batch = args.global_batch or MICROBATCHES * spec.microbatch_size * args.ep
        pieces = faster_pieces(spec, batch, args.steps)
        contention = {
            processes: side_by_side(spec, batch, args.steps, pieces, processes)
            / statistics.median(one_process_steps(spec, batch, args.steps, pieces))
            for processes in sorted({min(ranks * args.ep, os.cpu_count() or 1)
                                     for ranks in args.ranks})
            if processes > 1
        }  # fmt: skip
        results: dict[tuple, list[dict]] = {}
        one: list[float] = []
        for round_ in range(args.rounds):
            for ranks in args.ranks:
                for schedule in args.schedules:
                    for balance in args.balance:
                        folder = Path(scratch) / f"{round_}-{ranks}-{schedule}-{balance}"
                        folder.mkdir()
                        one_step = statistics.median(
                            one_process_steps(spec, batch, args.steps, pieces)
                        )
                        one.append(one_step)
                        run = pipeline_run(
                            model, schedule, ranks, args.ep, batch, args.steps, balance, folder
                        )
                        results.setdefault((ranks, schedule, balance), []).append(
                            {**run, "one_step": one_step}
                        )
    one_step = statistics.median(one)
    ep = f" x EP {args.ep}" if args.ep > 1 else ""
    side = ", ".join(f"{n} side by side {c:.2f}x" for n, c in contention.items())
    table = Table(
        title=f"{spec.name}{ep}, global batch {batch} in {MICROBATCHES} microbatches per "
        f"pipeline; one process: {one_step:.2f} s per step (in {pieces} pieces), "
        f"{batch * spec.seq_len / one_step:,.0f} tokens/s ({side}); medians of {args.rounds} rounds"
    )
    columns = ("ranks", "schedule", "balance", "tokens/s", "efficiency", "rounds", "simulated",
               "measured / simulated", "ops", "bubble", "runtime", "outside")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("schedule", "balance") else "right")
    for (ranks, schedule, balance), runs in results.items():
        each = [factors(run, ranks, args.ep) for run in runs]
        median = {key: statistics.median(e[key] for e in each) for key in each[0]}
        spread = [e["efficiency"] for e in each]
        table.add_row(
            f"{ranks}{ep}", schedule, balance, f"{median['tokens/s']:,.0f}",
            f"{median['efficiency']:.2f}", f"{min(spread):.2f}-{max(spread):.2f}",
            *(f"{median[key]:.2f}" for key in columns[6:]),
        )  # fmt: skip
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
