"""cutpipe: pipeline-parallel training schedules, from one IR, validated, simulated and run.

Importing cutpipe never imports torch: planning and simulation work on a laptop.
"""

from cutpipe.schedule import (
    SCHEDULES,
    Action,
    Kind,
    Overlap,
    Placement,
    Schedule,
    ScheduleError,
    cut_in_half,
    generate,
    validate,
)
from cutpipe.sim import Costs, Metrics, Timeline, metrics, simulate

__version__ = "0.1.0"

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Kind",
    "Metrics",
    "Overlap",
    "Placement",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "cut_in_half",
    "generate",
    "metrics",
    "simulate",
    "validate",
]
