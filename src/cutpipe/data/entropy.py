"""The unigram entropy of a corpus: the loss a model that ignores context cannot beat.

A model that predicts every token from no context at best predicts the tokens' frequencies, and
its cross-entropy is then the entropy of those frequencies, ``-sum p log p``. The trainer prints
it beside the final loss: a loss below it shows the model uses context; a loss at it, that the
model learned only which bytes are common.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

#: Tokens widened to int64 at a time to count them.
_BLOCK = 2**22

if TYPE_CHECKING:
    import torch

    from cutpipe.data.tokens import Tokens


def unigram_entropy(tokens: torch.Tensor | Tokens | bytes) -> float:
    """The entropy of the tokens' frequencies, in nats per token (``nats_to_bits`` for bits)."""
    import torch

    from cutpipe.data.tokens import Tokens

    if isinstance(tokens, (bytes, bytearray)):
        empty = torch.empty(0, dtype=torch.uint8)
        values = torch.frombuffer(bytearray(tokens), dtype=torch.uint8) if tokens else empty
    elif isinstance(tokens, Tokens):
        values = tokens.values
    else:
        values = tokens.flatten()
    if values.numel() == 0:
        raise ValueError("the entropy of no tokens is undefined: give at least one token")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(f"tokens must be integers, got {values.dtype}")
    if values.dtype == torch.uint8:
        counts = torch.bincount(values)
    else:  # widened a block at a time: a uint16 corpus as int64 would take four times its size
        counts = torch.zeros(0, dtype=torch.int64)
        for start in range(0, values.numel(), _BLOCK):
            block = values[start : start + _BLOCK].long()
            if int(block.min()) < 0:
                raise ValueError("tokens must be >= 0: a token is an index into the vocabulary")
            found = torch.bincount(block)
            if found.numel() > counts.numel():
                found[: counts.numel()] += counts
                counts = found
            else:
                counts[: found.numel()] += found
    shares = counts[counts > 0].double() / values.numel()
    return max(0.0, float(-(shares * shares.log()).sum()))


def nats_to_bits(nats: float) -> float:
    """Bits per token from nats per token."""
    return nats / math.log(2)
