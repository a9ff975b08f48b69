"""What a model is: the sizes of a decoder-only transformer (or of the example MLP), read from
YAML or JSON.

Torch-free and at the bottom of the package, so that both the planner (``cutpipe.plan``, which
derives costs from these sizes) and the torch models (``cutpipe.models``, which build layers of
these sizes) can import it without either importing the other.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

#: Far above any real model, low enough that the planner's per-layer lists stay small and the
#: cost formulas (products of up to four sizes) stay finite.
MAX_LAYERS = 10_000
MAX_SIZE = 2**40
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
#: How rotary frequencies may be scaled: Hugging Face's ``rope_type``s. The planner takes any;
#: the model builds ``BUILT_ROPE_TYPES`` and refuses the others by name.
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
BUILT_ROPE_TYPES = ("default", "linear", "llama3")
#: How an MoE's router scores its experts before the top k.
ROUTER_SCORINGS = ("softmax", "sigmoid")
#: Multi-head latent attention's sizes (``ModelSpec``).
MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: The MLP activations cutpipe builds (Hugging Face's ``hidden_act`` names).
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, dense or mixture-of-experts."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int  # FFN hidden size; per expert in an MoE
    vocab: int
    seq_len: int
    microbatch_size: int = 1  # sequences per microbatch
    experts: int = 0  # routed experts; 0 for a dense model
    top_k: int = 1
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense MLP in an MoE model
    dense_ffn: int = 0  # their FFN size (default: ffn)
    kv_heads: int = 0  # 0: as many as heads
    dtype: str = "bf16"
    gated_mlp: bool = True
    flash_attention: bool = True
    # how the layers compute, as the Hugging Face families define it (docs/models.md); the
    # defaults are cutpipe's own examples': no position encoding, no biases, SiLU, untied
    head_dim: int = 0  # 0: hidden / heads
    rope_theta: float = 0.0  # rotary position embedding's base; 0: no position encoding
    rope_type: str = "default"  # or "linear", "llama3": how the frequencies are scaled
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_positions: int = 0  # llama3: the context the frequencies were trained for
    qkv_bias: bool = False  # biases on the query, key and value projections
    o_bias: bool = False  # a bias on the attention's output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm of each query and key head (Qwen3)
    tie_embeddings: bool = False  # the head's weight is the embedding's
    activation: str = "silu"  # of the gated MLP's gate (of the plain MLP: gelu, if "silu")
    norm_eps: float = 1e-6
    # how an MoE routes and what its shared experts add (docs/models.md): Mixtral's softmax
    # top-k renormalised by default; DeepSeek-V3's sigmoid with groups and a scale; Qwen's gate
    router_scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3: with a correction bias)
    router_norm: bool = True  # the chosen experts' weights divided by their sum
    router_scale: float = 1.0  # the routed experts' output multiplied by it
    router_groups: int = 0  # experts in this many groups; the top router_top_groups kept
    router_top_groups: int = 0
    shared_expert_gate: bool = False  # the shared experts' output times sigmoid(a linear map)
    # multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank > 0: queries (through a
    # rank q_lora_rank bottleneck where > 0), keys and values from a shared latent
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotate pairs (x0, x1), (x2, x3)... (DeepSeek), not halves

    #: Fields a run's record leaves out at their defaults, so that checkpoints written before
    #: they existed still compare as the same model (``cutpipe.train.resume``).
    RECORDED_IF_SET = (
        "head_dim", "rope_theta", "rope_type", "rope_factor", "rope_low_freq_factor",
        "rope_high_freq_factor", "rope_original_positions", "qkv_bias", "o_bias", "mlp_bias",
        "qk_norm", "tie_embeddings", "activation", "norm_eps", "router_scoring", "router_norm",
        "router_scale", "router_groups", "router_top_groups", "shared_expert_gate", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
    )  # fmt: skip

    def __post_init__(self) -> None:
        counts = [f.name for f in fields(self) if f.type == "int"]
        wrong = [
            f"{n} must be a whole number, got {getattr(self, n)!r}"
            for n in counts
            if isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), int)
        ]
        if wrong:
            raise TypeError(f"model {self.name!r}: " + "; ".join(wrong))
        problems = []
        for name in (
            "layers",
            "hidden",
            "heads",
            "ffn",
            "vocab",
            "seq_len",
            "microbatch_size",
            "top_k",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("experts", "shared_experts", "dense_layers", "dense_ffn", "kv_heads",
                     *MLA_SIZES, "router_groups", "router_top_groups"):  # fmt: skip
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.layers > MAX_LAYERS:
            problems.append(f"layers must be at most {MAX_LAYERS:,}, got {self.layers:,}")
        problems += [
            f"{name} must be at most {MAX_SIZE:,}, got {getattr(self, name):,}"
            for name in counts
            if getattr(self, name) > MAX_SIZE
        ]
        if self.hidden % self.heads and not self.head_dim:
            problems.append(
                f"hidden {self.hidden} must be a multiple of heads {self.heads} (or give head_dim)"
            )
        if self.head_dim < 0:
            problems.append(f"head_dim must be >= 0, got {self.head_dim}")
        problems += self._architecture_problems()
        if self.kv_heads and (self.kv_heads > self.heads or self.heads % self.kv_heads):
            problems.append(
                f"kv_heads {self.kv_heads} must divide heads {self.heads} (each key/value head "
                "serves a whole group of query heads)"
            )
        if self.experts and self.top_k > self.experts:
            problems.append(f"top_k {self.top_k} is more than the {self.experts} experts")
        if self.dense_layers > self.layers:
            problems.append(
                f"dense_layers {self.dense_layers} is more than the {self.layers} layers"
            )
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if problems:
            raise ValueError(f"model {self.name!r}: " + "; ".join(problems))

    def _architecture_problems(self) -> list[str]:
        problems = []
        for name in ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "norm_eps"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                problems.append(f"{name} must be a number >= 0, got {value!r}")
        if self.rope_type not in ROPE_TYPES:
            problems.append(
                f"rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}"
            )
        elif self.rope_type == "llama3" and (
            self.rope_original_positions < 1
            or self.rope_high_freq_factor <= self.rope_low_freq_factor
        ):
            problems.append(
                "rope_type llama3 needs rope_original_positions >= 1 and rope_high_freq_factor "
                "above rope_low_freq_factor"
            )
        if self.rope_theta and self.rotary_dim % 2:
            problems.append(f"rotary embeddings need an even head_dim, got {self.rotary_dim}")
        problems += self._router_problems() + self._latent_problems()
        if self.activation not in ACTIVATIONS:
            problems.append(
                f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"
            )
        return problems

    def _router_problems(self) -> list[str]:
        problems = []
        if self.router_scoring not in ROUTER_SCORINGS:
            problems.append(
                f"router_scoring must be one of {', '.join(ROUTER_SCORINGS)}, "
                f"got {self.router_scoring!r}"
            )
        scale = self.router_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            problems.append(f"router_scale must be a number > 0, got {scale!r}")
        groups, top = self.router_groups, self.router_top_groups
        if groups or top:
            if not groups or not 1 <= top <= groups or self.experts % groups:
                problems.append(
                    f"router_groups {groups} must divide the {self.experts} experts and "
                    f"router_top_groups {top} be 1 to router_groups"
                )
            elif self.router_scoring == "sigmoid" and self.experts < 2 * groups:
                problems.append(
                    f"router_groups {groups}: sigmoid scoring ranks a group by its two best "
                    f"experts, so each group needs 2 of the {self.experts}"
                )
            elif self.top_k > top * (self.experts // groups):
                problems.append(
                    f"top_k {self.top_k} is more than the {top * (self.experts // groups)} "
                    f"experts of the router_top_groups {top} groups"
                )
        return problems

    def _latent_problems(self) -> list[str]:
        """Multi-head latent attention's sizes: all given (but ``q_lora_rank``) or none."""
        given = [name for name in MLA_SIZES if getattr(self, name)]
        if not given:
            return []
        needed = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
        missing = [name for name in needed if not getattr(self, name)]
        if missing:
            return [f"latent attention ({', '.join(given)}) also needs {', '.join(missing)}"]
        if self.kv_heads and self.kv_heads != self.heads:
            return [f"latent attention has as many key/value heads as heads, got {self.kv_heads}"]
        return []

    @property
    def latent_attention(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) rather than grouped heads."""
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """How many of each query/key head's dimensions rotate."""
        return self.qk_rope_head_dim if self.latent_attention else self.attention_head_dim

    @property
    def attention_head_dim(self) -> int:
        """The size of one attention head."""
        return self.head_dim or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def tokens(self) -> int:
        """Tokens in one microbatch."""
        return self.microbatch_size * self.seq_len

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def from_dict(cls, data: dict, source: str = "model") -> ModelSpec:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{source}: unknown fields {unknown}; known: {', '.join(known)}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise ValueError(f"{source}: missing fields {missing}")
        kinds = {"int": (int,), "bool": (bool,), "str": (str,), "float": (int, float)}
        for name, value in data.items():
            kind = kinds[known[name].type]
            if not isinstance(value, kind) or (bool not in kind and isinstance(value, bool)):
                raise ValueError(f"{source}: {name} must be {known[name].type}, got {value!r}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> ModelSpec:
        """Read a model from a YAML or JSON file."""
        data = read_mapping(path, "model")
        data.setdefault("name", Path(path).stem)
        return cls.from_dict(data, str(path))


#: Numbers the example MLP may hold in its weights: 1 GiB of fp32.
MAX_MLP_ELEMENTS = 2**28


@dataclass(frozen=True)
class MlpSpec:
    """The example model: ``blocks`` of ``Linear(width, width)`` + tanh, trained to imitate a
    teacher MLP of its shape on synthetic data (a quick look at a schedule running, nothing to
    read).

    A model file says ``family: mlp`` to mean this (examples/models/mlp.yaml); ``--model mlp``
    is these defaults."""

    name: str = "mlp"
    blocks: int = 16
    width: int = 128
    microbatch_size: int = 8  # samples per microbatch

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be a whole number >= 1, got {getattr(self, name)!r}"
            for name in ("blocks", "width", "microbatch_size")
            if isinstance(getattr(self, name), bool)
            or not isinstance(getattr(self, name), int)
            or getattr(self, name) < 1
        ]
        if not problems and self.blocks * self.width**2 > MAX_MLP_ELEMENTS:
            problems.append(
                f"{self.blocks} blocks of {self.width} x {self.width} hold "
                f"{self.blocks * self.width**2:,} weights, over the limit of {MAX_MLP_ELEMENTS:,} "
                "(1 GiB of fp32): use a smaller width or fewer blocks"
            )
        if problems:
            raise ValueError(f"model {self.name!r}: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, data: dict, source: str = "model") -> MlpSpec:
        data = {k: v for k, v in data.items() if k != "family"}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{source}: unknown fields {unknown}; known: family, {', '.join(known)}"
            )
        return cls(**data)


def spec_differences(ours: ModelSpec, theirs: ModelSpec, ignore: tuple[str, ...] = ()) -> list[str]:
    """``"field ours vs theirs"`` for each field the two models differ in, but those ignored:
    what a one-line refusal of another model names."""
    return [
        f"{f.name} {getattr(ours, f.name)!r} vs {getattr(theirs, f.name)!r}"
        for f in fields(ours)
        if f.name not in ignore and getattr(ours, f.name) != getattr(theirs, f.name)
    ]


def read_mapping(path: str | Path, what: str) -> dict:
    """The mapping a YAML (``.yaml``/``.yml``) or JSON file holds, with errors that say which
    ``what`` file (model, GPU) could not be read, parsed, or is not a mapping."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"cannot read {what} file {path}: {error.strerror}") from None
    try:
        if str(path).lower().endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as error:  # yaml.YAMLError or json.JSONDecodeError
        raise ValueError(f"{what} file {path} does not parse: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of {what} fields")
    return data
