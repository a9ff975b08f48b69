"""Cut any module into pipeline stages by block names, keeping every parameter's name.

The contract: the model runs a sequence of *blocks* one after another, each block's output being
the next one's input (a tuple is spread over the next block's arguments, as in ``Chain``), and
it holds no parameter or buffer outside them. Blocks are named by their paths in the model:

- by default, the model's children in registration order, with an ``nn.Sequential`` or
  ``nn.ModuleList`` child replaced by its own children (``embed, layers.0, ..., layers.7,
  head``); a model that is itself an ``nn.Sequential`` is its own list of blocks (``0, 1, ...``);
- or an explicit list of paths, in the order the model runs them.

``split`` says where to cut the blocks into stages: either the names of the blocks at which
stages 1, 2, ... begin (as torch's ``SplitPoint.BEGINNING``), or how many blocks each stage runs;
without it the blocks are shared out as evenly as possible (earlier stages take the rest:
``even_split``). ``cut_module`` is the one way stages are cut from a model: the runner's
``from_module`` (and ``from_sequential``), the trainer and the phased MoE stages all call it.

A stage is a ``Stage``: containers mirroring the model's dotted paths that hold the very same
block objects, so its ``named_parameters()`` and ``state_dict()`` keys are the unsplit model's
(``layers.3.attention.q.weight``, not ``0.0.weight``) and the stages' checkpoints together are
one of the model. The runner that runs them is in docs/runtime.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import nn


class Chain(nn.Sequential):
    """``nn.Sequential`` for layers that pass several tensors along: a layer that returns a
    tuple gets its successor called with the tuple's items as arguments, so layers like
    ``forward(hidden, aux) -> (hidden, aux)`` stack; single tensors pass as usual."""

    def forward(self, *inputs: Any) -> Any:
        value: Any = inputs if len(inputs) != 1 else inputs[0]
        for module in self:
            value = module(*value) if isinstance(value, tuple) else module(value)
        return value


#: Block names at which stages 1, 2, ... begin, or blocks per stage, or None for an even split.
Split = Sequence[str] | Sequence[int] | None


def default_blocks(model: nn.Module) -> list[str]:
    """The model's children in order, ``nn.Sequential`` and ``nn.ModuleList`` ones expanded."""
    if isinstance(model, nn.Sequential):
        return list(model._modules)
    names: list[str] = []
    for name, child in model._modules.items():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            names += [f"{name}.{inner}" for inner in child._modules]
        elif child is not None:
            names.append(name)
    return names


def sequence_blocks(model: nn.Module) -> list[str]:
    """The paths of ``list(model)``'s items: an ``nn.Sequential``'s children, or the blocks of a
    model that iterates over them (``cutpipe.models.transformer.LanguageModel``)."""
    if isinstance(model, nn.Sequential):
        return list(model._modules)
    paths: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            paths.setdefault(id(module), name)
    try:
        items = list(model)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"{type(model).__name__} is not a sequence of layers: pass an nn.Sequential, or use "
            "PipelineRunner.from_module, which cuts any module by block names"
        ) from None
    strays = [index for index, item in enumerate(items) if id(item) not in paths]
    if strays:
        raise ValueError(
            f"item {strays[0]} of {type(model).__name__} is not one of its submodules, so it has "
            "no name to keep: register it as a submodule"
        )
    return [paths[id(item)] for item in items]


def _shown(names: Sequence[str], most: int = 12) -> str:
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[: most - 3])}, ..., {', '.join(names[-3:])} ({len(names)} in all)"


def check_blocks(model: nn.Module, blocks: Iterable[str] | None = None) -> list[str]:
    """``blocks`` (default: ``default_blocks``) checked against the contract of the module."""
    kind = type(model).__name__
    if isinstance(blocks, str):
        raise TypeError(f"blocks must be a list of block names, got the string {blocks!r}")
    names = default_blocks(model) if blocks is None else list(blocks)
    if not names:
        raise ValueError(f"{kind} has no blocks to cut: give blocks=[...] by name")
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise TypeError(f"block names must be strings, got {wrong[0]!r}")
    known = dict(model.named_modules(remove_duplicate=False))
    unknown = [name for name in names if not name or name not in known]
    if unknown:
        raise ValueError(
            f"{kind} has no submodule {unknown[0]!r} to use as a block; its default blocks are "
            f"{_shown(default_blocks(model))}"
        )
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"block {name!r} is listed twice: each block runs once")
        seen.add(name)
    for name in names:
        parts = name.split(".")
        for end in range(1, len(parts)):
            outer = ".".join(parts[:end])
            if outer in seen:
                raise ValueError(
                    f"block {name!r} is inside block {outer!r}: list one of them, not both"
                )
    _check_covered(model, [known[name] for name in names])
    return names


