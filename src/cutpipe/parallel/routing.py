"""Watch and steer the MoE routing of a rank's modules: its statistics, and the balancing bias.

Every ``MoE`` adds up, on its device, what its training forwards routed (``MoE.tally``): the
load-balancing loss, the choices per expert, the choices a capacity dropped. It does so in
``MoE.route``, which both its own forward and the phased stage's route phase call.
``routing_statistics`` reads those tallies for all MoE layers of a rank's modules in one host
sync (summed over replicas if asked), by each layer's name in the model;
``reset_routing_statistics`` starts them again.

``update_routing_bias`` is DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step:
each expert's bias rises by ``rate`` if it took fewer choices than the mean over the step, falls
if it took more (``bias += rate * sign(mean - load)``). The loads are summed over the replicas
that route other tokens (``reduce``), so every rank moves the same bias the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.models.transformer import MoE

#: How to add up a tensor over the replicas: a process group, several (summed in each in turn,
#: e.g. ``[mesh.ep_group, mesh.dp_group]``), or a function that returns the sum (e.g.
#: ``mesh.sum_over_replicas``). None: this rank's own.
Reduce = dist.ProcessGroup | Sequence[dist.ProcessGroup] | Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's routing since the last reset (training forwards only)."""

    microbatches: int
    balance_loss: float  # the load-balancing losses it added, summed
    load: tuple[int, ...]  # choices routed to each expert of the model, before any drop
    dropped: int  # choices over their expert's capacity

    @property
    def max_load(self) -> int:
        """Tokens (choices) the busiest expert was routed."""
        return max(self.load)

    @property
    def mean_load(self) -> float:
        return sum(self.load) / len(self.load)

    @property
    def imbalance(self) -> float:
        """max / mean tokens per expert: 1.0 is a perfect balance (0.0 before any token)."""
        return self.max_load / self.mean_load if self.mean_load else 0.0

    def __add__(self, other: LayerRouting) -> LayerRouting:
        """Both tallies of one layer together (DualPipe's two copies of it)."""
        return LayerRouting(
            self.microbatches + other.microbatches,
            self.balance_loss + other.balance_loss,
            tuple(a + b for a, b in zip(self.load, other.load, strict=True)),
            self.dropped + other.dropped,
        )


@dataclass(frozen=True)
class RoutingStats:
    """Every MoE layer's ``LayerRouting``, by the layer's name in the model (``layers.3.mlp``)."""

    layers: dict[str, LayerRouting]

    @classmethod
    def combined(cls, shares: Iterable[RoutingStats]) -> RoutingStats:
        """Several ranks' statistics as one model's: each layer once, copies added up."""
        layers: dict[str, LayerRouting] = {}
        for share in shares:
            for name, layer in share.layers.items():
                layers[name] = layers[name] + layer if name in layers else layer
        return cls(dict(sorted(layers.items())))

    def summary(self) -> str:
        """One short line for a log: the worst balance, the mean loss, the dropped share."""
        if not self.layers:
            return "routing: no MoE layer"
        name, worst = max(self.layers.items(), key=lambda item: item[1].imbalance)
        microbatches = sum(layer.microbatches for layer in self.layers.values())
        balance = sum(layer.balance_loss for layer in self.layers.values())
        choices = sum(sum(layer.load) for layer in self.layers.values())
        dropped = sum(layer.dropped for layer in self.layers.values())
        return (
            f"routing: max/mean load {worst.imbalance:.2f} ({name}), balance loss "
            f"{balance / max(microbatches, 1):.4f} per layer-microbatch, dropped "
            f"{100 * dropped / max(choices, 1):.1f}%"
        )


