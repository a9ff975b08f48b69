"""Training runs' loss curves, from their metrics logs, as PNG or SVG.

The dashed line is the corpus's unigram entropy: the loss of a model that ignores context, so
the gap below it is what the model learned from context. A run that evaluated on held-out data
(``val_loss`` in its records) also shows that loss, dashed with a marker at each evaluation (in
the next color for one run, in the run's own for several). One run also shows its tokens/s on a second axis; several runs are drawn side
by side on the same axes, each named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from cutpipe.files import write_with

matplotlib.use("Agg")


#: One color per run, in order.
COLORS = ("#1f5fa8", "#d08a1e", "#2e8b57", "#8e44ad", "#b03a2e")


def save_loss_curve(
    records: Sequence[dict[str, Any]], path: str | Path, entropy: float | None = None,
    title: str = "",
) -> int:  # fmt: skip
    """Loss (and tokens/s, on a second axis) against step; the number of steps drawn."""
    return save_loss_curves({"loss": records}, path, entropy, title)


def save_loss_curves(
    runs: Mapping[str, Sequence[dict[str, Any]]], path: str | Path,
    entropy: float | None = None, title: str = "",
) -> int:  # fmt: skip
    """Each run's loss against step (one run: with its tokens/s); the most steps drawn."""
    if not runs:
        raise ValueError("no metrics log given: nothing to draw")
    empty = [name for name, records in runs.items() if not records]
    if empty:
        raise ValueError(f"the metrics log {empty[0]} holds no steps: nothing to draw")
    if len(runs) > len(COLORS):
        raise ValueError(f"at most {len(COLORS)} runs on one picture, got {len(runs)}")
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    axes = figure.add_subplot()
    for (name, records), color in zip(runs.items(), COLORS, strict=False):
        steps = [r["step"] for r in records]
        axes.plot(steps, [r["loss"] for r in records], color=color, linewidth=1.4, label=name)
        held_out = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if held_out:
            shade = COLORS[1] if len(runs) == 1 else color
            axes.plot(*zip(*held_out, strict=True), color=shade, linewidth=1.2, linestyle="--",
                      marker="o", markersize=3, label=f"{name} (validation)")  # fmt: skip
    records = next(iter(runs.values()))
    steps = [r["step"] for r in records]
    if entropy is not None:
        axes.axhline(entropy, color="#b03a2e", linestyle="--", linewidth=1,
                     label=f"unigram entropy {entropy:.3f}")  # fmt: skip
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.grid(alpha=0.3)
    if len(runs) == 1 and all("tokens_per_s" in r for r in records):
        speed = axes.twinx()
        speed.plot(steps, [r["tokens_per_s"] for r in records], color="#999999", linewidth=0.6,
                   alpha=0.7, label="tokens/s")  # fmt: skip
        speed.set_ylabel("tokens/s", color="#777777")
        speed.set_ylim(bottom=0)
    axes.legend(loc="upper right")
    if title:
        axes.set_title(title)
    kind = Path(path).suffix.lstrip(".").lower()
    write_with(path, lambda temporary: figure.savefig(temporary, dpi=120, format=kind))
    return max(len(records) for records in runs.values())
