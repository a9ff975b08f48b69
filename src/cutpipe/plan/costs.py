"""Costs from a model and a machine: per-layer F, B, W times, memory and traffic.

A model is a stack of cost *items*: the embedding, the transformer layers, the head. For one
microbatch of ``b`` sequences of ``s`` tokens (``T = b*s`` tokens), hidden size ``h``, ``a``
attention heads of size ``d = h/a``, ``kv`` key/value heads, FFN size ``f`` (per expert in an MoE),
``E`` routed experts of which each token uses ``k``, ``sh`` shared experts, vocabulary ``V``, and
``p`` bytes per activation element (2 for bf16/fp16):

Multiply-accumulates of one layer's forward:

- attention projections: ``MACw_att = T*h*(2h + 2*kv*d)`` (Q, O: h x h; K, V: h x kv*d)
- attention scores: ``MACs = T*s*h`` (QK^T and AV, ``2*T*s*h``, halved by the causal mask)
- MLP: ``MACw_mlp = g*T*h*f`` with ``g = 3`` for a gated (SwiGLU) MLP, 2 otherwise; in an MoE
  layer ``(k + sh)*g*T*h*f`` plus the router's ``T*h*E``

Times, at ``throughput = peak FLOP/s * efficiency`` (every matmul is 2 FLOPs per MAC):

- F = ``2*(MACw + MACs) / throughput``
- B (input gradients) = ``2*(MACw + 2*MACs) / throughput``: one matmul per weight matmul, two
  per attention-score matmul
- W (weight gradients) = ``2*MACw / throughput``: one matmul per weight matmul
- each is at least the time to stream the layer's parameters through memory once,
  ``params*p / memory bandwidth`` (small microbatches are memory-bound)

So F + B + W is three forwards, the usual rule. The embedding costs a gather in F and a
scatter-add in W (``T*h*p`` bytes each, at memory bandwidth); the head is a ``T*h*V`` matmul in
each of F, B and W.

Activation memory a layer's forward keeps until its backward, in bytes (Korthikanti et al.'s
``4sbh + 11sbh`` for the norms and attention at ``p = 2``, generalised):

- norms and attention: ``7.5*p*T*h``, plus ``2.5*p*a*s*T`` for the attention scores unless
  flash attention recomputes them
- MLP, per active expert (``k + sh`` of them in an MoE layer, one in a dense one):
  ``p*T*h + 2*(g-1)*p*T*f``: its input and, gated, the gate and up outputs, the activation and
  their product (4 of size f), plain, the up output and the activation (2)

What W still needs after B is the inputs of the weight matmuls and the gradients of their
outputs: attention ``p*T*(4h + 2*kv*d)``, MLP ``p*T*(2h + g*f)`` per active expert; ``w_memory``
is that over the whole: for a plain MLP of size 4h, 32h of 33h per token (the zero-bubble paper
finds 32h of 34h; the other h is a dropout mask this model does not have).

Parameters: attention ``h*(2h + 2*kv*d)``, MLP ``g*h*f`` per expert (an MoE layer holds ``E + sh``
experts and a ``h*E`` router; expert parallelism spreads the ``E`` routed experts over ``ep``
ranks), norms ``2h``; embedding and head ``V*h`` each. Training state is 16 bytes per parameter
(bf16 weights and gradients, fp32 Adam master weights and two moments).

Traffic: a stage boundary carries ``T*h*p`` bytes each way. An MoE layer's forward sends its
tokens to their experts and back (dispatch and combine), ``2*k*T*h*p*(ep-1)/ep`` bytes leaving the
rank, and its backward the same; each transfer takes ``bytes / bandwidth + latency`` over NVLink
when it stays in a node and the network otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cutpipe.spec import ModelSpec

STATE_BYTES_PER_PARAMETER = 16


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the links between them. Bandwidths are per GPU and direction."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes
    intra_bandwidth: float  # bytes/s within a node (NVLink)
    inter_bandwidth: float  # bytes/s between nodes (network)
    intra_latency: float = 5e-6  # s
    inter_latency: float = 10e-6  # s
    gpus_per_node: int = 8
    efficiency: float = 0.5  # the fraction of peak FLOP/s a training step achieves

    @property
    def throughput(self) -> float:
        return self.peak_flops * self.efficiency

    def link(self, within_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) of a transfer inside a node or across nodes."""
        if within_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency


#: Public figures: dense BF16 tensor-core peak, HBM bandwidth and size, NVLink per direction
#: (half the quoted bidirectional figure), one InfiniBand NIC per GPU (HDR 200 Gb/s, NDR 400 Gb/s).
GPUS = {
    "A100": Hardware("A100", 312e12, 2.039e12, 80e9, 300e9, 25e9),
    "H100": Hardware("H100", 989e12, 3.35e12, 80e9, 450e9, 50e9),
    "H200": Hardware("H200", 989e12, 4.8e12, 141e9, 450e9, 50e9),
}


