"""Model sizes from a file: a cutpipe model file, or a Hugging Face ``config.json``.

A cutpipe file (YAML or JSON, the fields of ``ModelSpec``) is read as ``ModelSpec.load`` reads
it. A Hugging Face ``config.json`` (Llama, Mistral, Qwen, Mixtral, DeepSeek and alike) is
recognised by its keys and read as JSON only: no network, no weights. The keys read:

- ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``: ``hidden``,
  ``layers``, ``heads``, ``vocab``;
- ``num_key_value_heads``: ``kv_heads`` (grouped key/value heads; absent or null: all heads);
- ``head_dim``: ``head_dim`` where it is not ``hidden_size / num_attention_heads``;
- ``max_position_embeddings``: ``seq_len``, at most the ``max_seq_len`` argument when given;
  the ``seq_len`` argument (``cutpipe train --seq-len``) replaces it, and then it may be absent;
- ``intermediate_size``: ``ffn`` of a dense model, ``dense_ffn`` of an MoE's leading dense
  layers, and each expert's size where ``moe_intermediate_size`` is absent (Mixtral);
- ``n_routed_experts``, ``num_local_experts`` or ``num_experts`` (DeepSeek's, Mixtral's and
  Qwen's spellings, which must agree where several are given): ``experts``;
- ``num_experts_per_tok``: ``top_k``; ``moe_intermediate_size``: ``ffn`` (per routed expert);
- ``n_shared_experts``: ``shared_experts``; ``shared_expert_intermediate_size`` (Qwen): as many
  shared experts as that size holds routed experts' sizes, behind Qwen2-MoE's gate;
- the routing of DeepSeek's and Qwen's MoE families (``_routing``): ``norm_topk_prob``,
  ``routed_scaling_factor``, ``scoring_func``, ``topk_method``, ``n_group``, ``topk_group``;
- DeepSeek's multi-head latent attention (``_latent``): ``q_lora_rank``, ``kv_lora_rank``,
  ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``qk_head_dim`` (checked),
  ``rope_interleave``;
- ``first_k_dense_replace``, or ``mlp_only_layers`` listing the first k layers: ``dense_layers``;
- ``moe_layer_freq`` and ``decoder_sparse_step``: checked, they must be 1 (every layer past the
  dense ones is an MoE);
- how the layers compute (docs/models.md): ``rope_parameters`` (or ``rope_theta`` and
  ``rope_scaling``): the rotary embedding; ``rms_norm_eps``, ``hidden_act``, ``mlp_bias``,
  ``tie_word_embeddings``; ``attention_bias`` (Qwen2's query/key/value biases come with its
  ``model_type``, as Qwen3's query/key norms do); ``partial_rotary_factor`` (must be 1) and
  ``sliding_window`` (must not be shorter than the sequence).

A key a config leaves out (or sets to null) reads as ``transformers`` reads it for the config's
``model_type`` (``FAMILY_DEFAULTS``). Keys that do not change the layers cutpipe builds are
ignored: names and versions, dtypes, initialisation, dropouts, token ids, caching, auxiliary
loss coefficients, the routing keys of families whose ``transformers`` code does not read them,
and DeepSeek's multi-token prediction layers (which ``transformers`` does not build either).
Any other key is an error that names it, as is a pair of keys that contradict each other, so
that a file is never silently misread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from cutpipe.spec import ACTIVATIONS, ROPE_TYPES, MlpSpec, ModelSpec, read_mapping

#: Keys found in every Hugging Face decoder config and in no cutpipe file.
HF_MARKERS = frozenset(
    {"hidden_size", "num_hidden_layers", "num_attention_heads", "model_type", "architectures"}
)
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
#: How the DeepSeek and Qwen MoE families route (``_routing``).
ROUTER_KEYS = (
    "norm_topk_prob", "routed_scaling_factor", "scoring_func", "topk_method", "n_group",
    "topk_group",
)  # fmt: skip
#: Multi-head latent attention's sizes (DeepSeek-V2/V3, ``_latent``).
LATENT_KEYS = (
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "qk_head_dim", "rope_interleave",
)  # fmt: skip
#: What ``transformers`` assumes for a family's key that a config leaves out.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8,
                    "topk_group": 4, "rope_interleave": True},
    "deepseek_v2": {"routed_scaling_factor": 1.0, "topk_method": "greedy"},
    "qwen2_moe": {"norm_topk_prob": False, "qkv_bias": True},
    "qwen3_moe": {"norm_topk_prob": False},
}  # fmt: skip
#: The families whose routing and attention the keys above describe.
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
READ = frozenset(
    {
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", *EXPERT_KEYS,
        "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
        "shared_expert_intermediate_size", "first_k_dense_replace", "mlp_only_layers",
        "moe_layer_freq", "decoder_sparse_step", "rms_norm_eps", "tie_word_embeddings",
        "attention_bias", "mlp_bias", "hidden_act", "rope_theta", "rope_scaling",
        "rope_parameters", "partial_rotary_factor", "sliding_window", "use_sliding_window",
        "qkv_bias", *ROUTER_KEYS, *LATENT_KEYS,
    }
)  # fmt: skip
IGNORED = frozenset(
    {
        "architectures", "model_type", "transformers_version", "_name_or_path", "auto_map",
        "torch_dtype", "dtype", "quantization_config", "initializer_range",
        "layer_norm_eps", "layer_norm_epsilon", "use_cache",
        "pretraining_tp", "max_window_layers", "layer_types",
        "aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits",
        "router_aux_loss_coef", "router_jitter_noise", "router_z_loss_coef",
        "num_nextn_predict_layers", "is_decoder",
    }
)  # fmt: skip
IGNORED_PREFIXES = ("rope_",)
IGNORED_SUFFIXES = ("_token_id", "_dropout", "_dropout_prob")


def load_model_config(
    path: str | Path,
    max_seq_len: int | None = None,
    name: str | None = None,
    seq_len: int | None = None,
) -> ModelSpec:
    """The model of a cutpipe model file or a Hugging Face ``config.json`` (or a directory
    holding one). Its ``seq_len`` is the ``seq_len`` argument when given (what ``cutpipe train
    --seq-len`` sets; a config may then lack ``max_position_embeddings``), else the file's; at
    most ``max_seq_len`` either way when that is given."""
    _check_length("seq_len", seq_len)
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory without a config.json: name the model file")
        path = path / "config.json"
    data = read_mapping(path, "model") if path.suffix in (".yaml", ".yml") else _read_json(path)
    if isinstance(data, Mapping) and data.get("family", "transformer") != "transformer":
        raise ValueError(
            f"{path} is a model of family {data['family']!r}, not a transformer: the planner and "
            "cutpipe profile price transformers (cutpipe train --model takes it)"
        )
    if is_hf_config(data):
        default = path.parent.name if path.name == "config.json" else path.stem
        return spec_from_hf_config(
            data, name or default or "model", max_seq_len, str(path), seq_len=seq_len
        )
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping of model fields")
    spec = ModelSpec.from_dict({"name": path.stem, **data}, str(path))
    if seq_len is not None:
        spec = replace(spec, seq_len=seq_len)
    return _capped(spec if name is None else replace(spec, name=name), max_seq_len)


#: Model families a training model file may name (``family:``); the default is a transformer.
FAMILIES = ("transformer", "mlp")
#: Names ``--model`` takes instead of a file.
PRESETS = {"mlp": MlpSpec}


def load_training_model(
    model: str | Path, max_seq_len: int | None = None, seq_len: int | None = None
) -> ModelSpec | MlpSpec:
    """What ``cutpipe train --model`` trains: a preset (``mlp``), a model file whose ``family``
    is ``mlp``, or a transformer (``load_model_config``) at ``seq_len`` (``--seq-len``) when
    given: a Hugging Face config without ``max_position_embeddings`` needs it."""
    _check_length("seq_len", seq_len)
    if str(model) in PRESETS:
        _no_sequence(model, seq_len)
        return PRESETS[str(model)]()
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"--model {model}: no such file or folder (or preset: {', '.join(PRESETS)})"
        )
    if path.is_file() and path.suffix.lower() in (".yaml", ".yml", ".json"):
        data = read_mapping(path, "model")
        family = data.get("family", "transformer")
        if family not in FAMILIES:
            raise ValueError(f"{path}: family must be one of {', '.join(FAMILIES)}, got {family!r}")
        if family == "mlp":
            _no_sequence(model, seq_len)
            data.setdefault("name", path.stem)
            return MlpSpec.from_dict(data, str(path))
        if "family" in data:
            raise ValueError(f"{path}: drop 'family: transformer' (it is the default)")
    return load_model_config(path, max_seq_len, seq_len=seq_len)


def _no_sequence(model: str | Path, seq_len: int | None) -> None:
    """The example MLP reads no sequences: a sequence length for it is a mistake to name."""
    if seq_len is not None:
        raise ValueError(
            f"--model {model} is the example MLP on synthetic data, which has no sequence "
            "length: drop --seq-len, or train a language model (--model FILE)"
        )


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"cannot read model file {path}: {error.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"model file {path} does not parse as JSON: {error}") from None


def _capped(spec: ModelSpec, max_seq_len: int | None) -> ModelSpec:
    return replace(spec, seq_len=_capped_length(spec.seq_len, max_seq_len))


def _capped_length(seq_len: int, max_seq_len: int | None) -> int:
    _check_length("max_seq_len", max_seq_len)
    return seq_len if max_seq_len is None else min(seq_len, max_seq_len)


def _check_length(name: str, value: int | None) -> None:
    """A sequence length argument is None or a whole number >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def is_hf_config(data: Any) -> bool:
    """Whether ``data`` is a Hugging Face config (by its keys) rather than a cutpipe model."""
    return isinstance(data, Mapping) and bool(HF_MARKERS & set(data))


