"""What one rank's part of a checkpoint holds: the saved keys, and the values that are not the
model's or the optimizer's (step, ``extra``, scheduler, random number generators).

Every key is independent of how the model was cut, so that any layout can read any other's:

- ``model.<fqn>``: parameters and buffers;
- ``optim.state.<fqn>.<name>`` and ``optim.param_groups.<fqn>.<hyperparameter>``: the optimizer
  flattened by FQN (``StateDictOptions(flatten_optimizer_state_dict=True)``), so no key depends on
  a rank's parameter order or group numbering (``optimizer_state``);
- ``scheduler``, ``step``, ``extra`` (the caller's JSON dict, e.g. the data loader's position):
  the same on every rank;
- ``rng.rank<r>.{cpu,cuda.<i>,python}``: each rank's random number generators, restored only by
  the same layout (same number of ranks, each holding the same names).
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from cutpipe.train.checkpoint.optimizer_state import model_and_optimizer_state


def rng_prefix(rank: int) -> str:
    """The start of every key of ``rank``'s random number generators."""
    return f"rng.rank{rank}."


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators from the keys under this rank's ``rng_prefix`` (prefix removed)."""
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    devices = sorted(int(k.removeprefix("cuda.")) for k in state if k.startswith("cuda."))
    cuda = [state[f"cuda.{device}"] for device in devices]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def extra_text(extra: dict[str, Any] | None) -> str:
    """``extra`` as the JSON text that is saved (sorted keys: ranks compare it as text)."""
    if extra is None:
        return "{}"
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    try:
        return json.dumps(extra, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"extra must hold JSON values (numbers, strings, lists, dicts): {error}; convert "
            "tensors with .tolist()"
        ) from None


def rank_state(
    rank: int,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    extra: str,
) -> dict[str, Any]:
    """The rank's part of a checkpoint, as DCP saves it."""
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model), {}
    else:
        model_state, optim_state = model_and_optimizer_state(model, optimizer)
    state: dict[str, Any] = {
        "model": model_state,
        "step": step,
        "extra": extra,
        "rng": {f"rank{rank}": _rng_state()},
    }
    if optim_state:
        state["optim"] = optim_state
    if scheduler is not None:
        # one pickled leaf: DCP would flatten the dict, and loading would need its shape first
        state["scheduler"] = (scheduler.state_dict(),)
    return state
