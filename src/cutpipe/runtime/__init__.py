"""Execute cutpipe schedules on torch.distributed (gloo on CPU, NCCL on GPU)."""

from cutpipe.runtime.guard import PipelineError
from cutpipe.runtime.launch import LaunchError, Outcome, launch, run
from cutpipe.runtime.runner import PipelineRunner, stage_sizes

__all__ = [
    "LaunchError",
    "Outcome",
    "PipelineError",
    "PipelineRunner",
    "launch",
    "run",
    "stage_sizes",
]
