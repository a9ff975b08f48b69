"""Stages that run as phases, so an overlapped F&B pair can hide one half's communication.

DualPipe and Cut-in-half pair one microbatch's forward with another's backward on the same rank.
That only pays if the two are interleaved: while one half waits for an all-to-all, the other
computes. So a ``PhasedStage`` describes its forward as a *program*: ``Compute`` phases (pieces of
the model, run under autograd) separated by ``Transfer`` phases (an exchange whose result the next
piece needs; it sends the last tensor of the state and puts what arrives in its place).

Every training forward records a ``Tape``: per piece its inputs, as fresh autograd leaves, and its
outputs; per transfer the exchange and the received tensor. The backward walks the tape in
reverse: ``torch.autograd.backward`` over one piece, then the transfer of that piece's input
gradient back the way the rows came, and so on. A ``Notice`` is a small collective without
gradient (the row counts an all-to-all needs first). Both walks are generators that yield right after
starting an exchange, so ``interleave`` can run the other walk's next piece before waiting.

The stage's outputs come out of one autograd node (``_TapeEnd``) whose backward walks the tape,
so the runner's ordinary ``torch.autograd.backward`` (its B and BW ops) works unchanged. For an
overlapped pair the stage's ``overlap_forward_backward`` hook runs the forward, which hands its
own walk to the backward stage before starting the backward: when autograd reaches that stage's
``_TapeEnd``, the two walks run interleaved. Everything runs on the calling thread, inside the
forward task's B/W-split context, in the same order on every rank of an EP group (each exchange
is a collective, so the order must match).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cutpipe.runtime.stages import Stage

Value = tuple[torch.Tensor, ...]
Context = dict[Any, Any]  # what one microbatch's phases tell each other (routes, indices)


class Pending(Protocol):
    def wait(self) -> Any: ...


class Exchange(Protocol):
    """A collective started now and finished later, in both directions."""

    def start(self, rows: torch.Tensor) -> Pending: ...  # wait() gives the received rows

    def start_backward(self, grad: torch.Tensor) -> Pending: ...


@dataclass(frozen=True)
class Compute:
    """A piece of the stage: ``fn(context, *state) -> state`` (a tuple of tensors)."""

    name: str
    fn: Callable[..., Value]


@dataclass(frozen=True)
class Transfer:
    """An exchange of the state's last tensor; ``make(context)`` builds this microbatch's."""

    name: str
    make: Callable[[Context], Exchange]


@dataclass(frozen=True)
class Notice:
    """A small collective that later phases read (how many rows will arrive); no gradient.

    ``start(context)`` launches it and returns something to ``wait()`` on, which records the
    result in the context. Starting it early and waiting after the other walk's next piece keeps
    even this handshake off the critical path.
    """

    name: str
    start: Callable[[Context], Pending]


Phase = Compute | Transfer | Notice


def fuse(program: Sequence[Phase]) -> list[Phase]:
    """Merge neighbouring Compute phases: nothing can run between them anyway."""
    fused: list[Phase] = []
    for phase in program:
        if fused and isinstance(phase, Compute) and isinstance(fused[-1], Compute):
            first, second = fused[-1], phase

            def both(context: Context, *state: torch.Tensor, _a=first.fn, _b=second.fn) -> Value:
                return _b(context, *_a(context, *state))

            fused[-1] = Compute(f"{first.name}+{second.name}", both)
        else:
            fused.append(phase)
    if fused and not isinstance(fused[0], Compute):
        raise ValueError("a stage program must start with a Compute phase")
    return fused


def _as_value(output: Any) -> Value:
    return output if isinstance(output, tuple) else (output,)


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh autograd leaf holding ``tensor``'s values: where a piece's graph begins."""
    if not tensor.is_floating_point():
        return tensor
    return tensor.detach().requires_grad_(tensor.requires_grad)


@dataclass
class _Piece:
    leaves: Value
    outputs: Value


@dataclass
class _Moved:
    name: str
    exchange: Exchange
    received: torch.Tensor


class Tape:
    """One microbatch's forward through a stage, piece by piece, until its backward."""

    def __init__(self, owner: PhasedStage) -> None:
        self.owner = owner
        self.records: list[_Piece | _Moved] = []
        self.outputs: Value = ()


class Walk:
    """A forward or backward pass that advances one phase (up to an exchange) at a time."""

    def __init__(self, steps: Generator[None, None, Any]) -> None:
        self._steps = steps
        self.done = False
        self.result: Any = None

    def advance(self) -> bool:
        """Run up to the next started exchange; False once the pass has finished."""
        if self.done:
            return False
        try:
            next(self._steps)
            return True
        except StopIteration as stop:
            self.done, self.result = True, stop.value
            return False

    def finish(self) -> Any:
        while self.advance():
            pass
        return self.result


def interleave(*walks: Walk) -> None:
    """Run the walks round-robin: each computes while the others' exchanges are in flight."""
    active = list(walks)
    while active:
        active = [walk for walk in active if walk.advance()]


