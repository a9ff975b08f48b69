"""Activation bytes op by op: what a forward keeps, what its B frees, what its W keeps.

``SavedMeter`` is the ``ActivationMeter`` of ``cutpipe.runtime.compute.memory`` (every storage autograd
saves, counted once, until it is freed) plus what a pending W holds that autograd never saved:
the output gradients its B queued (``keep``). Its linear inputs are saved tensors already, counted
until the W drops them. Run each op of a stage under ``op(kind, stage, microbatch)``; the meter
records the bytes held before, at most during and after it (``OpBytes``).

``slot_bytes`` turns those records into the simulator's terms (``cutpipe.sim.memory``): per
(stage, microbatch), the activation its F left, the part its B freed and the part its W freed;
``SlotBytes.w_share`` is the measured counterpart of ``w_memory``. ``stage_bytes`` sums a step's
records up per stage (the runner records them when given the meter as its ``op_meter``), so the
simulator can be fed the measured sizes and its predicted peak set beside the measured one. With activation recompute the
B rebuilds the linear inputs the W keeps, so the share can exceed one: the W then holds more than
the forward left, which the simulator's model (a share in [0, 1]) cannot express (docs/simulator.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

from cutpipe.runtime.compute.deferral import WeightGradients
from cutpipe.runtime.compute.memory import ActivationMeter


@dataclass(frozen=True, slots=True)
class OpBytes:
    """Activation bytes around one op: held before it, at most during it, held after it."""

    kind: str
    stage: int
    microbatch: int
    before: int
    high: int
    after: int


@dataclass(frozen=True, slots=True)
class SlotBytes:
    """One (stage, microbatch): what its F left, and what its B and its W freed of it."""

    activation: int
    b_frees: int  # negative when the B rebuilt more for its W than the graph held
    w_frees: int

    @property
    def w_share(self) -> float:
        """The share of the activation the W still held after the B (the simulator's w_memory)."""
        return self.w_frees / self.activation if self.activation else 0.0


class SavedMeter(ActivationMeter):
    """Saved-for-backward bytes, plus the output gradients pending Ws keep, op by op."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(exclude)
        self.ops: list[OpBytes] = []

    def reset(self) -> None:
        """Start a new peak from what is alive now, and a new list of op records."""
        super().reset()
        self.ops = []

    def keep(self, gradients: WeightGradients) -> None:
        """Count what ``gradients``' pending W holds, until the W lets go of it."""
        for _, _, inputs, grad_output in gradients.pending:
            self._pack(inputs)
            self._pack(grad_output)

    @contextmanager
    def op(
        self, kind: str, stage: int, microbatch: int, gradients: WeightGradients | None = None
    ) -> Iterator[None]:
        """Run one op under the meter and record its ``OpBytes``; after a B, pass its weight
        gradients so that what its W keeps is counted."""
        before, peak = self.current, self.peak
        self.peak = before
        try:
            with saved_tensors_hooks(self._pack, _same):
                yield
            if gradients is not None:
                self.keep(gradients)
        finally:
            high, self.peak = self.peak, max(peak, self.peak)
            self.ops.append(OpBytes(kind, stage, microbatch, before, high, self.current))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def slot_bytes(ops: Iterable[OpBytes]) -> dict[tuple[int, int], SlotBytes]:
    """Per (stage, microbatch) with one F, one B and one W recorded: its ``SlotBytes``."""
    change: dict[tuple[int, int], dict[str, int]] = {}
    for op in ops:
        change.setdefault((op.stage, op.microbatch), {})[op.kind] = op.before - op.after
    return {
        slot: SlotBytes(-kinds["F"], kinds["B"], kinds["W"])
        for slot, kinds in sorted(change.items())
        if {"F", "B", "W"} <= kinds.keys()
    }


@dataclass(frozen=True, slots=True)
class StageBytes:
    """One stage over a step: the median bytes one F left and the median share its W held."""

    activation: float
    w_share: float | None  # None: no microbatch of the stage ran a separate B and W


def stage_bytes(ops: Iterable[OpBytes]) -> dict[int, StageBytes]:
    """Per stage, from the records of one step: what a forward leaves (the Fs that ran alone: an
    overlapped pair's F and B are one record) and what share of it a W holds after its B."""
    ops = list(ops)
    left: dict[int, list[int]] = {}
    for op in ops:
        if op.kind == "F":
            left.setdefault(op.stage, []).append(op.after - op.before)
    shares: dict[int, list[float]] = {}
    for (stage, _), slot in slot_bytes(ops).items():
        if slot.activation > 0:
            shares.setdefault(stage, []).append(slot.w_share)
    return {
        stage: StageBytes(
            float(statistics.median(sizes)),
            float(statistics.median(shares[stage])) if stage in shares else None,
        )
        for stage, sizes in sorted(left.items())
    }
