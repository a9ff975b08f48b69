"""Costs from a model and a machine: per-layer F, B, W times, memory and traffic.

A model is a stack of cost *items*: the embedding, the transformer layers, the head. For one
microbatch of ``b`` sequences of ``s`` tokens (``T = b*s`` tokens), hidden size ``h``, ``a``
attention heads of size ``d = h/a``, ``kv`` key/value heads, FFN size ``f`` (per expert in an MoE),
``E`` routed experts of which each token uses ``k``, ``sh`` shared experts, vocabulary ``V``, and
``p`` bytes per activation element (2 for bf16/fp16), on ``t`` tensor-parallel ranks:

Multiply-accumulates of one layer's forward (each divided by ``t`` under tensor parallelism):

- attention projections, each its own matmul: queries and output ``T*h*a*d`` each, keys and
  values ``T*h*kv*d`` each (``attention_matmuls``; latent attention's low-rank projections
  likewise, its down-projections whole on every TP rank)
- attention scores: ``T*s*a*(d_qk + d_v)`` (QK^T and AV; ``2*T*s*h`` for plain heads), halved
  by the causal mask where flash attention skips the masked half
- MLP: ``MACw_mlp = g*T*h*f`` with ``g = 3`` for a gated (SwiGLU) MLP, 2 otherwise; in an MoE
  layer ``(k + sh)*g*T*h*f`` plus the router's ``T*h*E``

Every matmul runs at ``Hardware.gemm_throughput(x)``, ``x`` its own smallest dimension (tokens,
``h``, ``a*d/t`` for queries and output, ``kv*d/t`` for keys and values only, ``f/t`` for the
MLP, the head size for the scores; an expert sees ``T*k*ep/E`` tokens), at the FP8
peak where the training uses FP8 and the GPU has it. Context parallelism (``cp`` ranks) gives
each rank ``T/cp`` tokens of every sequence (``context_exchange`` for ring attention's traffic).
Around the matmuls F and B each move the
layer's activations through memory several times (norms, softmax, dropout, activation
functions, residual adds): ``ELEMENTWISE_PER_KEPT_BYTE`` times the bytes the layer keeps for
its backward (attention scores aside), at memory bandwidth. W is matmuls only. So:

- F = weight matmuls + score matmuls + elementwise
- B (input gradients) = weight matmuls + twice the score matmuls + elementwise
- W (weight gradients) = weight matmuls
- each is at least the time to stream the layer's parameters through memory once, and each
  pays ``PASS_OVERHEAD`` more, the time a measured step spends per layer and pass around the
  passes themselves

The constants come from fitting the zero-bubble paper's profiled A100 pass times
(docs/plan.md, "Calibration"): W/F is 0.5 to 0.75 there, not the 1.0 matmul-only counting gives.

Activation memory a layer's forward keeps until its backward, in bytes (Korthikanti et al.'s
``34sbh + 5as^2b`` for a plain 4h MLP at ``p = 2``, generalised; sequence parallelism divides it
by ``t``):

- norms and attention: ``7.5*p*T*h``, plus ``2.5*p*a*s*T`` for the attention scores unless
  flash attention recomputes them
- MLP, per active expert (``k + sh`` of them in an MoE layer, one in a dense one):
  ``p*T*h + 2*(g-1)*p*T*f``
- recompute ``selective`` keeps neither the norms' outputs (``2*p*T*h``) nor the scores and
  redoes them in B (their elementwise traffic, and the score matmuls without flash attention);
  ``full`` keeps only the layer's input (``p*T*h``) and reruns the whole F inside B
- FP8 training caches the weight matmuls' inputs in FP8 (half of the bytes W needs)

What W still needs after B is the inputs of the weight matmuls and the gradients of their
outputs: attention ``p*T*(4h + 2*kv*d)``, MLP ``p*T*(2h + g*f)`` per active expert; ``w_memory``
is that over the whole.

Parameters: attention ``h*(2h + 2*kv*d)``, MLP ``g*h*f`` per expert (an MoE layer holds ``E + sh``
experts and a ``h*E`` router; expert parallelism spreads the ``E`` routed experts over ``ep``
ranks), norms ``2h``; embedding and head ``V*h`` each; all but the norms divided by ``t``.
Training state per parameter (``Training.state_bytes_per_parameter``): bf16 weights (2) and
gradients (2), fp32 Adam master weights and two moments (12); ZeRO-1 shards the 12 over the
data-parallel ranks, ZeRO-2 the gradients too, ZeRO-3 the weights as well.

Traffic: a stage boundary carries ``T*h*p`` bytes each way (``Hardware.p2p_time``). An MoE
layer's forward sends its tokens to their experts and back (dispatch and combine),
``2*k*T*h*p*(ep-1)/ep`` bytes leaving the rank, and its backward the same, over the node's
fabric when the EP group fits in a node and the network otherwise. Tensor parallelism with
sequence parallelism all-gathers and reduce-scatters ``T*h*p`` bytes twice in F and twice in B
over the node's fabric; ZeRO-3 all-gathers a stage's weights in every F and B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cutpipe.plan.costs.hardware import GPUS, Hardware, gpu
from cutpipe.sim.costs import RECOMPUTE_MODES
from cutpipe.spec import ModelSpec

__all__ = ["GPUS", "Hardware", "ItemCost", "Training", "gpu", "model_items"]

#: Fitted to the zero-bubble paper's profiled F and B on A100 (docs/plan.md, "Calibration").
ELEMENTWISE_PER_KEPT_BYTE = 8.7
#: Fitted to the same paper's measured throughput with ZB-2p (docs/plan.md, "Calibration"): the
#: time a measured step spends per layer and pass beyond the profiled passes themselves
#: (launches and synchronisation between passes), added to each of F, B and W.
PASS_OVERHEAD = 0.31e-3
#: Adam with fp32 master weights reads the gradient, master weight and moments and writes them
#: back with the bf16 weight: about 28 bytes per parameter through memory per step.
OPTIMIZER_BYTES_PER_PARAMETER = 28
#: Without ZeRO: bf16 weights and gradients, fp32 Adam master weights and two moments.
STATE_BYTES_PER_PARAMETER = 16


@dataclass(frozen=True)
class Training:
    """How the model is trained, beyond its shape: what changes the cost of each item."""

    zero: int = 0  # ZeRO stage over the data-parallel ranks: 0 (none), 1, 2, 3
    dp: int = 1  # data-parallel ranks that ZeRO shards over
    recompute: str = "none"  # none | selective | full
    fp8: bool = False  # FP8 matmuls (where the GPU has them)
    tp: int = 1  # tensor-parallel ranks inside a node
    #: with TP: norms, dropout and residuals split over the TP ranks along the sequence
    #: (Korthikanti et al. 2022), else replicated on every TP rank
    sequence_parallel: bool = True
    cp: int = 1  # context-parallel ranks: each holds 1/cp of every sequence (ring attention)

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"sequence_parallel must be True or False, got {self.sequence_parallel!r}"
            )
        for name in ("dp", "tp", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")

    @property
    def sharding_ranks(self) -> int:
        """The ranks holding the same dense weights, over which gradients are reduced and ZeRO
        shards: the data-parallel ranks times the context-parallel ones."""
        return self.dp * self.cp

    @property
    def state_bytes_per_parameter(self) -> float:
        """Weights, gradients and Adam state per parameter, after ZeRO's sharding."""
        return self.state_bytes_over(self.sharding_ranks)

    def state_bytes_over(self, ranks: int) -> float:
        """Per parameter replicated on ``ranks`` data-parallel ranks (a routed expert is on
        DP/EP of them): ZeRO shards over those."""
        weights, grads, optimizer = 2.0, 2.0, 12.0
        if self.zero >= 1:
            optimizer /= ranks
        if self.zero >= 2:
            grads /= ranks
        if self.zero >= 3:
            weights /= ranks
        return weights + grads + optimizer

    def replicas(self, ep: int) -> int:
        """The data- (and context-) parallel ranks that hold the same routed experts."""
        return max(1, self.sharding_ranks // ep)

    def short(self) -> str:
        """A table cell: ``Z1 sel fp8`` (TP is part of the layout)."""
        words = [f"Z{self.zero}", {"none": "", "selective": "sel", "full": "full"}[self.recompute]]
        return " ".join(w for w in [*words, "fp8" if self.fp8 else ""] if w)

    def describe(self) -> str:
        parts = [f"ZeRO-{self.zero}" if self.zero else "no ZeRO", f"recompute {self.recompute}"]
        parts.append("FP8" if self.fp8 else "bf16")
        return ", ".join(parts)


PLAIN = Training()


@dataclass(frozen=True)
class ItemCost:
    """What one cost item (embedding, a layer, the head) costs per microbatch on one rank."""

    name: str
    forward: float  # seconds
    backward: float  # input-gradient backward, seconds
    weight: float  # weight-gradient backward, seconds
    activation: float  # bytes kept from F until B
    parameters: float  # parameters stored on the rank (routed experts divided by ep)
    ep_forward: float = 0.0  # all-to-all seconds inside F
    ep_backward: float = 0.0  # all-to-all seconds inside B
    ep_bytes: float = 0.0  # bytes one of those all-to-alls sends off the rank
    expert_parameters: float = 0.0  # of ``parameters``, the routed experts' (sharded by EP)
    bytes_per_parameter: float = STATE_BYTES_PER_PARAMETER  # training state (``Training``)
    expert_bytes_per_parameter: float = STATE_BYTES_PER_PARAMETER  # ZeRO over DP/EP ranks

    @property
    def state_bytes(self) -> float:
        dense = self.parameters - self.expert_parameters
        return dense * self.bytes_per_parameter + self.expert_parameters * (
            self.expert_bytes_per_parameter
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _gemm(macs: float, smallest: float, hardware: Hardware, fp8: bool) -> float:
    return 2 * macs / hardware.gemm_throughput(smallest, fp8) if macs else 0.0


def _floor(time: float, params: float, model: ModelSpec, hardware: Hardware) -> float:
    """Small microbatches are memory-bound: a pass streams its weights at least once."""
    return max(time, params * model.element_bytes / hardware.memory_bandwidth)


def _collective(size: float, ranks: int, bandwidth: float, latency: float) -> float:
    """One all-gather or reduce-scatter of ``size`` bytes (the whole) over a ring of ``ranks``."""
    if ranks <= 1 or size == 0:
        return 0.0
    return (ranks - 1) / ranks * size / bandwidth + (ranks - 1) * latency


def attention_weights(model: ModelSpec) -> int:
    """The numbers in one layer's attention matrices (its multiply-adds per token): grouped
    heads, or DeepSeek's latent attention."""
    return int(sum(macs for macs, _ in attention_matmuls(model, 1, 1)))


#: A matrix multiply: (multiply-adds, its smallest dimension) for the throughput curve.
Matmul = tuple[float, float]


def attention_matmuls(model: ModelSpec, tokens: float, tp: int) -> list[Matmul]:
    """One layer's attention projections for ``tokens`` tokens on one of ``tp`` ranks, each
    with its own shape: grouped key/value projections are narrow only where the key/value
    heads are (a Llama-style layer at TP 8 multiplies its queries at ``h x h/8`` and its keys
    at ``h x kv*d/8``). Latent attention's down-projections (to the query and key/value ranks)
    are not split by tensor parallelism; its up-projections and the output are, by heads."""
    h, a, T, t = model.hidden, model.heads, tokens, tp
    if model.latent_attention:
        query = a * (model.qk_nope_head_dim + model.qk_rope_head_dim)
        rank, latent = model.q_lora_rank, model.kv_lora_rank
        up_kv = a * (model.qk_nope_head_dim + model.v_head_dim)
        out = a * model.v_head_dim
        matmuls = [
            (T * h * (latent + model.qk_rope_head_dim), min(T, h, latent + model.qk_rope_head_dim)),
            (T * latent * up_kv / t, min(T, latent, up_kv / t)),
            (T * out * h / t, min(T, out / t, h)),
        ]
        if rank:
            matmuls += [
                (T * h * rank, min(T, h, rank)),
                (T * rank * query / t, min(T, rank, query / t)),
            ]
        else:
            matmuls.append((T * h * query / t, min(T, h, query / t)))
        return matmuls
    d, kv = model.attention_head_dim, model.kv_heads or a
    # fewer key/value heads than TP ranks: each rank keeps (a copy of) one
    keys = max(kv / t, 1.0) * d
    return [
        (T * h * a * d / t, min(T, h, a * d / t)),  # queries
        (2 * T * h * keys, min(T, h, keys)),  # keys and values
        (T * a * d * h / t, min(T, a * d / t, h)),  # output
    ]


def attention_replicated(model: ModelSpec) -> int:
    """Attention weights every TP rank holds whole: latent attention's down-projections."""
    if not model.latent_attention:
        return 0
    h = model.hidden
    return h * (model.kv_lora_rank + model.qk_rope_head_dim) + h * model.q_lora_rank


def score_macs(model: ModelSpec, queries: float) -> tuple[float, float]:
    """Multiply-adds of QK^T and AV for ``queries`` query tokens against the whole sequence
    (halved by the causal mask where flash attention skips it), and the heads' narrowest
    size: latent attention's scores use its query/key head size (nope + rope), AV its value
    head size."""
    if model.latent_attention:
        qk, v = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
    else:
        qk = v = model.attention_head_dim
    causal = 0.5 if model.flash_attention else 1.0
    return queries * model.seq_len * model.heads * (qk + v) * causal, min(qk, v, model.seq_len)


def score_traffic(model: ModelSpec, queries: float) -> tuple[float, float]:
    """Bytes the softmax and dropout move over the attention scores of ``queries`` query
    tokens in F and in B, without flash attention (which keeps the scores on chip): Megatron-LM's
    fused scale-mask-softmax and the dropout after it read the scores and write the dropped
    probabilities and a one-byte mask (``2p + 1`` per score); the backward reads the gradient
    and the mask and writes the scores' gradient (``2p + 1``). These bytes grow with the
    sequence where the rest of a layer's traffic does not (docs/plan.md, "Calibration")."""
    if model.flash_attention:
        return 0.0, 0.0
    moved = (2 * model.element_bytes + 1) * queries * model.heads * model.seq_len
    return moved, moved


def mlp_matmuls(tokens: float, hidden: int, ffn: int, gated: bool, tp: int) -> list[Matmul]:
    """One MLP (or one expert's) on ``tokens`` tokens: the up (and gate) projection, split by
    output columns over ``tp`` ranks, and the down projection, split by input rows."""
    up = 2 if gated else 1
    return [
        (up * tokens * hidden * ffn / tp, min(tokens, hidden, ffn / tp)),
        (tokens * ffn * hidden / tp, min(tokens, ffn / tp, hidden)),
    ]


def small_parameters(model: ModelSpec, moe: bool) -> int:
    """One layer's parameters outside its matrices and its two norms: biases, query/key norms,
    the latent attention's norms, the shared experts' gate (not split by tensor parallelism)."""
    h, a = model.hidden, model.heads
    count = 0
    if model.latent_attention:
        count += model.q_lora_rank + model.kv_lora_rank  # their norms
        if model.qkv_bias:
            count += model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim
    else:
        d, kv_heads = model.attention_head_dim, model.kv_heads or a
        count += (a * d + 2 * kv_heads * d if model.qkv_bias else 0) + (
            2 * d if model.qk_norm else 0
        )
    count += h if model.o_bias else 0
    if moe:
        count += h if model.shared_expert_gate and model.shared_experts else 0
    elif model.mlp_bias:
        ffn = model.dense_ffn or model.ffn
        count += (2 * ffn if model.gated_mlp else ffn) + h
    return count


#: Of a layer's kept activation, the bytes per token and hidden unit (times ``p``) that every
#: TP rank holds whole without sequence parallelism (Korthikanti et al. 2022, section 4.2.2:
#: 10sbh of 34sbh at 2 bytes): the two norms' inputs, the inputs of the QKV and first MLP
#: projections, the two dropout masks.
REPLICATED_WITHOUT_SP = 5.0


def layer_cost(
    model: ModelSpec, hardware: Hardware, index: int, ep: int = 1, ep_within_node: bool = True,
    training: Training = PLAIN,
) -> ItemCost:  # fmt: skip
    """One transformer layer (``index`` from 0) on one rank."""
    t, cp = training.tp, training.cp
    T = model.tokens / cp  # context parallelism: each rank holds 1/cp of every sequence
    h = model.hidden
    g = 3 if model.gated_mlp else 2
    p = model.element_bytes
    fp8 = training.fp8
    moe = model.moe and index >= model.dense_layers
    ffn = model.ffn if moe or not model.dense_ffn else model.dense_ffn
    attention_params = attention_weights(model)
    replicated_params = attention_replicated(model)
    matmuls = attention_matmuls(model, T, t)
    if moe:
        active = model.top_k + model.shared_experts
        expert_tokens = T * model.top_k * ep / model.experts  # tokens one expert multiplies
        experts = mlp_matmuls(T * model.top_k, h, ffn, model.gated_mlp, t)
        expert_weights = sum(
            _gemm(macs, min(smallest, expert_tokens), hardware, fp8) for macs, smallest in experts
        )
        for _ in range(model.shared_experts):
            matmuls += mlp_matmuls(T, h, ffn, model.gated_mlp, t)
        router = _gemm(T * h * model.experts, min(T, model.experts), hardware, False)
        routed = model.experts / ep * g * h * ffn
        mlp_params = routed + model.shared_experts * g * h * ffn + h * model.experts
    else:
        active = 1
        matmuls += mlp_matmuls(T, h, ffn, model.gated_mlp, t)
        expert_weights = router = 0.0
        mlp_params = g * h * ffn
        routed = 0.0
    weights = (
        sum(_gemm(macs, smallest, hardware, fp8) for macs, smallest in matmuls)
        + expert_weights
        + router
    )
    macs, narrowest = score_macs(model, T)
    scores = _gemm(macs / t, narrowest, hardware, False)
    score_bytes = 0.0 if model.flash_attention else 2.5 * p * model.heads * model.seq_len * T / t
    norms = 2 * p * T * h / t
    kept = 7.5 * p * T * h + active * (p * T * h + 2 * (g - 1) * p * T * ffn)
    if t > 1 and not training.sequence_parallel:  # norms, dropout, residual whole on each rank
        whole = REPLICATED_WITHOUT_SP * p * T * h
        kept = (kept - whole) / t + whole
        norms *= t
    else:
        kept /= t
    elementwise = ELEMENTWISE_PER_KEPT_BYTE * kept / hardware.memory_bandwidth
    softmax_forward, softmax_backward = (
        moved / hardware.memory_bandwidth for moved in score_traffic(model, T / t)
    )
    forward = weights + scores + elementwise + softmax_forward
    backward = weights + 2 * scores + elementwise + softmax_backward
    activation = kept + score_bytes
    if fp8 and hardware.fp8_flops:
        activation -= 0.5 * w_memory(model) * kept  # matmul inputs cached in FP8
    if training.recompute == "selective":
        activation -= norms + score_bytes
        backward += ELEMENTWISE_PER_KEPT_BYTE * norms / hardware.memory_bandwidth + (
            0.0 if model.flash_attention else scores + softmax_forward
        )
    elif training.recompute == "full":  # the layer's input, split over TP with SP
        activation = p * T * h / (t if training.sequence_parallel else 1)
        backward += forward
    params = (
        (attention_params - replicated_params + mlp_params) / t
        + replicated_params
        + 2 * h
        + small_parameters(model, moe)
    )
    ep_forward = ep_backward = ep_bytes = 0.0
    if moe and ep > 1:
        ep_bytes = model.top_k * T * h * p * (ep - 1) / ep  # one direction: dispatch or combine
        bandwidth, latency = hardware.link(ep_within_node)
        ep_forward = ep_backward = 2 * (ep_bytes / bandwidth + latency)
    if t > 1:
        # sequence parallel: all-gather before and reduce-scatter after attention and the MLP;
        # without it an all-reduce after each (a reduce-scatter and an all-gather's traffic):
        # the same bytes either way (Korthikanti et al. 2022, section 4.2.2)
        tp_time = 4 * _collective(T * h * p, t, *hardware.collective_link(True))
        forward += tp_time
        backward += tp_time
    if cp > 1:
        exchange = context_exchange(model, hardware, training, T)
        # ring attention sends the next block while it multiplies this one
        forward += max(0.0, exchange - scores)
        backward += max(0.0, 2 * exchange - 2 * scores)  # keys, values and their gradients
    if (
        training.zero == 3 and training.sharding_ranks > 1
    ):  # every F and B gathers the layer's weights
        network = hardware.link(False)
        experts = routed / t
        gather = _collective(
            (params - experts) * p, training.sharding_ranks, *network
        ) + _collective(experts * p, training.replicas(ep), *network)
        forward += gather
        backward += gather
    weight = weights
    return ItemCost(
        name=f"layer {index}{' (MoE)' if moe else ''}",
        forward=_floor(forward, params, model, hardware) + PASS_OVERHEAD,
        backward=_floor(backward, params, model, hardware) + PASS_OVERHEAD,
        weight=_floor(weight, params, model, hardware) + PASS_OVERHEAD,
        activation=activation,
        parameters=params,
        ep_forward=ep_forward,
        ep_backward=ep_backward,
        ep_bytes=2 * ep_bytes,
        expert_parameters=routed / t,
        bytes_per_parameter=training.state_bytes_per_parameter,
        expert_bytes_per_parameter=training.state_bytes_over(training.replicas(ep)),
    )


def context_exchange(
    model: ModelSpec, hardware: Hardware, training: Training, tokens: float
) -> float:
    """Seconds ring attention spends passing key/value blocks in one forward: ``cp - 1`` sends
    of this rank's ``tokens`` keys and values (its TP share), over the node's fabric while the
    TP x CP group fits in a node, else the network."""
    t, cp = training.tp, training.cp
    if model.latent_attention:
        width = model.heads * (model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim)
    else:
        width = 2 * max((model.kv_heads or model.heads) / t, 1.0) * model.attention_head_dim * t
    bandwidth, latency = hardware.link(t * cp <= hardware.gpus_per_node)
    block = tokens * width / t * model.element_bytes
    return (cp - 1) * (block / bandwidth + latency)


def embedding_cost(model: ModelSpec, hardware: Hardware, training: Training = PLAIN) -> ItemCost:
    tokens = model.tokens / training.cp
    moved = tokens * model.hidden * model.element_bytes / hardware.memory_bandwidth
    return ItemCost("embedding", forward=moved, backward=0.0, weight=moved, activation=0.0,
                    parameters=model.vocab * model.hidden / training.tp,
                    bytes_per_parameter=training.state_bytes_per_parameter)  # fmt: skip


def head_cost(model: ModelSpec, hardware: Hardware, training: Training = PLAIN) -> ItemCost:
    t, tokens = training.tp, model.tokens / training.cp
    macs = tokens * model.hidden * model.vocab / t
    params = model.vocab * model.hidden / t + model.hidden
    time = _floor(
        _gemm(macs, min(tokens, model.hidden, model.vocab / t), hardware, False),
        params, model, hardware,
    )  # fmt: skip
    logits = tokens * model.vocab / t * 4  # fp32 logits kept for the loss
    return ItemCost("head", forward=time, backward=time, weight=time,
                    activation=tokens * model.hidden * model.element_bytes + logits,
                    parameters=params, bytes_per_parameter=training.state_bytes_per_parameter)  # fmt: skip


def model_items(
    model: ModelSpec, hardware: Hardware, ep: int = 1, ep_within_node: bool = True,
    training: Training = PLAIN,
) -> list[ItemCost]:  # fmt: skip
    """The model's cost items in order: embedding, every layer, head."""
    if model.moe and model.experts % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the {model.experts} experts")
    if training.tp > hardware.gpus_per_node:
        raise ValueError(
            f"tensor parallelism stays inside a node: TP={training.tp} is more than the "
            f"{hardware.gpus_per_node} GPUs of a {hardware.name} node"
        )
    layers = [
        layer_cost(model, hardware, i, ep, ep_within_node, training) for i in range(model.layers)
    ]
    return [
        embedding_cost(model, hardware, training),
        *layers,
        head_cost(model, hardware, training),
    ]


def w_memory(model: ModelSpec) -> float:
    """The fraction of a layer's activation its W still needs after its B (see the module)."""
    T, h, p = model.tokens, model.hidden, model.element_bytes
    d, kv = h // model.heads, model.kv_heads or model.heads
    g = 3 if model.gated_mlp else 2
    active = model.top_k + model.shared_experts if model.moe else 1
    kept = p * T * (4 * h + 2 * kv * d) + active * p * T * (2 * h + g * model.ffn)
    total = 7.5 * p * T * h + active * (p * T * h + 2 * (g - 1) * p * T * model.ffn)
    return min(1.0, kept / total)


def boundary_bytes(model: ModelSpec, training: Training = PLAIN) -> float:
    """Bytes of the activation (or its gradient) crossing one stage boundary per microbatch
    (split over the tensor-parallel ranks, and over the context-parallel ones that each hold
    part of the sequence). Without sequence parallelism Megatron-LM still sends a TP rank's
    share and all-gathers it over the node's fabric on arrival (Narayanan et al. 2021, 4.1)."""
    return model.tokens * model.hidden * model.element_bytes / (training.tp * training.cp)


def p2p_time(
    model: ModelSpec, hardware: Hardware, within_node: bool, training: Training = PLAIN
) -> float:
    return hardware.p2p_time(boundary_bytes(model, training), within_node)


def training_flops_per_token(model: ModelSpec) -> float:
    """FLOPs of F, B and W for one token through the whole model (three times the forward's
    matmuls, routed experts counted for the ``k`` a token uses): the numerator of MFU."""
    h = model.hidden
    g = 3 if model.gated_mlp else 2
    attention = attention_weights(model) + score_macs(model, 1)[0]
    dense_ffn = model.dense_ffn or model.ffn
    if model.moe:
        moe_layers = model.layers - model.dense_layers
        mlp = model.dense_layers * g * h * dense_ffn + moe_layers * (
            (model.top_k + model.shared_experts) * g * h * model.ffn + h * model.experts
        )
    else:
        mlp = model.layers * g * h * model.ffn
    return 3 * 2 * (model.layers * attention + mlp + h * model.vocab)


def optimizer_time(
    parameters: float, hardware: Hardware, training: Training = PLAIN, experts: float = 0.0,
    ep: int = 1,
) -> float:  # fmt: skip
    """Seconds for one Adam step over a rank's ``parameters`` (of which ``experts`` are routed
    experts, replicated on DP/EP ranks); ZeRO-1 and up step only the rank's shard."""
    if training.zero >= 1:
        parameters = (parameters - experts) / training.sharding_ranks + experts / training.replicas(
            ep
        )
    return parameters * OPTIMIZER_BYTES_PER_PARAMETER / hardware.memory_bandwidth


def summarize(items: Sequence[ItemCost]) -> dict[str, float]:
    """Totals over items: times per microbatch, activation and training-state bytes."""
    return {
        "forward": sum(i.forward for i in items),
        "backward": sum(i.backward for i in items),
        "weight": sum(i.weight for i in items),
        "activation": sum(i.activation for i in items),
        "parameters": sum(i.parameters for i in items),
        "state_bytes": sum(i.state_bytes for i in items),
    }
