"""A trained model ready to sample from (``cutpipe generate``): read whole, on one process, from a
training checkpoint (its run record says what was trained: ``cutpipe.train.resume.run_record``,
so no model file is needed) or from a Hugging Face folder (``cutpipe export --format hf`` writes
one), with the codec that turns text into its tokens and back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cutpipe.spec import ModelSpec


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
    bias = any(name.endswith(".routing_bias") for name in state)  # saved where it exists
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
