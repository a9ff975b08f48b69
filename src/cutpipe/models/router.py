"""How an MoE's routing may be steered and what it keeps of what it did.

``RoutingOptions`` are the choices a model is built with: a capacity per expert (overflowing
choices are dropped) and a per-expert bias that steers which experts are chosen (DeepSeek-V3's
auxiliary-loss-free balancing; ``cutpipe.parallel.routing.update_routing_bias`` moves it).
``over_capacity`` says which choices a capacity drops, and ``RoutingTally`` adds up, on the
device, what each training forward routed, for ``cutpipe.parallel.routing`` to read on demand.

They live apart from ``MoE`` so that both ways a layer runs (its own forward, and the phased
expert-parallel stage, which calls ``MoE.route``) route, drop and count through the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cutpipe.spec import ModelSpec


@dataclass(frozen=True)
class RoutingOptions:
    """How the MoE layers of a model route (the defaults: as a plain top-k router).

    ``capacity_factor``: each expert takes at most ``ceil(capacity_factor * tokens * top_k /
    experts)`` of a microbatch's choices on this rank; None drops nothing. ``bias``: the MoE
    holds a per-expert bias (a buffer, so checkpoints keep it) added to the scores that pick the
    top k, never to the weights.
    """

    capacity_factor: float | None = None
    bias: bool = False

    def __post_init__(self) -> None:
        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or factor <= 0
        ):
            raise ValueError(
                f"capacity_factor must be a number > 0 (or None: drop no token), got {factor!r}"
            )
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias must be True or False, got {self.bias!r}")


@dataclass(frozen=True)
class RouterScoring:
    """How a router turns its logits into chosen experts and their weights, as the model's
    family defines it (``ModelSpec.router_*``; the defaults: Mixtral's softmax top-k,
    renormalised).

    ``function``: "softmax" over the experts, or "sigmoid" of each (DeepSeek-V3).
    ``groups``/``top_groups``: the experts fall in ``groups`` equal groups and only the best
    ``top_groups`` groups are chosen from, a group scored by its two best (bias included) under
    sigmoid scoring (DeepSeek-V3), by its best under softmax (DeepSeek-V2).
    ``normalise``: the chosen weights divided by their sum; ``scale`` then multiplies them.
    """

    function: str = "softmax"
    normalise: bool = True
    scale: float = 1.0
    groups: int = 0
    top_groups: int = 0

    @classmethod
    def of(cls, spec: ModelSpec) -> RouterScoring:
        return cls(
            spec.router_scoring, spec.router_norm, spec.router_scale, spec.router_groups,
            spec.router_top_groups,
        )  # fmt: skip

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each expert's score, the scores as a distribution over the experts: what the
        load-balancing loss weighs)."""
        if self.function == "sigmoid":
            scores = logits.sigmoid()
            return scores, scores / scores.sum(-1, keepdim=True)
        scores = logits.softmax(-1)
        return scores, scores

    def choose(self, scores: torch.Tensor, bias: torch.Tensor | None, k: int) -> torch.Tensor:
        """The ``k`` experts of each token (``[tokens, k]``), by score plus ``bias``."""
        choice = scores.detach() if bias is None else scores.detach() + bias
        if self.groups:
            tokens, experts = choice.shape
            grouped = choice.view(tokens, self.groups, experts // self.groups)
            if self.function == "sigmoid":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.amax(-1)
            best = group_scores.topk(self.top_groups, dim=-1).indices
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            kept = kept.repeat_interleave(experts // self.groups, dim=1)
            choice = choice.masked_fill(~kept, float("-inf"))
        return choice.topk(k, dim=-1).indices

    def weights(self, chosen_scores: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weights from their scores."""
        weights = chosen_scores
        if self.normalise:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (total + 1e-20 if self.function == "sigmoid" else total)
        return weights * self.scale if self.scale != 1.0 else weights


def capacity(factor: float | None, tokens: int, top_k: int, experts: int) -> int | None:
    """Choices one expert may take from ``tokens`` tokens (None: no limit)."""
    if factor is None:
        return None
    return math.ceil(factor * tokens * top_k / experts)


def choices_per_expert(chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of the choices (``[tokens, k]`` expert indices) went to each expert (int64).

    A comparison and a sum: exact, deterministic and without a host sync on any device (unlike
    ``bincount``, whose output size is read from the data).
    """
    index = torch.arange(experts, device=chosen.device)
    return (chosen.unsqueeze(-1) == index).sum((0, 1))


def over_capacity(chosen: torch.Tensor, scores: torch.Tensor, limit: int) -> torch.Tensor:
    """Which choices (a ``[tokens, k]`` mask) fall past their expert's first ``limit``.

    Each expert keeps its highest-scoring choices, the earliest (by token, then by slot) among
    equal scores: the same choices on every run and in every way the layer runs.
    """
    flat_expert, flat_score = chosen.reshape(-1), scores.detach().reshape(-1)
    best_first = torch.sort(flat_score, descending=True, stable=True).indices
    grouped = best_first[torch.sort(flat_expert[best_first], stable=True).indices]
    expert = flat_expert[grouped]  # ascending: each expert's choices together, best first
    position = torch.arange(expert.numel(), device=expert.device)
    first = torch.searchsorted(expert, expert, right=False)  # where its expert's run begins
    dropped = torch.empty_like(flat_expert, dtype=torch.bool)
    dropped[grouped] = position - first >= limit
    return dropped.view_as(chosen)


class RoutingTally:
    """What one MoE's training forwards routed since the last ``reset``, kept on the device.

    ``add`` costs a few tensor additions and no host sync; the values are read on demand
    (``cutpipe.parallel.routing.routing_statistics``), one sync for all layers.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.microbatches = 0
        self.balance: torch.Tensor | None = None  # the load-balancing losses, summed
        self.routed: torch.Tensor | None = None  # choices per expert (before any drop)
        self.dropped: torch.Tensor | None = None  # choices over their expert's capacity

    def add(
        self, balance: torch.Tensor, routed: torch.Tensor, dropped: torch.Tensor | None
    ) -> None:
        self.microbatches += 1
        self.balance = _plus(self.balance, balance.detach())
        self.routed = _plus(self.routed, routed)
        if dropped is not None:
            self.dropped = _plus(self.dropped, dropped)


def _plus(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value.clone() if total is None else total.add_(value)