def gpu(name: str) -> Hardware:
    try:
        return GPUS[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


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

    @property
    def state_bytes(self) -> float:
        return self.parameters * STATE_BYTES_PER_PARAMETER

    def to_dict(self) -> dict:
        return asdict(self)


def _matmul_time(macs: float, params: float, model: ModelSpec, hardware: Hardware) -> float:
    compute = 2 * macs / hardware.throughput
    memory = params * model.element_bytes / hardware.memory_bandwidth
    return max(compute, memory)


def layer_cost(
    model: ModelSpec, hardware: Hardware, index: int, ep: int = 1, ep_within_node: bool = True
) -> ItemCost:
    """One transformer layer (``index`` from 0) on one rank."""
    T, s, h, a = model.tokens, model.seq_len, model.hidden, model.heads
    d = h // a
    kv = model.kv_heads or a
    g = 3 if model.gated_mlp else 2
    p = model.element_bytes
    moe = model.moe and index >= model.dense_layers
    ffn = model.ffn if moe or not model.dense_ffn else model.dense_ffn
    attention_params = h * (2 * h + 2 * kv * d)
    if moe:
        active = model.top_k + model.shared_experts
        mlp_macs = active * g * T * h * ffn + T * h * model.experts
        routed = model.experts / ep * g * h * ffn
        mlp_params = routed + model.shared_experts * g * h * ffn + h * model.experts
    else:
        active = 1
        mlp_macs = g * T * h * ffn
        mlp_params = g * h * ffn
        routed = 0.0
    weight_macs = T * attention_params + mlp_macs
    score_macs = T * s * h
    params = attention_params + mlp_params + 2 * h
    activation = 7.5 * p * T * h + active * (p * T * h + 2 * (g - 1) * p * T * ffn)
    if not model.flash_attention:
        activation += 2.5 * p * a * s * T
    ep_forward = ep_backward = ep_bytes = 0.0
    if moe and ep > 1:
        ep_bytes = model.top_k * T * h * p * (ep - 1) / ep  # one direction: dispatch or combine
        bandwidth, latency = hardware.link(ep_within_node)
        ep_forward = ep_backward = 2 * (ep_bytes / bandwidth + latency)
    return ItemCost(
        name=f"layer {index}{' (MoE)' if moe else ''}",
        forward=_matmul_time(weight_macs + score_macs, params, model, hardware),
        backward=_matmul_time(weight_macs + 2 * score_macs, params, model, hardware),
        weight=_matmul_time(weight_macs, params, model, hardware),
        activation=activation,
        parameters=params,
        ep_forward=ep_forward,
        ep_backward=ep_backward,
        ep_bytes=2 * ep_bytes,
        expert_parameters=routed,
    )


def embedding_cost(model: ModelSpec, hardware: Hardware) -> ItemCost:
    moved = model.tokens * model.hidden * model.element_bytes / hardware.memory_bandwidth
    return ItemCost("embedding", forward=moved, backward=0.0, weight=moved, activation=0.0,
                    parameters=model.vocab * model.hidden)  # fmt: skip


def head_cost(model: ModelSpec, hardware: Hardware) -> ItemCost:
    macs = model.tokens * model.hidden * model.vocab
    params = model.vocab * model.hidden + model.hidden
    time = _matmul_time(macs, params, model, hardware)
    logits = model.tokens * model.vocab * 4  # fp32 logits kept for the loss
    return ItemCost("head", forward=time, backward=time, weight=time,
                    activation=model.tokens * model.hidden * model.element_bytes + logits, parameters=params)  # fmt: skip


def model_items(
    model: ModelSpec, hardware: Hardware, ep: int = 1, ep_within_node: bool = True
) -> list[ItemCost]:
    """The model's cost items in order: embedding, every layer, head."""
    if model.moe and model.experts % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the {model.experts} experts")
    layers = [layer_cost(model, hardware, i, ep, ep_within_node) for i in range(model.layers)]
    return [embedding_cost(model, hardware), *layers, head_cost(model, hardware)]


def w_memory(model: ModelSpec) -> float:
    """The fraction of a layer's activation its W still needs after its B (see the module)."""
    T, h, p = model.tokens, model.hidden, model.element_bytes
    d, kv = h // model.heads, model.kv_heads or model.heads
    g = 3 if model.gated_mlp else 2
    active = model.top_k + model.shared_experts if model.moe else 1
    kept = p * T * (4 * h + 2 * kv * d) + active * p * T * (2 * h + g * model.ffn)
    total = 7.5 * p * T * h + active * (p * T * h + 2 * (g - 1) * p * T * model.ffn)
    return min(1.0, kept / total)


def boundary_bytes(model: ModelSpec) -> float:
    """Bytes of the activation (or its gradient) crossing one stage boundary per microbatch."""
    return model.tokens * model.hidden * model.element_bytes


def p2p_time(model: ModelSpec, hardware: Hardware, within_node: bool) -> float:
    bandwidth, latency = hardware.link(within_node)
    return boundary_bytes(model) / bandwidth + latency


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
