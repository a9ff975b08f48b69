"""Activation recompute per layer: keep less from a forward, rebuild the rest once, during B.

``apply_recompute(module, mode)`` wraps the *units* of a stage module: each transformer layer,
or in general each block the stage runs one after another (``units=`` names a block class
instead). A phased stage (``cutpipe.runtime.compute.phased``: an expert-parallel MoE stage) never
runs a layer whole; its units are its compute pieces (``phased_recompute``). Every tensor a unit's forward saves for the backward goes through its saved-tensor
hooks, which keep some and drop the rest:

- ``"none"``: nothing is wrapped; autograd keeps everything.
- ``"full"``: a unit keeps its inputs (and its parameters and buffers, which are no
  activations); every other saved tensor is dropped.
- ``"selective"``: a unit keeps its inputs and the outputs of its expensive ops, the weight
  matmuls (``mm``, ``addmm``: every linear, an MoE's router and experts) and fused attention
  kernels (output and log-sum-exp); it drops everything else: norms and their inputs, activations
  and gates, residual sums, routing (softmax, top-k), the linear inputs made from those, and an
  unfused attention's scores and softmax. A saved tensor that shares storage with a kept one is
  kept (it costs nothing). An output the forward modified in place after the op is not kept: that
  op runs again instead.

The first time B needs a dropped tensor, the unit's forward runs again (once) and rebuilds every
dropped tensor, then stops; in ``"selective"`` that rerun replays the kept outputs instead of
running the matmuls, so it costs elementwise work only. The rerun restores the random state and
the autocast state of the forward, so it must do the same ops (checked: a mismatch says which).

With the B/W split (``cutpipe.runtime.compute.deferral``) the rerun re-enters the weight gradients the
forward deferred into, read from the unit's splitter at forward time, so its linears save what
the forward's saved; the B's linears then queue the rebuilt linear inputs with their output
gradients for the W. So B rebuilds what it needs, the W keeps only what it queued, and nothing
runs twice: the W never reruns anything. The executor needs nothing new for this beyond its
``splitter.deferring(gradients)`` around the forward (see docs/runtime.md for the split).

A unit passes what it keeps, and what its rerun rebuilds, to the saved-tensor hooks around it
(an ``ActivationMeter``, CPU offload), so a meter outside counts the memory really held.

A module that keeps count of what its training forwards did (an MoE's routing tally) can tell
the rerun apart: every module of the unit that has a ``during_recompute_rerun()`` method (a
context manager) runs the rerun inside it (``RERUN_HOOK``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

from cutpipe.runtime.compute.deferral import WeightSplitter, splitter_of
from cutpipe.runtime.compute.phased import PhasedStage
from cutpipe.sim.costs import RECOMPUTE_MODES

#: The method a module may define to know that its forward is running again, as a rerun.
RERUN_HOOK = "during_recompute_rerun"

#: The ops whose outputs a selective unit keeps: weight matmuls and fused attention kernels
#: (their functional overloads: an ``out=`` call writes into a tensor a replay could not fill).
_EXPENSIVE = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


class _Held:
    """A tensor handed to the saved-tensor hooks around the unit (held as is when none)."""

    __slots__ = ("packed", "unpack")

    def __init__(self, tensor: torch.Tensor, hooks: Hooks | None) -> None:
        self.unpack = None if hooks is None else hooks[1]
        self.packed = tensor if hooks is None else hooks[0](tensor)

    def get(self) -> torch.Tensor:
        return self.packed if self.unpack is None else self.unpack(self.packed)


class _Argument:
    """A tensor argument of a unit, detached, with whether the rerun must differentiate it."""

    __slots__ = ("held", "requires_grad")

    def __init__(self, tensor: torch.Tensor, hooks: Hooks | None) -> None:
        self.held, self.requires_grad = _Held(tensor.detach(), hooks), tensor.requires_grad

    def get(self) -> torch.Tensor:
        return self.held.get().detach().requires_grad_(self.requires_grad)


class _Output:
    """The outputs of one expensive op of a selective unit's forward, for its rerun to replay."""

    __slots__ = ("check", "func", "many", "values")

    def __init__(self, func: Any, out: Any, hooks: Hooks | None) -> None:
        self.func, self.many = func, isinstance(out, (tuple, list))
        values = out if self.many else (out,)
        # the output itself: below autograd, detach() makes an alias with a version of its own
        self.check = [(v, v._version) for v in values if isinstance(v, torch.Tensor)]
        self.values: list[Any] | None = [
            _Held(v.detach(), hooks) if isinstance(v, torch.Tensor) else v for v in values
        ]

    def settle(self) -> None:
        """At the end of the forward: drop the values if the forward changed one in place."""
        if any(tensor._version != version for tensor, version in self.check):
            self.values = None  # the rerun runs this op again
        self.check = []

    def replay(self) -> Any:
        if self.values is None:
            return None
        values = [v.get().detach() if isinstance(v, _Held) else v for v in self.values]
        return tuple(values) if self.many else values[0]


