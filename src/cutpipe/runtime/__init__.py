"""Execute cutpipe schedules on torch.distributed (gloo on CPU, NCCL on GPU)."""

from cutpipe.runtime.agreement import MismatchError
from cutpipe.runtime.guard import PipelineError
from cutpipe.runtime.launch import LaunchError, Outcome, launch, run
from cutpipe.runtime.options import RunnerOptions
from cutpipe.runtime.protocols import Executor, ExecutorContext, Transport, TransportContext
from cutpipe.runtime.runner import PipelineRunner, stage_sizes

__all__ = [
    "Executor",
    "ExecutorContext",
    "LaunchError",
    "MismatchError",
    "Outcome",
    "PipelineError",
    "PipelineRunner",
    "RunnerOptions",
    "Transport",
    "TransportContext",
    "launch",
    "run",
    "stage_sizes",
]
