"""The runner's own cost per op, in one process: plain autograd against a one-rank runner.

`benchmarks/train_efficiency.py` finds a pipeline's ops slower than the same work in one
process. This separates what the runner adds from what sharing the machine costs: one process
(one thread) steps the model of that benchmark through its microbatches with plain autograd,
with a one-rank runner holding the model as one stage (1F1B), and with one holding it as two
stages (interleaved, two chunks: a boundary value handed over and a backward split between
them), alternating in rounds; it prints each one's median step and its ratio to autograd's
(medians of the round-by-round ratios, the first round dropped).

    python benchmarks/runner_vs_autograd.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from train_efficiency import MICROBATCHES, MODEL

from cutpipe.models.transformer import LanguageModelLoss, language_model
from cutpipe.runtime.runner import PipelineRunner
from cutpipe.schedule import generate
from cutpipe.spec import ModelSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec(**MODEL)
    loss_fn = LanguageModelLoss()
    batch = MICROBATCHES * spec.microbatch_size
    tokens = torch.randint(
        spec.vocab, (batch, spec.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    plain = language_model(spec, seed=0)
    one_stage = PipelineRunner.from_module(
        generate("1f1b", 1, MICROBATCHES), language_model(spec, seed=0), loss_fn
    )
    two_stages = PipelineRunner.from_module(
        generate("interleaved", 1, MICROBATCHES, chunks=2), language_model(spec, seed=0), loss_fn
    )

    def autograd_step() -> None:
        plain.zero_grad(set_to_none=True)
        for chunk_inputs, chunk_targets in zip(
            inputs.chunk(MICROBATCHES), targets.chunk(MICROBATCHES), strict=True
        ):
            (loss_fn(plain(chunk_inputs), chunk_targets) / MICROBATCHES).backward()

    def runner_step(runner: PipelineRunner) -> Callable[[], None]:
        def step() -> None:
            for parameter in runner.parameters():
                parameter.grad = None
            runner.step(inputs, targets)

        return step

    ways = {
        "plain autograd": autograd_step,
        "runner, one stage": runner_step(one_stage),
        "runner, two stages on one rank": runner_step(two_stages),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, step in ways.items():
            began = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - began)
    table = Table(
        title=f"{spec.name}, {batch} sequences in {MICROBATCHES} microbatches, one thread; "
        f"{args.rounds} alternating rounds, the first dropped"
    )
    for column in ("way", "median step (s)", "/ plain autograd"):
        table.add_column(column, justify="left" if column == "way" else "right")
    base = times["plain autograd"][1:]
    for name, each in times.items():
        ratio = statistics.median(t / b for t, b in zip(each[1:], base, strict=True))
        table.add_row(name, f"{statistics.median(each[1:]):.3f}", f"{ratio:.3f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
