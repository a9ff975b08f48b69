"""A pipeline stage of the MoE transformer whose layers run as phases around their all-to-alls.

An expert-parallel ``Layer`` becomes six phases, the split DualPipe overlaps:

    route (attention, norm, router; sort rows by destination)  compute
    counts (rows per expert, so each rank knows what arrives)  small all-to-all
    dispatch                                                   all-to-all
    experts (this rank's experts on the rows it received)      compute
    combine                                                    all-to-all
    finish (weight and sum each token's rows, shared experts, residual)   compute

With a capacity factor the dispatch carries its counts (``exchange.CountedAllToAll``), so such
a layer has five phases: no counts. ``finish`` of one layer and ``route`` of the next fuse into
one piece, as do the embedding, the head and layers without expert parallelism with their
neighbours. The arithmetic is the ``Layer``'s and ``ExpertParallel``'s own, in the same order,
so a ``MoEStage`` computes what the same layers chained in an ``nn.Sequential`` compute; the
phases only decide what may run between them (``cutpipe.runtime.compute.phased``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from cutpipe.models.transformer import Layer, MoE
from cutpipe.parallel.exchange import AllToAll
from cutpipe.parallel.expert_parallel import CountsPending, ExpertParallel
from cutpipe.runtime.compute.phased import (
    Compute,
    Context,
    Exchange,
    Notice,
    Phase,
    PhasedStage,
    Transfer,
    Value,
)
from cutpipe.runtime.stages import cut_module, sequence_blocks


def _plain(layer: nn.Module) -> Compute:
    def run(context: Context, *state: torch.Tensor) -> Value:
        output = layer(*state)
        return output if isinstance(output, tuple) else (output,)

    return Compute(type(layer).__name__.lower(), run)


def _expert_parallel(key: int, layer: Layer, moe: MoE, parallel: ExpertParallel) -> list[Phase]:
    """The six phases of one expert-parallel layer (five under a capacity: the dispatch
    carries the counts); ``key`` names its route in the context."""

    def route(context: Context, x: torch.Tensor, aux: torch.Tensor) -> Value:
        h = x + layer.attention(layer.attention_norm(x))
        tokens = layer.mlp_norm(h).reshape(-1, h.shape[-1])
        chosen, weights, balance = moe.route(tokens)
        context[key] = plan = parallel.plan(chosen, moe.capacity(tokens.shape[0]))
        return h, aux + balance, weights, tokens, parallel.dispatch_rows(tokens, plan)

    def counts(context: Context) -> CountsPending:
        return parallel.start_counts(context[key])

    def dispatch(context: Context) -> Exchange:
        return parallel.dispatch(context[key])

    def experts(context: Context, *carried: torch.Tensor) -> Value:
        *rest, received = carried  # h, aux, weights, tokens pass through untouched
        return (*rest, parallel.run_experts(moe.experts, received, context[key]))

    def combine(context: Context) -> AllToAll:
        return parallel.combine_exchange(context[key])

    def finish(
        context: Context,
        h: torch.Tensor,
        aux: torch.Tensor,
        weights: torch.Tensor,
        tokens: torch.Tensor,
        returned: torch.Tensor,
    ) -> Value:
        out = parallel.combine(returned, weights, context[key])
        shared = moe.shared_forward(tokens)
        if shared is not None:
            out = out + shared
        return h + out.view_as(h), aux

    counted = moe.capacity_factor is not None
    return [
        Compute(f"route{key}", route),
        *([] if counted else [Notice(f"counts{key}", counts)]),
        Transfer(f"dispatch{key}", dispatch),
        Compute(f"experts{key}", experts),
        Transfer(f"combine{key}", combine),
        Compute(f"finish{key}", finish),
    ]


def moe_program(layers: Sequence[nn.Module]) -> list[Phase]:
    """The phases of a stage made of ``layers`` (embedding, transformer layers, head, ...)."""
    program: list[Phase] = []
    for key, layer in enumerate(layers):
        moe = layer.mlp if isinstance(layer, Layer) else None
        if isinstance(moe, MoE) and moe.expert_parallel is not None:
            program += _expert_parallel(key, layer, moe, moe.expert_parallel)
        else:
            program.append(_plain(layer))
    return program


class MoEStage(PhasedStage):
    """Consecutive blocks of ``language_model`` (under their names in it), run phase by phase
    (see the module)."""

    def __init__(self, model: nn.Module, blocks: Sequence[str], overlap: bool = True) -> None:
        layers = [model.get_submodule(path) for path in blocks]
        super().__init__(model, blocks, program=moe_program(layers), overlap=overlap)


def moe_stages(
    model: nn.Module,
    num_stages: int,
    held: Iterable[int],
    partition: Sequence[int] | None = None,
    overlap: bool = True,
) -> dict[int, MoEStage]:
    """The stages ``held`` of ``model`` cut by block (``cut_module``) into ``num_stages``
    (``partition[s]`` blocks in stage s; default as even as possible), for
    ``PipelineRunner(schedule, stages, ...)``; every parameter keeps its name in ``model``."""

    def make(whole: nn.Module, blocks: Sequence[str]) -> MoEStage:
        return MoEStage(whole, blocks, overlap=overlap)

    return cut_module(  # type: ignore[return-value]
        model, partition, blocks=sequence_blocks(model), num_stages=num_stages, held=held,
        make_stage=make,
    )  # fmt: skip
