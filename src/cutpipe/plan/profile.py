"""Measured costs of a model's items (``cutpipe.plan.measure`` takes them) as a file.

A ``Profile`` holds one measurement per kind of item (embedding, dense layer, MoE layer, head),
is written as JSON, and is turned back into the per-item costs of the whole model by
``Profile.items_for``: each layer takes its kind's measurement, experts are divided over the
expert-parallel ranks, and the all-to-all and pipeline transfer times still come from the
hardware model (one machine cannot measure a cluster's network). Torch-free, so the planning
commands that read a profile do not import torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cutpipe.plan.costs import Hardware, ItemCost, ModelSpec, model_items

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
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"profile file {path} does not exist") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"profile file {path} is not JSON: {error}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a cutpipe profile (written by `cutpipe profile`)")
        model = ModelSpec.from_dict(data["model"], source=str(path))
        needed = {"embedding", "head", "moe_layer" if model.moe else "dense_layer"}
        if model.moe and model.dense_layers:
            needed.add("dense_layer")
        missing = needed - set(data["items"])
        if missing:
            raise ValueError(f"profile {path} lacks measurements of {', '.join(sorted(missing))}")
        items = {kind: ItemCost(**values) for kind, values in data["items"].items()}
        return cls(model, data["device"], data["dtype"], items, float(data["w_memory"]))
