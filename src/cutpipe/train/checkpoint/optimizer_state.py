"""The optimizer's state saved by parameter name (FQN), and put back into any grouping.

DCP flattens the optimizer by FQN (``optim.state.<fqn>.<name>``,
``optim.param_groups.<fqn>.<hyperparameter>``), so no key depends on a rank's parameter order or
group numbering. Loading reverses that for the keys one rank reads: it finds each key's FQN and
field, and rebuilds the FQN-keyed state and parameter groups that ``set_state_dict`` takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_KINDS: tuple[Literal["state", "param_groups"], ...] = ("state", "param_groups")


@dataclass(frozen=True)
class OptimizerKey:
    """Where one saved optimizer key goes back: into the parameter's state or its group's
    hyperparameters (``kind``), for the parameter ``name`` (its FQN), as ``field``."""

    kind: Literal["state", "param_groups"]
    name: str
    field: str


def model_and_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state by FQN, leaving a fresh optimizer fresh: DCP builds
    missing optimizer state with a zero-learning-rate step, which would count as a step."""
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    if fresh:
        optimizer.state.clear()
        optim_state = {k: v for k, v in optim_state.items() if not k.startswith("state.")}
    return model_state, optim_state


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The FQNs of each of the optimizer's parameter groups."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise ValueError(
                f"the optimizer holds {len(unknown)} parameters that are not in the model: "
                "give the module whose parameters the optimizer updates"
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def saved_parameters(keys: Iterable[str]) -> set[str]:
    """The FQNs whose optimizer hyperparameters the checkpoint's ``keys`` hold (every parameter
    an optimizer updated when it was saved)."""
    prefix = "optim.param_groups."
    # hyperparameter names have no dots, so the FQN is all before the last one
    return {key[len(prefix) :].rpartition(".")[0] for key in keys if key.startswith(prefix)}


def optimizer_keys(keys: Iterable[str], names: Iterable[str]) -> dict[str, OptimizerKey]:
    """Each saved optimizer key of the parameters ``names``, and where it goes back. The FQN is
    the longest dotted head of the key that names a parameter (a parameter has no children, so
    no other head can)."""
    names = set(names)
    found = {}
    for key in keys:
        for kind in _KINDS:
            prefix = f"optim.{kind}."
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            cut = rest.rfind(".")
            while cut > 0 and rest[:cut] not in names:
                cut = rest.rfind(".", 0, cut)
            if cut > 0:
                found[key] = OptimizerKey(kind, rest[:cut], rest[cut + 1 :])
    return found


def nested_optimizer(
    loaded: dict[str, Any],
    keys: dict[str, OptimizerKey],
    groups: list[list[str]],
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """The FQN-keyed optimizer state DCP's ``set_state_dict`` takes, from the flat keys this rank
    loaded; each of this optimizer's groups takes the saved hyperparameters of its parameters
    (its own, if none of them was saved)."""
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, where in keys.items():
        into = state if where.kind == "state" else hyper
        into.setdefault(where.name, {})[where.field] = loaded[key]
    param_groups = []
    for names, current in zip(groups, optimizer.param_groups, strict=True):
        present = [name for name in names if name in hyper]
        if not present:
            param_groups.append(
                {k: v for k, v in current.items() if k != "params"} | {"params": []}
            )
            continue
        values = hyper[present[0]]
        for name in present[1:]:
            if hyper[name] != values:
                raise ValueError(
                    f"{present[0]} and {name} share an optimizer group here but were saved in "
                    "groups with different hyperparameters: group the parameters as the saved "
                    "run did"
                )
        param_groups.append({"params": present, **values})
    return {"state": state, "param_groups": param_groups}
