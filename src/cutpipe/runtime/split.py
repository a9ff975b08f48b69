"""A real B/W split: the backward computes input gradients now and weight gradients later.

During a forward whose backward the schedule splits, every ``nn.Linear`` of the stage runs through
``_DeferrableLinear``. Its backward returns the input gradient at once and, when the microbatch's
``WeightGradients`` is set to defer, queues (input, output gradient) instead of computing the weight
gradient. The W op then computes ``grad_weight += grad_output^T @ input`` (one fused ``addmm_``) and
``grad_bias += grad_output.sum(0)``. Nothing is recomputed: W uses exactly the tensors B kept.

Parameters of other layers (norms, embeddings) get their gradients during B. Forwards whose
backward is a full BW use the plain ``F.linear``, which PyTorch differentiates fastest.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradients:
    """The deferred weight gradients of one stage on one microbatch."""

    __slots__ = ("defer", "pending")

    def __init__(self) -> None:
        self.defer = False
        self.pending: list[
            tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]
        ] = []

    def __len__(self) -> int:
        return len(self.pending)

    @torch.no_grad()
    def run(self) -> None:
        """Compute and accumulate every queued weight gradient, then drop the kept tensors."""
        for weight, bias, inputs, grad_output in self.pending:
            grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
            input_2d = inputs.reshape(-1, inputs.shape[-1])
            if weight.grad is None:
                weight.grad = torch.mm(grad_2d.t(), input_2d)
            else:
                weight.grad.addmm_(grad_2d.t(), input_2d)
            if bias is not None:
                if bias.grad is None:
                    bias.grad = grad_2d.sum(0)
                else:
                    bias.grad.add_(grad_2d.sum(0))
        self.pending.clear()


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight, bias, gradients: WeightGradients):  # type: ignore[override]
        ctx.save_for_backward(inputs, weight)
        ctx.parameters = (weight, bias)  # the Parameters themselves: W accumulates into their .grad
        ctx.gradients = gradients
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        inputs, weight = ctx.saved_tensors
        grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
        if ctx.gradients.defer:
            parameter, bias = ctx.parameters
            ctx.gradients.pending.append((parameter, bias, inputs.detach(), grad_output))
            return grad_input, None, None, None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_2d.t() @ inputs.reshape(-1, inputs.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.parameters[1] is not None else None
        return grad_input, grad_weight, grad_bias, None


class WeightSplitter:
    """Routes the ``nn.Linear`` layers of one stage module through the deferrable linear.

    While ``deferring(gradients)`` is active, forwards of those layers record their weight
    gradients into ``gradients``; at all other times they are plain ``nn.Linear`` forwards.
    """

    def __init__(self, module: nn.Module) -> None:
        self._current: WeightGradients | None = None
        self._layers = [
            layer
            for layer in module.modules()
            if isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward
        ]
        for layer in self._layers:
            layer.forward = self._forward_of(layer)  # shadows nn.Linear.forward on this instance

    def _forward_of(self, layer: nn.Linear):
        def forward(inputs: torch.Tensor) -> torch.Tensor:
            gradients = self._current
            if gradients is None or not torch.is_grad_enabled():
                return F.linear(inputs, layer.weight, layer.bias)
            return _DeferrableLinear.apply(inputs, layer.weight, layer.bias, gradients)

        return forward

    @property
    def layers(self) -> int:
        return len(self._layers)

    @contextmanager
    def deferring(self, gradients: WeightGradients | None) -> Iterator[None]:
        self._current = gradients
        try:
            yield
        finally:
            self._current = None

    def close(self) -> None:
        """Give the layers their own ``forward`` back."""
        for layer in self._layers:
            if "forward" in layer.__dict__:
                del layer.forward
        self._layers = []
