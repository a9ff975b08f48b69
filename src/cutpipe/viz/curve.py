"""Training runs' loss curves, from their metrics logs, as PNG or SVG.

The dashed line is the corpus's unigram entropy: the loss of a model that ignores context, so
the gap below it is what the model learned from context. A run that evaluated on held-out data
(``val_loss`` in its records) also shows that loss, dashed with a marker at each evaluation (in
the next color for one run, in the run's own for several). The learning rate is drawn on a
second axis (a log without it, from an older cutpipe: the tokens/s), and a run's median
throughput is named in its legend; several runs are drawn side by side on the same axes, each
named. A log's first record says what ran (``run``: model, schedule, learning-rate schedule),
which titles the picture.
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
    """Loss (and the learning rate, on a second axis) against step; the number of steps drawn."""
    return save_loss_curves({"loss": records}, path, entropy, title)


def save_loss_curves(
    runs: Mapping[str, Sequence[dict[str, Any]]], path: str | Path,
    entropy: float | None = None, title: str = "",
) -> int:  # fmt: skip
    """Each run's loss against step, with its learning rate; the most steps drawn."""
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
        label = name + _speed(records)
        axes.plot(steps, [r["loss"] for r in records], color=color, linewidth=1.4, label=label)
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
    with_lr = {name: rs for name, rs in runs.items() if all(r.get("lr", 0) > 0 for r in rs)}
    if with_lr:
        rate = axes.twinx()
        for (name, records), color in zip(runs.items(), COLORS, strict=False):
            if name in with_lr:
                rate.plot([r["step"] for r in records], [r["lr"] for r in records], color=color,
                          linewidth=0.9, linestyle=":", alpha=0.8)  # fmt: skip
        rate.set_ylabel("learning rate (dotted)", color="#777777")
        rate.set_ylim(bottom=0)
        rate.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    elif len(runs) == 1 and all("tokens_per_s" in r for r in records):
        speed = axes.twinx()
        speed.plot(steps, [r["tokens_per_s"] for r in records], color="#999999", linewidth=0.6,
                   alpha=0.7, label="tokens/s")  # fmt: skip
        speed.set_ylabel("tokens/s", color="#777777")
        speed.set_ylim(bottom=0)
    axes.legend(loc="upper right")
    title = title or run_title(runs)
    if title:
        axes.set_title(title, fontsize=10)
    kind = Path(path).suffix.lstrip(".").lower()
    write_with(path, lambda temporary: figure.savefig(temporary, dpi=120, format=kind))
    return max(len(records) for records in runs.values())


def run_info(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What ran, as the log's first record of a run says (``run``); empty for older logs."""
    for record in records:
        if isinstance(record.get("run"), dict):
            return record["run"]
    return {}


def run_title(runs: Mapping[str, Sequence[dict[str, Any]]]) -> str:
    """The model and schedule the runs share, and (one run) its learning-rate schedule."""
    infos = [run_info(records) for records in runs.values()]
    first = infos[0]
    if not first or any(info.get("model") != first.get("model") for info in infos):
        return ""
    title = f"{first['model']}"
    if all(info.get("schedule") == first.get("schedule") for info in infos):
        title += f", {first['schedule']} on {first.get('ranks', '?')} ranks"
    if len(infos) == 1 and first.get("lr_schedule"):
        title += f"\n{first['lr_schedule']}"
    return title


def _speed(records: Sequence[dict[str, Any]]) -> str:
    """`` (median N tokens/s)`` from a run's steady steps (the first warms up)."""
    import statistics

    steady = [r["tokens_per_s"] for r in records[1:] or records if "tokens_per_s" in r]
    return f" (median {statistics.median(steady):,.0f} tokens/s)" if steady else ""
