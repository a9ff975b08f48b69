"""Closed forms of the published results, and exactly when they hold (docs/formulas.md names
the source of each and tabulates them).

Convention: ``b`` is the input-gradient backward, ``w`` the weight-gradient backward, and the full
backward is ``b + w`` (DeepSeek writes B for the full one: their (PP-1)(F+B) is our
(R-1)(F+B+W)). Every form assumes equal stages and no communication. Where a form is exact, the
simulator reproduces it to the last bit; the tests check this over grids of ranks, microbatches
and costs, and the conditions below are the ones those tests found (and prove).

Bubbles are times. ``measure`` says which simulated quantity a form predicts:

- ``"idle"``: the idle time of the most idle rank over the whole step (makespan minus busy time);
- ``"span"``: the longest per-rank span minus the least busy time (the zero-bubble papers' measure,
  which lets the next step's warm-up overlap this step's tail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cutpipe.sim.costs import Costs
from cutpipe.sim.metrics import Metrics


def bubble_1f1b(ranks: int, f: float, b: float, w: float) -> float:
    """1F1B: (R-1)(F+B+W). Exact for every microbatch count."""
    return (ranks - 1) * (f + b + w)


def bubble_zbh1(ranks: int, f: float, b: float, w: float) -> float:
    """ZB-H1: (R-1)(F+B-min(F,B,W)), i.e. (R-1)(F+B-W) when W <= min(F, B). Exact for m >= R."""
    return (ranks - 1) * (f + b - min(f, b, w))


def bubble_zbh2(ranks: int, f: float, b: float, w: float) -> float:
    """ZB-H2, span measure: (R-1) max(F+B-2W, B-F, 0). Exact for m >= 2R-1."""
    return (ranks - 1) * max(f + b - 2 * w, b - f, 0.0)


def bubble_zbv(ranks: int, f: float, b: float, w: float) -> float | None:
    """ZB-V, span measure: 0 when F = B = W (and m >= 2R-1); no closed form otherwise."""
    return 0.0 if f == b == w else None


def bubble_dualpipe(stages: int, f: float, b: float, w: float, fb: float) -> float:
    """DualPipe and DualPipeV: (PP/2-1)(F&B + B_full - 3W) with PP stages and B_full = B+W.

    The most idle rank's idle time equals this exactly when F = B = W and
    B_full <= F&B <= F + B_full (an overlapped pair no faster than its longer half and no slower
    than running both halves back to back). DeepSeek states it for any F&B; outside that range
    the simulated schedule idles more than the form says.
    """
    return (stages / 2 - 1) * (fb + b + w - 3 * w)


def bubble_ratio_1f1b(ranks: int, microbatches: int) -> float:
    """1F1B's bubble ratio at F = B = W: (R-1) / (m+R-1)."""
    return (ranks - 1) / (microbatches + ranks - 1)


def bubble_ratio_zbh1(ranks: int, microbatches: int) -> float:
    """ZB-H1's bubble ratio at F = B = W: (R-1) / (3m+R-1)."""
    return (ranks - 1) / (3 * microbatches + ranks - 1)


@dataclass(frozen=True)
class ClosedForm:
    """A schedule's published bubble, parameter, memory and traffic figures."""

    schedule: str
    bubble_text: str
    measure: str  # "idle" or "span", see the module docstring
    params_text: str  # parameters per device, against 1F1B on as many devices
    activations_text: str  # peak activations per device, in stage-microbatch units
    traffic_text: str  # pipeline point-to-point traffic against 1F1B
    exact_when: str  # besides equal stages and no communication
    bubble: Callable[[int, int, Costs], float | None]  # (ranks, stages, costs) -> bubble time
    exact: Callable[[int, int, Costs], bool]  # (ranks, microbatches, costs) -> form is exact


def _uniform(costs: Costs, stages: int) -> tuple[float, float, float] | None:
    """(F, B, W) when every stage costs the same, else None (the forms assume equal stages)."""
    if not costs.is_uniform(stages):
        return None
    return costs.per_stage("f", 1)[0], costs.per_stage("b", 1)[0], costs.per_stage("w", 1)[0]


def _no_communication(costs: Costs) -> bool:
    return not costs.comm and not costs.has_ep()