def _ignored(key: str) -> bool:
    return key in IGNORED or key.startswith(IGNORED_PREFIXES) or key.endswith(IGNORED_SUFFIXES)


def spec_from_hf_config(
    config: Mapping[str, Any],
    name: str = "model",
    max_seq_len: int | None = None,
    source: str = "config",
    *,
    seq_len: int | None = None,
) -> ModelSpec:
    """A ``ModelSpec`` of a Hugging Face config's sizes (the keys the module lists); ``seq_len``
    replaces ``max_position_embeddings``, which may then be absent."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{source}: expected a mapping of config keys")
    ours = sorted(
        key
        for key in set(config) & {f.name for f in fields(ModelSpec)}
        if not _ignored(key) and key not in READ  # a name both formats use
    )
    if ours:
        raise ValueError(
            f"{source}: mixes Hugging Face keys with cutpipe fields {ours}: use one format"
        )
    unknown = sorted(key for key in config if key not in READ and not _ignored(key))
    if unknown:
        raise ValueError(
            f"{source}: unknown keys {unknown}; cutpipe reads "
            f"{', '.join(sorted(READ))} and ignores keys that do not change its layers "
            "(see cutpipe.model_config): remove these, or describe the model in a cutpipe "
            "model file"
        )
    _check_length("seq_len", seq_len)
    sizes = _sizes(_Reader(config, source), max_seq_len, seq_len)
    try:
        return ModelSpec(name=name, **sizes)
    except (TypeError, ValueError) as error:  # ModelSpec's own checks, which name no file
        raise ValueError(f"{source}: {error}") from None


class _Reader:
    """Typed access to a config's keys, with errors that name the file and the key; a key left
    out (or null) reads as ``transformers`` reads it for the config's family."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.source = source
        family = config.get("model_type", "llama")
        given = {key: value for key, value in config.items() if value is not None}
        self.config = {**FAMILY_DEFAULTS.get(family, {}), **given}
        self.family = family

    def count(self, key: str, low: int = 1) -> int | None:
        """The key's whole number, or None where it is absent or null."""
        value = self.config.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.fail(f"{key} must be a whole number >= {low}, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        """The key's number (the default where it is absent or null)."""
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise self.fail(f"{key} must be a number >= 0, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{key} must be true or false, got {value!r}")
        return value

    def choice(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        value = self.config.get(key, default)
        if value not in allowed:
            raise self.fail(
                f"{key} {value!r} is not built by cutpipe (it builds {', '.join(allowed)})"
            )
        return value

    def need(self, key: str) -> int:
        value = self.count(key)
        if value is None:
            raise self.fail(f"missing {key}")
        return value

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")


def _sizes(read: _Reader, max_seq_len: int | None, seq_len: int | None) -> dict[str, Any]:
    """ModelSpec's fields from the config's keys."""
    hidden, heads = read.need("hidden_size"), read.need("num_attention_heads")
    sizes = {
        "layers": read.need("num_hidden_layers"),
        "hidden": hidden,
        "heads": heads,
        "vocab": read.need("vocab_size"),
        "seq_len": _seq_len(read, max_seq_len, seq_len),
    }
    kv_heads = read.count("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise read.fail(f"num_key_value_heads {kv_heads} must divide num_attention_heads {heads}")
    if kv_heads is not None and kv_heads != heads:
        sizes["kv_heads"] = kv_heads
    head_dim = read.count("head_dim")
    latent = _latent(read, heads)
    if head_dim is not None and head_dim * heads != hidden and not latent:
        sizes["head_dim"] = head_dim  # (DeepSeek's is the rotated part of its latent attention)
    sizes.update(_experts(read, sizes["layers"]))
    sizes.update(_architecture(read, sizes["seq_len"]))
    if sizes.get("experts"):
        sizes.update(_routing(read))
        if read.family == "qwen2_moe" and sizes["shared_experts"]:
            sizes["shared_expert_gate"] = True  # sigmoid(shared_expert_gate(x)) weighs them
        if sizes["mlp_bias"]:
            raise read.fail("mlp_bias with experts: cutpipe builds experts without biases")
    sizes.update(latent)
    return sizes


def _routing(read: _Reader) -> dict[str, Any]:
    """How the MoE routes, as ``transformers`` routes the config's family: DeepSeek-V3 by
    sigmoid scores within groups, scaled; DeepSeek-V2 by softmax, greedy or within groups,
    scaled, never normalised; Qwen's MoE by softmax, normalised if ``norm_topk_prob``; others
    (Mixtral) by softmax, normalised."""
    family = read.family
    if family not in (*DEEPSEEK, *QWEN_MOE):
        return {}
    fields_: dict[str, Any] = {"router_norm": read.flag("norm_topk_prob", False)}
    if family in QWEN_MOE:
        return fields_
    scoring = "sigmoid" if family == "deepseek_v3" else "softmax"
    read.choice("scoring_func", scoring, (scoring,))
    fields_.update(router_scoring=scoring, router_scale=read.number("routed_scaling_factor", 1.0))
    if family == "deepseek_v2" and fields_["router_norm"]:
        raise read.fail(
            "norm_topk_prob true: transformers' DeepSeek-V2 does not normalise the chosen "
            "experts' weights, so this config means two things; set it false"
        )
    grouped = family == "deepseek_v3"
    if family == "deepseek_v3":
        read.choice("topk_method", "noaux_tc", ("noaux_tc",))
    else:
        method = read.choice("topk_method", "greedy", ("greedy", "group_limited_greedy"))
        grouped = method == "group_limited_greedy"
    if grouped:
        groups, top = read.need("n_group"), read.need("topk_group")
        if (groups, top) != (1, 1):  # one group of all the experts chooses as no group
            fields_.update(router_groups=groups, router_top_groups=top)
    return fields_


def _latent(read: _Reader, heads: int) -> dict[str, Any]:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3) where ``kv_lora_rank`` is given."""
    if read.count("kv_lora_rank") is None:
        return {}
    if read.family not in DEEPSEEK:
        raise read.fail(
            f"kv_lora_rank: latent attention is read for {' and '.join(DEEPSEEK)} (model_type), "
            f"not {read.family!r}"
        )
    sizes = {
        "q_lora_rank": read.count("q_lora_rank") or 0,
        "kv_lora_rank": read.need("kv_lora_rank"),
        "qk_nope_head_dim": read.count("qk_nope_head_dim", low=0) or 0,
        "qk_rope_head_dim": read.need("qk_rope_head_dim"),
        "v_head_dim": read.need("v_head_dim"),
        "rope_interleave": read.flag("rope_interleave", True),
    }
    query = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    if read.count("qk_head_dim") not in (None, query):
        raise read.fail(
            f"qk_head_dim {read.config['qk_head_dim']} is not qk_nope_head_dim + "
            f"qk_rope_head_dim ({query})"
        )
    if read.family == "deepseek_v2" and not sizes["rope_interleave"]:
        raise read.fail("rope_interleave false: transformers' DeepSeek-V2 always interleaves")
    kv_heads = read.count("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise read.fail(
            f"num_key_value_heads {kv_heads}: latent attention gives every one of the {heads} "
            "heads its own keys and values"
        )
    rope = read.config.get("rope_parameters") or read.config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else ""
    if isinstance(rope, Mapping) and rope.get("mscale_all_dim") and kind not in ("default", "yarn"):
        raise read.fail(
            f"mscale_all_dim with rope_type {kind!r}: cutpipe does not scale latent attention's "
            "softmax"
        )
    return sizes


#: Families whose attention has biases on the query, key and value projections only (Qwen2's
#: are fixed in its code, not in its config), and families with per-head query/key norms.
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")


def _architecture(read: _Reader, seq_len: int) -> dict[str, Any]:
    """How the layers compute: position encoding, biases, norms, activation, tied embeddings
    (``ModelSpec``'s architecture fields), as the config's family defines them."""
    config, family = read.config, read.config.get("model_type", "llama")
    fields_: dict[str, Any] = {
        "norm_eps": read.number("rms_norm_eps", 1e-6),
        "tie_embeddings": read.flag("tie_word_embeddings", False),
        "mlp_bias": read.flag("mlp_bias", False),
        "activation": read.choice("hidden_act", "silu", ACTIVATIONS),
        "qk_norm": family in QK_NORM_FAMILIES,
    }
    if family in QKV_BIAS_FAMILIES:
        fields_["qkv_bias"] = read.flag("qkv_bias", True)
    else:
        fields_["qkv_bias"] = fields_["o_bias"] = read.flag("attention_bias", False)
    partial = read.number("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise read.fail(
            f"partial_rotary_factor {partial}: cutpipe rotates whole heads; it cannot build "
            "this model"
        )
    window = config.get("sliding_window")
    sliding = config.get("use_sliding_window", window is not None)
    if sliding and window is not None and read.count("sliding_window") < seq_len:
        raise read.fail(
            f"sliding_window {window} is shorter than the sequence length {seq_len}: cutpipe "
            "attends over the whole sequence; train with --seq-len at most the window"
        )
    fields_.update(_rotary(read))
    return fields_


def _rotary(read: _Reader) -> dict[str, Any]:
    """The rotary embedding: ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier); the families' default base, 10000, where none is given."""
    given = read.config.get("rope_parameters")
    if given is None:
        given = dict(read.config.get("rope_scaling") or {})
        if "rope_theta" in read.config:
            given["rope_theta"] = read.config["rope_theta"]
    if not isinstance(given, Mapping):
        raise read.fail(f"rope_parameters must be a mapping, got {given!r}")
    rope = _Reader(given, f"{read.source}: rope parameters")
    kind = given.get("rope_type", given.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise read.fail(f"rope_type {kind!r} is not one of {', '.join(ROPE_TYPES)}")
    fields_: dict[str, Any] = {"rope_theta": rope.number("rope_theta", 10000.0), "rope_type": kind}
    if kind != "default":
        fields_["rope_factor"] = rope.number("factor", 1.0)
    if kind == "llama3":
        fields_["rope_low_freq_factor"] = rope.number("low_freq_factor", 1.0)
        fields_["rope_high_freq_factor"] = rope.number("high_freq_factor", 4.0)
        fields_["rope_original_positions"] = rope.need("original_max_position_embeddings")
    return fields_


def _seq_len(read: _Reader, max_seq_len: int | None, seq_len: int | None) -> int:
    """The sequence length: ``seq_len`` when given, else the config's longest, at most
    ``max_seq_len``; a config without one needs ``seq_len`` (``--seq-len``) or ``max_seq_len``."""
    longest = read.count("max_position_embeddings")  # read even when replaced: checked
    given = seq_len if seq_len is not None else longest
    if given is None:
        given = max_seq_len
    if given is None:
        raise read.fail(
            "missing max_position_embeddings: give the sequence length with cutpipe train "
            "--seq-len N (seq_len=N in code), or add max_position_embeddings to the file"
        )
    return _capped_length(given, max_seq_len)


def _experts(read: _Reader, layers: int) -> dict[str, int]:
    """The FFN and mixture-of-experts fields."""
    counts = {key: read.count(key, low=0) for key in EXPERT_KEYS}
    given = {key: value for key, value in counts.items() if value is not None}
    if len(set(given.values())) > 1:
        raise read.fail(f"the expert counts disagree: {given}")
    experts = next(iter(given.values()), 0) or 0
    dense_ffn = read.count("intermediate_size")
    if not experts:
        moe_only = [
            key
            for key in (
                "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "shared_expert_intermediate_size", "first_k_dense_replace",
            )
            if read.count(key, low=0)
        ]  # fmt: skip
        if moe_only:
            raise read.fail(f"{', '.join(moe_only)} set but no experts ({' / '.join(EXPERT_KEYS)})")
        if dense_ffn is None:
            raise read.fail("missing intermediate_size")
        return {"ffn": dense_ffn}
    top_k = read.count("num_experts_per_tok")
    if top_k is None:
        raise read.fail(f"{experts} experts but no num_experts_per_tok")
    expert_ffn = read.count("moe_intermediate_size") or dense_ffn
    if expert_ffn is None:
        raise read.fail("missing moe_intermediate_size (or intermediate_size) for the experts")
    for key in ("moe_layer_freq", "decoder_sparse_step"):
        every = read.count(key)
        if every not in (None, 1):
            raise read.fail(
                f"{key} {every}: only models whose layers past the dense ones are all MoE "
                "can be built"
            )
    dense_layers = _dense_layers(read)
    if dense_layers and dense_ffn is None:
        raise read.fail(f"{dense_layers} dense layers but no intermediate_size for them")
    fields_ = {
        "ffn": expert_ffn,
        "experts": experts,
        "top_k": top_k,
        "shared_experts": _shared(read, expert_ffn),
    }
    if dense_layers:
        fields_["dense_layers"] = min(dense_layers, layers)
        if dense_ffn != expert_ffn:
            fields_["dense_ffn"] = dense_ffn or 0
    return fields_


def _dense_layers(read: _Reader) -> int:
    first = read.count("first_k_dense_replace", low=0)
    listed = read.config.get("mlp_only_layers") or []
    if not isinstance(listed, list) or listed != list(range(len(listed))):
        raise read.fail(
            f"mlp_only_layers {listed!r}: only the first layers can be dense, as [0, 1, ..., k-1]"
        )
    if first is not None and listed and first != len(listed):
        raise read.fail(
            f"first_k_dense_replace {first} disagrees with mlp_only_layers {listed} "
            f"({len(listed)} dense layers)"
        )
    return first if first is not None else len(listed)


def _shared(read: _Reader, expert_ffn: int) -> int:
    count = read.count("n_shared_experts", low=0)
    size = read.count("shared_expert_intermediate_size", low=0)
    if size is None:
        return count or 0
    if size % expert_ffn:
        raise read.fail(
            f"shared_expert_intermediate_size {size} is not a multiple of the experts' "
            f"{expert_ffn}: cutpipe builds shared experts of the routed experts' size"
        )
    if count is not None and count != size // expert_ffn:
        raise read.fail(
            f"n_shared_experts {count} disagrees with shared_expert_intermediate_size {size} "
            f"({size // expert_ffn} experts of {expert_ffn})"
        )
    return size // expert_ffn
