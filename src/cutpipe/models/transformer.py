"""A decoder-only transformer, dense or mixture-of-experts, cut into pipeline stages by layer.

Built from a ``ModelSpec`` (``cutpipe.spec``): an embedding, ``layers`` blocks (pre-norm
causal attention, then a gated MLP or a top-k routed mixture of experts), and a head. Every
module between stages takes and returns ``(hidden, aux)``: ``aux`` accumulates the MoE
load-balancing loss along the pipeline, so the last stage can add it to the loss.

All experts of an ``MoE`` live on this rank unless ``cutpipe.parallel.expert_parallel.shard_experts``
spreads them over an expert-parallel group; then its dispatch goes through all-to-alls.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from cutpipe.models.router import (
    RouterScoring,
    RoutingOptions,
    RoutingTally,
    capacity,
    choices_per_expert,
    over_capacity,
)
from cutpipe.spec import BUILT_ROPE_TYPES, ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        # in float32, as the Hugging Face families normalise, then back to the input's dtype
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) as the Hugging Face Llama family computes it: each head's
    first and second halves rotated by ``position * inv_freq``, the frequencies scaled as
    ``rope_type`` says ("linear": divided by ``rope_factor``; "llama3": Llama 3.1's smooth
    scaling of the long wavelengths)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.rope_type not in BUILT_ROPE_TYPES:
            raise ValueError(
                f"model {spec.name!r}: rope_type {spec.rope_type!r} is not built by cutpipe's "
                f"transformer (it builds {', '.join(BUILT_ROPE_TYPES)}): the planner prices the "
                "model, but it cannot be trained here yet"
            )
        dim = spec.rotary_dim
        inv_freq = 1.0 / (
            spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
        if spec.rope_type == "linear":
            inv_freq = inv_freq / spec.rope_factor
        elif spec.rope_type == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, spec)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of every position's angles, ``(length, head_dim)``, in float32."""
        positions = torch.arange(length, device=device, dtype=torch.float32)
        with torch.autocast(device.type, enabled=False):
            angles = torch.outer(positions, self.inv_freq.to(device).float())
            both = torch.cat((angles, angles), dim=-1)
            return both.cos(), both.sin()


