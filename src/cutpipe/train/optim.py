"""The optimizer step of pipelined training: AdamW's decay groups, warm-up + cosine, and
gradient accumulation over several runner steps.

Each pipeline rank updates only the parameters it stores (``PipelineRunner.parameters()``), so
everything here is local except the gradient norm, which clipping takes over the whole pipeline
(``cutpipe.runtime.clipping``, re-exported here with ``clip_pipeline_grad_norm`` for a runner).
With that, training on R ranks follows the same trajectory as one process training the
unsplit model (docs/runtime.md, "What a step does").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.runtime.clipping import clip_grad_norm, mirror_copies

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


def clip_pipeline_grad_norm(
    runner: PipelineRunner, max_norm: float, **options: Any
) -> torch.Tensor:
    """``clip_grad_norm`` of this rank's parameters over ``runner``'s group, with its schedule's
    copies; ``options`` are ``clip_grad_norm``'s keywords."""
    return clip_grad_norm(
        runner.parameters(), max_norm, runner.group, mirror_copies(runner.schedule), **options
    )


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
