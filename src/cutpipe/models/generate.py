"""Text from a trained model, on one process: sampling one token at a time.

The model is a ``LanguageModel`` read whole from a training checkpoint (its run record says
what was trained: ``cutpipe.train.resume.run_record``) or from a Hugging Face folder
(``cutpipe export --format hf`` writes one). Each new token runs the whole window again: no
key-value cache, which keeps the model the one that was trained, at a cost that only matters
for long outputs of large models. The window is the trained sequence length: older tokens fall
out of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cutpipe.spec import ModelSpec


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


@dataclass(frozen=True)
class Codec:
    """How text becomes a model's tokens and back, and the token that ends a text (if any);
    ``digest`` names the tokenizer as training runs record it (``"bytes"``, or its SHA-256)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    stop: int | None = None
    digest: str = "bytes"


def byte_codec() -> Codec:
    """Byte tokens, as ``cutpipe train`` reads text by default."""
    return Codec(
        lambda text: list(text.encode()),
        lambda tokens: bytes(t for t in tokens if t < 256).decode(errors="replace"),
    )


@dataclass(frozen=True)
class Trained:
    """A trained model ready to sample from, the codec it is read with, and the tokenizer its
    run recorded (None: not recorded)."""

    model: torch.nn.Module
    spec: ModelSpec
    codec: Codec
    tokenizer: str | None = None

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)

    @property
    def stop(self) -> int | None:
        return self.codec.stop


def from_checkpoint(path: str | Path, codec: Codec | None = None, note: Any = None) -> Trained:
    """The model of a training checkpoint (a ``--checkpoint-dir``, or one step folder in it),
    built from its run record: no model file needed."""
    from cutpipe.models.router import RoutingOptions
    from cutpipe.models.transformer import language_model
    from cutpipe.train.checkpoint.export import model_and_record

    state, extra = model_and_record(path, note)
    record = extra.get("run")
    if not record or not isinstance(record.get("model"), dict):
        raise ValueError(
            f"the checkpoint {path} records no model (an older cutpipe, or not a cutpipe train "
            "checkpoint): export it and generate from the exported folder"
        )
    if "blocks" in record["model"] and "width" in record["model"]:
        raise ValueError(f"the checkpoint {path} is of the example MLP, which makes no text")
    spec = ModelSpec.from_dict(
        {**record["model"], "name": Path(path).name, "seq_len": record["seq_len"]}, str(path)
    )
    bias = bool(record.get("routing_bias")) or any(k.endswith(".routing_bias") for k in state)
    model = language_model(spec, routing=RoutingOptions(bias=bias))
    model.load_state_dict(state)
    return Trained(model, spec, codec or byte_codec(), record.get("tokenizer", "bytes"))


def from_hf_folder(folder: str | Path, codec: Codec | None = None) -> Trained:
    """The model of a Hugging Face folder (``config.json`` and safetensors)."""
    from cutpipe.model_config import load_model_config
    from cutpipe.models.hf import load_hf_weights
    from cutpipe.models.transformer import language_model

    spec = load_model_config(folder)
    model = language_model(spec)
    load_hf_weights(model, folder, spec)
    return Trained(model, spec, codec or byte_codec())
