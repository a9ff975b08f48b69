"""Expert parallelism: an MoE's routed experts spread over the ranks of an EP group.

Each rank of the group keeps ``E / ep`` consecutive experts (rank r: experts ``r*E/ep`` onward)
and its own tokens. A layer routes its tokens, sends each (token, choice) row to the rank owning
the chosen expert (dispatch), runs its local experts on the rows it receives, and sends the
results back (combine), where they are weighted and summed per token. Both moves are
``all_to_all_single`` with uneven splits; a small all-to-all of per-expert counts first tells
every rank how many rows to expect. No token is dropped, so the loss and the gradients are those
of the same model with every expert local (up to the order of floating-point sums).

With a capacity (``RoutingOptions.capacity_factor``) the MoE has dropped the choices past each
expert's capacity from its own tokens before they are planned (they are neither sent nor
computed, and come back as zero rows), and the dispatch carries its counts
(``exchange.CountedAllToAll``): each rank sends each peer a block of one size, so no count
exchange is needed before it.

The steps are separate methods (``plan``, ``exchange_counts``, ``dispatch_rows``,
``run_experts``, ``combine``) so that a stage can run them as phases and put another
microbatch's compute between an exchange's start and its end (``cutpipe.parallel.moe_stage``).
``forward`` chains them with blocking, differentiable all-to-alls for ordinary autograd use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.models.transformer import MoE
from cutpipe.parallel.exchange import AllToAll, CountedAllToAll, CountedPending, all_to_all
from cutpipe.parallel.mesh import check_experts
from cutpipe.runtime.compute.phased import Exchange


@dataclass
class Route:
    """Where one microbatch's (token, choice) rows go and what comes back: indices only.

    ``order`` lists the flat choices (token * k + j) sorted by expert, which is also by
    destination rank: the send buffer's row i is choice ``order[i]``.
    """

    order: torch.Tensor  # every choice index, sorted by expert; the dropped ones last
    tokens: torch.Tensor  # token of each send row
    counts: torch.Tensor  # rows for each expert of the whole model, from this rank
    send_splits: list[int]  # rows to each rank of the group
    recv_counts: torch.Tensor | None = (
        None  # [ep, local]: rows from each rank for each local expert
    )
    recv_splits: list[int] | None = None  # rows from each rank
    capacity: int | None = None  # at most this many rows per expert: a counted dispatch

    def received_by_expert(self) -> tuple[torch.Tensor, list[int]]:
        """(the received rows reordered by local expert, how many each expert gets)."""
        assert self.recv_counts is not None, "exchange_counts first"
        ep, local = self.recv_counts.shape
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=self.recv_counts.device).repeat(ep),
            self.recv_counts.reshape(-1),
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        return by_expert, self.recv_counts.sum(0).tolist()


class CountsPending:
    """A count exchange in flight; ``wait`` fills in the route's receive side."""

    def __init__(
        self, work: dist.Work | None, received: torch.Tensor, route: Route, ep: int, local: int
    ) -> None:
        self._work, self._received, self._route = work, received, route
        self._shape = (ep, local)

    def wait(self) -> Route:
        if self._work is not None:
            self._work.wait()
            self._work = None
        route = self._route
        route.recv_counts = self._received.view(self._shape)
        route.recv_splits = route.recv_counts.sum(1).tolist()
        return route


