"""Cost model, event simulation (one step or several), metrics and closed forms. Pure Python;
no torch."""

from cutpipe.sim.costs import Costs
from cutpipe.sim.memory import activation_trace, peak_activations
from cutpipe.sim.metrics import Metrics, metrics
from cutpipe.sim.simulate import simulate
from cutpipe.sim.steps import MultiStep, simulate_steps
from cutpipe.sim.timeline import Timeline

__all__ = [
    "Costs",
    "Metrics",
    "MultiStep",
    "Timeline",
    "activation_trace",
    "metrics",
    "peak_activations",
    "simulate",
    "simulate_steps",
]