def _enclosing_hooks() -> Hooks | None:
    """The saved-tensor hooks active here; PyTorch has no public way to ask, hence the guard."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, meta, subclass)
        return None


class _Rebuilt(Exception):
    """Raised inside a rerun once it has rebuilt every dropped tensor: the rest need not run."""


def _no_unpack(_: Any) -> torch.Tensor:
    raise RuntimeError("a recompute rerun's own graph was used for a backward; report this bug")


class _Outputs(TorchDispatchMode):
    """Records the outputs of a selective unit's expensive ops (forward) or replays them (rerun)."""

    def __init__(self, frame: Frame, replay: bool) -> None:
        super().__init__()
        self.frame, self.replay, self.position = frame, replay, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func not in _EXPENSIVE:
            return func(*args, **kwargs)
        outputs = self.frame.outputs
        if not self.replay:
            out = func(*args, **kwargs)
            outputs.append(_Output(func, out, self.frame.hooks))
            self.frame.kept_storages.update(_storage(t) for t, _ in outputs[-1].check)
            return out
        if self.position >= len(outputs):  # past the last one the rerun needs
            return func(*args, **kwargs)
        recorded = outputs[self.position]
        self.position += 1
        if recorded.func is not func:
            raise RuntimeError(
                f"the recompute rerun of {self.frame.name} ran {func} where its forward ran "
                f"{recorded.func}: a recomputed unit must run the same ops every time"
            )
        replayed = recorded.replay()
        return func(*args, **kwargs) if replayed is None else replayed


def state_storages(module: nn.Module) -> set[int]:
    """The storages of ``module``'s parameters and buffers: saved, they cost a unit nothing."""
    return {_storage(t) for t in (*module.parameters(), *module.buffers())} - {None}


