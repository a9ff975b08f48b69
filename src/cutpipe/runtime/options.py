"""``RunnerOptions``: how a ``PipelineRunner`` runs, in one checked value.

A runner's constructor takes the schedule, this rank's stage modules, the loss and the process
group; everything else is an option here, with its default and its meaning in one place.
``PipelineRunner(..., options=RunnerOptions(...))`` and ``PipelineRunner(..., step_timeout=30)``
(any field as a keyword) are the same thing. The executor and the transport are options too:
factories that build them for one rank (see ``cutpipe.runtime.protocols``), which is where a new
executor (say, CUDA graphs) or a new transport (say, NCCL-specific overlap) plugs in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from cutpipe.sim.costs import Costs
from cutpipe.sim.steps import BOUNDARIES

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import nn

    from cutpipe.runtime.compute.saved import SavedMeter
    from cutpipe.runtime.protocols import (
        Executor,
        ExecutorContext,
        GradientReducer,
        Transport,
        TransportContext,
    )

#: seconds a rank may go without completing an op before the watchdog stops the pipeline
DEFAULT_STEP_TIMEOUT = 600.0
#: how long set-up waits for the other ranks when the progress watchdog is off
NO_TIMEOUT = 1800.0


@dataclass(frozen=True)
class RunnerOptions:
    """Attributes:
    loss_reduction: "mean" (default, as torch's schedules) or "sum" over the microbatches.
    split_backward: run the schedule's B and W as separate passes (False: a W does nothing and
        every B computes the weight gradients too).
    emulate: sleep for these costs instead of running the stage modules (``time_unit`` seconds
        per cost unit); tiny tensors still flow.
    w_memory: the share of an activation a B keeps for its W, for the activation meter.
    dynamic_shapes: boundary shapes may change at a fixed input shape: send them every step.
    sync_copies: start DualPipe's two copies of each stage equal (the lower rank's wins).
    record_timeline: measure when each op of a training step starts and ends
        (``PipelineRunner.timeline()``; forward-only steps are not recorded).
    prefetch: how many ops ahead receives are posted.
    loss_on_every_rank: all-reduce the loss so that every rank returns it (None: yes, except
        with ``step_boundary="overlap"``, where that all-reduce would end every step with a wait
        for every rank; there the ranks that compute losses return their own share).
    check_finite: a NaN or infinite loss raises, naming step, microbatch and rank.
    step_boundary: how a step that is given an optimizer (``step(x, y, optimizer=opt)``) ends:
        "sync" (every rank waits for the global gradient norm and finite check, then steps) or
        "overlap" (each rank steps as soon as its own gradients are final; the check follows,
        and a wrong step is rolled back and redone; ``cutpipe.runtime.step_boundary``).
    clip_grad_norm: clip the gradients of the whole pipeline to this global L2 norm before the
        optimizer step (None: no clipping).
    skip_nonfinite: skip the optimizer step when any gradient value of any rank is not finite.
    step_timeout, heartbeat, dead_after, exit_after: the failure model (docs/runtime.md);
        ``step_timeout=None`` turns the progress watchdog off.
    make_executor, make_transport: factories of this rank's executor and transport (None: the
        stage executor, or the emulated one with ``emulate``; the point-to-point ``Mailbox``).
    reducer: data parallelism: averages each stage's gradients over its replicas, started as
        soon as the stage's last backward of the step has run (``cutpipe.parallel.data_parallel``;
        ``ParallelMesh.gradient_reducer()`` builds one). None: no data parallelism.
    partitioned: parameters that each rank of a group holds a different part of, with that
        group (an EP group's experts: ``[(experts, ep_group)]``): for ``clip_grad_norm`` and
        ``skip_nonfinite`` their squares are summed over the group (the rest counted once), as
        ``cutpipe.runtime.clipping.clip_grad_norm(partitioned=...)`` does.
    op_meter: records the activation bytes around every op of the stage executor (a
        ``cutpipe.runtime.compute.saved.SavedMeter``: what each F leaves, what its B and its W
        free), which the simulator's memory model takes per stage. None: no records.
    """

    loss_reduction: str = "mean"
    split_backward: bool = True
    emulate: Costs | None = None
    time_unit: float = 0.01
    w_memory: float = 0.5
    dynamic_shapes: bool = False
    sync_copies: bool = True
    record_timeline: bool = False
    prefetch: int = 16
    loss_on_every_rank: bool | None = None
    check_finite: bool = False
    step_boundary: str = "sync"
    clip_grad_norm: float | None = None
    skip_nonfinite: bool = False
    step_timeout: float | None = DEFAULT_STEP_TIMEOUT
    heartbeat: float = 1.0
    dead_after: float = 20.0
    exit_after: float = 10.0
    make_executor: Callable[[ExecutorContext], Executor] | None = None
    make_transport: Callable[[TransportContext], Transport] | None = None
    reducer: GradientReducer | None = None
    partitioned: Sequence[tuple[Sequence[nn.Parameter], dist.ProcessGroup]] = ()
    op_meter: SavedMeter | None = None

    def __post_init__(self) -> None:
        if self.loss_reduction not in ("sum", "mean"):
            raise ValueError(f"loss_reduction must be 'sum' or 'mean', got {self.loss_reduction!r}")
        if (
            isinstance(self.prefetch, bool)
            or not isinstance(self.prefetch, int)
            or self.prefetch < 1
        ):
            raise ValueError(
                "prefetch is how many ops ahead receives are posted; it must be an int >= 1, "
                f"got {self.prefetch!r}"
            )
        if self.step_boundary not in BOUNDARIES:
            raise ValueError(
                f"step_boundary must be one of {', '.join(BOUNDARIES)}, got {self.step_boundary!r}"
            )
        if self.clip_grad_norm is not None and (
            not _is_number(self.clip_grad_norm) or self.clip_grad_norm <= 0
        ):
            raise ValueError(
                "clip_grad_norm is the largest global gradient norm, a number > 0 (None: no "
                f"clipping), got {self.clip_grad_norm!r}"
            )
        if self.check_finite and self.skip_nonfinite:
            raise ValueError(
                "check_finite raises at the first non-finite loss and skip_nonfinite skips the "
                "step instead: choose one"
            )
        if self.step_boundary == "overlap" and self.loss_on_every_rank:
            raise ValueError(
                "loss_on_every_rank=True all-reduces the loss at the end of every step, a wait for "
                "every rank that step_boundary='overlap' exists to avoid: leave it None (each rank "
                "returns its own losses) or use step_boundary='sync'"
            )
        if self.emulate is not None and not isinstance(self.emulate, Costs):
            raise TypeError(f"emulate takes a cutpipe Costs, got {type(self.emulate).__name__}")
        if not _is_number(self.w_memory) or not 0 <= self.w_memory <= 1:
            raise ValueError(f"w_memory is a share of an activation in [0, 1], got {self.w_memory}")
        for name in ("time_unit", "heartbeat", "dead_after", "exit_after", "step_timeout"):
            value = getattr(self, name)
            if name == "step_timeout" and value is None:
                continue
            if not _is_number(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.step_timeout is not None and self.step_timeout <= self.heartbeat:
            raise ValueError(
                f"step_timeout ({self.step_timeout:g} s) must be longer than the heartbeat "
                f"({self.heartbeat:g} s)"
            )
        if self.reducer is not None and not all(
            callable(getattr(self.reducer, name, None)) for name in ("stage_done", "finish")
        ):
            raise TypeError(
                "reducer must have stage_done(stage, parameters) and finish() (a "
                f"cutpipe.runtime.protocols.GradientReducer), got {type(self.reducer).__name__}"
            )
        for name in ("make_executor", "make_transport"):
            factory = getattr(self, name)
            if factory is not None and not callable(factory):
                raise TypeError(f"{name} must be callable, got {type(factory).__name__}")

    @classmethod
    def with_overrides(
        cls, options: RunnerOptions | None, overrides: dict[str, Any]
    ) -> RunnerOptions:
        """``options`` (default: the defaults) with some fields replaced by keyword; an unknown
        keyword is a TypeError that lists the known ones."""
        if options is not None and not isinstance(options, RunnerOptions):
            raise TypeError(f"options must be a RunnerOptions, got {type(options).__name__}")
        names = [field.name for field in fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(
                f"PipelineRunner got unknown option(s) {', '.join(unknown)}; known: "
                f"{', '.join(names)}"
            )
        values = {name: getattr(options, name) for name in names} if options else {}
        return cls(**{**values, **overrides})

    @property
    def loss_everywhere(self) -> bool:
        """Whether every rank returns the whole step's loss (``loss_on_every_rank`` resolved)."""
        if self.loss_on_every_rank is None:
            return self.step_boundary != "overlap"
        return self.loss_on_every_rank

    @property
    def validates_steps(self) -> bool:
        """Whether a step's end needs every rank's gradient norm and finite check."""
        return (
            self.clip_grad_norm is not None
            or self.skip_nonfinite
            or self.step_boundary == "overlap"
        )

    @property
    def setup_timeout(self) -> float:
        """How long set-up waits for the other ranks."""
        return self.step_timeout if self.step_timeout is not None else NO_TIMEOUT


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
