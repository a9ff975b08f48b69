"""The optimizer step at a step boundary: synchronous, or post-validated (docs/runtime.md, "Step
boundaries").

Clipping by the global gradient norm and skipping a step whose gradients are not finite both need
one number from every rank before any rank may step. ``sync`` waits for it: each rank's squared
norm (its own stages, DualPipe's mirrored copies counted once) and finite flag are gathered, then
every rank clips or skips and steps. That gather ends every step with a wait for the slowest rank,
so the next step's warm-up cannot overlap this step's cool-down.

``overlap`` steps first and checks afterwards. Each rank steps as soon as its own gradients are
final, as if nothing needed clipping and every value were finite, and keeps what it needs to undo
the step: its parameters and optimizer state from before it (copies) and the gradients it used.
The same words are gathered in the background, on a channel of their own. The next step runs on
the stepped parameters; when it has ended on this rank, the verdict on the previous step is read.
Usually it says the optimistic step was right and the copies are dropped. Otherwise every rank
(they all read the same verdict) restores its parameters and state, redoes the previous step as
``sync`` would have (clipped, or skipped), and runs the step it has just run again, since its
forwards used parameters that should not have existed. The words, the verdict and the arithmetic
are those of ``sync``, so the parameters are bitwise equal to synchronous clipping and skipping; a
rollback costs one step run twice, which pays while clipping rarely triggers.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from cutpipe.runtime.clipping import clip_coefficient, scale_gradients
from cutpipe.runtime.options import RunnerOptions

#: a gather that has started; calling it waits and gives every rank's word, one row per rank
Gathered = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    """What the whole pipeline's gradients say about a step.

    Attributes:
        norm: the global L2 norm of the gradients (NaN or infinity when some value is not).
        finite: every gradient value of every rank is finite.
        skip: the step is skipped (``skip_nonfinite`` and a value is not finite).
        scale: what the gradients are multiplied by before the optimizer step (1.0: unclipped).
        loss: the step's loss over the whole pipeline (None: no rank computed one), which
            travels with the words so that no separate all-reduce ends the step.
        max_norm: what the gradients are clipped to (None: not clipped).
    """

    norm: float
    finite: bool
    skip: bool
    scale: float
    loss: float | None = None
    max_norm: float | None = None

    @property
    def as_stepped_optimistically(self) -> bool:
        """An optimistic step (unscaled gradients, not skipped) was the right one."""
        return not self.skip and self.scale == 1.0


#: the verdict an optimistic step assumes: nothing clipped, nothing skipped
OPTIMISTIC = Verdict(norm=math.nan, finite=True, skip=False, scale=1.0)


def gradient_word(
    parameters: Sequence[nn.Parameter],
    loss_share: float = 0.0,
    losses: int = 0,
    partitioned: Sequence[tuple[Sequence[nn.Parameter], dist.ProcessGroup]] = (),
) -> torch.Tensor:
    """This rank's part of the verdict, in float64 on the CPU: the sum of its gradients' squares
    (a non-finite value makes it NaN or infinite), its share of the step's loss, how many
    microbatch losses it computed, and the squares of the ``partitioned`` parameters, each set
    summed over the group whose ranks hold different parts of it (an EP group's experts; a
    collective of that group, whose ranks the all-to-alls keep in step)."""
    grads = {id(p): p.grad.detach() for p in parameters if p.grad is not None}
    if any(isinstance(g, DTensor) for g in grads.values()):
        raise TypeError(
            "the runner's clip_grad_norm and skip_nonfinite count plain gradients; these are "
            "DTensor shards (FSDP or tensor parallelism): clip with "
            "cutpipe.runtime.clipping.clip_grad_norm after runner.step instead"
        )
    apart = {id(p) for held, _ in partitioned for p in held}
    squares = _squares([grad for key, grad in grads.items() if key not in apart])
    split = 0.0
    for held, owners in partitioned:
        part = [p.grad.detach() for p in held if p.grad is not None]
        device = part[0].device if part else torch.device("cpu")
        total = torch.tensor([_squares(part)], dtype=torch.float64, device=device)
        if dist.get_world_size(owners) > 1:
            dist.all_reduce(total, group=owners)
        split += float(total)
    return torch.tensor([squares, loss_share, losses, split], dtype=torch.float64)


def _squares(grads: Sequence[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    return float(torch.stack(torch._foreach_norm(grads)).double().square().sum())


def verdict(
    words: torch.Tensor, copies: int, clip_grad_norm: float | None, skip_nonfinite: bool
) -> Verdict:
    """The decision every rank takes from the gathered words (one row per rank), each stage's
    squares counted once when every stage is stored ``copies`` times; the scale is torch's
    ``clip_grad_norm_``'s (``cutpipe.runtime.clipping.clip_coefficient``)."""
    squares = float(words[:, 0].sum() + words[:, 3].sum()) / copies
    norm = math.sqrt(squares) if squares >= 0 else math.nan
    finite = math.isfinite(norm)
    skip = skip_nonfinite and not finite
    scale = 1.0
    if clip_grad_norm is not None and not skip:
        scale = clip_coefficient(norm, clip_grad_norm)
    loss = float(words[:, 1].sum()) if float(words[:, 2].sum()) > 0 else None
    return Verdict(
        norm=norm, finite=finite, skip=skip, scale=scale, loss=loss, max_norm=clip_grad_norm
    )