class ExpertParallel:
    """The EP group of one MoE: which experts this rank owns and how rows move between ranks."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        check_experts(num_experts, self.size)
        self.num_experts = num_experts
        self.local = num_experts // self.size
        self.first = self.rank * self.local  # global index of this rank's first expert

    def plan(self, chosen: torch.Tensor, capacity: int | None = None) -> Route:
        """Sort this microbatch's choices ([tokens, k] expert indices; ``num_experts`` for a
        dropped one) by destination. ``capacity``: the MoE's limit per expert (None: none)."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        per_expert = counts.tolist()
        if capacity is not None and max(per_expert) > capacity:
            raise ValueError(
                f"an expert has {max(per_expert)} rows, over the capacity of {capacity}: plan "
                "the choices MoE.route made with that capacity"
            )
        send_splits = [
            sum(per_expert[r * self.local : (r + 1) * self.local]) for r in range(self.size)
        ]
        sent = order[: sum(send_splits)]
        return Route(order, sent // chosen.shape[1], counts, send_splits, capacity=capacity)

    def start_counts(self, route: Route) -> CountsPending:
        """Start telling every rank how many rows it gets for each of its experts."""
        received = torch.empty_like(route.counts)
        work = None
        if self.size == 1:
            received.copy_(route.counts)
        else:
            work = dist.all_to_all_single(received, route.counts, group=self.group, async_op=True)
        return CountsPending(work, received, route, self.size, self.local)

    def exchange_counts(self, route: Route) -> None:
        """``start_counts`` and wait: the route then knows what this rank receives."""
        self.start_counts(route).wait()

    def dispatch_rows(self, tokens: torch.Tensor, route: Route) -> torch.Tensor:
        """The send buffer: one row per (token, choice), ordered by destination."""
        return tokens.index_select(0, route.tokens)

    def dispatch(self, route: Route) -> Exchange:
        """The rows' exchange: counted under a capacity, else uneven (``exchange_counts``
        first)."""
        if route.capacity is not None:
            return _CountedDispatch(self._peers, route, self.size, self.local)
        assert route.recv_splits is not None, "exchange_counts first"
        return AllToAll(self._peers, route.send_splits, route.recv_splits)

    def combine_exchange(self, route: Route) -> AllToAll:
        assert route.recv_splits is not None, "exchange_counts first"
        return AllToAll(self._peers, route.recv_splits, route.send_splits)

    @property
    def _peers(self) -> dist.ProcessGroup | None:
        return self.group if self.size > 1 else None

    def run_experts(
        self, experts: nn.ModuleList, received: torch.Tensor, route: Route
    ) -> torch.Tensor:
        """Each local expert on its received rows; the results in the order the rows came."""
        by_expert, sizes = route.received_by_expert()
        grouped = received.index_select(0, by_expert)
        outputs = [
            expert(chunk) if size else chunk
            for expert, chunk, size in zip(experts, grouped.split(sizes), sizes, strict=True)
        ]
        return torch.cat(outputs).index_select(0, torch.argsort(by_expert))

    def combine(self, returned: torch.Tensor, weights: torch.Tensor, route: Route) -> torch.Tensor:
        """Weight the rows that came back and sum each token's ``k`` of them (a dropped
        choice's row is zero, its weight too)."""
        tokens, k = weights.shape
        dropped = tokens * k - returned.shape[0]
        if dropped:
            returned = torch.cat([returned, returned.new_zeros(dropped, returned.shape[1])])
        by_choice = returned.index_select(0, torch.argsort(route.order))
        return (by_choice.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)

    def forward(
        self,
        experts: nn.ModuleList,
        tokens: torch.Tensor,
        chosen: torch.Tensor,
        weights: torch.Tensor,
        capacity: int | None = None,
    ) -> torch.Tensor:
        """The routed experts' output for every token, with blocking differentiable exchanges."""
        route = self.plan(chosen, capacity)
        if capacity is None:
            self.exchange_counts(route)
        received = all_to_all(self.dispatch_rows(tokens, route), self.dispatch(route))
        results = self.run_experts(experts, received, route)
        returned = all_to_all(results, self.combine_exchange(route))
        return self.combine(returned, weights, route)


class _CountedDispatch(CountedAllToAll):
    """A route's dispatch under a capacity: what arrives also fills in the route's receive
    side, which the experts and the combine read."""

    def __init__(
        self, group: dist.ProcessGroup | None, route: Route, size: int, local: int
    ) -> None:
        assert route.capacity is not None
        super().__init__(group, route.counts.view(size, local), route.capacity)
        self.route = route

    def start(self, rows: torch.Tensor) -> _Arrival:
        return _Arrival(super().start(rows), self)


class _Arrival:
    def __init__(self, pending: CountedPending, dispatch: _CountedDispatch) -> None:
        self._pending, self._dispatch = pending, dispatch

    def wait(self) -> torch.Tensor:
        rows = self._pending.wait()
        counts = self._dispatch.received_counts
        assert counts is not None
        route = self._dispatch.route
        route.recv_counts, route.recv_splits = counts, counts.sum(1).tolist()
        return rows


class ExpertShard(nn.Module):
    """This rank's routed experts of one MoE, each under its index in the whole model.

    A parameter's name is the same on every layout (``layers.3.mlp.experts.6.up.weight`` is expert
    6 wherever it lives), so a checkpoint saved with EP 2 loads into EP 4, into EP 1 or into one
    process: each rank asks for the names it holds. Iterating gives the experts in order.
    """

    def __init__(self, experts: list[nn.Module], first: int) -> None:
        super().__init__()
        self.first = first
        for index, expert in enumerate(experts):
            self.add_module(str(first + index), expert)

    def __iter__(self):  # type: ignore[override]
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Keep only this rank's experts of every MoE in ``model`` (an ``ExpertShard``: each under its
    index in the whole model) and route through ``group``.

    Call it on the same model (same seed) on every rank of the group. With a group of one (or
    None) nothing changes: the MoE keeps every expert and its local dispatch.
    """
    if group is None or dist.get_world_size(group) == 1:
        return model
    for moe in moe_layers(model):
        if moe.expert_parallel is not None or len(moe.experts) != moe.num_experts:
            raise ValueError("this model's experts are already sharded: shard a fresh model")
        parallel = ExpertParallel(group, moe.num_experts)
        kept = list(moe.experts)[parallel.first : parallel.first + parallel.local]
        moe.experts = ExpertShard(kept, parallel.first)
        moe.expert_parallel = parallel
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of sharded experts: each lives on one EP rank, so EP does not average them."""
    return [
        parameter
        for moe in moe_layers(model)
        if moe.expert_parallel is not None
        for parameter in moe.experts.parameters()
    ]
