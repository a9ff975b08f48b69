"""Parallelize a rank's stages for training, in one stated order (as torchtitan's
``parallelize.py`` does for its models):

1. **FSDP** (``--dp-mode fsdp``): shard each block's parameters over the data-parallel group
   (with ``--ep``: an EP group's experts over the DP replicas holding them, the rest over all
   DP x EP replicas). First, because the runner and the optimizer must hold the sharded
   parameters.
2. **Recompute** (``--recompute``): wrap each layer's forward so it keeps less and rebuilds the
   rest during B; it wraps the forwards FSDP's hooks call, so it composes with sharding.
3. **Gradient reducer** (``--dp`` or ``--ep`` > 1): what averages the stages' gradients over the
   replicas, as each stage's last backward ends (FSDP's reduce-scatter, or one all-reduce per
   stage: over DP x EP for what every replica holds, over DP for an EP group's experts).

Expert parallelism itself comes first of all, before the stages are cut: ``shard_experts`` keeps
this rank's experts in the whole model, which ``cut_module`` then cuts.

Tensor parallelism, when the trainer takes it, goes before all three: it changes the modules the
others wrap.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from cutpipe.parallel.fsdp import FsdpReducer
    from cutpipe.parallel.mesh import ParallelMesh
    from cutpipe.runtime.compute.recompute import Recompute
    from cutpipe.runtime.protocols import GradientReducer
    from cutpipe.train.options import TrainOptions


@dataclass
class Parallelized:
    """A rank's stages, ready for the runner, and what acts on them during a step."""

    stages: dict[int, nn.Module]
    reducer: GradientReducer | None = None
    fsdp: FsdpReducer | None = None  # the reducer, when it is FSDP's (it also unshards)
    recomputes: list[Recompute] = field(default_factory=list)
    experts: list[nn.Parameter] = field(default_factory=list)  # this rank's share of its EP group's
    #: what a global gradient norm sums over a group first: the experts over their EP group
    partitioned: list[tuple[list[nn.Parameter], Any]] = field(default_factory=list)

    def reduce_next_step(self, reduce: bool) -> None:
        """Whether the coming pipeline step reduces the gradients over the replicas: with
        accumulation only the last one of an optimizer step does, once, the sum of the local
        gradients (``AllReduce.paused``). FSDP reduce-scatters each step's fresh gradients into
        the sharded ones, which accumulates exactly as it is."""
        from cutpipe.parallel.data_parallel import AllReduce

        if isinstance(self.reducer, AllReduce):
            self.reducer.paused = not reduce

    def close(self) -> None:
        for recompute in self.recomputes:
            recompute.close()


def parallelize(
    stages: Mapping[int, nn.Module],
    options: TrainOptions,
    mesh: ParallelMesh,
    recompute_unit: type[nn.Module] | None = None,
    experts: Sequence[nn.Parameter] = (),
) -> Parallelized:
    """Apply FSDP, recompute and the gradient reducer to ``stages`` (see the module); ``experts``
    are the parameters of this rank's share of an expert-parallel group's experts (averaged over
    the data-parallel replicas only)."""
    from cutpipe.runtime.compute.recompute import apply_recompute

    done = Parallelized(dict(stages))
    if options.dp > 1 and options.dp_mode == "fsdp":
        from cutpipe.parallel.fsdp import FsdpReducer, shard_stages

        if mesh.layout.ep > 1:  # experts over their DP replicas, the rest over DP x EP
            expert_shards = (mesh.mesh["dp"], float(mesh.replicas))
            shard_stages(done.stages, mesh.replica_mesh(), experts=expert_shards)
        else:
            shard_stages(done.stages, mesh.mesh["dp"])
        # FSDP2 warns that blocks return views (the layers' and the head's reshapes), where an
        # in-place op would drop its pre-backward hook, which all-gathers resharded weights for
        # the backward: here they stay whole through the step, and FsdpReducer runs the
        # post-backward itself (the gradients are exact: tests/test_fsdp.py)
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor"
        )
    done.recomputes = [
        apply_recompute(module, options.recompute, units=recompute_unit)
        for module in done.stages.values()
    ]
    if options.dp > 1 and options.dp_mode == "fsdp":
        done.reducer = done.fsdp = FsdpReducer(done.stages)
    elif mesh.replicas > 1:
        done.reducer = mesh.gradient_reducer(experts)
    if done.fsdp is not None and experts:  # FSDP put DTensor parameters in their place
        from cutpipe.parallel.expert_parallel import expert_parameters

        held = [p for module in done.stages.values() for p in expert_parameters(module)]
        experts = list({id(p): p for p in held}.values())
    done.experts = list(experts)
    if mesh.layout.ep > 1:
        done.partitioned = [(done.experts, mesh.ep_group)]
    return done