def _apply(
    optimizer: torch.optim.Optimizer, parameters: Sequence[nn.Parameter], ruling: Verdict
) -> None:
    """Clip and step, or skip; the gradients are gone afterwards either way."""
    if not ruling.skip:
        if ruling.scale != 1.0 and ruling.max_norm is not None:
            norm = torch.tensor(ruling.norm, dtype=torch.float64)
            scale_gradients(parameters, ruling.max_norm, norm)
        optimizer.step()
    for parameter in parameters:
        parameter.grad = None


class _Undo:
    """What undoing one optimizer step needs: the parameters and the optimizer's state from before
    it (copies), its hyperparameters (a learning-rate schedule may move them before the verdict
    comes) and the gradients it used (kept, not copied)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, parameters: Sequence[nn.Parameter]
    ) -> None:
        self.optimizer = optimizer
        self.parameters = list(parameters)
        self.values = [p.detach().clone() for p in self.parameters]
        self.state = {
            p: {
                k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                for k, v in s.items()
            }
            for p, s in optimizer.state.items()
        }
        self.hyperparameters = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]
        self.grads = [p.grad for p in self.parameters]

    @torch.no_grad()
    def redo(self, ruling: Verdict) -> None:
        """Put everything back as it was before the step, then take the step ``ruling`` asks for,
        with the hyperparameters it had."""
        optimizer = self.optimizer
        for parameter, value in zip(self.parameters, self.values, strict=True):
            parameter.copy_(value)
        optimizer.state.clear()
        optimizer.state.update(self.state)
        current = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        for group, then in zip(optimizer.param_groups, self.hyperparameters, strict=True):
            group.update(then)
        for parameter, grad in zip(self.parameters, self.grads, strict=True):
            parameter.grad = grad
        _apply(optimizer, self.parameters, ruling)
        for group, now in zip(optimizer.param_groups, current, strict=True):
            group.update(now)


@dataclass
class _Pending:
    """An optimistic step whose verdict is still travelling."""

    gathered: Gathered
    undo: _Undo | None  # None: no optimizer, nothing to undo


class StepBoundary:
    """One rank's optimizer steps, at the boundary its runner was asked for.

    ``finish(optimizer)`` ends a step whose gradients are final on this rank; ``settle()`` reads
    the verdict still pending (``overlap``) and says whether the last step must run again.
    ``optimizer=None`` takes no optimizer step at all (time emulation measures the boundary's
    traffic only). What it does comes from the runner's (checked) options: ``step_boundary``,
    ``clip_grad_norm``, ``skip_nonfinite``; without anything to validate (sync, nothing to clip
    or skip) it steps without gathering.
    """

    def __init__(
        self,
        options: RunnerOptions,
        parameters: Callable[[], Sequence[nn.Parameter]],
        start_gather: Callable[[torch.Tensor], Gathered],
        copies: int = 1,
    ) -> None:
        self.boundary = options.step_boundary
        self._parameters = parameters
        self._start_gather = start_gather
        self._copies = copies
        self._clip = options.clip_grad_norm
        self._skip = options.skip_nonfinite
        self._validate = options.validates_steps
        self._partitioned = options.partitioned
        self._pending: _Pending | None = None
        #: the verdict on the last step it was read for
        self.last: Verdict | None = None
        #: how many optimistic steps were undone and redone
        self.rollbacks = 0

    def _rule(self, words: torch.Tensor) -> Verdict:
        self.last = verdict(words, self._copies, self._clip, self._skip)
        return self.last

    def finish(
        self, optimizer: torch.optim.Optimizer | None, loss_share: float = 0.0, losses: int = 0
    ) -> None:
        """This rank's gradients of the step are final: step (``sync``: once every rank's word
        is in; ``overlap``: now, optimistically). ``loss_share`` is this rank's part of the
        step's loss (computed from ``losses`` microbatch losses)."""
        parameters = list(self._parameters())
        if not self._validate:  # nothing to check: step at once
            if optimizer is not None:
                _apply(optimizer, parameters, OPTIMISTIC)
            return
        word = gradient_word(parameters, loss_share, losses, self._partitioned)
        gathered = self._start_gather(word)
        if self.boundary == "sync":
            ruling = self._rule(gathered())
            if optimizer is not None:
                _apply(optimizer, parameters, ruling)
            return
        undo = None
        if optimizer is not None:
            undo = _Undo(optimizer, parameters)
            _apply(optimizer, parameters, OPTIMISTIC)  # the undo record keeps the gradients
        self._pending = _Pending(gathered, undo)

    def settle(self) -> bool:
        """Read the pending verdict (if any); True when the optimistic step was wrong and has just
        been redone, so whatever ran on its parameters since must run again."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        ruling = self._rule(pending.gathered())
        if ruling.as_stepped_optimistically:
            return False
        self.rollbacks += 1
        if pending.undo is not None:
            pending.undo.redo(ruling)
            # autocast keeps its casts of the parameters until its outermost region ends: the
            # step that runs again inside the same region must not reuse the stale ones
            torch.clear_autocast_cache()
        return True
