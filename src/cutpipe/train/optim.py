"""The optimizer step of pipelined training: AdamW's decay groups, warm-up + cosine, clipping
over the whole pipeline, and gradient accumulation over several runner steps.

Each pipeline rank updates only the parameters it stores (``PipelineRunner.parameters()``), so
everything here is local except the gradient norm: clipping must see the norm of the *whole*
model, one all-reduce over the pipeline group, with each parameter counted once even where
DualPipe stores it on two ranks (docs/runtime.md, "What a step does"). With that, training on
R ranks follows the same trajectory as one process training the unsplit model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.runtime.transport.flat import local_shard as local_tensor
from cutpipe.schedule.schedule import Schedule

if TYPE_CHECKING:
    from cutpipe.runtime.runner import PipelineRunner

#: parameters, as ``model.named_parameters()`` gives them, or modules to take them from
NamedParameters = Iterable[tuple[str, nn.Parameter]] | nn.Module | Mapping[int, nn.Module]

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


# -- AdamW and its two parameter groups ------------------------------------------------------


def decays(name: str, parameter: torch.Tensor, *, embedding: bool = False) -> bool:
    """Whether weight decay applies to a parameter.

    Decay pulls weights towards zero to keep the matrices' scale in check; on a bias or a norm's
    gain (1-D, a shift or a scale per feature) it only fights the model, and on an embedding
    table it shrinks the rows of rare tokens, which get few gradients to push back. So: matrices
    (two or more dimensions) decay, except embeddings (``embedding=True``, or ``embed`` in the
    name); vectors and scalars do not.
    """
    return parameter.dim() >= 2 and not embedding and "embed" not in name.lower()


def _named(source: NamedParameters) -> list[tuple[str, nn.Parameter, bool]]:
    """(name, parameter, owned by an embedding layer), each trainable parameter once."""
    if isinstance(source, (nn.Module, Mapping)):
        modules = (
            [("", source)]
            if isinstance(source, nn.Module)
            else [(f"stage{stage}.", source[stage]) for stage in sorted(source)]
        )
        entries = []
        for prefix, module in modules:
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"{prefix.rstrip('.')} must be a torch.nn.Module, got {type(module).__name__}"
                )
            for path, layer in module.named_modules():
                owner = isinstance(layer, _EMBEDDINGS)
                for name, parameter in layer.named_parameters(recurse=False):
                    entries.append(
                        (f"{prefix}{path}.{name}" if path else prefix + name, parameter, owner)
                    )
    else:
        entries = []
        for item in source:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(
                    "build_optimizer takes (name, parameter) pairs, as model.named_parameters() "
                    f"gives them, or modules; got an item {item!r}"
                )
            entries.append((item[0], item[1], False))
    seen: set[int] = set()
    unique = []
    for name, parameter, owner in entries:
        if not isinstance(parameter, torch.Tensor):
            raise TypeError(f"{name} is a {type(parameter).__name__}, not a parameter")
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            unique.append((name, parameter, owner))
    return unique


def decay_groups(named_parameters: NamedParameters, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups for any torch optimizer: ``decay`` (``weight_decay``) and
    ``no_decay`` (0), split by ``decays``. Both are always there, possibly empty, so that every
    rank's optimizer has the same groups and its state dict the same layout.

    ``named_parameters`` is ``model.named_parameters()``, or a module, or this rank's stage
    modules (``runner.modules``): with modules, a parameter of an ``nn.Embedding`` is known for
    one by its layer's type, whatever its name.
    """
    if not _finite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    decay, rest = [], []
    for name, parameter, embedding in _named(named_parameters):
        (decay if decays(name, parameter, embedding=embedding) else rest).append(parameter)
    return [
        {"name": "decay", "params": decay, "weight_decay": float(weight_decay)},
        {"name": "no_decay", "params": rest, "weight_decay": 0.0},
    ]


