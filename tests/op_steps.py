"""One training step of a module holding a whole model, op by op, under a ``SavedMeter``: every
forward first, then each microbatch's B (or BW) and W, as a stage does in warm-up and cooldown.
The recompute tests subclass it to count what each op reruns (``enter`` names the op kind)."""

from __future__ import annotations

import torch
from torch import nn

from cutpipe.models import LanguageModelLoss
from cutpipe.runtime.compute.deferral import WeightGradients, WeightSplitter
from cutpipe.runtime.compute.saved import SavedMeter


class OpSteps:
    def __init__(self, module: nn.Module, meter: SavedMeter, split: bool) -> None:
        self.module, self.meter = module, meter
        self.splitter = WeightSplitter(module) if split else None
        self.loss_fn = LanguageModelLoss()
        self.losses: dict[int, torch.Tensor] = {}
        self.gradients: dict[int, WeightGradients | None] = {}

    def enter(self, kind: str) -> None:
        """An op of ``kind`` ("F", "B" or "W") begins."""

    def forward(self, microbatch: int, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.enter("F")
        gradients = WeightGradients() if self.splitter is not None else None
        with self.meter.op("F", 0, microbatch):
            if self.splitter is None:
                self.losses[microbatch] = self.loss_fn(self.module(tokens), targets)
            else:
                with self.splitter.deferring(gradients):
                    self.losses[microbatch] = self.loss_fn(self.module(tokens), targets)
        self.gradients[microbatch] = gradients

    def backward(self, microbatch: int) -> None:
        self.enter("B")
        gradients = self.gradients[microbatch]
        if gradients is not None:
            gradients.defer = True
        kind = "BW" if gradients is None else "B"
        with self.meter.op(kind, 0, microbatch, gradients):
            self.losses.pop(microbatch).backward()

    def weight(self, microbatch: int) -> None:
        self.enter("W")
        gradients = self.gradients.pop(microbatch)
        if gradients is not None:
            with self.meter.op("W", 0, microbatch):
                gradients.run()

    def run(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for microbatch, (tokens, targets) in enumerate(data):
            self.forward(microbatch, tokens, targets)
        for microbatch in range(len(data)):
            self.backward(microbatch)
            self.weight(microbatch)