def forward_steps(
    stage: PhasedStage, inputs: Value, context: Context, tape: Tape | None
) -> Generator[None, None, Value]:
    """The forward, yielding after each exchange starts. ``tape=None``: no autograd (inference)."""
    state = tuple(inputs)
    recording = tape is not None
    for index, phase in enumerate(stage.program):
        if isinstance(phase, Compute):
            leaves = tuple(map(_leaf, state)) if recording and index else state
            stage.note("F", phase.name)
            with torch.enable_grad() if recording else nullcontext():
                state = _as_value(phase.fn(context, *leaves))
            if tape is not None:
                tape.records.append(_Piece(leaves, state))
        elif isinstance(phase, Notice):
            pending = phase.start(context)
            stage.note("F", f"start {phase.name}")
            yield
            stage.wait(pending, "F", phase.name)
        else:
            exchange = phase.make(context)
            outgoing = state[-1]
            pending = exchange.start(outgoing.detach())
            stage.note("F", f"start {phase.name}")
            yield
            received = stage.wait(pending, "F", phase.name)
            if tape is not None:
                received.requires_grad_(outgoing.requires_grad)
                tape.records.append(_Moved(phase.name, exchange, received))
            state = (*state[:-1], received)
    return state


def backward_steps(
    stage: PhasedStage, tape: Tape, grads: Sequence[torch.Tensor | None]
) -> Generator[None, None, None]:
    """The backward from the gradients of the stage outputs, yielding after each exchange starts.

    Every exchange runs whatever the gradients are (zeros if none): it is a collective, and the
    other ranks of the group run it too.
    """
    current = list(grads)
    while tape.records:
        record = tape.records.pop()  # drop each piece as soon as it is done: frees its graph
        if isinstance(record, _Moved):
            grad = current[-1]
            if grad is None:
                grad = torch.zeros_like(record.received)
            pending = record.exchange.start_backward(grad.contiguous())
            stage.note("B", f"start {record.name}")
            yield
            current[-1] = stage.wait(pending, "B", record.name)
        else:
            stage.note("B", "compute")
            pairs = [
                (output, grad)
                for output, grad in zip(record.outputs, current, strict=True)
                if grad is not None and output.requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            current = [leaf.grad if leaf.is_floating_point() else None for leaf in record.leaves]


class _TapeEnd(torch.autograd.Function):
    """The autograd node the stage outputs come from; its backward walks the tape."""

    @staticmethod
    def forward(ctx, tape: Tape, anchor: torch.Tensor) -> Value:  # type: ignore[override]
        ctx.tape = tape
        outputs = tuple(o.detach() for o in tape.outputs)
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        tape, ctx.tape = ctx.tape, None
        stage = tape.owner
        walk = Walk(backward_steps(stage, tape, grads))
        partner = stage.take_partner()
        if partner is None:
            walk.finish()
        else:
            interleave(walk, partner)
        return None, None


class PhasedStage(Stage):
    """A pipeline stage whose forward and backward run as a program of phases (see the module).

    ``overlap=False`` keeps the hook but runs a pair's halves one after the other, as the runner
    does without a hook: the same stage, measured both ways. ``exposed_comm`` adds up the seconds
    spent waiting for exchanges (reset it yourself); set ``trace`` to a list to log each phase.
    Like any ``Stage``, it holds ``blocks`` of ``model`` under their names in the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        blocks: Sequence[str],
        program: Sequence[Phase],
        overlap: bool = True,
    ) -> None:
        super().__init__(model, blocks)
        self.program = fuse(program)
        self.phased = any(not isinstance(phase, Compute) for phase in self.program)
        self.overlap = overlap
        self.exposed_comm = 0.0
        self.trace: list[tuple[str, str]] | None = None
        self._partner: Walk | None = None
        self._backward_task: Any = None

    # -- what the walks report ---------------------------------------------------------------

    def note(self, half: str, event: str) -> None:
        if self.trace is not None:
            self.trace.append((half, event))

    def wait(self, pending: Pending, half: str, name: str) -> Any:
        began = time.perf_counter()
        received = pending.wait()
        self.exposed_comm += time.perf_counter() - began
        self.note(half, f"wait {name}")
        return received

    def take_partner(self) -> Walk | None:
        partner, self._partner = self._partner, None
        return partner

    # -- running -------------------------------------------------------------------------------

    def forward(self, *inputs: torch.Tensor) -> Any:
        if not self.phased:
            return super().forward(*inputs)
        context: Context = {}
        if not torch.is_grad_enabled():
            return Walk(forward_steps(self, inputs, context, None)).finish()
        tape = Tape(self)
        walk = Walk(forward_steps(self, inputs, context, tape))
        task, self._backward_task = self._backward_task, None
        if task is not None:  # an overlapped pair: the backward's walk runs beside this one
            task.module._partner = walk
            try:
                task.run()
            finally:
                task.module._partner = None
        tape.outputs = walk.finish()
        anchor = torch.empty(0, device=tape.outputs[0].device, requires_grad=True)
        return _TapeEnd.apply(tape, anchor)

    def overlap_forward_backward(self, forward_task: Any, backward_task: Any) -> None:
        """Run an F&B pair with the two halves' phases interleaved (see the module)."""
        forward_stage, backward_stage = forward_task.module, backward_task.module
        if (
            not self.overlap
            or not isinstance(forward_stage, PhasedStage)
            or not isinstance(backward_stage, PhasedStage)
            or not (forward_stage.phased and backward_stage.phased)
        ):
            forward_task.run()
            backward_task.run()
            return
        forward_stage._backward_task = backward_task
        try:
            forward_task.run()
        finally:
            forward_stage._backward_task = None
