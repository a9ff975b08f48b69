"""Running a rank's stage modules: forward, split or full backward, weight pass, overlapped pairs.

The executor knows nothing about communication: the runner hands it the values an op receives and
passes on what it returns. Per (stage, microbatch) it keeps a slot from the forward until the
op that last needs it: the inputs as autograd leaves and the outputs (or the loss) until the
backward, the deferred weight gradients until the W. Dropping a slot's tensors frees the graph.

It counts what it holds in *activation units*, the simulator's: a slot with its graph is one unit,
a slot holding only deferred weight gradients is ``w_memory`` of one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd import Variable

from cutpipe.runtime.compute.deferral import WeightGradients, WeightSplitter
from cutpipe.runtime.program import Instruction
from cutpipe.schedule.codes import B_CODE

if TYPE_CHECKING:
    from cutpipe.runtime.compute.saved import SavedMeter

Value = tuple[torch.Tensor, ...]
Backward = Callable[[Value, Value], None]


def as_value(output: Any, where: str | int) -> Value:
    """A stage's output as a tuple of tensors, or a clear error (``where``: a stage number, or
    what returned it)."""
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in output):
        return tuple(output)
    where = f"stage {where}" if isinstance(where, int) else where
    raise TypeError(
        f"{where} returned {type(output).__name__}; a stage must return a tensor or a tuple of tensors"
    )


def engine_backward(roots: Value, grads: Value) -> None:
    """``torch.autograd.backward`` without its Python checks and conversions, which on a small
    CPU stage cost about a third of the whole backward (docs/runtime.md, "Overhead per op"); the
    engine still checks every gradient against its root. ``grads`` has one tensor per root."""
    Variable._execution_engine.run_backward(roots, grads, False, False, (), True, True)


def python_backward(roots: Value, grads: Value) -> None:
    """``torch.autograd.backward``, for devices whose backward runs on the engine's own threads
    (which need the caller's context that the Python entry passes on)."""
    torch.autograd.backward(roots, grads)


@dataclass(slots=True)
class ForwardTask:
    """One microbatch's forward through one stage, for an overlap hook to run."""

    module: nn.Module
    stage: int
    microbatch: int
    inputs: Value
    run_forward: Callable[[], Value]
    outputs: Value | None = None

    def run(self) -> Value:
        self.outputs = self.run_forward()
        return self.outputs


@dataclass(slots=True)
class BackwardTask:
    """Another microbatch's backward through a stage: autograd from ``roots`` with ``grads``."""

    module: nn.Module
    stage: int
    microbatch: int
    roots: Value
    grads: Value | None
    run_backward: Backward = python_backward

    def run(self) -> None:
        if self.roots:
            self.run_backward(self.roots, self.grads)


@dataclass(slots=True)
class _Slot:
    inputs: Value  # the stage inputs, as leaves whose .grad the backward fills
    outputs: Value  # the stage outputs with their graph (empty on the last stage)
    loss: torch.Tensor | None  # the loss, on the last stage (scaled by its backward's seed)
    gradients: WeightGradients | None  # the weight gradients a B defers to the W


class StageExecutor:
    """Runs the stage modules of one rank."""

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        split_slots: frozenset[tuple[int, int]],
        split_backward: bool = True,
        w_memory: float = 0.5,
        check_finite: bool = False,
        device: torch.device | None = None,
        meter: SavedMeter | None = None,
    ) -> None:
        self.modules = dict(modules)
        self._meter = meter
        cpu = device is not None and torch.device(device).type == "cpu"
        self._run_backward: Backward = engine_backward if cpu else python_backward
        self._check_finite = check_finite
        self.loss_fn = loss_fn
        self._split_slots = split_slots if split_backward else frozenset()
        split_stages = {stage for stage, _ in self._split_slots}
        self._splitters = {
            stage: WeightSplitter(module)
            for stage, module in self.modules.items()
            if stage in split_stages
        }
        self._w_memory = w_memory
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._targets: Sequence[Any] = ()
        self._scale = 1.0
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Value] = {}
        self.units = 0.0
        self.peak_units = 0.0

    def begin_step(self, targets: Sequence[Any], loss_scale: float) -> None:
        self._targets = targets
        self._scale = loss_scale
        self.losses = []
        self.outputs = {}
        self.units = self.peak_units = 0.0

    def end_step(self) -> None:
        if self._slots:
            left = ", ".join(f"stage {s} microbatch {m}" for s, m in sorted(self._slots))
            raise RuntimeError(f"activations still held after the step: {left}")

    def _hold(self, amount: float) -> None:
        self.units += amount
        if self.units > self.peak_units:
            self.peak_units = self.units

    def _measured(
        self, kind: str, ins: Instruction, backward: bool = False
    ) -> AbstractContextManager:
        """The op meter's record of one op (nothing without a meter); after a B, what its W
        keeps is counted too."""
        if self._meter is None:
            return nullcontext()
        gradients = None
        if backward and kind in ("B", "FB"):
            gradients = self._slots[(ins.stage, ins.microbatch)].gradients
        return self._meter.op(kind, ins.stage, ins.microbatch, gradients)

    # -- forward -----------------------------------------------------------------------------

    def _forward_task(
        self, ins: Instruction, values: Value
    ) -> tuple[ForwardTask, WeightGradients | None]:
        module = self.modules[ins.stage]
        training = torch.is_grad_enabled()
        if training and not ins.first:
            values = tuple(v.requires_grad_() if v.is_floating_point() else v for v in values)
        splitter = self._splitters.get(ins.stage)
        deferred = (
            training and splitter is not None and (ins.stage, ins.microbatch) in self._split_slots
        )
        gradients = WeightGradients() if deferred else None
        stage = ins.stage

        def run() -> Value:
            if gradients is None:
                return as_value(module(*values), stage)
            with splitter.deferring(gradients):
                return as_value(module(*values), stage)

        return ForwardTask(module, ins.stage, ins.microbatch, values, run), gradients

    def _finish_forward(
        self, ins: Instruction, task: ForwardTask, gradients: WeightGradients | None
    ) -> Value | None:
        outputs = task.outputs
        if outputs is None:
            raise RuntimeError(f"the overlap hook did not run the forward of stage {ins.stage}")
        training = torch.is_grad_enabled()
        loss = None
        if not ins.last:
            passed_on: Value | None = tuple(o.detach() for o in outputs)
        else:
            passed_on = None
            if self.loss_fn is None or not self._targets:
                self.outputs[ins.microbatch] = tuple(o.detach() for o in outputs)
            else:
                value = self.loss_fn(
                    outputs[0] if len(outputs) == 1 else outputs, self._targets[ins.microbatch]
                )
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    shape = (
                        tuple(value.shape)
                        if isinstance(value, torch.Tensor)
                        else type(value).__name__
                    )
                    raise ValueError(
                        f"loss_fn must return a scalar tensor, got {shape}: reduce it inside the "
                        "loss (e.g. .mean() or reduction='mean')"
                    )
                if self._check_finite and not bool(torch.isfinite(value.detach()).all()):
                    raise FloatingPointError(
                        f"the loss of microbatch {ins.microbatch} is {float(value)}: check the "
                        "data, the learning rate and the loss scale"
                    )
                self.losses.append(value.detach().reshape(()))
                loss = value
            outputs = ()
        if training:
            self._slots[(ins.stage, ins.microbatch)] = _Slot(task.inputs, outputs, loss, gradients)
            self._hold(1.0)
        return passed_on

    def forward(self, ins: Instruction, values: Value) -> Value | None:
        """Run one forward; return the value to pass to the next stage (None on the last)."""
        with self._measured("F", ins):
            task, gradients = self._forward_task(ins, values)
            task.run()
            return self._finish_forward(ins, task, gradients)

    # -- backward ----------------------------------------------------------------------------

    def _backward_task(self, ins: Instruction, grads: Value | None) -> tuple[BackwardTask, _Slot]:
        slot = self._slots[(ins.stage, ins.microbatch)]
        if slot.gradients is not None:
            slot.gradients.defer = ins.kind == B_CODE
        if ins.last:
            loss = slot.loss
            roots: Value = () if loss is None or not loss.requires_grad else (loss,)
            # the loss scale seeds the backward: no multiplication node in every loss's graph
            root_grads: Value | None = tuple(torch.full_like(r, self._scale) for r in roots)
        else:
            # the message holds one gradient per floating output, in order
            pairs, incoming = [], iter(grads or ())
            for output in slot.outputs:
                if output.is_floating_point():
                    grad = next(incoming)
                    if output.requires_grad:
                        pairs.append((output, grad))
            roots = tuple(o for o, _ in pairs)
            root_grads = tuple(g for _, g in pairs)
        module = self.modules[ins.stage]
        task = BackwardTask(
            module, ins.stage, ins.microbatch, roots, root_grads, self._run_backward
        )
        return task, slot

    def _finish_backward(self, ins: Instruction, slot: _Slot) -> Value | None:
        passed_back = None
        if not ins.first:
            passed_back = tuple(
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                for leaf in slot.inputs
                if leaf.is_floating_point()
            )
        slot.inputs = slot.outputs = ()
        slot.loss = None
        if ins.kind == B_CODE and slot.gradients is not None and len(slot.gradients):
            self._hold(self._w_memory - 1.0)  # the graph is gone; what the W needs stays
        else:
            del self._slots[(ins.stage, ins.microbatch)]
            self._hold(-1.0)
        return passed_back

    def backward(self, ins: Instruction, grads: Value | None) -> Value | None:
        """Run one B or BW; return the gradient of the stage input (None on the first stage)."""
        with self._measured("B" if ins.kind == B_CODE else "BW", ins, backward=True):
            task, slot = self._backward_task(ins, grads)
            task.run()
            return self._finish_backward(ins, slot)

    def weight(self, ins: Instruction) -> None:
        """Run one W: the weight gradients its B deferred (nothing if the B deferred none)."""
        slot = self._slots.pop((ins.stage, ins.microbatch), None)
        if slot is not None and slot.gradients is not None:
            with self._measured("W", ins):
                slot.gradients.run()
            self._hold(-self._w_memory)

    # -- overlapped pairs ----------------------------------------------------------------------

    def pair(
        self, forward: Instruction, values: Value, backward: Instruction, grads: Value | None
    ) -> tuple[Value | None, Value | None]:
        """Run an F&B pair through a stage module's overlap hook, or one after the other.

        A stage module may define ``overlap_forward_backward(forward_task, backward_task)``: it
        must run both tasks (``task.run()``, or its own interleaving of their parts) before it
        returns. DualPipe uses this to hide one microbatch's all-to-all behind the other's compute.
        """
        kind = "FB" if backward.kind == B_CODE else "FBW"
        with self._measured(kind, backward, backward=True):
            f_task, gradients = self._forward_task(forward, values)
            b_task, slot = self._backward_task(backward, grads)
            hook = getattr(f_task.module, "overlap_forward_backward", None) or getattr(
                b_task.module, "overlap_forward_backward", None
            )
            if hook is None:
                f_task.run()
                b_task.run()
            else:
                hook(f_task, b_task)
            passed_on = self._finish_forward(forward, f_task, gradients)
            return passed_on, self._finish_backward(backward, slot)

    def close(self) -> None:
        for splitter in self._splitters.values():
            splitter.close()
