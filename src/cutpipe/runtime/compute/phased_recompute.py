"""Activation recompute on a phased stage, piece by piece, so F&B pairs still overlap.

A ``PhasedStage`` (``cutpipe.runtime.compute.phased``; an expert-parallel ``MoEStage``) never
calls its layers' ``forward``: its ``Compute`` pieces call their parts (attention, norms, router,
experts) directly, with exchanges (``Transfer``, ``Notice``) between them. So here the units of
recompute are the pieces themselves. ``apply_recompute`` (``cutpipe.runtime.compute.recompute``)
hands a phased stage to ``recompute_pieces``, which swaps each piece's function for one that runs
it inside the same recompute frame a layer gets (saved-tensor hooks, ``"selective"`` or
``"full"``).

What a piece keeps:

- its inputs: the tensors the tape already holds as the piece's leaves, among them what the
  dispatch delivered (the experts piece's received rows) and what the combine delivered (the
  finish piece's returned rows), so keeping them costs nothing the tape does not hold anyway;
- in ``"selective"``: also the outputs of its expensive ops (weight matmuls: attention's
  projections, the router, every expert and shared expert; fused attention kernels);
- its parameters and buffers, which are no activations.

Everything else it saved is dropped: in ``"full"`` all of it, in ``"selective"`` the norms,
activations, gates, routing (softmax, top-k, the sort by destination) and residual sums.

The first time the backward walk's ``torch.autograd.backward`` over a piece needs a dropped
tensor, that piece's function runs again, once, and rebuilds every dropped tensor (in
``"selective"`` replaying the kept matmul outputs). This happens inside the backward walk's step
for that piece, between two exchanges, so an overlapped pair still hides each exchange behind
the other half's compute: the rerun is part of the compute that hides it. A piece never starts
an exchange, so no all-to-all is ever rerun. The rerun reads a copy of the context the piece saw
in its forward (the routes of the layers it touches), so it cannot change what the microbatch's
other phases read. With the B/W split the rerun defers into the weight gradients of its own
microbatch, as a layer's does, and the W reruns nothing.

``units`` is not used on a phased stage: a piece holds parts of two layers (one layer's combine,
the next one's attention and routing), so no layer runs whole, and wrapping layers as well would
nest two recomputes.
"""

from __future__ import annotations

import torch

from cutpipe.runtime.compute.deferral import WeightSplitter, splitter_of
from cutpipe.runtime.compute.phased import Compute, Context, Phase, PhasedStage, Value
from cutpipe.runtime.compute.recompute import Frame, Recompute, recomputed, state_storages


class _StageNow:
    """What every piece of one training forward shares: the stage's splitter and the storages
    of its parameters and buffers, looked up again when a forward starts (FSDP, ``.to()`` and
    a new executor may change them between steps)."""

    def __init__(self, stage: PhasedStage, mode: str, splitter: WeightSplitter | None) -> None:
        self.stage, self.mode, self.given = stage, mode, splitter
        self.splitter: WeightSplitter | None = splitter
        self.state: set[int] = set()

    def look(self) -> None:
        self.splitter = self.given if self.given is not None else splitter_of(self.stage)
        self.state = state_storages(self.stage)


class _RecomputedPiece:
    """A ``Compute`` piece's function that runs inside a recompute frame while training."""

    __slots__ = ("first", "fn", "name", "now")

    def __init__(self, piece: Compute, now: _StageNow, first: bool) -> None:
        self.name, self.fn, self.now, self.first = piece.name, piece.fn, now, first

    def __call__(self, context: Context, *state: torch.Tensor) -> Value:
        if not torch.is_grad_enabled():
            return self.fn(context, *state)
        now = self.now
        if self.first:  # every forward starts with the first piece
            now.look()
        seen = dict(context)

        def again(*inputs: torch.Tensor) -> Value:
            return self.fn(dict(seen), *inputs)  # a copy: the rerun's writes stay its own

        frame = Frame(
            f"piece {self.name}", now.state, again, now.mode, now.splitter, state, {}, now.stage
        )
        with frame.forward():
            return self.fn(context, *state)


class PhasedRecompute(Recompute):
    """What ``recompute_pieces`` wrapped; ``close()`` gives the stage its own pieces back.

    ``units`` is empty (no module's forward is wrapped); ``pieces`` names the wrapped pieces.
    """

    def __init__(self, mode: str, stage: PhasedStage, original: list[Phase]) -> None:
        super().__init__(mode, [])
        self._stage, self._original = stage, original
        self._pieces = [p.name for p in stage.program if isinstance(p, Compute)]

    @property
    def pieces(self) -> list[str]:
        return list(self._pieces)

    def close(self) -> None:
        super().close()
        if self._original:
            self._stage.program = self._original
            self._original, self._pieces = [], []


def is_recomputed(stage: PhasedStage) -> bool:
    """Whether ``stage``'s pieces run inside recompute frames now."""
    return any(isinstance(p, Compute) and isinstance(p.fn, _RecomputedPiece) for p in stage.program)


def recompute_pieces(
    stage: PhasedStage, mode: str, splitter: WeightSplitter | None = None
) -> PhasedRecompute:
    """Recompute the activations of each ``Compute`` piece of ``stage`` in ``mode``
    (``"selective"`` or ``"full"``; see the module). ``splitter`` as for ``apply_recompute``."""
    if mode not in ("selective", "full"):
        raise ValueError(f"a phased stage recomputes 'selective' or 'full', not {mode!r}")
    if is_recomputed(stage):
        raise ValueError(
            f"{type(stage).__name__} is recomputed already: close() the Recompute the first "
            "apply_recompute returned before applying another mode"
        )
    inside = next((m for m in stage.modules() if recomputed(m)), None)
    if inside is not None:
        raise ValueError(
            f"a {type(inside).__name__} inside {type(stage).__name__} is recomputed already: "
            "close() that Recompute, then recompute the phased stage's pieces alone"
        )
    now = _StageNow(stage, mode, splitter)
    original = list(stage.program)
    stage.program = [
        Compute(p.name, _RecomputedPiece(p, now, first=index == 0)) if isinstance(p, Compute) else p
        for index, p in enumerate(original)
    ]
    return PhasedRecompute(mode, stage, original)
