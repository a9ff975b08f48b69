"""Cost model, event simulation, metrics and closed forms. Pure Python; no torch."""

from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import activation_trace, peak_activations
from cutpipe.sim.metrics import Metrics, metrics
from cutpipe.sim.simulate import simulate
from cutpipe.sim.timeline import Timeline

__all__ = [
    "Costs",
    "Metrics",
    "Timeline",
    "activation_trace",
    "metrics",
    "peak_activations",
    "simulate",
]
