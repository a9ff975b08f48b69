"""An MoE stage whose compute and all-to-alls take set times: the overlap hook, measured alone.

Each layer runs the same phases as ``MoEStage`` (route, dispatch, experts, combine), but a
compute phase sleeps for its cost (forward now, backward when autograd reaches it) and an
exchange is a real all-to-all of a few values on the EP group that completes no earlier than its
set time after it started, as a transfer handled by a network engine would. Compute does not slow
communication down and nothing else competes for the processor, so the measured time of an F&B
pair shows what the interleaving itself achieves: about max(compute, communication) with the
hook, their sum without it. It runs through the real ``PipelineRunner`` and executor.

``emulated_moe_stages`` gives a rank's stages for the simulator's costs (``cutpipe.sim.Costs``):
what ``cutpipe train --emulate --ep N`` runs, so that a step of DualPipe or Cut-in-half with the
hook can be set beside the simulator's, which hides the exchanges of an overlapped pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.parallel.exchange import AllToAll, Pending
from cutpipe.runtime.compute.emulation import busy_wait as hold
from cutpipe.runtime.compute.phased import Compute, Context, Phase, PhasedStage, Transfer, Value
from cutpipe.sim.costs import Costs


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds per layer: forward compute of each piece, the backward's multiple, one exchange."""

    route: float = 0.01
    experts: float = 0.01
    exchange: float = 0.01
    backward: float = 2.0  # a piece's backward takes this many times its forward
    backward_exchange: float | None = None  # an exchange of gradients (None: as ``exchange``)

    def layer(self) -> dict[str, float]:
        """One layer's forward compute, backward compute and communication (each direction)."""
        compute = self.route + self.experts
        return {"forward": compute, "backward": compute * self.backward, "comm": 2 * self.exchange}

    @classmethod
    def from_costs(cls, costs: Costs, stage: int, num_stages: int, time_unit: float) -> PhaseCosts:
        """One MoE layer that takes ``stage``'s costs (``time_unit`` seconds each): F split
        evenly between the route and the experts, ``ep_f`` between the dispatch and the combine,
        the whole backward (B + W) in the B, ``ep_b`` between the two gradient exchanges."""
        f, b, w, ep_f, ep_b = (
            costs.per_stage(name, num_stages)[stage] * time_unit
            for name in ("f", "b", "w", "ep_f", "ep_b")
        )
        if f <= 0:
            raise ValueError(
                f"an emulated MoE stage needs a forward to sleep in: stage {stage} has F=0"
            )
        return cls(
            route=f / 2, experts=f / 2, exchange=ep_f / 2, backward=(b + w) / f,
            backward_exchange=ep_b / 2,
        )  # fmt: skip


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward: float, backward: float) -> torch.Tensor:  # type: ignore[override]
        hold(forward)
        ctx.backward_seconds = backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hold(ctx.backward_seconds)
        return grad, None, None


class _Timed:
    """An exchange that is done no earlier than ``seconds`` (``backward`` for the gradients')
    after it started."""

    def __init__(self, inner: AllToAll, seconds: float, backward: float) -> None:
        self._inner = inner
        self._seconds = seconds
        self._backward = backward

    def start(self, rows: torch.Tensor) -> _Arrival:
        return _Arrival(self._inner.start(rows), time.perf_counter() + self._seconds)

    def start_backward(self, grad: torch.Tensor) -> _Arrival:
        return _Arrival(self._inner.start_backward(grad), time.perf_counter() + self._backward)


class _Arrival:
    def __init__(self, pending: Pending, due: float) -> None:
        self._pending = pending
        self._due = due

    def wait(self) -> torch.Tensor:
        received = self._pending.wait()
        left = self._due - time.perf_counter()
        if left > 0:
            hold(left)
        return received


class EmulatedMoEStage(PhasedStage):
    """``layers`` emulated MoE layers on ``group`` (its ranks exchange real tensors)."""

    def __init__(
        self,
        layers: int,
        costs: PhaseCosts,
        group: dist.ProcessGroup | None,
        overlap: bool = True,
    ) -> None:
        self._group = group
        self._size = 1 if group is None else dist.get_world_size(group)
        scale = nn.Parameter(torch.ones(()))  # so that every piece has a backward to run
        program: list[Phase] = []
        for index in range(layers):
            program += [
                Compute(f"route{index}", self._sleeper(scale, costs.route, costs.backward)),
                Transfer(f"dispatch{index}", self._exchange(costs)),
                Compute(f"experts{index}", self._sleeper(scale, costs.experts, costs.backward)),
                Transfer(f"combine{index}", self._exchange(costs)),
            ]
        program.append(Compute("finish", lambda context, x: (x,)))
        super().__init__(nn.Module(), (), program=program, overlap=overlap)
        self.scale = scale

    @staticmethod
    def _sleeper(
        scale: nn.Parameter, seconds: float, backward: float
    ) -> Callable[[Context, torch.Tensor], Value]:
        def run(context: Context, x: torch.Tensor) -> Value:
            return (_Sleep.apply(x * scale, seconds, seconds * backward),)

        return run

    def _exchange(self, costs: PhaseCosts) -> Callable[[Context], _Timed]:
        backward = costs.exchange if costs.backward_exchange is None else costs.backward_exchange

        def make(context: Context) -> _Timed:
            exchange = AllToAll(self._peers, [1] * self._size, [1] * self._size)
            return _Timed(exchange, costs.exchange, backward)

        return make

    @property
    def _peers(self) -> dist.ProcessGroup | None:
        return self._group if self._size > 1 else None


def emulated_moe_stages(
    costs: Costs,
    num_stages: int,
    held: Iterable[int],
    time_unit: float,
    group: dist.ProcessGroup | None,
    overlap: bool = True,
) -> dict[int, EmulatedMoEStage]:
    """The ``held`` stages of a rank, one emulated MoE layer each at its ``costs``, exchanging
    over the expert-parallel ``group``."""
    return {
        stage: EmulatedMoEStage(
            1, PhaseCosts.from_costs(costs, stage, num_stages, time_unit), group, overlap=overlap
        )
        for stage in held
    }
