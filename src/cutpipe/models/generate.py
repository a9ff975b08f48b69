"""Text from a model, on one process: sampling one token at a time.

Each new token runs the whole window again: no key-value cache, which keeps the model the one
that was trained, at a cost that only matters for long outputs of large models. The window is
the trained sequence length: older tokens fall out of it. ``cutpipe.train.trained`` reads a
trained model to sample from (``cutpipe generate``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How each next token is picked: the most likely (``temperature`` 0), or drawn from the
    distribution at ``temperature``, restricted to the ``top_k`` most likely when given."""

    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    window: int,
    sampling: Sampling = Sampling(),
    stop: int | None = None,
) -> list[int]:
    """The tokens ``model`` continues ``prompt`` with (at most ``max_new_tokens``; fewer when
    it produces ``stop``, which is kept), each from the last ``window`` tokens."""
    if not prompt:
        raise ValueError("the prompt holds no tokens: give some text")
    model.eval()
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([tokens[-window:]], dtype=torch.long)
        logits = model(context)[0][0, -1].float()
        token = _pick(logits, sampling, generator)
        tokens.append(token)
        new.append(token)
        if token == stop:
            break
    return new


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature == 0:
        return int(logits.argmax())
    if sampling.top_k is not None and sampling.top_k < logits.numel():
        kept = logits.topk(sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kept, float("-inf"))
    probabilities = (logits / sampling.temperature).softmax(-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
