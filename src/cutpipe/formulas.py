"""Closed forms of the published results; see ``cutpipe.sim.formulas``."""

from cutpipe.sim.formulas import (
    CLOSED_FORMS,
    ClosedForm,
    bubble_1f1b,
    bubble_dualpipe,
    bubble_ratio_1f1b,
    bubble_ratio_zbh1,
    bubble_zbh1,
    bubble_zbh2,
    bubble_zbv,
    predicted_bubble,
    simulated_bubble,
)

__all__ = [
    "CLOSED_FORMS",
    "ClosedForm",
    "bubble_1f1b",
    "bubble_dualpipe",
    "bubble_ratio_1f1b",
    "bubble_ratio_zbh1",
    "bubble_zbh1",
    "bubble_zbh2",
    "bubble_zbv",
    "predicted_bubble",
    "simulated_bubble",
]
