"""Measured costs of a model's items (``cutpipe.profiling`` takes them) as a file.

A ``Profile`` holds one measurement per kind of item (embedding, dense layer, MoE layer, head),
is written as JSON, and is turned back into the per-item costs of the whole model by
``Profile.items_for``: each layer takes its kind's measurement, experts are divided over the
expert-parallel ranks, and the all-to-all and pipeline transfer times still come from the
hardware model (one machine cannot measure a cluster's network). Torch-free, so the planning
commands that read a profile do not import torch.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from cutpipe.files import write_text
from cutpipe.plan.costs.model import Hardware, ItemCost, model_items
from cutpipe.records import finite, mapping, require_keys
from cutpipe.spec import ModelSpec

FORMAT = "cutpipe-profile/1"
KINDS = ("embedding", "dense_layer", "moe_layer", "head")
DTYPES = ("fp32", "bf16", "fp16")  # what a measurement can run in


@dataclass(frozen=True)
class Profile:
    """Measured per-microbatch costs of each kind of item of one model."""

    model: ModelSpec
    device: str
    dtype: str  # what the measurement ran in
    items: dict[str, ItemCost]  # by kind, see KINDS
    w_memory: float  # measured fraction of a layer's activation W still needs after B

    def items_for(
        self, hardware: Hardware, ep: int = 1, ep_within_node: bool = True
    ) -> list[ItemCost]:
        """The model's items (embedding, every layer, head) with measured compute and memory."""
        analytic = model_items(self.model, hardware, ep, ep_within_node)
        out = []
        for index, modelled in enumerate(analytic):
            kind = (
                "embedding" if index == 0
                else "head" if index == len(analytic) - 1
                else "moe_layer" if modelled.expert_parameters
                else "dense_layer"
            )  # fmt: skip
            measured = self.items[kind]
            experts = measured.expert_parameters / ep
            out.append(
                replace(
                    modelled,
                    forward=measured.forward,
                    backward=measured.backward,
                    weight=measured.weight,
                    activation=measured.activation,
                    parameters=measured.parameters - measured.expert_parameters + experts,
                    expert_parameters=experts,
                )
            )
        return out

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model": asdict(self.model),
            "device": self.device,
            "dtype": self.dtype,
            "w_memory": self.w_memory,
            "items": {kind: item.to_dict() for kind, item in self.items.items()},
        }

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON, atomically (the old file stays until the new is whole)."""
        write_text(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile ``save`` wrote; a ValueError names the file and what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"profile file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read profile file {path}: {error}") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"profile file {path} is not JSON: {error}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a cutpipe profile (written by `cutpipe profile`)")
        try:
            return cls._from_dict(data, str(path))
        except (TypeError, ValueError) as error:
            message = str(error)
            raise ValueError(message if str(path) in message else f"{path}: {message}") from None

    @classmethod
    def from_dict(cls, data: dict, source: str = "profile") -> Profile:
        """The profile ``to_dict`` gave; a ValueError names ``source`` and what is wrong."""
        return cls._from_dict(data, source)

    @classmethod
    def _from_dict(cls, data: dict, source: str) -> Profile:
        record = require_keys(data, "profile", ("model", "device", "dtype", "w_memory", "items"))
        model = ModelSpec.from_dict(dict(mapping(record["model"], "profile model")), source)
        needed = {"embedding", "head", "moe_layer" if model.moe else "dense_layer"}
        if model.moe and model.dense_layers:
            needed.add("dense_layer")
        measured = mapping(record["items"], "profile items")
        missing = needed - set(measured)
        if missing:
            raise ValueError(f"profile {source} lacks measurements of {', '.join(sorted(missing))}")
        unknown = set(measured) - set(KINDS)
        if unknown:
            raise ValueError(f"profile items {sorted(unknown)} are not among {', '.join(KINDS)}")
        items = {kind: _item(kind, values) for kind, values in measured.items()}
        kept = finite(record["w_memory"], "profile w_memory")
        if not 0 <= kept <= 1:
            raise ValueError(f"profile w_memory is a fraction between 0 and 1, got {kept}")
        return cls(model, str(record["device"]), str(record["dtype"]), items, kept)


def _item(kind: str, values: object) -> ItemCost:
    """One measured item; every figure a finite number >= 0."""
    names = [f.name for f in fields(ItemCost)]
    numeric = [n for n in names if n != "name"]
    required = [f.name for f in fields(ItemCost) if f.default is MISSING]
    record = require_keys(values, f"profile item {kind}", required)
    unknown = sorted(set(record) - set(names))
    if unknown:
        raise ValueError(f"profile item {kind} has unknown fields {unknown}")
    figures = {n: finite(record[n], f"profile item {kind} {n}") for n in numeric if n in record}
    negative = [n for n, v in figures.items() if v < 0]
    if negative:
        raise ValueError(f"profile item {kind}: {', '.join(negative)} must be >= 0")
    return ItemCost(name=str(record["name"]), **figures)
