"""Execute cutpipe schedules on torch.distributed (gloo on CPU, NCCL on GPU)."""

from cutpipe.runtime.failure.agreement import MismatchError
from cutpipe.runtime.failure.guard import PipelineError
from cutpipe.runtime.options import RunnerOptions
from cutpipe.runtime.protocols import Executor, ExecutorContext, Transport, TransportContext
from cutpipe.runtime.runner import PipelineRunner
from cutpipe.runtime.stages import cut_module, even_split

__all__ = [
    "Executor",
    "ExecutorContext",
    "MismatchError",
    "PipelineError",
    "PipelineRunner",
    "RunnerOptions",
    "Transport",
    "TransportContext",
    "cut_module",
    "even_split",
]
