"""Data parallelism next to the pipeline: each stage's gradients averaged over its replicas,
started as soon as the stage's last backward of the step is done.

In a pipeline step a stage's weight gradients are complete long before the step ends: its last
W (or full backward) runs while the ranks further down the cool-down are still working, and on
the ranks that finish early nothing else runs at all. A reducer (``cutpipe.runtime.protocols.GradientReducer``) gets a call the moment
a stage is done (``stage_done``) and starts that stage's reduction without waiting (an
asynchronous collective on the data-parallel group); ``finish`` at the end of the step waits for
the ones still in flight and writes the averages back. So the reduction of the first stages to
finish hides behind the others' cool-down, and only the last stage's is exposed.

``AllReduce`` is plain data parallelism (every rank keeps every gradient and the whole optimizer
state). ZeRO-1 uses the same reduction with the optimizer state sharded over the replicas
(torch's ``ZeroRedundancyOptimizer``, ``cutpipe.train.optim.build_optimizer(dp_mode="zero1")``).
``cutpipe.parallel.fsdp`` shards parameters too (FSDP2, ZeRO-3). docs/runtime.md, "Data
parallelism", compares their memory and cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.runtime.transport.flat import flatten_gradients, write_gradients


@dataclass
class _InFlight:
    """One bucket's reduction: started over the first group, the others (EP, then DP) after."""

    parameters: list[nn.Parameter]
    flat: torch.Tensor
    work: dist.Work | None
    later: Sequence[dist.ProcessGroup]


@dataclass
class AllReduce:
    """Each stage's gradients as one flat buffer, summed over ``groups`` without waiting, then
    multiplied by ``scale`` (1 / replicas for a mean).

    ``groups_of`` says which groups a parameter is reduced over (default: all of ``groups``):
    with expert parallelism a replicated parameter is summed over EP and DP but an expert over
    DP only (``cutpipe.parallel.mesh.ParallelMesh.gradient_reducer``).

    ``paused``: reduce nothing (the earlier pipeline steps of an accumulated optimizer step, as
    DDP's ``no_sync``): the local gradients add up and the last step reduces their sum once. It
    must: an expert's sum over DP scaled by 1 / (DP x EP), reduced again with the next step's,
    would be divided by EP once more.
    """

    groups: Sequence[dist.ProcessGroup]
    scale: float = 1.0
    groups_of: Callable[[nn.Parameter], Sequence[dist.ProcessGroup]] | None = None
    paused: bool = False
    _in_flight: list[_InFlight] = field(default_factory=list)

    @torch.no_grad()
    def stage_done(self, stage: int, parameters: Sequence[nn.Parameter]) -> None:
        if self.paused:
            return
        buckets: dict[tuple[int, ...], tuple[Sequence[dist.ProcessGroup], list[nn.Parameter]]] = {}
        for parameter in parameters:
            groups = self.groups if self.groups_of is None else self.groups_of(parameter)
            buckets.setdefault(tuple(map(id, groups)), (groups, []))[1].append(parameter)
        for groups, bucket in buckets.values():
            flat = flatten_gradients(bucket)
            # a parameter with no group (an expert without DP) is still scaled to the mean
            first, *later = groups or (None,)
            work = None if first is None else dist.all_reduce(flat, group=first, async_op=True)
            self._in_flight.append(_InFlight(bucket, flat, work, later))

    @torch.no_grad()
    def finish(self) -> None:
        if self.paused:
            return
        in_flight, self._in_flight = self._in_flight, []
        for item in in_flight:
            if item.work is not None:
                item.work.wait()
            for group in item.later:  # needs the first group's sum
                dist.all_reduce(item.flat, group=group)
            if self.scale != 1.0:
                item.flat.mul_(self.scale)
            write_gradients(item.parameters, item.flat)
