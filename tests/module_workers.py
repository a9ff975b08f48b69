"""Models and per-rank functions for the tests of ``PipelineRunner.from_module`` (spawned
processes import this module)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from cutpipe import generate
from cutpipe.models import LanguageModelLoss, language_model
from cutpipe.runtime import PipelineRunner
from cutpipe.spec import ModelSpec

DENSE = ModelSpec(name="tiny", layers=6, hidden=16, heads=2, ffn=24, vocab=32, seq_len=8)
MOE = ModelSpec(
    name="tiny-moe", layers=6, hidden=16, heads=2, ffn=24, vocab=32, seq_len=8, experts=4,
    top_k=2, shared_experts=1, dense_layers=1, dense_ffn=32, kv_heads=1,
)  # fmt: skip


class Block(nn.Module):
    """A residual block with a norm, a linear layer and a buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.tanh(self.mix(self.norm(x)))


class Tower(nn.Module):
    """A user's own model: a stem, an nn.Sequential body, a ModuleList neck, an output layer;
    its default blocks are ``stem, body.0, ..., body.3, neck.0, neck.1, out``."""

    def __init__(self, width: int = 8, depth: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(4, width)
        self.body = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.neck = nn.ModuleList(Block(width) for _ in range(2))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(self.stem(x))
        for block in self.neck:
            x = block(x)
        return self.out(x)


def build(kind: str, seed: int) -> tuple[nn.Module, nn.Module]:
    """(model, loss function) of one kind: "dense", "moe" or "tower"."""
    if kind == "tower":
        return Tower(seed=seed), nn.MSELoss()
    return language_model(DENSE if kind == "dense" else MOE, seed=seed), LanguageModelLoss()


def batch(kind: str, size: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if kind == "tower":
        return torch.randn(size, 4, generator=generator), torch.randn(size, 3, generator=generator)
    x = torch.randint(0, DENSE.vocab, (size, DENSE.seq_len + 1), generator=generator)
    return x[:, :-1], x[:, 1:]


def reference(model: nn.Module, loss_fn: nn.Module, x, y, m: int) -> float:
    """One process, the microbatches one after the other: gradients of their mean loss."""
    total = 0.0
    for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True):
        loss = loss_fn(model(xi), yi)
        (loss / m).backward()
        total += loss.item()
    return total / m


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def exactness(rank: int, world: int, cases: list[tuple[str, int, str, object]]) -> list[dict]:
    """Each case (schedule, microbatches, model kind, split): one training step through
    ``from_module`` against the single-process reference, gradients matched by name."""
    results = []
    for name, m, kind, split in cases:
        schedule = generate(name, world, m)
        model, loss_fn = build(kind, seed=3)
        twin = copy.deepcopy(model)
        x, y = batch(kind, 2 * m)
        runner = PipelineRunner.from_module(schedule, model, loss_fn, split=split)
        loss = float(runner.step(x, y))
        expected = reference(twin, loss_fn, x, y, m)
        named = runner.named_parameters()
        twins = dict(twin.named_parameters())
        state = runner.state_dict()
        reference_state = twin.state_dict()
        results.append(
            {
                "case": f"{name} R={world} m={m} {kind} split={split}",
                "loss": loss,
                "expected": expected,
                "grad_error": max(relative_error(p.grad, twins[n].grad) for n, p in named.items()),
                "same_objects": all(
                    p is dict(model.named_parameters())[n] for n, p in named.items()
                ),
                "names": sorted(named),
                "state_keys": sorted(state),
                "state_equal": all(torch.equal(v, reference_state[k]) for k, v in state.items()),
                "all_names": sorted(twins),
                "all_state_keys": sorted(reference_state),
            }
        )
        runner.close()
    return results
