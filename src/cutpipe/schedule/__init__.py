"""The schedule IR: placements, actions, schedules, generators, cut-in-half and validation.

Pure Python; nothing here imports torch.
"""

from cutpipe.schedule.actions import Action, Kind, Op, Overlap, parse_action, parse_op, units
from cutpipe.schedule.cut_in_half import cut_in_half
from cutpipe.schedule.limits import MAX_OPS
from cutpipe.schedule.placement import Placement
from cutpipe.schedule.registry import SCHEDULES, ScheduleInfo, generate, schedule_info
from cutpipe.schedule.schedule import Schedule
from cutpipe.schedule.validate import ScheduleError, validate

__all__ = [
    "MAX_OPS",
    "SCHEDULES",
    "Action",
    "Kind",
    "Op",
    "Overlap",
    "Placement",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "cut_in_half",
    "generate",
    "parse_action",
    "parse_op",
    "schedule_info",
    "units",
    "validate",
]
