"""Tensor parallelism (TP) inside pipeline stages, with torch's ``parallelize_module``.

Every transformer ``Layer`` of a stage is sharded over a one-dimensional TP mesh (a dimension of
a ``DeviceMesh``, e.g. ``mesh["tp"]`` of a ``("pp", "tp")`` mesh) the Megatron way:

- attention: ``q`` and the fused ``kv`` column-wise (each rank computes ``heads / tp`` query
  heads and ``kv_heads / tp`` key/value heads), ``o`` row-wise;
- MLP: ``up`` and ``gate`` column-wise, ``down`` row-wise.

Each layer then costs two all-reduces forward (the outputs of ``o`` and ``down``) and one
backward per column-wise projection (its input gradient: ``q``, ``kv``, ``up``, ``gate``, each
wrapped on its own as torch's styles do). Everything else stays replicated, as plain
tensors, on every rank of the TP group: norms, the embedding, the head, and the residual stream.
So a layer takes and returns plain ``torch.Tensor`` values, identical on every TP rank, and the
tensors that cross pipeline stages are plain tensors of the full hidden size: the runner, its
transport and its B/W split see nothing new. Every TP rank of a pipeline rank must feed the same
microbatches (replicated inputs), and its replicated parameters get the same gradients as its
peers', so no extra gradient reduction is needed for them.

The sharded weights become ``DTensor`` parameters (``Shard(0)`` column-wise, ``Shard(1)``
row-wise): optimizers update the local shards, ``DTensor.full_tensor()`` gives the whole weight.
The fused ``kv`` weight is laid out ``[keys; values]``, so it is sharded with torch's
``_StridedShard(0, split_factor=2)``: each rank holds the keys *and* the values of its heads,
and ``full_tensor()`` is the unsplit weight. The attention module keeps its ``forward``; its
``heads`` and ``kv_heads`` become this rank's local counts (as torchtitan's ``n_local_heads``),
and ``tp_size`` records the TP degree.

The B/W split (``cutpipe.runtime.compute.deferral``) needs no fallback: the runner's splitter routes the
sharded ``nn.Linear`` layers as any others (torch's styles add hooks, not a new ``forward``), B
computes the input gradients with the TP all-reduces, and W computes each weight gradient from
its local shards (a DTensor with the weight's placement) with no communication.

Mixture-of-experts layers are not TP-sharded: their attention is, but the router and the experts
(and shared experts) stay replicated on every TP rank (use expert parallelism for those).
DualPipe's two mirrored copies are not supported yet: the runner moves their weights and
gradients as one flat buffer, which cannot mix DTensor and plain tensors.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from cutpipe.models.transformer import MLP, Attention, Layer, MoE


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a linear whose output is ``parts`` projections side by side (the
    fused ``kv``): each rank gets its share of every part, and returns them side by side as a
    plain tensor, ``[part 0 share, part 1 share, ...]``, as the unsharded layer lays them out."""

    def __init__(self, parts: int, *, use_local_output: bool = True) -> None:
        super().__init__(use_local_output=use_local_output)
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for key, param in module.named_parameters():
            sharded = distribute_tensor(
                param,
                device_mesh,
                [_StridedShard(0, split_factor=self.parts)],
                src_data_rank=self.src_data_rank,
            )
            module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor,
        device_mesh: DeviceMesh,
    ) -> Any:  # fmt: skip
        # the output is strided-sharded on its last dimension like the weight's rows: locally,
        # this rank's share of each part, side by side; nothing to move
        return outputs.to_local() if use_local_output else outputs

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(parts={self.parts}, use_local_output={self.use_local_output})"
        )


def _divides(tp_size: int, count: int, what: str) -> None:
    if count % tp_size:
        divisors = ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)
        raise ValueError(
            f"{what} ({count}) must divide by the tensor-parallel size {tp_size}: use a TP size "
            f"in {divisors}, or change the model"
        )


def tp_plan(layer: nn.Module, tp_size: int | None = None) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan of one transformer ``Layer``: column-wise ``q``, ``kv``
    (fused, see ``FusedColwiseParallel``), ``up`` and ``gate``, row-wise ``o`` and ``down``; every
    output a plain tensor (the row-wise ones replicated). An MoE layer's plan covers its attention
    only. With ``tp_size``, a ValueError if the heads, key/value heads or MLP width do not divide
    by it."""
    if not isinstance(layer, Layer):
        raise TypeError(
            f"tp_plan takes a cutpipe.models.transformer.Layer, got {type(layer).__name__}"
        )
    attention = layer.attention
    if not isinstance(attention, Attention):
        raise TypeError(f"the layer's attention is a {type(attention).__name__}, not an Attention")
    if isinstance(attention.q.weight, DTensor):
        raise ValueError("this layer is already tensor-parallel: parallelize it once")
    if tp_size is not None:
        if tp_size < 1:
            raise ValueError(f"the tensor-parallel size must be at least 1, got {tp_size}")
        _divides(tp_size, attention.heads, "the attention heads")
        _divides(tp_size, attention.kv_heads, "the key/value heads")
    plan: dict[str, ParallelStyle] = {
        "attention.q": ColwiseParallel(),
        "attention.kv": FusedColwiseParallel(2),
        "attention.o": RowwiseParallel(),
    }
    mlp = layer.mlp
    if isinstance(mlp, MLP):
        if tp_size is not None:
            _divides(tp_size, mlp.up.out_features, "the MLP width (ffn)")
        plan["mlp.up"] = ColwiseParallel()
        if mlp.gate is not None:
            plan["mlp.gate"] = ColwiseParallel()
        plan["mlp.down"] = RowwiseParallel()
    elif not isinstance(mlp, MoE):
        raise TypeError(f"the layer's mlp is a {type(mlp).__name__}, neither an MLP nor an MoE")
    return plan


def parallelize_stage(module: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard every transformer ``Layer`` inside ``module`` (a stage, or a whole model before it
    is cut) over ``tp_mesh`` with ``tp_plan``, and return ``module``. The embedding and the head
    stay replicated; MoE layers shard their attention only.

    Call it on every rank of the TP group with identically initialised modules (each sharded
    weight is cut from TP rank 0's values), before the stage goes to a ``PipelineRunner``.
    Every check (sizes, a second call, a runner already routing the layers) runs on every layer
    before any is changed.
    """
    from cutpipe.runtime.compute.deferral import splitter_of

    if not isinstance(tp_mesh, DeviceMesh) or tp_mesh.ndim != 1:
        raise ValueError(
            "tp_mesh must be a one-dimensional DeviceMesh: pass the TP dimension of your mesh, "
            'e.g. mesh["tp"]'
        )
    tp_size = tp_mesh.size()
    layers = [layer for layer in module.modules() if isinstance(layer, Layer)]
    plans = [tp_plan(layer, tp_size) for layer in layers]  # every check before any change
    if layers and splitter_of(module) is not None:
        raise ValueError(
            "a PipelineRunner already routes this stage's linears (its B/W split): parallelize "
            "the stage before building the runner"
        )
    if tp_size == 1:
        return module
    for layer, plan in zip(layers, plans, strict=True):
        parallelize_module(layer, tp_mesh, plan)
        attention = layer.attention
        attention.heads //= tp_size  # the forward views this rank's heads only
        attention.kv_heads //= tp_size
        attention.tp_size = tp_size
    return module
