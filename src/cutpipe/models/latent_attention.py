"""Multi-head latent attention (MLA), DeepSeek-V2's and V3's: keys and values come out of one
low-rank latent per token, and only a few dimensions of each head carry the position.

Each query head is ``qk_nope_head_dim`` dimensions without position and ``qk_rope_head_dim``
rotated ones; the queries come from the hidden state directly, or through a rank
``q_lora_rank`` bottleneck (with an RMSNorm) where it is set. ``kv_down`` projects each token to
a ``kv_lora_rank`` latent (normed) and ``qk_rope_head_dim`` rotated key dimensions that every
head shares; ``kv_up`` expands the latent into each head's unrotated key and its value
(``v_head_dim``). Named after what the layers do; ``cutpipe.models.hf`` maps them onto the
Hugging Face names (``q_a_proj``, ``kv_a_proj_with_mqa``, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cutpipe.models.transformer import RMSNorm, Rotary, _rotate, _rotate_pairs
from cutpipe.spec import ModelSpec

#: The epsilon of the latents' norms, which the families fix rather than configure.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Causal multi-head latent attention; the softmax scale is ``1/sqrt(query head size)``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads = spec.heads
        self.nope, self.rope = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.latent, self.value = spec.kv_lora_rank, spec.v_head_dim
        query = self.heads * (self.nope + self.rope)
        self.q: nn.Linear | None = None
        self.q_down: nn.Linear | None = None
        if spec.q_lora_rank:
            self.q_down = nn.Linear(spec.hidden, spec.q_lora_rank, bias=spec.qkv_bias)
            self.q_down_norm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS)
            self.q_up = nn.Linear(spec.q_lora_rank, query, bias=False)
        else:
            self.q = nn.Linear(spec.hidden, query, bias=False)
        self.kv_down = nn.Linear(spec.hidden, self.latent + self.rope, bias=spec.qkv_bias)
        self.kv_down_norm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_up = nn.Linear(self.latent, self.heads * (self.nope + self.value), bias=False)
        self.o = nn.Linear(self.heads * self.value, spec.hidden, bias=spec.o_bias)
        self.rotary = Rotary(spec) if spec.rope_theta else None
        self.rotate = _rotate_pairs if spec.rope_interleave else _rotate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        if self.q_down is not None:
            q = self.q_up(self.q_down_norm(self.q_down(x)))
        else:
            assert self.q is not None
            q = self.q(x)
        q = q.view(batch, length, self.heads, self.nope + self.rope).transpose(1, 2)
        q_plain, q_turned = q.split([self.nope, self.rope], dim=-1)
        latent, k_turned = self.kv_down(x).split([self.latent, self.rope], dim=-1)
        kv = self.kv_up(self.kv_down_norm(latent))
        kv = kv.view(batch, length, self.heads, self.nope + self.value).transpose(1, 2)
        k_plain, v = kv.split([self.nope, self.value], dim=-1)
        k_turned = k_turned.view(batch, 1, length, self.rope)
        if self.rotary is not None:
            cos, sin = self.rotary(length, x.device)
            q_turned, k_turned = self.rotate(q_turned, cos, sin), self.rotate(k_turned, cos, sin)
        q = torch.cat((q_plain, q_turned), dim=-1)
        k = torch.cat((k_plain, k_turned.expand(-1, self.heads, -1, -1)), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, length, self.heads * self.value))
