"""What the B/W split costs: B (input gradients) + W (weight gradients) against one full backward.

A stage of ``--blocks`` Linear(width) + tanh blocks runs a forward, then either PyTorch's own full
backward (plain ``nn.Linear`` autograd), or cutpipe's split: B with the weight gradients deferred,
then W computing them. Same inputs, same output gradient; rounds alternate between the two; the
medians and their ratio are printed. Target: (B + W) / full <= 1.15. ``--device cuda`` also
times real transformer layers (attention + SwiGLU MLP of ``cutpipe.models``) in bf16 autocast.

    python benchmarks/bw_split.py [--reps 30] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from cutpipe.models import mlp
from cutpipe.models.transformer import Layer
from cutpipe.runtime.compute.deferral import WeightGradients, WeightSplitter
from cutpipe.runtime.stages import Chain
from cutpipe.spec import ModelSpec

CASES = [(128, 8), (128, 64), (1024, 8), (1024, 64), (2048, 32)]  # (width, rows per microbatch)
#: (hidden, heads, tokens per microbatch) of the transformer-layer cases, on CUDA only
LAYER_CASES = [(1024, 16, 4096), (4096, 32, 4096)]


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure(
    stage: nn.Module, x: torch.Tensor, reps: int, autocast: bool = False
) -> tuple[float, float, float]:
    """Median seconds of the full backward, of B and of W for ``stage`` on ``x``; gradients
    accumulate from round to round, as they do over a step's microbatches."""
    device = x.device
    splitter = WeightSplitter(stage)
    cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)

    def forward() -> torch.Tensor:
        with cast:
            out = stage(x.clone().requires_grad_())
        return (out[0] if isinstance(out, tuple) else out).float()

    grad = torch.randn_like(forward())
    full, backward, weight = [], [], []
    for _ in range(reps):
        out = forward()  # plain nn.Linear forward: what a full BW differentiates
        start = clock(device)
        out.backward(grad)
        full.append(clock(device) - start)

        gradients = WeightGradients()
        with splitter.deferring(gradients):
            out = forward()
        gradients.defer = True
        start = clock(device)
        out.backward(grad)
        middle = clock(device)
        gradients.run()
        end = clock(device)
        backward.append(middle - start)
        weight.append(end - middle)
    splitter.close()
    return statistics.median(full), statistics.median(backward), statistics.median(weight)


def layer_stage(hidden: int, heads: int, blocks: int, device: torch.device) -> nn.Module:
    spec = ModelSpec(name="bench", layers=blocks, hidden=hidden, heads=heads, ffn=4 * hidden,
                     vocab=256, seq_len=1024)  # fmt: skip
    return _Hidden(Chain(*(Layer(spec, i) for i in range(blocks)))).to(device)


class _Hidden(nn.Module):
    """Transformer layers on a hidden state alone (their ``aux`` starts at zero)."""

    def __init__(self, layers: Chain) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x, torch.zeros((), device=x.device))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.blocks} x Linear(width)+tanh on {device}, median of {args.reps}")
    for column in ("width", "rows", "full BW ms", "B ms", "W ms", "(B+W) / full"):
        table.add_column(column, justify="right")
    for width, rows in CASES:
        stage = mlp(args.blocks, width).to(device)
        full, b, w = measure(stage, torch.randn(rows, width, device=device), args.reps)
        table.add_row(str(width), str(rows), f"{full * 1e3:.3f}", f"{b * 1e3:.3f}", f"{w * 1e3:.3f}",
                      f"{(b + w) / full:.2f}")  # fmt: skip
    Console().print(table)
    if device.type != "cuda":
        return
    table = Table(title=f"{args.blocks} transformer layers, bf16 autocast, median of {args.reps}")
    for column in ("hidden", "tokens", "full BW ms", "B ms", "W ms", "(B+W) / full"):
        table.add_column(column, justify="right")
    for hidden, heads, tokens in LAYER_CASES:
        stage = layer_stage(hidden, heads, args.blocks, device)
        x = torch.randn(tokens // 1024, 1024, hidden, device=device)
        full, b, w = measure(stage, x, args.reps, autocast=True)
        table.add_row(str(hidden), str(tokens), f"{full * 1e3:.3f}", f"{b * 1e3:.3f}", f"{w * 1e3:.3f}",
                      f"{(b + w) / full:.2f}")  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
