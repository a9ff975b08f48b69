"""A real B/W split: the backward computes input gradients now and weight gradients later.

During a forward whose backward the schedule splits, every ``nn.Linear`` of the stage runs through
``_DeferrableLinear``. Its backward returns the input gradient at once and, when the microbatch's
``WeightGradients`` is set to defer, queues (input, output gradient) instead of computing the weight
gradient. The W op then computes ``grad_weight += grad_output^T @ input`` (one fused ``addmm_``) and
``grad_bias += grad_output.sum(0)``. Nothing is recomputed: W uses exactly the tensors B kept.

Parameters of other layers (norms, embeddings) get their gradients during B. Forwards whose
backward is a full BW use the plain ``F.linear``, which PyTorch differentiates fastest.

Activation recompute (``cutpipe.runtime.compute.recompute``) reruns a layer's forward during B. It finds
the layer's splitter with ``splitter_of``, reads ``current`` at forward time and re-enters it with
``deferring`` for the rerun, so the rerun saves exactly what the forward saved. ``deferring``
nests (it restores what was current before), because that rerun can happen in the middle of
another microbatch's forward when an overlap hook interleaves an F with a B.
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
                weight.grad = torch.mm(grad_2d.t(), input_2d).to(weight.dtype)
            elif grad_2d.dtype == weight.grad.dtype:
                weight.grad.addmm_(grad_2d.t(), input_2d)
            else:  # computed in the autocast dtype, accumulated in the parameter's
                weight.grad.add_(torch.mm(grad_2d.t(), input_2d))
            if bias is not None:
                if bias.grad is None:
                    bias.grad = grad_2d.sum(0).to(bias.dtype)
                else:
                    bias.grad.add_(grad_2d.sum(0))
        self.pending.clear()


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, weight, bias, gradients: WeightGradients, parameters):  # type: ignore[override]
        ctx.save_for_backward(inputs, weight)
        ctx.parameters = parameters  # the Parameters themselves: W accumulates into their .grad
        ctx.gradients = gradients
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        inputs, weight = ctx.saved_tensors
        grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
        if ctx.gradients.defer:
            parameter, bias = ctx.parameters
            ctx.gradients.pending.append((parameter, bias, inputs.detach(), grad_output))
            return grad_input, None, None, None, None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = grad_2d.t() @ inputs.reshape(-1, inputs.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.parameters[1] is not None else None
        return grad_input, grad_weight, grad_bias, None, None


class _RoutedForward:
    """A linear's ``forward`` through its splitter: deferrable while the splitter is deferring."""

    __slots__ = ("layer", "splitter")

    def __init__(self, splitter: WeightSplitter, layer: nn.Linear) -> None:
        self.splitter, self.layer = splitter, layer

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        gradients, layer = self.splitter.current, self.layer
        if gradients is None or not torch.is_grad_enabled():
            return F.linear(inputs, layer.weight, layer.bias)
        # on rows, reshaped back outside the Function: an output that is a view made inside a
        # custom Function may not be changed in place, and models do (``hidden.add_(...)``)
        flat = inputs.dim() == 2
        rows = inputs if flat else inputs.reshape(-1, inputs.shape[-1])
        weight, bias = layer.weight, layer.bias
        kind = rows.device.type
        if torch.is_autocast_enabled(kind):  # cast as autocast would: W then runs in that dtype
            dtype = torch.get_autocast_dtype(kind)
            rows, weight = rows.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(kind, enabled=False):
                out = _DeferrableLinear.apply(
                    rows, weight, bias, gradients, (layer.weight, layer.bias)
                )
        else:
            out = _DeferrableLinear.apply(rows, weight, bias, gradients, (weight, bias))
        return out if flat else out.view(*inputs.shape[:-1], out.shape[-1])


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
        for layer in self._layers:  # the instance's forward shadows nn.Linear.forward
            layer.forward = _RoutedForward(self, layer)

    @property
    def layers(self) -> int:
        return len(self._layers)

    @property
    def current(self) -> WeightGradients | None:
        """The weight gradients the forward running now defers into (None: plain linears)."""
        return self._current

    @contextmanager
    def deferring(self, gradients: WeightGradients | None) -> Iterator[None]:
        previous, self._current = self._current, gradients
        try:
            yield
        finally:
            self._current = previous

    def close(self) -> None:
        """Give the layers their own ``forward`` back."""
        for layer in self._layers:
            if "forward" in layer.__dict__:
                del layer.forward
        self._layers = []


def splitter_of(module: nn.Module) -> WeightSplitter | None:
    """The splitter routing the linears inside ``module``, or None if none does."""
    for layer in module.modules():
        forward = layer.__dict__.get("forward")
        if isinstance(forward, _RoutedForward):
            return forward.splitter
    return None