def _check_covered(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Every parameter and buffer lives in a block: a stage runs only its blocks."""
    inside = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
    outside = [
        name
        for name, tensor in (*model.named_parameters(), *model.named_buffers())
        if id(tensor) not in inside
    ]
    if outside:
        raise ValueError(
            f"{type(model).__name__} has parameters or buffers in no block: {_shown(outside)}; "
            "the stages run only their blocks, so these would never be used or trained: list "
            "the modules holding them as blocks, or move them into one"
        )


def even_split(count: int, stages: int, what: str = "blocks") -> list[int]:
    """``count`` blocks shared out over ``stages`` as evenly as possible, earlier stages taking
    one more where they do not divide."""
    if count < stages:
        raise ValueError(
            f"{count} {what} cannot fill {stages} stages: use fewer stages, a deeper model, or "
            "finer blocks (blocks=[...] naming smaller modules)"
        )
    base, extra = divmod(count, stages)
    return [base + (s < extra) for s in range(stages)]


def stage_blocks(
    blocks: Sequence[str], split: Split = None, num_stages: int | None = None
) -> list[list[str]]:
    """The block names of each stage: ``split`` (see the module) checked against the blocks
    and, when given, the number of stages the schedule has."""
    count = len(blocks)
    if isinstance(split, str):
        raise TypeError(
            f"split must be a list of block names or block counts, got the string {split!r}: "
            f"write [{split!r}]"
        )
    if split is None:
        if num_stages is None:
            raise ValueError("give split=[...] or the number of stages")
        sizes = even_split(count, num_stages)
    else:
        points = list(split)
        if all(isinstance(p, str) for p in points):
            sizes = _sizes_from_points(blocks, points)  # type: ignore[arg-type]
        elif all(isinstance(p, int) and not isinstance(p, bool) for p in points):
            sizes = list(points)  # type: ignore[arg-type]
            if min(sizes) < 1 or sum(sizes) != count:
                raise ValueError(
                    f"split {sizes} must give every stage at least one block and {count} "
                    "blocks in all"
                )
        else:
            raise TypeError(
                f"split must be all block names (where stages 1, 2, ... begin) or all block "
                f"counts (one per stage), got {points!r}"
            )
        if num_stages is not None and len(sizes) != num_stages:
            raise ValueError(
                f"split {points!r} makes {len(sizes)} stages but the schedule has {num_stages}: "
                f"give {num_stages - 1} split points or {num_stages} counts"
            )
    bounds = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    return [list(blocks[bounds[s] : bounds[s + 1]]) for s in range(len(sizes))]


def _sizes_from_points(blocks: Sequence[str], points: Sequence[str]) -> list[int]:
    where = {name: index for index, name in enumerate(blocks)}
    starts = [0]
    for point in points:
        if point not in where:
            raise ValueError(
                f"split point {point!r} is not a block; the blocks are {_shown(blocks)}"
            )
        index = where[point]
        if index == 0:
            raise ValueError(
                f"split point {point!r} is the first block: stage 0 would be empty (split "
                "points name where stages 1, 2, ... begin)"
            )
        if index == starts[-1]:
            raise ValueError(f"split point {point!r} is given twice: each stage needs a block")
        if index < starts[-1]:
            raise ValueError(
                f"split point {point!r} comes before {blocks[starts[-1]]!r} in the model: "
                "give the split points in the order the blocks run"
            )
        starts.append(index)
    starts.append(len(blocks))
    return [b - a for a, b in pairwise(starts)]


class Container(nn.Module):
    """Holds a stage's blocks under one part of their original path (``layers`` in
    ``layers.3``); never run itself."""


class Stage(nn.Module):
    """Some blocks of a model, under their original paths, run one after the other.

    ``named_parameters()`` and ``state_dict()`` give the unsplit model's keys; the blocks are
    the model's own objects, so training a stage trains the model.
    """

    def __init__(self, model: nn.Module, blocks: Sequence[str]) -> None:
        super().__init__()
        for path in blocks:
            *outer, leaf = path.split(".")
            holder: nn.Module = self
            for part in outer:
                inner = holder._modules.get(part)
                if inner is None:
                    inner = Container()
                    holder.add_module(part, inner)
                holder = inner
            holder.add_module(leaf, model.get_submodule(path))
        self._block_paths = tuple(blocks)
        # the blocks themselves, in order, for forward: looking paths up costs on every call
        self._blocks = tuple(model.get_submodule(path) for path in blocks)
        self.training = model.training

    @property
    def block_names(self) -> tuple[str, ...]:
        return self._block_paths

    def forward(self, *inputs: Any) -> Any:
        value: Any = inputs if len(inputs) != 1 else inputs[0]
        for block in self._blocks:
            value = block(*value) if isinstance(value, tuple) else block(value)
        return value


def cut_module(
    model: nn.Module,
    split: Split = None,
    *,
    blocks: Iterable[str] | None = None,
    num_stages: int | None = None,
    held: Iterable[int] | None = None,
    make_stage: Callable[[nn.Module, Sequence[str]], Stage] = Stage,
) -> dict[int, Stage]:
    """The stages ``held`` (default: all) of ``model`` cut at ``split`` (see the module), each
    built by ``make_stage(model, its block names)``: a ``Stage``, or a subclass that runs its
    blocks otherwise (``cutpipe.parallel.moe_stage.MoEStage`` runs them as phases)."""
    names = check_blocks(model, blocks)
    groups = stage_blocks(names, split, num_stages)
    wanted = range(len(groups)) if held is None else sorted(set(held))
    _check_untied(model, groups, set(wanted))
    outside = [s for s in wanted if not 0 <= s < len(groups)]
    if outside:
        raise ValueError(f"there is no stage {outside[0]}: the model is cut into {len(groups)}")
    return {s: make_stage(model, groups[s]) for s in wanted}


def _check_untied(model: nn.Module, groups: Sequence[Sequence[str]], held: set[int]) -> None:
    """No parameter is shared by a stage held here and one held elsewhere: each would train its
    own copy. Stages held together share it as one parameter (the runner reduces it once, after
    the later of them: a tied embedding and head on a V schedule's first rank)."""
    names = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, tuple[int, str]] = {}
    for stage, group in enumerate(groups):
        for block in group:
            for parameter in model.get_submodule(block).parameters():
                first = owner.setdefault(id(parameter), (stage, block))
                if first[0] != stage and len({first[0], stage} & held) == 1:
                    raise ValueError(
                        f"blocks {first[1]!r} (stage {first[0]}) and {block!r} (stage {stage}) "
                        f"share the parameter {names[id(parameter)]!r}: tied weights must stay in "
                        "one stage; split elsewhere, or untie them"
                    )


