"""Hugging Face weights in and out: a model folder's safetensors onto cutpipe's parameters, and
cutpipe's parameters as a folder ``transformers`` loads.

cutpipe's names follow its own modules (``layers.3.attention.q.weight``); a Hugging Face
decoder's follow its family's (``model.layers.3.self_attn.q_proj.weight``; Mixtral's experts
``model.layers.3.block_sparse_moe.experts.6.w1.weight``, Qwen's and DeepSeek's
``model.layers.3.mlp.experts.6.gate_proj.weight``). ``hf_family`` says which family a
``ModelSpec`` is (or why none builds it) and ``hf_names`` maps one name onto the other, tensor
by tensor: one cutpipe tensor is one Hugging Face tensor, except the keys and values, which
cutpipe projects with one matrix (``kv``: ``k_proj`` above ``v_proj``), and a tied head, which is
the embedding. DeepSeek-V3's ``e_score_correction_bias`` is a buffer on both sides (cutpipe's
``routing_bias``).

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
#: DeepSeek's latent attention (``cutpipe.models.latent_attention``)
_LATENT = (
    (r"layers\.(\d+)\.attention\.q_down\.(weight|bias)", "model.layers.{0}.self_attn.q_a_proj.{1}"),
    (
        r"layers\.(\d+)\.attention\.q_down_norm\.weight",
        "model.layers.{0}.self_attn.q_a_layernorm.weight",
    ),
    (r"layers\.(\d+)\.attention\.q_up\.weight", "model.layers.{0}.self_attn.q_b_proj.weight"),
    (
        r"layers\.(\d+)\.attention\.kv_down\.(weight|bias)",
        "model.layers.{0}.self_attn.kv_a_proj_with_mqa.{1}",
    ),
    (
        r"layers\.(\d+)\.attention\.kv_down_norm\.weight",
        "model.layers.{0}.self_attn.kv_a_layernorm.weight",
    ),
    (r"layers\.(\d+)\.attention\.kv_up\.weight", "model.layers.{0}.self_attn.kv_b_proj.weight"),
)
#: Qwen's and DeepSeek's mixture of experts: the router, each expert's projections
_EXPERTS = (
    (r"layers\.(\d+)\.mlp\.router\.weight", "model.layers.{0}.mlp.gate.weight"),
    (
        r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)\.weight",
        "model.layers.{0}.mlp.experts.{1}.{2}_proj.weight",
    ),
)
#: their shared experts (one MLP of the summed width on both sides) and its gate (Qwen2-MoE)
_SHARED = {
    "qwen2_moe": (
        (
            r"layers\.(\d+)\.mlp\.shared\.0\.(gate|up|down)\.weight",
            "model.layers.{0}.mlp.shared_expert.{1}_proj.weight",
        ),
        (
            r"layers\.(\d+)\.mlp\.shared_gate\.weight",
            "model.layers.{0}.mlp.shared_expert_gate.weight",
        ),
    ),
    "deepseek_v2": (
        (
            r"layers\.(\d+)\.mlp\.shared\.0\.(gate|up|down)\.weight",
            "model.layers.{0}.mlp.shared_experts.{1}_proj.weight",
        ),
    ),
}
_SHARED["deepseek_v3"] = (
    *_SHARED["deepseek_v2"],
    (r"layers\.(\d+)\.mlp\.routing_bias", "model.layers.{0}.mlp.gate.e_score_correction_bias"),
)
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
    """The Hugging Face tensors that make cutpipe's parameter (or buffer) ``name``, in the order
    they are stacked (keys, then values, for ``kv``)."""
    family = hf_family(spec)
    if name == "head.out.weight" and spec.tie_embeddings:
        return ["model.embed_tokens.weight"]
    kv = _KV.fullmatch(name)
    if kv is not None:
        layer, kind = kv.groups()
        return [f"model.layers.{layer}.self_attn.{p}_proj.{kind}" for p in ("k", "v")]
    patterns: tuple[tuple[str, str], ...] = _RENAMES
    if family == "mixtral":
        patterns += _MIXTRAL
    elif spec.moe:
        patterns += _EXPERTS + _SHARED.get(family, ())
    if spec.latent_attention:
        patterns += _LATENT
    for pattern, hf in patterns:
        match = re.fullmatch(pattern, name)
        if match is not None:
            return [hf.format(*match.groups())]
    raise ValueError(f"no Hugging Face name for cutpipe's {name!r} ({family})")


def hf_family(spec: ModelSpec) -> str:
    """The Hugging Face family (``model_type``) that builds ``spec``'s layers, or a ValueError
    that says what none of them builds. Dense models are Llama's, Qwen2's (query/key/value
    biases only) or Qwen3's (query/key norms); mixtures of experts Mixtral's (every layer routed,
    renormalised, nothing shared), Qwen2-MoE's (gated shared experts), Qwen3-MoE's (query/key
    norms, nothing shared) or DeepSeek's (latent attention: V3 with sigmoid scoring, V2 with
    softmax)."""
    if not spec.gated_mlp:
        return _none(spec, "the Hugging Face families export gated MLPs")
    routed_like_deepseek = spec.router_scoring == "sigmoid" or spec.router_scale != 1.0
    if spec.latent_attention:
        if not spec.moe:
            return _none(spec, "latent attention without experts (DeepSeek's have experts)")
        if spec.shared_expert_gate or spec.qk_norm:
            return _none(spec, "DeepSeek has no shared-expert gate and no query/key norms")
        if spec.router_scoring == "sigmoid":
            return "deepseek_v3"
        if spec.router_norm:
            return _none(spec, "DeepSeek-V2 does not normalise the chosen experts' weights")
        return "deepseek_v2"
    if routed_like_deepseek or spec.router_groups:
        return _none(
            spec, "DeepSeek's routing (sigmoid, groups, scale) comes with its latent attention"
        )
    if not spec.moe:
        return (
            "qwen3" if spec.qk_norm else "qwen2" if spec.qkv_bias and not spec.o_bias else "llama"
        )
    if spec.shared_expert_gate or spec.shared_experts:
        if not spec.shared_expert_gate or spec.qk_norm:
            return _none(
                spec, "shared experts come with Qwen2-MoE's gate or DeepSeek's latent attention"
            )
        return "qwen2_moe"
    if spec.qk_norm:
        return "qwen3_moe"
    if spec.router_norm and not spec.dense_layers:
        return "mixtral"
    return _none(
        spec, "a mixture of experts without shared experts or query/key norms is Mixtral's: "
        "every layer routed, the chosen weights normalised"
    )  # fmt: skip


def _none(spec: ModelSpec, why: str) -> str:
    raise ValueError(f"model {spec.name!r}: no Hugging Face family builds it: {why}")


def hf_buffers(module: nn.Module, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """The buffers of ``module`` that Hugging Face weights hold (DeepSeek-V3's correction bias)."""
    if hf_family(spec) != "deepseek_v3":
        return []
    return [(n, b) for n, b in module.named_buffers() if n.endswith("mlp.routing_bias")]


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
        tensors = [*module.named_parameters(remove_duplicate=False), *hf_buffers(module, spec)]
        for name, parameter in tensors:
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


#: Each family's architecture name in ``config.json``.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}  # fmt: skip


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` of ``spec`` as the Hugging Face family that builds it
    (``hf_family``)."""
    family = hf_family(spec)
    qkv_only = family in ("qwen2", "qwen2_moe")
    if family in ("mixtral", "deepseek_v2", "deepseek_v3") and spec.qk_norm:
        raise ValueError(f"model {spec.name!r}: {family} has no query/key norms")
    if family == "mixtral" and (spec.qkv_bias or spec.o_bias):
        raise ValueError(f"model {spec.name!r}: Mixtral has no attention biases")
    if not qkv_only and spec.qkv_bias != spec.o_bias:
        raise ValueError(
            f"model {spec.name!r}: no Hugging Face family has these attention biases "
            f"(qkv_bias={spec.qkv_bias}, o_bias={spec.o_bias})"
        )
    if qkv_only and spec.o_bias:
        raise ValueError(f"model {spec.name!r}: {family} has no bias on the output projection")
    if not spec.rope_theta:
        raise ValueError(
            f"model {spec.name!r} has no position encoding (rope_theta 0), which no Hugging Face "
            "family builds: give it rope_theta to export it"
        )
    rope: dict[str, Any] = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
    if spec.rope_type != "default":
        rope["factor"] = spec.rope_factor
    if spec.rope_type == "llama3":
        rope.update(
            low_freq_factor=spec.rope_low_freq_factor,
            high_freq_factor=spec.rope_high_freq_factor,
            original_max_position_embeddings=spec.rope_original_positions,
        )
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
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
    if qkv_only:
        config["qkv_bias"] = spec.qkv_bias
    else:
        config["attention_bias"] = spec.qkv_bias
    if family == "llama":
        config["mlp_bias"] = spec.mlp_bias
    elif spec.mlp_bias:
        raise ValueError(f"model {spec.name!r}: {family} has no MLP biases")
    if spec.moe:
        config.update(_experts_config(spec, family))
    if spec.latent_attention:
        del config["head_dim"]  # the family's own: qk_rope_head_dim
        config.update(
            q_lora_rank=spec.q_lora_rank or None, kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
        )  # fmt: skip
        if family == "deepseek_v3":
            config["rope_interleave"] = spec.rope_interleave
        elif not spec.rope_interleave:
            raise ValueError(f"model {spec.name!r}: DeepSeek-V2 rotates interleaved pairs")
    return config


def _experts_config(spec: ModelSpec, family: str) -> dict[str, Any]:
    """The mixture-of-experts keys of ``family``'s config."""
    if family == "mixtral":
        return dict(
            num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, sliding_window=None
        )
    config: dict[str, Any] = dict(
        num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.ffn,
        norm_topk_prob=spec.router_norm,
    )  # fmt: skip
    if family in ("qwen2_moe", "qwen3_moe"):
        config.update(
            num_experts=spec.experts, decoder_sparse_step=1,
            mlp_only_layers=list(range(spec.dense_layers)), use_sliding_window=False,
            sliding_window=None,
        )  # fmt: skip
        if family == "qwen2_moe":
            config["shared_expert_intermediate_size"] = spec.shared_experts * spec.ffn
        return config
    groups = (spec.router_groups, spec.router_top_groups) if spec.router_groups else (1, 1)
    config.update(
        n_routed_experts=spec.experts, n_shared_experts=spec.shared_experts,
        first_k_dense_replace=spec.dense_layers, routed_scaling_factor=spec.router_scale,
        n_group=groups[0], topk_group=groups[1],
    )  # fmt: skip
    if family == "deepseek_v2":
        config["topk_method"] = "group_limited_greedy" if spec.router_groups else "greedy"
        config["mlp_bias"] = False
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
