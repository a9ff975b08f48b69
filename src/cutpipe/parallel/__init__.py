"""Parallelism around the pipeline: the PP x DP x EP mesh, data-parallel gradient reducers
(all-reduce, ZeRO-1's, FSDP2), expert parallelism with its all-to-alls and phased MoE stages,
and tensor parallelism inside stages."""

from cutpipe.parallel.expert_parallel import ExpertParallel, expert_parameters, shard_experts
from cutpipe.parallel.mesh import build_mesh
from cutpipe.parallel.moe_stage import MoEStage, moe_stages
from cutpipe.parallel.routing import (
    LayerRouting,
    RoutingStats,
    reset_routing_statistics,
    routing_statistics,
    update_routing_bias,
)

__all__ = [
    "ExpertParallel",
    "LayerRouting",
    "MoEStage",
    "RoutingStats",
    "build_mesh",
    "expert_parameters",
    "moe_stages",
    "reset_routing_statistics",
    "routing_statistics",
    "shard_experts",
    "update_routing_bias",
]
