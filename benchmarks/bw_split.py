"""What the B/W split costs: B (input gradients) + W (weight gradients) against one full backward.

A stage of ``--blocks`` Linear(width) + tanh blocks runs a forward, then either PyTorch's own full
backward (plain ``nn.Linear`` autograd), or cutpipe's split: B with the weight gradients deferred,
then W computing them. Same inputs, same output gradient; rounds alternate between the two; the
medians and their ratio are printed. Target: (B + W) / full <= 1.15.

    python benchmarks/bw_split.py [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cutpipe.models import mlp
from cutpipe.runtime.split import WeightGradients, WeightSplitter

CASES = [(128, 8), (128, 64), (1024, 8), (1024, 64), (2048, 32)]  # (width, rows per microbatch)


def measure(width: int, rows: int, blocks: int, reps: int) -> tuple[float, float, float]:
    stage = mlp(blocks, width)
    splitter = WeightSplitter(stage)
    x = torch.randn(rows, width)
    grad = torch.randn(rows, width)
    full, backward, weight = [], [], []
    for _ in range(reps):
        inputs = x.clone().requires_grad_()
        out = stage(inputs)  # plain nn.Linear forward: what a full BW differentiates
        start = time.perf_counter()
        out.backward(grad)
        full.append(time.perf_counter() - start)

        gradients = WeightGradients()
        inputs = x.clone().requires_grad_()
        with splitter.deferring(gradients):
            out = stage(inputs)
        gradients.defer = True
        start = time.perf_counter()
        out.backward(grad)
        middle = time.perf_counter()
        gradients.run()
        end = time.perf_counter()
        backward.append(middle - start)
        weight.append(end - middle)
    splitter.close()
    return statistics.median(full), statistics.median(backward), statistics.median(weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.blocks} x Linear(width)+tanh, median of {args.reps}, one thread")
    for column in ("width", "rows", "full BW ms", "B ms", "W ms", "(B+W) / full"):
        table.add_column(column, justify="right")
    for width, rows in CASES:
        full, b, w = measure(width, rows, args.blocks, args.reps)
        table.add_row(str(width), str(rows), f"{full * 1e3:.3f}", f"{b * 1e3:.3f}", f"{w * 1e3:.3f}",
                      f"{(b + w) / full:.2f}")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