def build_optimizer(
    named_parameters: NamedParameters,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    shard_over: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """AdamW over ``decay_groups``: this rank's parameters, decay on matrices only.

    Every rank builds its own from its own parameters; DualPipe's two copies of a stage get the
    same gradients and so take the same steps. With ``shard_over`` (the data-parallel group,
    ZeRO-1) each replica keeps the AdamW state of its share of the parameters only, steps them,
    and broadcasts them to the others (torch's ``ZeroRedundancyOptimizer``).
    """
    if not _finite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if len(betas) != 2 or not all(_finite(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not _finite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    groups = decay_groups(named_parameters, weight_decay)
    if shard_over is None or dist.get_world_size(shard_over) == 1:
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        groups, optimizer_class=torch.optim.AdamW, process_group=shard_over, lr=lr,
        betas=tuple(betas), eps=eps,
    )  # fmt: skip


# -- the learning rate over the run ----------------------------------------------------------


@dataclass(frozen=True)
class WarmupCosine:
    """The learning-rate factor of optimizer step ``step`` (0-based): ``(step + 1) / warmup``
    during the warm-up (so the first step already moves), then a cosine from 1 down to
    ``min_lr_ratio``, which it reaches at ``total_steps`` and keeps after.

    A callable object rather than a closure so that ``LambdaLR.state_dict()`` saves it.
    """

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / decay_steps) if decay_steps else 1.0
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up for ``warmup_steps`` optimizer steps, then cosine decay to ``min_lr_ratio``
    times each group's lr at ``total_steps`` (``WarmupCosine``). Call its ``step()`` after each
    ``optimizer.step()``."""
    for name, value, low in (("warmup_steps", warmup_steps, 0), ("total_steps", total_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if warmup_steps > total_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps}): "
            "shorten the warm-up or train longer"
        )
    if not _finite(min_lr_ratio) or not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio is a share of the lr in [0, 1], got {min_lr_ratio!r}")
    schedule = WarmupCosine(warmup_steps, total_steps, float(min_lr_ratio))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


# -- clipping over the whole pipeline ---------------------------------------------------------


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
    sharded = _sharded_gradients(parameters)
    grads = [  # a replicated DTensor's local gradient is the whole one
        local_tensor(p.grad)
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
    # torch's scaling, of DTensors' local parts (of the plain gradients themselves otherwise)
    local_grads = [_LocalGradient(local_tensor(p.grad)) for p in parameters if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(local_grads, max_norm, total, foreach)  # type: ignore[arg-type]
    return total


def clip_pipeline_grad_norm(
    runner: PipelineRunner, max_norm: float, **options: Any
) -> torch.Tensor:
    """``clip_grad_norm`` of this rank's parameters over ``runner``'s group, with its schedule's
    copies; ``options`` are ``clip_grad_norm``'s keywords."""
    return clip_grad_norm(
        runner.parameters(), max_norm, runner.group, mirror_copies(runner.schedule), **options
    )


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


def _sharded_gradients(parameters: Sequence[torch.Tensor]) -> _Sharded:
    """The DTensor parameters sharded along some mesh dimension of more than one rank, grouped
    by those dimensions' process groups (in order of first appearance, the same on every rank
    holding the same parameters), with their gradients' local shards (None: no gradient)."""
    from torch.distributed.tensor import DTensor

    members: set[int] = set()
    by_layout: dict[tuple[int, ...], tuple[list[dist.ProcessGroup], list[torch.Tensor]]] = {}
    for parameter in parameters:
        if not isinstance(parameter, DTensor):
            continue
        mesh, groups = parameter.device_mesh, []
        for dim, placement in enumerate(parameter.placements):
            if placement.is_partial():
                raise ValueError(
                    "a parameter is a DTensor with a Partial placement: clip after the "
                    "gradients are reduced"
                )
            if placement.is_shard() and mesh.size(dim) > 1:
                groups.append(mesh.get_group(dim))
        if not groups:
            continue  # replicated: its local gradient is the whole one, counted as a plain one
        members.add(id(parameter))
        key = tuple(id(g) for g in groups)
        bucket = by_layout.setdefault(key, (groups, []))
        if parameter.grad is not None:
            bucket[1].append(local_tensor(parameter.grad))
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


# -- several runner steps, one optimizer step ------------------------------------------------


def accumulate(runner: PipelineRunner, batches: Iterable[tuple[Any, Any]]) -> torch.Tensor | None:
    """Run ``runner.step(inputs, targets)`` for each batch and leave in the parameters the
    gradient of all of them together; return their loss. Then clip and step the optimizer once.

    ``runner.step`` adds its gradients to ``.grad`` (autograd and the split W accumulate), so
    accumulation itself needs nothing; what needs care:

    - the batches are reduced as the runner reduces microbatches: with ``loss_reduction="mean"``
      the result is the mean over the batches (each weighs the same: equal batches make it the
      mean over every microbatch, as one step on the concatenated batch), with ``"sum"`` the sum.
      The loss returned is reduced the same way (None where the runner returns None);
    - it starts from no gradients (it sets them to None, as ``optimizer.zero_grad()`` does).

    Every rank of the pipeline must call it with the same number of batches.
    """
    if not torch.is_grad_enabled():
        raise ValueError("accumulate computes gradients: call it with grad enabled")
    parameters = runner.parameters()
    for parameter in parameters:
        parameter.grad = None
    losses: list[torch.Tensor | None] = []
    for item in batches:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"accumulate takes (inputs, targets) pairs, got {type(item).__name__}: pass "
                "(inputs, None) or (None, targets) where a rank needs only one"
            )
        losses.append(runner.step(*item))
    if not losses:
        raise ValueError("accumulate needs at least one (inputs, targets) batch")
    count = len(losses)
    mean = runner.loss_reduction == "mean"
    if mean and count > 1:
        with torch.no_grad():
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.div_(count)
    if any(loss is None for loss in losses):
        return None
    total = torch.stack([loss for loss in losses if loss is not None]).sum()
    return total / count if mean else total


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