def _llama3_frequencies(inv_freq: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    factor, low, high = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    context = spec.rope_original_positions
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) & ~(wavelength > context / low)
    return torch.where(medium, smoothed, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    turned = torch.cat((-second, first), dim=-1)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotation of the pairs ``(x0, x1), (x2, x3), ...``, each by one frequency; the
    rotated evens then the rotated odds come out (as ``transformers`` lays them out: queries
    and keys alike, so their products are those of the pairs)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention (grouped key/value heads if ``kv_heads < heads``), with
    rotary position embeddings, biases and per-head query/key norms where ``spec`` asks for them.

    Keys and values come from one projection (``kv``: the keys' rows, then the values'), the
    Hugging Face ``k_proj`` and ``v_proj`` one above the other (``cutpipe.models.hf_weights``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads = spec.heads, spec.kv_heads or spec.heads
        self.head_dim = spec.attention_head_dim
        width = self.heads * self.head_dim
        self.q = nn.Linear(spec.hidden, width, bias=spec.qkv_bias)
        self.kv = nn.Linear(spec.hidden, 2 * self.kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o = nn.Linear(width, spec.hidden, bias=spec.o_bias)
        self.q_norm = RMSNorm(self.head_dim, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.norm_eps) if spec.qk_norm else None
        self.rotary = Rotary(spec) if spec.rope_theta else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, self.heads, self.head_dim)
        k, v = self.kv(x).view(batch, length, 2, self.kv_heads, self.head_dim).unbind(2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rotary is not None:
            cos, sin = self.rotary(length, x.device)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))


#: The MLP activations by their Hugging Face names.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    """A gated MLP (``down(act(gate(x)) * up(x))``, SwiGLU by default) or a plain one
    (``down(act(up(x)))``, GELU where the activation is left at SiLU)."""

    def __init__(
        self, hidden: int, ffn: int, gated: bool = True, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        self.gated = gated
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.gate = nn.Linear(hidden, ffn, bias=bias) if gated else None
        self.down = nn.Linear(ffn, hidden, bias=bias)
        self.act = ACTIVATIONS["gelu" if not gated and act == "silu" else act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))


class MoE(nn.Module):
    """Top-k routed experts with a Switch-style load-balancing loss; all local unless sharded.

    ``routing`` (``cutpipe.models.router.RoutingOptions``) may cap each expert's choices per
    microbatch and add a per-expert bias that steers the top-k choice. Every training forward
    adds what it routed to ``tally`` (read by ``cutpipe.parallel.routing``). ``scoring``
    (``cutpipe.models.router.RouterScoring``) is the family's own routing: softmax or sigmoid
    scores, groups, normalised and scaled weights; sigmoid scoring always holds the bias
    (DeepSeek-V3's ``e_score_correction_bias``, which its weights carry).

    The ``shared`` experts, which every token passes through, are one MLP of their summed width
    (as the Hugging Face families build them; the sum of several is that one), optionally
    weighed by ``sigmoid(shared_gate(x))`` (Qwen2-MoE).
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int,
        shared: int = 0,
        gated: bool = True,
        routing: RoutingOptions | None = None,
        scoring: RouterScoring | None = None,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        if top_k > experts:
            raise ValueError(f"top_k {top_k} is more than the {experts} experts")
        routing = routing or RoutingOptions()
        self.scoring = scoring or RouterScoring()
        self.top_k = top_k
        self.num_experts = experts  # routed experts in the whole model, local or not
        self.capacity_factor = routing.capacity_factor
        self.expert_parallel = None  # set by shard_experts: experts live on an EP group
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden, ffn, gated) for _ in range(experts))
        self.shared = nn.ModuleList([MLP(hidden, shared * ffn, gated)] if shared else [])
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared and shared_gate else None
        # DeepSeek-V3's balancing bias, moved by cutpipe.parallel.routing.update_routing_bias
        biased = routing.bias or self.scoring.function == "sigmoid"
        self.register_buffer("routing_bias", torch.zeros(experts) if biased else None)
        self.bias_load: torch.Tensor | None = None  # choices per expert since the bias moved
        self.tally = RoutingTally()
        self._counting = True  # off while activation recompute reruns the forward

    def capacity(self, tokens: int) -> int | None:
        """Choices each expert may take from a microbatch of ``tokens`` tokens (None: all)."""
        return capacity(self.capacity_factor, tokens, self.top_k, self.num_experts)

    @contextmanager
    def during_recompute_rerun(self) -> Iterator[None]:
        """Activation recompute runs the forward again: its routing is counted once, not twice
        (``cutpipe.runtime.compute.recompute.RERUN_HOOK``)."""
        counting, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = counting

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert of each token's choices, their weights, the load-balancing loss).

        The routing bias, if any, decides which experts are chosen; the weights are the
        unbiased scores (normalised and scaled as ``scoring`` says). A choice over its expert's
        capacity is dropped: its expert is ``num_experts`` (none) and its weight 0. The loss and
        the tally count the choices before any is dropped.
        """
        scores, affinity = self.scoring.scores(self.router(tokens))
        chosen = self.scoring.choose(scores, self.routing_bias, self.top_k)
        weights = self.scoring.weights(scores.gather(-1, chosen))
        scores = scores.gather(-1, chosen)  # what a capacity keeps the best of
        count = self.num_experts
        routed = choices_per_expert(chosen, count)
        load = routed.float() / (tokens.shape[0] * self.top_k)
        balance = count * (load * affinity.mean(0)).sum()
        dropped = None
        limit = self.capacity(tokens.shape[0])
        if limit is not None:
            over = over_capacity(chosen, scores, limit)
            chosen, weights = chosen.masked_fill(over, count), weights.masked_fill(over, 0.0)
            dropped = over.sum()
        if torch.is_grad_enabled() and self._counting:  # a training forward, not a rerun
            self.tally.add(balance, routed, dropped)
            if self.routing_bias is not None:
                self.bias_load = routed if self.bias_load is None else self.bias_load + routed
        return chosen, weights, balance

    def experts_forward(
        self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        chosen, weights, balance = self.route(tokens)
        if self.expert_parallel is None:
            out = self.experts_forward(tokens, chosen, weights)
        else:
            out = self.expert_parallel.forward(
                self.experts, tokens, chosen, weights, self.capacity(tokens.shape[0])
            )
        shared = self.shared_forward(tokens)
        if shared is not None:
            out = out + shared
        return out.view_as(x), balance

    def shared_forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """What the shared experts add to ``tokens``' output (None: there are none)."""
        if not self.shared:
            return None
        out = self.shared[0](tokens)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(tokens)) * out
        return out


class Layer(nn.Module):
    """One pre-norm block: attention, then an MLP or an MoE; adds its balance loss to ``aux``."""

    def __init__(
        self,
        spec: ModelSpec,
        index: int,
        routing: RoutingOptions | None = None,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.mlp_norm = RMSNorm(spec.hidden, spec.norm_eps)
        if spec.latent_attention:
            from cutpipe.models.latent_attention import LatentAttention  # it builds on this module

            self.attention: nn.Module = LatentAttention(spec)
        else:
            self.attention = Attention(spec)
        if spec.moe and index >= spec.dense_layers:
            self.mlp: nn.Module = MoE(
                spec.hidden, spec.ffn, spec.experts, spec.top_k, spec.shared_experts,
                spec.gated_mlp, routing, RouterScoring.of(spec), spec.shared_expert_gate,
            )  # fmt: skip
        else:
            self.mlp = MLP(
                spec.hidden, spec.dense_ffn or spec.ffn, spec.gated_mlp, spec.mlp_bias,
                spec.activation,
            )  # fmt: skip

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x))
        out = self.mlp(self.mlp_norm(x))
        if isinstance(out, tuple):
            out, balance = out
            aux = aux + balance
        return x + out, aux


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.table = nn.Embedding(spec.vocab, spec.hidden)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.table(tokens), torch.zeros((), device=tokens.device)