class Frame:
    """One forward of one unit: what it kept, what it dropped, and how to run it again.

    ``name`` says which unit in errors; ``state``: the storages of its parameters and buffers
    (``state_storages``), which it keeps whenever they are saved.
    """

    def __init__(
        self,
        name: str,
        state: set[int],
        run: Callable[..., Any],
        mode: str,
        splitter: WeightSplitter | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        told: nn.Module | None = None,
    ) -> None:
        self.name, self.run, self.mode, self.splitter = name, run, mode, splitter
        self.told = told  # whose modules' RERUN_HOOK the rerun runs inside
        self.gradients = None if splitter is None else splitter.current
        self.hooks = _enclosing_hooks()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.args = [_Argument(a, self.hooks) if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {
            k: _Argument(v, self.hooks) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        self.kept_storages = state | ({_storage(t) for t in tensors} - {None})
        self.device = next((t.device for t in tensors if t.device.type != "cpu"), None)
        kind = "cpu" if self.device is None else self.device.type
        self.autocast = (kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind))
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if kind == "cuda" else None
        self.saved = 0  # tensors the forward saved for the backward
        self.dropped: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self.outputs: list[_Output] = []  # selective only
        self.replayed = 0  # the outputs a rerun replays before it has rebuilt everything
        self.rebuilt: dict[int, _Held] = {}

    # -- the forward ---------------------------------------------------------------------------

    @contextmanager
    def forward(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.mode == "selective":
                stack.enter_context(_Outputs(self, replay=False))
            stack.enter_context(saved_tensors_hooks(self.pack, self.unpack))
            yield
        del self.outputs[self.replayed :]
        for output in self.outputs:
            output.settle()

    def pack(self, tensor: torch.Tensor) -> tuple[bool, Any]:
        index, self.saved = self.saved, self.saved + 1
        parameter = tensor.requires_grad and tensor.grad_fn is None
        if parameter or _storage(tensor) in self.kept_storages:
            return True, _Held(tensor.detach(), self.hooks)
        self.dropped[index] = (tensor.shape, tensor.dtype)
        self.replayed = len(self.outputs)
        return False, index

    def unpack(self, packed: tuple[bool, Any]) -> torch.Tensor:
        kept, value = packed
        if kept:
            return value.get()
        if value not in self.rebuilt:
            self.rerun()
        return self.rebuilt.pop(value).get()

    # -- the rerun, during B -------------------------------------------------------------------

    def rerun(self) -> None:
        """Run the unit again and keep every dropped tensor not rebuilt yet (normally: all)."""
        wanted = set(self.dropped) - set(self.rebuilt)
        last, hooks, position = max(wanted), _enclosing_hooks(), 0

        def rebuild(tensor: torch.Tensor) -> None:
            nonlocal position
            index, position = position, position + 1
            if index in wanted:
                shape, dtype = self.dropped[index]
                if (tensor.shape, tensor.dtype) != (shape, dtype):
                    raise RuntimeError(
                        f"the recompute rerun of {self.name} saved a {tensor.dtype} tensor of "
                        f"shape {tuple(tensor.shape)} where its forward saved a {dtype} one of "
                        f"shape {tuple(shape)}: a recomputed unit must run the same ops every time"
                    )
                self.rebuilt[index] = _Held(tensor.detach(), hooks)
                if index == last:
                    raise _Rebuilt

        args = [a.get() if isinstance(a, _Argument) else a for a in self.args]
        kwargs = {k: v.get() if isinstance(v, _Argument) else v for k, v in self.kwargs.items()}
        kind, dtype, enabled = self.autocast
        with ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            if self.splitter is not None:
                stack.enter_context(self.splitter.deferring(self.gradients))
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(self._random_state())
            if self.mode == "selective":
                stack.enter_context(_Outputs(self, replay=True))
            stack.enter_context(saved_tensors_hooks(rebuild, _no_unpack))
            for module in self.told.modules() if self.told is not None else ():
                hook = getattr(module, RERUN_HOOK, None)
                if hook is not None:
                    stack.enter_context(hook())
            try:
                self.run(*args, **kwargs)
            except _Rebuilt:
                self.outputs = []  # replayed: let go of them now (a second rerun runs the ops)
                return
        raise RuntimeError(
            f"the recompute rerun of {self.name} saved {position} tensors for the backward, "
            f"fewer than the {self.saved} of its forward: a recomputed unit must run the same ops "
            "every time (no branching on global state between its forward and its backward)"
        )

    @contextmanager
    def _random_state(self) -> Iterator[None]:
        devices = [] if self.cuda_rng is None else [self.device]
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            yield


class _RecomputedForward:
    """A unit's ``forward`` that runs its own forward inside a recompute frame."""

    __slots__ = ("mode", "own", "shadowed", "splitter", "unit")

    def __init__(self, unit: nn.Module, mode: str, splitter: WeightSplitter | None) -> None:
        self.unit, self.mode, self.splitter = unit, mode, splitter
        self.shadowed = "forward" in unit.__dict__  # someone else's forward, to give back
        self.own = unit.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.own(*args, **kwargs)
        splitter = self.splitter if self.splitter is not None else splitter_of(self.unit)
        name, state = type(self.unit).__name__, state_storages(self.unit)
        frame = Frame(name, state, self.own, self.mode, splitter, args, kwargs, self.unit)
        with frame.forward():
            return self.own(*args, **kwargs)

    def remove(self) -> None:
        if self.shadowed:
            self.unit.forward = self.own
        else:
            del self.unit.forward


def recomputed(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs inside a recompute frame now."""
    return isinstance(module.__dict__.get("forward"), _RecomputedForward)


class Recompute:
    """What ``apply_recompute`` wrapped; ``close()`` gives the units their own forward back."""

    def __init__(self, mode: str, wrapped: list[_RecomputedForward]) -> None:
        self.mode, self._wrapped = mode, wrapped

    @property
    def units(self) -> list[nn.Module]:
        return [w.unit for w in self._wrapped]

    def close(self) -> None:
        for wrapped in self._wrapped:
            wrapped.remove()
        self._wrapped = []


def _blocks(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        grandchildren = list(child.children())
        if not grandchildren:
            continue  # a lone op: keeping its input is all a recompute could save
        holds_blocks = any(next(g.children(), None) is not None for g in grandchildren)
        if isinstance(child, _CONTAINERS) and holds_blocks:
            yield from _blocks(child)
        else:
            yield child


def recompute_units(
    module: nn.Module, units: type[nn.Module] | tuple[type[nn.Module], ...] | None = None
) -> list[nn.Module]:
    """The modules ``apply_recompute`` wraps, each recomputed as a whole.

    With ``units`` (a block class, e.g. the transformer's ``Layer``): every instance inside
    ``module`` that is not inside another. Without: the blocks the stage runs one after another,
    its children, looking through ``nn.Sequential`` (``Chain`` too), ``nn.ModuleList`` and
    ``nn.ModuleDict`` that hold blocks of their own; a child with no submodules (a lone linear or
    activation) is no unit, since keeping its input is all a recompute could save there.
    """
    if units is None:
        return list(_blocks(module))
    found: list[nn.Module] = []
    inside: set[int] = set()
    for candidate in module.modules():
        if isinstance(candidate, units) and id(candidate) not in inside:
            found.append(candidate)
            inside.update(id(m) for m in candidate.modules())
    if not found:
        names = units.__name__ if isinstance(units, type) else ", ".join(u.__name__ for u in units)
        raise ValueError(
            f"no {names} inside {type(module).__name__} to recompute: pass units= the class of "
            "its layers, or leave it out to recompute each block of the stage"
        )
    return found


def apply_recompute(
    module: nn.Module,
    mode: str,
    splitter: WeightSplitter | None = None,
    units: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
) -> Recompute:
    """Recompute the activations of ``module``'s units (``recompute_units``) in ``mode``.

    ``splitter``: the stage's ``WeightSplitter``; without it each forward looks for the one that
    routes the unit's linears, so the executor may build its splitters before or after this call.
    A phased stage (a ``PhasedStage`` with exchanges, such as an expert-parallel ``MoEStage``)
    never runs its layers' ``forward``: its units are its compute pieces and ``units`` is not used
    (``cutpipe.runtime.compute.phased_recompute``). Returns the ``Recompute`` to ``close()``.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"recompute mode {mode!r} is unknown: choose one of {', '.join(RECOMPUTE_MODES)}"
        )
    if mode != "none" and isinstance(module, PhasedStage) and module.phased:
        from cutpipe.runtime.compute.phased_recompute import recompute_pieces

        return recompute_pieces(module, mode, splitter)
    chosen = [] if mode == "none" else recompute_units(module, units)
    twice = [u for u in chosen if recomputed(u)]
    if twice:
        raise ValueError(
            f"{type(twice[0]).__name__} is recomputed already: close() the Recompute the first "
            "apply_recompute returned before applying another mode"
        )
    wrapped = [_RecomputedForward(unit, mode, splitter) for unit in chosen]
    for wrapper in wrapped:
        wrapper.unit.forward = wrapper
    return Recompute(mode, wrapped)