def named_parameters_of(stages: Mapping[int, nn.Module]) -> dict[str, nn.Parameter]:
    """Every stage's parameters by name, each once; a name two parameters claim is an error."""
    named: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for stage in sorted(stages):
        for name, parameter in stages[stage].named_parameters():
            if id(parameter) in seen:
                continue
            if name in named:
                raise ValueError(_clash(name, stages))
            named[name] = parameter
            seen.add(id(parameter))
    return named


def state_dict_of(stages: Mapping[int, nn.Module]) -> dict[str, torch.Tensor]:
    """Every stage's ``state_dict`` merged; a key two different tensors claim is an error."""
    merged: dict[str, torch.Tensor] = {}
    for stage in sorted(stages):
        for key, value in stages[stage].state_dict().items():
            held = merged.setdefault(key, value)
            if held is not value and (
                held.data_ptr() != value.data_ptr() or held.shape != value.shape
            ):
                raise ValueError(_clash(key, stages))
    return merged


def _clash(name: str, stages: Mapping[int, nn.Module]) -> str:
    return (
        f"two stages of this rank ({', '.join(map(str, sorted(stages)))}) name different "
        f"tensors {name!r}: build the runner with from_module or from_sequential, whose stages "
        "keep the model's names, or give stage modules whose names differ"
    )
