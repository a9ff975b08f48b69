"""1F1B, DualPipe, Cut-in-half, ZB-H1 and ZB-V on the same devices, beside their closed forms.

The default lineup and costs are those of the Cut-in-half report's comparison table (see
docs/formulas.md). Costs are given per device share (one 1F1B stage: 1/R of the model); a
schedule with S stages on R ranks gets R/S of them per stage (``stage_costs``), so every row
trains the same model on the same number of devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from cutpipe.schedule.registry import generate, schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.sim.costs import Costs
from cutpipe.sim.formulas import CLOSED_FORMS, predicted_bubble, simulated_bubble
from cutpipe.sim.metrics import Metrics, metrics
from cutpipe.sim.simulate import simulate

#: The schedules of the comparison table with closed forms (docs/formulas.md), in its order.
DEFAULT_SCHEDULES = ("1f1b", "dualpipe", "dualpipev", "zbh1", "zbv")
#: The embedded default: 8 devices, F = B = W = 1 per device share, an F&B pair saving half a unit.
DEFAULT_RANKS = 8
DEFAULT_MICROBATCHES = 32
DEFAULT_COSTS = Costs(f=1.0, b=1.0, w=1.0, fb=2.5, p2p_bytes=1.0, ep_bytes=1.0)


@dataclass(frozen=True)
class ComparisonRow:
    """One schedule of the comparison; ``error`` is set instead of figures if it cannot run."""

    schedule: str
    title: str
    error: str | None = None
    metrics: Metrics | None = None
    formula: str | None = None
    measure: str | None = None
    bubble: float | None = None  # the simulated quantity the formula predicts
    bubble_formula: float | None = None
    formula_exact: bool = False  # the published form is stated to hold here
    params_x: float | None = None  # parameters per device against 1F1B
    activations: float | None = None  # peak activations per device, in 1F1B stage-microbatches
    pp_traffic_x: float | None = None  # point-to-point bytes against 1F1B
    ep_traffic_x: float | None = None  # all-to-all volume against 1F1B
    ep_overlapped: float | None = None  # share of all-to-alls inside overlapped F&B pairs

    @property
    def agrees(self) -> bool | None:
        """Whether simulation and published form give the same bubble (None: no form)."""
        if self.bubble is None or self.bubble_formula is None:
            return None
        return abs(self.bubble - self.bubble_formula) <= 1e-9 * max(1.0, abs(self.bubble))


def _ep_volume(result: Metrics) -> float:
    """All-to-all volume in device shares: a stage of 1/S of the model moves 1/S of the tokens'
    expert traffic per op (V-shapes run twice the all-to-alls, each half the size)."""
    return result.ep_alltoalls / result.stages


def stage_costs(schedule: Schedule, costs: Costs) -> Costs:
    """Per-stage costs for ``schedule`` from costs given per device share.

    A schedule with S stages on R ranks cuts the model into S pieces where 1F1B cuts it into R,
    so each of its stages costs R/S of a device share, whatever the placement: half for a V,
    interleaved 1F1B with two chunks and Cut-in-half, one for DualPipe (R stages, each stored
    on two ranks).
    """
    factor = schedule.num_ranks / schedule.num_stages
    return costs if factor == 1 else costs.scaled(factor)


def compare(
    ranks: int = DEFAULT_RANKS,
    microbatches: int = DEFAULT_MICROBATCHES,
    costs: Costs = DEFAULT_COSTS,
    schedules: tuple[str | Schedule, ...] = DEFAULT_SCHEDULES,
) -> list[ComparisonRow]:
    """Simulate each schedule on ``ranks`` devices beside its published closed form.

    A schedule is a name, generated here, or a ``Schedule`` (read from a file, tuned), which
    must be one for ``ranks`` ranks and ``microbatches`` microbatches; it has no closed form.
    """
    baseline = metrics(simulate(generate("1f1b", ranks, microbatches), costs), costs)
    rows = []
    for entry in schedules:
        if isinstance(entry, Schedule):
            name, title = entry.name, entry.name
            if (entry.num_ranks, entry.num_microbatches) != (ranks, microbatches):
                rows.append(ComparisonRow(name, title, error=(
                    f"a schedule for {entry.num_ranks} ranks and {entry.num_microbatches} "
                    f"microbatches, not {ranks} and {microbatches}: pass -r and -m to match")))  # fmt: skip
                continue
            schedule = entry
        else:
            name, title = entry, schedule_info(entry).title
            try:
                schedule = generate(name, ranks, microbatches)
            except ValueError as error:
                rows.append(ComparisonRow(name, title, error=str(error)))
                continue
        own = stage_costs(schedule, costs)
        result = metrics(simulate(schedule, own), own)
        form = CLOSED_FORMS.get(name)
        value, exact = predicted_bubble(name, ranks, schedule.num_stages, microbatches, own)
        rows.append(
            ComparisonRow(
                schedule=name,
                title=title,
                metrics=result,
                formula=form.bubble_text if form else None,
                measure=form.measure if form else None,
                bubble=simulated_bubble(result, form.measure) if form else None,
                bubble_formula=value,
                formula_exact=exact,
                params_x=max(result.params_per_rank) * ranks,
                activations=max(result.peak_activations_per_rank),
                pp_traffic_x=result.p2p_bytes / baseline.p2p_bytes if baseline.p2p_bytes else None,
                ep_traffic_x=_ep_volume(result) / _ep_volume(baseline),
                ep_overlapped=result.ep_alltoalls_overlapped / result.ep_alltoalls,
            )
        )
    return rows
