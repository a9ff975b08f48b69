"""Hugging Face weights in and out: a model folder's safetensors onto cutpipe's parameters, and
cutpipe's parameters as a folder ``transformers`` loads.

cutpipe's names follow its own modules (``layers.3.attention.q.weight``); a Hugging Face
decoder's follow its family's (``model.layers.3.self_attn.q_proj.weight``; Mixtral's experts
``model.layers.3.block_sparse_moe.experts.6.w1.weight``). ``hf_names`` maps one
onto the other, parameter by parameter: one cutpipe tensor is one Hugging Face tensor, except the
keys and values, which cutpipe projects with one matrix (``kv``: ``k_proj`` above ``v_proj``), and
a tied head, which is the embedding.

``load_hf_weights`` fills the parameters a module holds (a whole model, or the stages one rank
keeps, named as in the whole model) from a folder's ``*.safetensors``, sharded or not: the files
are memory-mapped and only the tensors those parameters need are read, so no rank ever holds the
whole model. ``save_hf_folder`` writes ``config.json`` and ``model.safetensors`` for a whole
model's state. Both need the ``safetensors`` package (``pip install 'cutpipe[hf]'``).
docs/models.md says which families and keys are built.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cutpipe.spec import ModelSpec

#: cutpipe's name pattern -> the Hugging Face name (``{i}``: the layer)
_RENAMES = (
    (r"embed\.table\.weight", "model.embed_tokens.weight"),
    (r"head\.norm\.weight", "model.norm.weight"),
    (r"head\.out\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"layers\.(\d+)\.mlp_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.(q|o)\.(weight|bias)", "model.layers.{0}.self_attn.{1}_proj.{2}"),
    (r"layers\.(\d+)\.attention\.(q|k)_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)\.(weight|bias)", "model.layers.{0}.mlp.{1}_proj.{2}"),
)
_KV = re.compile(r"layers\.(\d+)\.attention\.kv\.(weight|bias)")
#: Mixtral's mixture of experts: the router and each expert's three projections
_MIXTRAL = (
    (r"layers\.(\d+)\.mlp\.router\.weight", "model.layers.{0}.block_sparse_moe.gate.weight"),
    (r"layers\.(\d+)\.mlp\.experts\.(\d+)\.gate\.weight",
     "model.layers.{0}.block_sparse_moe.experts.{1}.w1.weight"),
    (r"layers\.(\d+)\.mlp\.experts\.(\d+)\.down\.weight",
     "model.layers.{0}.block_sparse_moe.experts.{1}.w2.weight"),
    (r"layers\.(\d+)\.mlp\.experts\.(\d+)\.up\.weight",
     "model.layers.{0}.block_sparse_moe.experts.{1}.w3.weight"),
)  # fmt: skip


def hf_names(name: str, spec: ModelSpec) -> list[str]:
    """The Hugging Face tensors that make cutpipe's parameter ``name``, in the order they are
    stacked (keys, then values, for ``kv``)."""
    _check_mixtral(spec)
    if name == "head.out.weight" and spec.tie_embeddings:
        return ["model.embed_tokens.weight"]
    kv = _KV.fullmatch(name)
    if kv is not None:
        layer, kind = kv.groups()
        return [f"model.layers.{layer}.self_attn.{p}_proj.{kind}" for p in ("k", "v")]
    for pattern, hf in (*_RENAMES, *_MIXTRAL) if spec.moe else _RENAMES:
        match = re.fullmatch(pattern, name)
        if match is not None:
            return [hf.format(*match.groups())]
    raise ValueError(f"no Hugging Face name for cutpipe's parameter {name!r}")


def _check_mixtral(spec: ModelSpec) -> None:
    """Of the mixture-of-experts families, Mixtral's weights map so far: every layer routed, no
    shared experts, the chosen experts' weights normalised (as cutpipe's router does)."""
    if spec.moe and (spec.shared_experts or spec.dense_layers or not spec.gated_mlp):
        raise ValueError(
            f"model {spec.name!r}: of the mixture-of-experts families, Hugging Face weights map "
            "for Mixtral so far (no shared experts, no dense layers); Qwen-MoE's gated shared "
            "experts and DeepSeek's routing are not built yet"
        )


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ValueError(
            "reading Hugging Face weights needs the safetensors package: pip install 'cutpipe[hf]'"
        ) from None
    return safe_open


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Each tensor of a Hugging Face model folder, by name, with the file that holds it (from
    ``model.safetensors.index.json`` when the weights are sharded)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        found = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []
        raise ValueError(
            f"{folder}: no model.safetensors or model.safetensors.index.json (found "
            f"{', '.join(found[:6]) or 'nothing'}): give a Hugging Face model folder"
        )
    with _safe_open()(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118 (not a dict)


@torch.no_grad()
def load_hf_weights(module: nn.Module, folder: str | Path, spec: ModelSpec) -> list[str]:
    """Copy into every parameter of ``module`` (named as in the whole model) its Hugging Face
    tensors from ``folder``; the names loaded. Only those tensors are read, each file mapped."""
    files = weight_files(folder)
    safe_open = _safe_open()
    loaded = []
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}  # each file opened once, mapped
        for name, parameter in module.named_parameters(remove_duplicate=False):
            names, parts = hf_names(name, spec), []
            for hf in names:
                if hf not in files:
                    raise ValueError(
                        f"{folder}: no tensor {hf} (cutpipe's {name}): is this folder the "
                        f"model of {spec.name!r}?"
                    )
                path = files[hf]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                parts.append(handles[path].get_tensor(hf))
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tuple(value.shape) != tuple(parameter.shape):
                raise ValueError(
                    f"{folder}: {', '.join(names)} has shape {tuple(value.shape)}, cutpipe's "
                    f"{name} {tuple(parameter.shape)}: the folder's config and its weights disagree"
                )
            parameter.copy_(value.to(parameter.dtype))
            loaded.append(name)
    return loaded


def hf_state(state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A whole model's state dict under the Hugging Face names (a tied head saved once)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "head.out.weight" and spec.tie_embeddings:
            continue
        names = hf_names(name, spec)
        pieces = tensor.chunk(len(names), dim=0) if len(names) > 1 else (tensor,)
        for hf, piece in zip(names, pieces, strict=True):
            out[hf] = piece.contiguous()
    return out


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` of ``spec`` as the Hugging Face family that builds it: Qwen3 (per-head
    query/key norms), Qwen2 (biases on the query, key and value projections only) or Llama."""
    _check_mixtral(spec)
    if spec.moe:
        family, architecture = "mixtral", "MixtralForCausalLM"
    elif spec.qk_norm:
        family, architecture = "qwen3", "Qwen3ForCausalLM"
    elif spec.qkv_bias and not spec.o_bias:
        family, architecture = "qwen2", "Qwen2ForCausalLM"
    else:
        family, architecture = "llama", "LlamaForCausalLM"
    if family == "mixtral" and (spec.qkv_bias or spec.o_bias or spec.mlp_bias or spec.qk_norm):
        raise ValueError(f"model {spec.name!r}: Mixtral has no biases and no query/key norms")
    if family != "qwen2" and spec.qkv_bias != spec.o_bias:
        raise ValueError(
            f"model {spec.name!r}: no Hugging Face family has these attention biases "
            f"(qkv_bias={spec.qkv_bias}, o_bias={spec.o_bias})"
        )
    if not spec.gated_mlp:
        raise ValueError(f"model {spec.name!r}: the Hugging Face families export gated MLPs")
    rope: dict[str, Any] = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta or 10000.0}
    if spec.rope_type != "default":
        rope["factor"] = spec.rope_factor
    if spec.rope_type == "llama3":
        rope.update(
            low_freq_factor=spec.rope_low_freq_factor,
            high_freq_factor=spec.rope_high_freq_factor,
            original_max_position_embeddings=spec.rope_original_positions,
        )
    if not spec.rope_theta:
        raise ValueError(
            f"model {spec.name!r} has no position encoding (rope_theta 0), which no Hugging Face "
            "family builds: give it rope_theta to export it"
        )
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": family,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.dense_ffn or spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads or spec.heads,
        "head_dim": spec.attention_head_dim,
        "hidden_act": spec.activation,
        "max_position_embeddings": spec.seq_len,
        "rms_norm_eps": spec.norm_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "rope_parameters": rope,
        "dtype": "float32",
    }
    if family == "mixtral":
        config.update(
            num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, sliding_window=None
        )
    elif family != "qwen2":
        config["attention_bias"] = spec.qkv_bias
    if family == "llama":
        config["mlp_bias"] = spec.mlp_bias
    elif spec.mlp_bias:
        raise ValueError(f"model {spec.name!r}: {family} has no MLP biases")
    return config


def save_hf_folder(state: Mapping[str, torch.Tensor], spec: ModelSpec, folder: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a whole model's ``state`` to
    ``folder`` (created), which ``transformers.AutoModelForCausalLM.from_pretrained`` loads."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ValueError(
            "writing a Hugging Face folder needs the safetensors package: pip install 'cutpipe[hf]'"
        ) from None
    config = hf_config(spec)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous() for name, t in hf_state(state, spec).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
