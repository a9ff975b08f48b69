"""Time emulation: every op sleeps for its cost instead of computing; small tensors still flow.

With compute replaced by sleeps of known length, a measured timeline isolates what the schedule and
the runtime add: waiting on the pipeline, communication, Python overhead. Durations come from the
same per-slot tables the simulator uses (``Costs.timing``), so both see identical op costs.
"""

from __future__ import annotations

import time

import torch

from cutpipe.runtime.compute.executor import Value
from cutpipe.runtime.program import Instruction
from cutpipe.schedule.codes import B_CODE, BW_CODE, KIND_BITS
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs


def busy_wait(seconds: float, spin: float = 3e-4) -> None:
    """Sleep for ``seconds``, precisely: the OS oversleeps by up to a few hundred microseconds
    on a loaded machine, so sleep until ``spin`` before the deadline and spin the rest."""
    deadline = time.perf_counter() + seconds
    if seconds > spin:
        time.sleep(seconds - spin)
    while time.perf_counter() < deadline:
        pass


class EmulatedExecutor:
    """Sleeps ``cost * time_unit`` seconds per op and passes a one-element token on."""

    def __init__(
        self,
        schedule: Schedule,
        costs: Costs,
        time_unit: float,
        w_memory: float = 0.5,
        device: torch.device | None = None,
    ) -> None:
        if time_unit <= 0:
            raise ValueError(f"time_unit is seconds per cost unit and must be > 0, got {time_unit}")
        self._timing = costs.timing(schedule)
        self._unit = time_unit
        self._w_memory = w_memory
        self._token = torch.zeros(1, device=device)  # on the device the backend sends from
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Value] = {}
        self.units = 0.0
        self.peak_units = 0.0

    def _slot(self, ins: Instruction) -> int:
        return ins.code >> KIND_BITS

    def _hold(self, amount: float) -> None:
        self.units += amount
        self.peak_units = max(self.peak_units, self.units)

    def begin_step(self, targets, loss_scale: float) -> None:
        self.units = self.peak_units = 0.0

    def end_step(self) -> None:
        pass

    def forward(self, ins: Instruction, values: Value) -> Value | None:
        busy_wait(self._timing.forward[self._slot(ins)] * self._unit)
        self._hold(1.0)
        return None if ins.last else (self._token,)

    def _backward_cost(self, ins: Instruction) -> float:
        table = self._timing.full_backward if ins.kind == BW_CODE else self._timing.backward
        return table[self._slot(ins)]

    def _after_backward(self, ins: Instruction) -> Value | None:
        self._hold(self._w_memory - 1.0 if ins.kind == B_CODE else -1.0)
        return None if ins.first else (self._token,)

    def backward(self, ins: Instruction, grads: Value | None) -> Value | None:
        busy_wait(self._backward_cost(ins) * self._unit)
        return self._after_backward(ins)

    def weight(self, ins: Instruction) -> None:
        busy_wait(self._timing.weight[self._slot(ins)] * self._unit)
        self._hold(-self._w_memory)

    def pair(self, forward: Instruction, values: Value, backward: Instruction, grads: Value | None):
        busy_wait(self._timing.pair(forward.code, backward.code) * self._unit)
        self._hold(1.0)
        passed_on = None if forward.last else (self._token,)
        return passed_on, self._after_backward(backward)

    def close(self) -> None:
        pass
