"""Clipping by the global gradient norm of the whole pipeline: one function for every step
boundary.

Each pipeline rank holds only its own stages' gradients, so the norm of the *whole* model needs
one reduction over the pipeline group, with each parameter counted once even where DualPipe
stores it on two ranks (``mirror_copies``). ``clip_grad_norm`` reduces it with an all-reduce
(the trainer's synchronous step, after accumulation, DTensor shards included); the runner's
step boundary (``cutpipe.runtime.step_boundary``) gathers the same squares beside its verdict.
Both then scale with ``scale_gradients``: torch's own ``clip_grads_with_norm_`` on the local
parts, so the arithmetic is ``torch.nn.utils.clip_grad_norm_``'s, bit for bit on one process.
docs/runtime.md, "What a step does", walks through it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cutpipe.runtime.transport.flat import local_shard
from cutpipe.schedule.schedule import Schedule

#: what torch's clip_grad_norm_ adds to the norm before dividing
CLIP_EPSILON = 1e-6


def mirror_copies(schedule: Schedule) -> int:
    """How many ranks store each stage of ``schedule``: 2 for DualPipe (rank r and R-1-r), 1 for
    every other schedule; ``clip_grad_norm``'s ``copies``."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a cutpipe Schedule, got {type(schedule).__name__}")
    placement = schedule.placement
    counts = {len(placement.copies(stage)) for stage in range(placement.num_stages)}
    if len(counts) != 1:
        raise ValueError(
            f"the stages of {schedule.name!r} are stored {sorted(counts)} times: one divisor "
            "cannot count each parameter once; store every stage equally often"
        )
    return counts.pop()


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    copies: int = 1,
    *,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    partitioned: Sequence[tuple[Sequence[torch.Tensor], dist.ProcessGroup]] = (),
) -> torch.Tensor:
    """Clip the gradients of the whole pipeline to ``max_norm``; return the norm before clipping.

    Every rank of the pipeline group must call it (one all-reduce), each with its own
    parameters. The norm is that of all the model's gradients as one vector: each rank's sum of
    ``|g|^p`` all-reduced over ``group`` (the default group; this process alone without
    torch.distributed), divided by ``copies``. Dividing counts each parameter once when every
    stage is stored ``copies`` times (``mirror_copies``: DualPipe's two copies hold the same
    gradients once ``runner.step`` has summed them), and it keeps every rank on the same code,
    where naming an owner per copy would not. With the max norm (``norm_type=inf``) copies do
    not matter. Then every rank scales by the same factor, as
    ``torch.nn.utils.clip_grad_norm_`` does on one process (and with the same answer there):
    ``min(1, max_norm / (norm + 1e-6))``, a non-finite norm included, unless
    ``error_if_nonfinite``, when every rank raises.

    ``max_norm=inf`` only measures. Pass the pipeline's own group (``runner.group``) when the
    pipeline is part of a larger mesh.

    Gradients that are ``DTensor`` shards (FSDP's, over the data-parallel mesh; tensor
    parallelism's) count their local shards, summed (or, for the max norm, maxed) over the mesh
    dimensions they are sharded along before the pipeline's reduction, so the norm is that of
    the whole gradients, exactly; replicated dimensions count once. Every rank of such a mesh
    dimension must then call it too, with parameters of the same layouts in the same order (the
    ranks of a data-parallel group hold the same stages). The local shards are scaled.

    ``partitioned`` lists parameters of ``parameters`` that each rank of a group holds a
    different part of (an expert-parallel group's experts: ``(experts, ep_group)``): their
    ``|g|^p`` are summed over that group first, as a DTensor's shards are, while the rest of
    ``parameters`` (replicated over that group) count once.
    """
    parameters = list(parameters)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0 (inf: only measure), got {max_norm!r}")
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies is how many ranks store each stage (>= 1), got {copies!r}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type!r}")
    pipeline = _group_size(group)
    if pipeline == 1 and copies > 1:
        raise ValueError(
            f"copies={copies} but this process is the whole pipeline: pass the pipeline's process "
            "group, or copies=1"
        )
    sharded = _sharded_gradients(parameters, partitioned)
    grads = [  # a replicated DTensor's local gradient is the whole one
        local_shard(p.grad)
        for p in parameters
        if p.grad is not None and id(p) not in sharded.members
    ]
    local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if sharded.buckets:
        total = _sharded_norm(
            local, sharded, parameters, norm_type, group, pipeline, copies, foreach
        )
    elif pipeline > 1:
        total = _reduce_norm(local, _device(parameters, group), norm_type, group, copies)
    else:
        total = local
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"the gradient norm of order {norm_type:g} over the pipeline is {float(total)}, so it "
            "cannot be clipped: look for the NaN or infinity (check_finite=True on the runner "
            "names the microbatch), lower the learning rate, or pass error_if_nonfinite=False to "
            "scale by it anyway"
        )
    scale_gradients(parameters, max_norm, total, foreach)
    return total


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What clipping to ``max_norm`` multiplies the gradients by when their global norm is
    ``norm``: torch's ``min(1, max_norm / (norm + 1e-6))`` (NaN for a NaN or infinite norm)."""
    scale = max_norm / (norm + CLIP_EPSILON) if math.isfinite(norm) else math.nan
    return min(scale, 1.0) if not math.isnan(scale) else scale