def moe_layers_of(
    modules: nn.Module | Iterable[nn.Module] | Mapping[Any, nn.Module],
) -> dict[str, MoE]:
    """Each MoE inside ``modules`` (a model, a stage, a rank's stages as a list or a dict), once,
    by its name in the model, in a fixed order (the same on ranks holding the same stages)."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    elif isinstance(modules, Mapping):
        modules = list(modules.values())
    else:
        modules = list(modules)
    found: dict[str, MoE] = {}
    seen: set[int] = set()
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"expected modules (a model, a stage, or a list or dict of stages), got a "
                f"{type(module).__name__}"
            )
        for name, sub in module.named_modules():
            if isinstance(sub, MoE) and id(sub) not in seen:
                if name in found:
                    raise ValueError(
                        f"two MoE layers are named {name!r}: pass the stages of one model"
                    )
                seen.add(id(sub))
                found[name] = sub
    return dict(sorted(found.items()))


def routing_statistics(
    modules: nn.Module | Iterable[nn.Module] | Mapping[Any, nn.Module],
    reduce: Reduce | None = None,
    reset: bool = False,
) -> RoutingStats:
    """What every MoE layer in ``modules`` routed since the last reset; one host sync in all.

    ``reduce``: also sum over these replicas (a collective: call it on every rank of them).
    ``reset``: start the tallies again once read.
    """
    layers = moe_layers_of(modules)
    rows = [_tally_row(moe) for moe in layers.values()]
    values: list[float] = []
    if rows:
        values = _summed(torch.cat(rows), reduce).tolist()
    stats: dict[str, LayerRouting] = {}
    at = 0
    for name, moe in layers.items():
        stats[name] = _layer_routing(values[at : at + 3 + moe.num_experts])
        at += 3 + moe.num_experts
    if reset:
        for moe in layers.values():
            moe.tally.reset()
    return RoutingStats(stats)


def start_model_routing_statistics(
    modules: nn.Module | Iterable[nn.Module] | Mapping[Any, nn.Module],
    names: Sequence[str],
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    reset: bool = False,
    device: torch.device | None = None,
) -> Callable[[], RoutingStats]:
    """What every MoE layer of the whole model routed since the last reset, on every rank of
    ``group`` (default: all), in one all-reduce: each rank fills the rows of the layers it holds
    (``names`` lists the model's MoE layers, the same on every rank), so the sum adds up the
    pipeline's ranks, the replicas and DualPipe's two copies of a layer at once.

    The all-reduce starts now and is waited for when the returned function is called: a trainer
    starts it as the pipeline step ends and reads it after the optimizer step, so the
    collective's wait hides behind that work. A call on every rank of ``group``, with the tensor
    on ``device`` (the collective's: a rank holding no MoE layer has none of its own); the
    tallies are copied now, and ``reset`` clears them at the read."""
    layers = moe_layers_of(modules)
    unknown = sorted(set(layers) - set(names))
    if unknown:
        raise ValueError(f"MoE layers {unknown} are not among the model's names {list(names)}")
    if device is None and layers:
        device = next(iter(layers.values())).router.weight.device
    table = torch.zeros(len(names), 3 + num_experts, dtype=torch.float64, device=device)
    row_of = {name: index for index, name in enumerate(names)}
    for name, moe in layers.items():
        table[row_of[name]] += _tally_row(moe)
    work = dist.all_reduce(table, group=group, async_op=True)

    def read() -> RoutingStats:
        work.wait()
        values = table.tolist()
        stats = {name: _layer_routing(row) for name, row in zip(names, values, strict=True)}
        if reset:
            for moe in layers.values():
                moe.tally.reset()
        return RoutingStats(dict(sorted(stats.items())))

    return read


def reset_routing_statistics(
    modules: nn.Module | Iterable[nn.Module] | Mapping[Any, nn.Module],
) -> None:
    """Start every MoE layer's statistics in ``modules`` from nothing."""
    for moe in moe_layers_of(modules).values():
        moe.tally.reset()


def update_routing_bias(
    modules: nn.Module | Iterable[nn.Module] | Mapping[Any, nn.Module],
    rate: float,
    reduce: Reduce | None = None,
) -> None:
    """Move each MoE's routing bias toward balance from the loads since the last update.

    Call it once per optimizer step, on every rank (``reduce`` is a collective over the replicas
    that route other tokens, EP and DP: so each rank moves its bias the same way). ``rate`` 0
    leaves the bias as it is. Layers built without a bias (``RoutingOptions(bias=True)``) are
    skipped; a rate above 0 with none at all is a mistake and raises.
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
        raise ValueError(f"the routing bias rate must be a number >= 0, got {rate!r}")
    layers = moe_layers_of(modules)
    biased = [moe for moe in layers.values() if moe.routing_bias is not None]
    if layers and not biased and rate > 0:
        raise ValueError(
            "no MoE layer here has a routing bias: build the model with "
            "RoutingOptions(bias=True), or leave the rate at 0"
        )
    loads = [_take_load(moe) for moe in biased]
    if not biased or rate == 0:
        return
    summed = _summed(torch.cat(loads), reduce).double()
    at = 0
    for moe in biased:
        load = summed[at : at + moe.num_experts]
        at += moe.num_experts
        step = rate * torch.sign(load.mean() - load)
        moe.routing_bias.add_(step.to(moe.routing_bias.dtype))


def _take_load(moe: MoE) -> torch.Tensor:
    """The choices per expert since the last update, and a fresh start."""
    assert moe.routing_bias is not None
    load, moe.bias_load = moe.bias_load, None
    if load is None:
        return torch.zeros(moe.num_experts, dtype=torch.long, device=moe.routing_bias.device)
    return load


def _tally_row(moe: MoE) -> torch.Tensor:
    """[microbatches, balance, dropped, load...] of one MoE, in float64 (exact for counts)."""
    tally = moe.tally
    device = moe.router.weight.device
    row = torch.zeros(3 + moe.num_experts, dtype=torch.float64, device=device)
    row[0] = tally.microbatches
    if tally.balance is not None:
        row[1] = tally.balance
    if tally.dropped is not None:
        row[2] = tally.dropped
    if tally.routed is not None:
        row[3:] = tally.routed
    return row


def _layer_routing(row: Sequence[float]) -> LayerRouting:
    """The ``LayerRouting`` of a row ``_tally_row`` made (summed or not)."""
    microbatches, balance, dropped, *load = row
    return LayerRouting(int(microbatches), balance, tuple(map(int, load)), int(dropped))


def _summed(value: torch.Tensor, reduce: Reduce | None) -> torch.Tensor:
    """``value`` summed over the replicas ``reduce`` names (see ``Reduce``)."""
    if reduce is None:
        return value
    if isinstance(reduce, dist.ProcessGroup):
        groups = [reduce]
    elif callable(reduce):
        return reduce(value)
    elif isinstance(reduce, Sequence) and all(isinstance(g, dist.ProcessGroup) for g in reduce):
        groups = list(reduce)
    else:
        raise TypeError(
            "reduce must be a process group, a list of them or a function that sums a tensor "
            f"over the replicas (e.g. mesh.sum_over_replicas), got a {type(reduce).__name__}"
        )
    total = value.clone()
    for group in groups:
        dist.all_reduce(total, group=group)
    return total