class Head(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.out = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out(self.norm(x)), aux


class LanguageModel(nn.Module):
    """``embed``, ``layers`` (a ModuleList), ``head``, run in that order.

    Named like Hugging Face decoders (``embed.table.weight``, ``layers.3.attention.q.weight``,
    ``head.out.weight``), so that a checkpoint of a pipelined copy (``PipelineRunner.from_module``
    keeps these names) matches the unsplit model. It is also the sequence of its blocks
    ``[embed, layers.0, ..., head]`` (``len``, iteration, indexing), the cost items of
    ``cutpipe.plan.costs.model``, so code that cuts a model by position (``moe_stages``,
    ``PipelineRunner.from_sequential``) takes it as it took a ``Chain``.
    """

    def __init__(self, spec: ModelSpec, routing: RoutingOptions | None = None) -> None:
        super().__init__()
        self.spec, self.routing = spec, routing
        self.embed = Embedding(spec)
        self.layers = nn.ModuleList(Layer(spec, i, routing) for i in range(spec.layers))
        self.head = Head(spec)
        self.tie()

    def tie(self) -> None:
        """A tied head is the embedding's parameter, under two names (saved once)."""
        if self.spec.tie_embeddings:
            self.head.out.weight = self.embed.table.weight

    def blocks(self) -> list[nn.Module]:
        return [self.embed, *self.layers, self.head]

    def block_names(self) -> list[str]:
        return ["embed", *(f"layers.{i}" for i in range(len(self.layers))), "head"]

    def new_block(self, name: str) -> nn.Module:
        """A freshly built (and initialised) block ``name`` of this model's sizes."""
        if name == "embed":
            return Embedding(self.spec)
        if name == "head":
            return Head(self.spec)
        return Layer(self.spec, int(name.removeprefix("layers.")), self.routing)

    def __len__(self) -> int:
        return len(self.layers) + 2

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.blocks())

    def __getitem__(self, index: int) -> nn.Module:
        return self.blocks()[index]

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the summed load-balancing loss), as ``LanguageModelLoss`` takes them."""
        hidden, aux = self.embed(tokens)
        for layer in self.layers:
            hidden, aux = layer(hidden, aux)
        return self.head(hidden, aux)


def language_model(
    spec: ModelSpec,
    seed: int = 0,
    routing: RoutingOptions | None = None,
    blocks: Collection[str] | None = None,
) -> LanguageModel:
    """A ``LanguageModel`` of ``spec``'s sizes, initialised from ``seed``; its MoE layers route
    as ``routing`` says (``cutpipe.models.router``; the default: plain top-k, nothing dropped).

    The model is laid out on the meta device and only ``blocks`` (by name, default all) are
    built, each from its own seed (``block_seed``): a pipeline rank allocates only the blocks of
    its stages, and they hold the values the whole model holds, whatever the layout."""
    with torch.device("meta"):
        model = LanguageModel(spec, routing)
    names = model.block_names()
    unknown = sorted(set(blocks or ()) - set(names))
    if unknown:
        raise ValueError(f"{spec.name} has no block {unknown[0]!r}: its blocks are {names}")
    for name in names:
        if blocks is None or name in blocks:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(block_seed(seed, name))
                model.set_submodule(name, model.new_block(name))
    if spec.tie_embeddings:
        built = [name for name in ("embed", "head") if blocks is None or name in blocks]
        if built == ["head"]:
            raise ValueError(
                f"{spec.name} ties its head to its embedding: build the embedding with the head"
            )
        model.tie()
    return model


def block_seed(seed: int, name: str) -> int:
    """The seed of block ``name``'s initial values: a digest of the run's seed and the name, so
    blocks built apart (on different ranks) hold what one process building them all holds."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class LanguageModelLoss(nn.Module):
    """Next-token cross entropy plus ``aux_weight`` times the summed load-balancing loss."""

    def __init__(self, aux_weight: float = 0.01) -> None:
        super().__init__()
        self.aux_weight = aux_weight

    def forward(
        self, output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor
    ) -> torch.Tensor:
        logits, aux = output
        return (
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            + self.aux_weight * aux
        )