def _linear_form(fn: Callable[[int, float, float, float], float | None]) -> Callable:
    def bubble(ranks: int, stages: int, costs: Costs) -> float | None:
        fbw = _uniform(costs, stages)
        return None if fbw is None else fn(ranks, *fbw)

    return bubble


def _dualpipe_form(ranks: int, stages: int, costs: Costs) -> float | None:
    fbw = _uniform(costs, stages)
    if fbw is None:
        return None
    f, b, w = fbw
    return bubble_dualpipe(stages, f, b, w, f + b + w if costs.fb is None else costs.fb)


def _min_microbatches(rule: Callable[[int], int], extra: Callable[[Costs], bool] = lambda _: True):
    def exact(ranks: int, microbatches: int, costs: Costs) -> bool:
        return microbatches >= rule(ranks) and extra(costs) and _no_communication(costs)

    return exact


def _equal_fbw(costs: Costs) -> bool:
    return costs.per_stage("f", 1) == costs.per_stage("b", 1) == costs.per_stage("w", 1)


def _dualpipe_exact(ranks: int, microbatches: int, costs: Costs) -> bool:
    if not (_equal_fbw(costs) and _no_communication(costs)):
        return False
    f, b, w = (costs.per_stage(n, 1)[0] for n in ("f", "b", "w"))
    fb = f + b + w if costs.fb is None else costs.fb
    return b + w <= fb <= f + b + w


CLOSED_FORMS: dict[str, ClosedForm] = {
    form.schedule: form
    for form in (
        ClosedForm(
            "1f1b",
            "(R-1)(F+B+W)",
            "idle",
            "1x",
            "R",
            "1x",
            "any m",
            _linear_form(bubble_1f1b),
            _min_microbatches(lambda r: 1),
        ),
        ClosedForm(
            "zbh1",
            "(R-1)(F+B-min(F,B,W))",
            "idle",
            "1x",
            "R",
            "1x",
            "m >= R",
            _linear_form(bubble_zbh1),
            _min_microbatches(lambda r: r),
        ),
        ClosedForm(
            "zbh2",
            "(R-1)max(F+B-2W,B-F,0)",
            "span",
            "1x",
            "2R-1",
            "1x",
            "m >= 2R-1",
            _linear_form(bubble_zbh2),
            _min_microbatches(lambda r: 2 * r - 1),
        ),
        ClosedForm(
            "zbv",
            "0 when F=B=W",
            "span",
            "1x",
            "2R half-stages (R)",
            "2x",
            "m >= 2R-1",
            _linear_form(bubble_zbv),
            _min_microbatches(lambda r: 2 * r - 1, _equal_fbw),
        ),
        ClosedForm(
            "dualpipe",
            "(PP/2-1)(F&B+B+W-3W)",
            "idle",
            "2x",
            "PP+1",
            "1x",
            "F=B=W, B+W <= F&B <= F+B+W, even m",
            _dualpipe_form,
            lambda r, m, c: m % 2 == 0 and _dualpipe_exact(r, m, c),
        ),
        ClosedForm(
            "dualpipev",
            "(PP/2-1)(F&B+B+W-3W)",
            "idle",
            "1x",
            "PP+1 half-stages",
            "2x",
            "F=B=W, B+W <= F&B <= F+B+W",
            _dualpipe_form,
            _dualpipe_exact,
        ),
    )
}


def simulated_bubble(result: Metrics, measure: str) -> float:
    """The simulated quantity a closed form with this ``measure`` predicts."""
    if measure == "idle":
        return max(result.idle_per_rank)
    if measure == "span":
        return max(result.span_per_rank) - min(result.busy_per_rank)
    raise ValueError(f"unknown bubble measure {measure!r}: use 'idle' or 'span'")


def predicted_bubble(name: str, ranks: int, stages: int, microbatches: int, costs: Costs):
    """(closed-form bubble, whether the form is exact here) for a named schedule.

    The form is evaluated whenever it is defined (equal stages; for ZB-V, F = B = W), even where
    it is not exact, so that callers can show where published form and simulation part ways.
    """
    form = CLOSED_FORMS.get(name)
    if form is None:
        return None, False
    value = form.bubble(ranks, stages, costs)
    return value, value is not None and form.exact(ranks, microbatches, costs)
