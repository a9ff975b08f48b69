"""A training run's loss curve, from its metrics log, as PNG or SVG.

The dashed line is the corpus's unigram entropy: the loss of a model that ignores context, so
the gap below it is what the model learned from context.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from cutpipe.files import write_with

matplotlib.use("Agg")


def save_loss_curve(
    records: Sequence[dict[str, Any]], path: str | Path, entropy: float | None = None,
    title: str = "",
) -> int:  # fmt: skip
    """Loss (and tokens/s, on a second axis) against step; the number of steps drawn."""
    if not records:
        raise ValueError("the metrics log holds no steps: nothing to draw")
    steps = [r["step"] for r in records]
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    axes = figure.add_subplot()
    axes.plot(steps, [r["loss"] for r in records], color="#1f5fa8", linewidth=1.4, label="loss")
    if entropy is not None:
        axes.axhline(entropy, color="#b03a2e", linestyle="--", linewidth=1,
                     label=f"unigram entropy {entropy:.3f}")  # fmt: skip
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.grid(alpha=0.3)
    if all("tokens_per_s" in r for r in records):
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
    return len(records)