def scale_gradients(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """Clip the gradients of ``parameters`` (DTensors' local parts) to ``max_norm`` given the
    global ``norm``, with torch's own ``clip_grads_with_norm_``."""
    grads = [_LocalGradient(local_shard(p.grad)) for p in parameters if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach)  # type: ignore[arg-type]


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "a process group was given but torch.distributed is not initialized: call "
                "init_process_group first, or pass group=None"
            )
        return 1
    return dist.get_world_size(group)


def _device(parameters: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> torch.device:
    """Where the norm's all-reduce runs: NCCL's on this process's GPU, others' with the
    parameters."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return parameters[0].device if parameters else torch.device("cpu")


class _LocalGradient:
    """Stands for a parameter, holding its gradient's local part, for torch's scaling."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


@dataclass
class _Sharded:
    """Parameters whose gradients are sharded DTensors, by the groups that shard them."""

    members: set[int]  # their ids
    buckets: list[tuple[list[dist.ProcessGroup], list[torch.Tensor]]]  # groups, local shards


def _sharded_gradients(
    parameters: Sequence[torch.Tensor],
    partitioned: Sequence[tuple[Sequence[torch.Tensor], dist.ProcessGroup]] = (),
) -> _Sharded:
    """The parameters split over some group of more than one rank: DTensors sharded along a
    mesh dimension, and ``partitioned`` ones (each rank of the group holds a different part,
    which may itself be a DTensor shard), grouped by those process groups (in order of first
    appearance, the same on every rank holding the same parameters), with their gradients'
    local shards (None: no gradient)."""
    from torch.distributed.tensor import DTensor

    owners_of = {
        id(p): owners for held, owners in partitioned if _group_size(owners) > 1 for p in held
    }
    members: set[int] = set()
    by_layout: dict[tuple[int, ...], tuple[list[dist.ProcessGroup], list[torch.Tensor]]] = {}
    for parameter in parameters:
        groups = []
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            for dim, placement in enumerate(parameter.placements):
                if placement.is_partial():
                    raise ValueError(
                        "a parameter is a DTensor with a Partial placement: clip after the "
                        "gradients are reduced"
                    )
                if placement.is_shard() and mesh.size(dim) > 1:
                    groups.append(mesh.get_group(dim))
        if id(parameter) in owners_of:
            groups.append(owners_of[id(parameter)])
        if not groups:
            continue  # replicated: its local gradient is the whole one, counted as a plain one
        members.add(id(parameter))
        key = tuple(id(g) for g in groups)
        bucket = by_layout.setdefault(key, (groups, []))
        if parameter.grad is not None:
            bucket[1].append(local_shard(parameter.grad))
    return _Sharded(members, list(by_layout.values()))


@torch.no_grad()
def _sharded_norm(
    local: torch.Tensor,
    sharded: _Sharded,
    parameters: Sequence[torch.Tensor],
    norm_type: float,
    group: dist.ProcessGroup | None,
    pipeline: int,
    copies: int,
    foreach: bool | None,
) -> torch.Tensor:
    """The norm over the pipeline of plain gradients (``local``: this rank's norm of them) and
    sharded ones: each bucket's shards combined over its sharding groups, then everything over
    the pipeline, in float64 as ``_reduce_norm``."""
    dtype = local.dtype if local.dtype.is_floating_point else torch.float32
    device = _device(parameters, group)  # sharded gradients mean torch.distributed is up
    inf = math.isinf(norm_type)

    def power(norm: torch.Tensor) -> torch.Tensor:
        own = norm.to(device, torch.float64)
        return own if inf else own.pow(norm_type)

    total = power(local)
    for groups, shards in sharded.buckets:
        norm = torch.nn.utils.get_total_norm(shards, norm_type, False, foreach)
        part = power(norm if shards else torch.zeros((), device=device))
        for shard_group in groups:
            part = _combine(part, norm_type, shard_group)
        total = torch.maximum(total, part) if inf else total + part
    if pipeline > 1:
        total = _combine(total, norm_type, group)
    if not inf:
        total = (total / copies).pow(1.0 / norm_type)
    return total.to(dtype)


def _combine(
    value: torch.Tensor, norm_type: float, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``value`` (a float64 ``|g|^p`` sum, or a max for the max norm) over ``group``."""
    if math.isinf(norm_type):
        # a max drops NaNs on some backends: carry "this rank saw a NaN" beside it
        pair = torch.stack([torch.nan_to_num(value, nan=0.0), value.isnan().to(torch.float64)])
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group)
        return torch.where(pair[1] > 0, torch.full_like(pair[0], math.nan), pair[0])
    value = value.clone()
    dist.all_reduce(value, group=group)
    return value


@torch.no_grad()
def _reduce_norm(
    local: torch.Tensor,
    device: torch.device,
    norm_type: float,
    group: dist.ProcessGroup | None,
    copies: int,
) -> torch.Tensor:
    """The pipeline's norm from every rank's own, in float64 so ``|g|^p`` sums stay in range."""
    dtype = local.dtype if local.dtype.is_floating_point else torch.float32
    own = local.to(device, torch.float64)
    if math.isinf(norm_type):
        # a max drops NaNs on some backends: carry "this rank saw a NaN" beside it
        pair = torch.stack([torch.nan_to_num(own, nan=0.0), own.isnan().to(torch.float64)])
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group)
        total = torch.where(pair[1] > 0, torch.full_like(pair[0], math.nan), pair[0])
    else:
        power = own.pow(norm_type)
        dist.all_reduce(power, group=group)
        total = (power / copies).pow(1.0 / norm_type)
    return total.to(dtype)
