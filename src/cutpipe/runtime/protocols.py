"""The runtime's two seams: what runs an op (the executor) and what moves its values (the transport).

``PipelineRunner`` walks this rank's program; for each op it asks the transport for the inputs,
hands them to the executor, and gives the outputs back to the transport. Neither knows about the
other, or about the schedule beyond the instruction in hand, so either can be replaced:

- an **executor** runs forwards, split or full backwards, weight passes and overlapped F&B pairs
  on the stage modules (``StageExecutor``), or sleeps for their costs (``EmulatedExecutor``). A
  CUDA-graph executor would capture and replay the same calls.
- a **transport** posts receives ahead, sends, waits, and settles each step's end
  (``Mailbox``: point-to-point over torch.distributed, gloo or NCCL). An NCCL-specific transport
  (batched ``P2POp``s, its own streams) would implement the same five calls.

``RunnerOptions(make_executor=..., make_transport=...)`` plugs one in: each is called once per
runner with the context below. A third, smaller seam is the **gradient reducer**
(``RunnerOptions(reducer=...)``), which data parallelism implements (``cutpipe.parallel``).
docs/architecture.md shows the whole picture.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.runtime.failure.heartbeat import Progress
from cutpipe.runtime.program import Instruction, MessageKey, Parcel, RankProgram
from cutpipe.schedule.schedule import Schedule

Value = tuple[torch.Tensor, ...]


class GradientReducer(Protocol):
    """Averages the gradients of this rank's stages over their data-parallel replicas."""

    def stage_done(self, stage: int, parameters: Sequence[nn.Parameter]) -> None:
        """``stage``'s gradients for this step are complete: start reducing them."""
        ...

    def finish(self) -> None:
        """Wait for every reduction started this step and leave the averages in ``.grad``."""
        ...


class Executor(Protocol):
    """Runs this rank's ops. ``losses`` (the step's per-microbatch losses on the last stage),
    ``outputs`` (the last stage's outputs when there is no loss) and ``peak_units`` (the most
    activation units held at once) are read by the runner after each step."""

    losses: list[torch.Tensor]
    outputs: dict[int, Value]
    peak_units: float

    def begin_step(self, targets: Sequence[Any], loss_scale: float) -> None: ...

    def forward(self, ins: Instruction, values: Value) -> Value | None:
        """Run one forward; return what the next stage receives (None on the last stage)."""
        ...

    def backward(self, ins: Instruction, grads: Value | None) -> Value | None:
        """Run one B or BW; return the gradient of the stage input (None on the first)."""
        ...

    def weight(self, ins: Instruction) -> None:
        """Run one W: the weight gradients its B deferred."""
        ...

    def pair(
        self, forward: Instruction, values: Value, backward: Instruction, grads: Value | None
    ) -> tuple[Value | None, Value | None]:
        """Run an overlapped F&B pair; return both halves' outputs."""
        ...

    def end_step(self) -> None:
        """Check that nothing is left over (every slot freed)."""
        ...

    def close(self) -> None: ...


class Transport(Protocol):
    """Moves boundary values between this rank and the others."""

    def begin_step(self, program: RankProgram, agreed: Callable[[], bool]) -> None:
        """Start a step of ``program``. ``agreed()`` waits for the ranks' agreement on the step
        (and raises if they disagree) and says whether shapes must be learned again: call it
        before the step's first transfer."""
        ...

    def prefetch(self, key: MessageKey, src: int) -> None:
        """Post the receive of a value needed soon, so that it lands while the rank computes."""
        ...

    def receive(self, key: MessageKey, src: int) -> Value:
        """Wait for a value from rank ``src``."""
        ...

    def send(self, parcel: Parcel, values: Sequence[Value], dst: int) -> None:
        """Send the values of one parcel to rank ``dst``; return at once."""
        ...

    def end_step(self) -> None:
        """Wait for the step's sends; check nothing was left unreceived."""
        ...


@dataclass(frozen=True)
class ExecutorContext:
    """What building one rank's executor may use."""

    schedule: Schedule
    program: RankProgram
    modules: Mapping[int, nn.Module]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    device: torch.device
    options: Any  # RunnerOptions (imported lazily to keep this module's imports one-way)


@dataclass(frozen=True)
class TransportContext:
    """What building one rank's transport may use: the program, the pipeline's process group
    (its ranks as global ranks), the device tensors live on, and where to report waits."""

    program: RankProgram
    group: dist.ProcessGroup
    global_ranks: Sequence[int]
    device: torch.device
    progress: Progress
    options: Any  # RunnerOptions


def default_executor(context: ExecutorContext) -> Executor:
    """The stage executor, or the emulated one when the options ask for emulation."""
    from cutpipe.runtime.compute.emulation import EmulatedExecutor
    from cutpipe.runtime.compute.executor import StageExecutor

    options = context.options
    if options.emulate is not None:
        return EmulatedExecutor(
            context.schedule, options.emulate, options.time_unit, options.w_memory, context.device
        )
    return StageExecutor(
        context.modules, context.loss_fn, context.program.split_slots, options.split_backward,
        options.w_memory, options.check_finite, context.device, options.op_meter,
    )  # fmt: skip


def default_transport(context: TransportContext) -> Transport:
    """Point-to-point transfers over torch.distributed (gloo or NCCL)."""
    from cutpipe.runtime.transport.mailbox import Mailbox

    return Mailbox.open(context)
