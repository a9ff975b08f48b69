"""The ``fsdp`` data-parallel mode: FSDP2 (``fully_shard``, ZeRO-3) on each stage module.

``shard_stages`` applies ``torch.distributed.fsdp.fully_shard`` over the data-parallel mesh to
every block of each stage (its transformer layers) and then to the stage module itself, so each
stage is one FSDP root whose parameters are ``DTensor`` shards (``Shard(0)`` over DP) between
steps. ``FsdpReducer`` is the ``GradientReducer`` (``cutpipe.runtime.protocols``) that goes
with it, doing for cutpipe what ``torch.distributed.pipelining`` does for its zero-bubble
schedules (``stage.py``: ``backward_maybe_with_nosync``, ``perform_reduce_grad``):

- during the step gradient sync is off (``set_requires_gradient_sync(False)``,
  ``set_reshard_after_backward(False)``, ``set_is_last_backward(False)``): every B, BW and W
  accumulates the full, unsharded gradients locally into the unsharded parameters' ``.grad``,
  and the parameters, all-gathered by the stage's first forward, stay unsharded to the end of
  the stage's work in the step. cutpipe's W (``runtime/split.py``) adds into the ``.grad`` of
  the very parameter objects the forward used, which under FSDP2 are the unsharded ones, so
  the split needs nothing from FSDP's autograd hooks: it runs no autograd at all;
- ``stage_done(stage, ...)`` (the stage's last backward or W of the step has run) turns sync
  on and runs FSDP's post-backward on every parameter group of the stage, exactly the calls
  of torch's ``perform_reduce_grad``: one reduce-scatter per group of the accumulated
  gradients into the sharded ``DTensor`` ``.grad`` (added to any gradient already there), and
  the parameters resharded. On CUDA the reduce-scatters run on FSDP's own stream and the call
  returns at once; on the CPU (gloo) FSDP2 reduces inline, so the call returns when they are
  done;
- ``finish()`` runs FSDP's root post-backward callback of each stage with
  ``is_last_backward`` (the compute stream waits for the reductions; FSDP's per-step state is
  reset) and turns sync off again for the next step.

The gradients left are the **mean over the DP replicas** (FSDP2's default
``gradient_divide_factor``: the DP size), of whatever the runner's ``loss_reduction`` made
on each replica: with ``"mean"`` and equal shares of the batch, the gradient of the mean loss
over the whole batch.

DualPipe: the runner sums the two copies of each stage over the mirror pair. After
``finish`` the gradients are ``DTensor`` shards; summing the two copies' local shards is
exact (the sum is linear) when both copies shard alike, which they do in a ``(pp, dp)`` mesh:
mirrors differ in ``pp`` only, so they hold the same DP coordinate and the same shard of
every parameter. ``cutpipe.runtime.transport.flat`` must then work on the DTensors' local tensors.

``per_block=False`` shards each stage as one group: one all-gather and one reduce-scatter per
stage and step instead of one per block (fewer, larger collectives: better where latency
dominates, as on gloo), at the price of all-gathering the whole stage at once. ``prefetch()``
before ``runner.step`` starts every all-gather of the step without waiting (torch's UNSHARD
action), so that they hide behind the warm-up on a GPU; on gloo the background thread costs
more than it hides.

**Expert parallelism.** With ``experts=(dp_mesh, factor)`` every ``ExpertShard`` (an EP rank's
experts of one MoE) is sharded on its own first, over the data-parallel replicas that hold the
same experts, and its gradients are divided by ``factor`` (DP x EP: each expert's gradient
already sums the tokens of the whole EP group, as ``ParallelMesh.gradient_reducer`` divides
them); the rest of each block, which every replica holds, is sharded over ``dp_mesh`` given as
the 1-D mesh of all DP x EP replicas (``ParallelMesh.replica_mesh()``), the mean over them.

``reshard_after_forward=True`` frees each block's unsharded parameters after every forward
and all-gathers them again for its backward (FSDP's pre-backward hook; two all-gathers per
microbatch and stage instead of one per step), saving the unsharded parameters between a
forward and its backward; the unsharded gradients stay, as sync is off. A W needs no
parameter values, so it runs on resharded parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def _blocks(module: nn.Module) -> list[nn.Module]:
    """What to wrap one by one inside a stage: a cutpipe ``Stage``'s blocks (embedding,
    transformer layers, head), a module's ``layers`` or ``blocks`` list, or nothing."""
    names = getattr(module, "block_names", None)
    if names is not None:  # cutpipe.runtime.stages.Stage
        return [module.get_submodule(name) for name in names]
    for attribute in ("layers", "blocks"):
        inner = getattr(module, attribute, None)
        if isinstance(inner, (nn.ModuleList, nn.Sequential)):
            return list(inner)
    return []


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard_stages(
    stages: Mapping[int, nn.Module],
    dp_mesh: Any,
    reshard_after_forward: bool = False,
    per_block: bool = True,
    experts: tuple[Any, float] | None = None,
    **fully_shard_options: Any,
) -> dict[int, nn.Module]:
    """Apply FSDP2 over ``dp_mesh`` (a 1-D ``DeviceMesh``, e.g. ``mesh["dp"]``) to each stage:
    to every block that has parameters (unless ``per_block=False``; blocks that share a
    parameter need it), then to the stage module; in place, so the stages are
    returned for ``PipelineRunner(schedule, shard_stages(stages, mesh["dp"]), ...,
    reducer=FsdpReducer(...))``. Shard before building the runner and the optimizer: the
    optimizer must hold the sharded parameters. ``fully_shard_options`` go to every
    ``fully_shard`` call (e.g. ``mp_policy``)."""
    if getattr(dp_mesh, "ndim", 1) != 1:
        raise ValueError(
            f"shard_stages takes the 1-D data-parallel mesh (mesh['dp']), got {dp_mesh.ndim} dims"
        )
    sharded: dict[int, nn.Module] = {}
    for stage, module in stages.items():
        if not isinstance(module, nn.Module):
            raise TypeError(f"stage {stage} must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, FSDPModule):
            raise ValueError(f"stage {stage} is already sharded (fully_shard was applied)")
        if experts is not None:  # their own replicas first: the blocks then leave them out
            _shard_experts(module, *experts, reshard_after_forward, fully_shard_options)
        for block in _blocks(module) if per_block else ():
            if _has_parameters(block) and not isinstance(block, FSDPModule):
                fully_shard(
                    block,
                    mesh=dp_mesh,
                    reshard_after_forward=reshard_after_forward,
                    **fully_shard_options,
                )
        fully_shard(
            module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **fully_shard_options
        )
        sharded[stage] = module
    return sharded


def _shard_experts(
    module: nn.Module, mesh: Any, factor: float, reshard_after_forward: bool, options: Any
) -> None:
    """Shard each ``ExpertShard`` of ``module`` over ``mesh``, its gradients divided by
    ``factor``."""
    from cutpipe.parallel.expert_parallel import ExpertShard

    for inner in module.modules():
        if isinstance(inner, ExpertShard) and _has_parameters(inner):
            fully_shard(inner, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
            inner.set_gradient_divide_factor(factor)  # type: ignore[operator]
            # a plain sum, scaled before and after: gloo has no pre-multiplied sum (NCCL's)
            force_sum = getattr(inner, "set_force_sum_reduction_for_comms", None)
            if force_sum is not None:
                force_sum(True)


def _accumulate_locally(module: FSDPModule) -> None:
    """Gradient sync off, as torch's ``backward_maybe_with_nosync``: backwards add into the
    unsharded gradients and leave the parameters unsharded; nothing is reduced."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    module.set_is_last_backward(False)


class FsdpReducer:
    """The ``GradientReducer`` of stages sharded by ``shard_stages``: gradients accumulate
    unsharded through the step, each stage is reduce-scattered (mean over DP) when the
    runner says it is done, and ``finish`` completes the step (see the module)."""

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        unsharded = [
            stage for stage, module in stages.items() if not isinstance(module, FSDPModule)
        ]
        if unsharded:
            raise TypeError(
                f"stage {unsharded[0]} is not sharded: pass the stages shard_stages returned"
            )
        self._stages: dict[int, FSDPModule] = dict(stages)  # type: ignore[arg-type]
        self._done: list[int] = []
        for module in self._stages.values():
            _accumulate_locally(module)

    def stage_done(self, stage: int, parameters: Sequence[Any] = ()) -> None:
        """Reduce-scatter ``stage``'s accumulated gradients into its sharded ``.grad`` and
        reshard its parameters. ``parameters`` is ignored: FSDP knows its own (the sharded
        ``DTensor`` parameters and the unsharded ones it swaps in for the step)."""
        if stage not in self._stages:
            raise KeyError(f"stage {stage} is not one of this reducer's ({sorted(self._stages)})")
        if stage in self._done:
            return
        module = self._stages[stage]
        for inner in _fsdp_modules(module):
            # a no-op unless forwards resharded the parameters since their last backward: FSDP's
            # post-backward reads the gradients off the unsharded parameters
            inner.unshard()
        # sync on, as torch's perform_reduce_grad; is_last_backward stays off until finish(),
        # where the compute stream waits for the reductions
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        for state in fully_shard.state(module)._state_ctx.all_states:  # type: ignore[attr-defined]
            for group in state._fsdp_param_groups:
                group.post_backward()
        self._done.append(stage)

    def finish(self) -> None:
        """Reduce the stages not reported done, then wait for every reduction of the step and
        turn gradient sync off again for the next step."""
        for stage in self._stages:
            if stage not in self._done:
                self.stage_done(stage)
        done, self._done = self._done, []
        for stage in done:
            module = self._stages[stage]
            module.set_is_last_backward(True)
            fully_shard.state(module)._root_post_backward_final_callback()  # type: ignore[attr-defined]
            _accumulate_locally(module)

    def prefetch(self) -> None:
        """Start all-gathering every stage's parameters now, without waiting: each block's
        first forward of the step then waits only for its own (as torch's UNSHARD action).
        Call it after the optimizer step, right before ``runner.step``: the all-gathers then
        hide behind the pipeline's warm-up instead of delaying each stage's first forward."""
        for module in self._stages.values():
            for inner in _fsdp_modules(module):
                inner.unshard(async_op=True)

    def unshard(self) -> None:
        """All-gather every stage's parameters now and wait: until the stages' reductions
        the modules hold the unsharded parameters (for a caller that must know them before
        the step, such as an activation meter leaving them out). The step's forwards then
        find them gathered; ``prefetch`` is the same without waiting."""
        for module in self._stages.values():
            for inner in _fsdp_modules(module):
                inner.unshard()

    def reshard(self) -> None:
        """Free the unsharded parameters now and register the shards again. A training step
        does this itself; an evaluation step (``torch.no_grad()``) with
        ``reshard_after_forward=False`` leaves the stages all-gathered until the next one."""
        for module in self._stages.values():
            for inner in _fsdp_modules(module):
                inner.reshard()


def _fsdp_modules(module: nn.Module) -> Iterable[FSDPModule]:
    return [inner for inner in module.modules() if isinstance(inner, FSDPModule)]
