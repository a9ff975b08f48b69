"""Validation during training: a held-out loss, forward-only through the run's own pipeline.

An evaluation runs the pipeline's forwards under ``torch.no_grad()`` (``PipelineRunner.step``
then runs the schedule's F ops only, on every rank of every replica), over the same global
batches each time (``cutpipe.data.heldout``): each replica takes its share of a batch as in
training, and the loss is the mean over the microbatches, the batches and the replicas. It is
the next-token cross entropy alone: an MoE's load-balancing term, a training regulariser, is
left out, so the loss and its perplexity (``exp``) read like any language model's.

Nothing of the training state moves: the models have no dropout, so there is no eval mode to
switch; an MoE counts its routing (statistics, the balancing bias's load) only in forwards with
gradients; the activation meter and the gradient reducer run only in training steps; a runner
that records timelines keeps the last training step's; and the step's time and tokens/s are
measured before an evaluation starts.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cutpipe.data.heldout import HeldOutBatches

if TYPE_CHECKING:
    from torch import nn

    from cutpipe.train.options import TrainOptions
    from cutpipe.train.tasks import Task
    from cutpipe.train.trainer import Trainer


@dataclass(frozen=True)
class Evaluation:
    """One evaluation: after which step, its loss, and how long it took."""

    step: int
    loss: float
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def fields(self) -> dict[str, float]:
        """What the step's metrics record gains (``val_loss``, ``val_ppl``, ``val_time``)."""
        return {"val_loss": self.loss, "val_ppl": self.perplexity, "val_time": self.seconds}


class Evaluator:
    """When a run evaluates, and on which batches (the same every time)."""

    def __init__(self, batches: HeldOutBatches, every: int | None, last_step: int) -> None:
        self.batches, self.every, self.last_step = batches, every, last_step

    @classmethod
    def of_run(cls, options: TrainOptions, task: Task, batch: int) -> Evaluator | None:
        """The run's evaluator (None: no validation set), once ``task.loader`` has read the
        data; ``batch`` is the global batch of one pipeline step."""
        tokens = task.validation()
        if tokens is None:
            return None
        batches = HeldOutBatches(tokens, task.tokens_per_sample, batch, options.eval_steps)
        return cls(batches, options.eval_every, options.steps)

    def due(self, step: int) -> bool:
        """Whether to evaluate after ``step``: every ``every`` steps, and after the last one
        (``every=0``: never)."""
        if self.every == 0:
            return False
        return step == self.last_step or (self.every is not None and step % self.every == 0)

    def run(self, trainer: Trainer) -> Evaluation:
        """Evaluate the trainer's model as it is now, on every rank together."""
        start = time.perf_counter()
        runner, mesh = trainer.runner, trainer.mesh
        total = torch.zeros((), dtype=torch.float64, device=trainer.device)
        with torch.no_grad(), trainer.autocast(), cross_entropy_only(trainer.loss_fn):
            for inputs, targets in self.batches:
                inputs, targets = inputs.to(trainer.device), targets.to(trainer.device)
                loss = runner.step(mesh.shard(inputs), mesh.shard(targets))
                if loss is not None:  # a rank's own share when the runner does not sum them
                    total += loss.double()
        if not runner.options.loss_everywhere and mesh.layout.pp > 1:
            dist.all_reduce(total, group=mesh.pp_group)
        total = mesh.average(total / len(self.batches))
        dist.broadcast(total, src=0)  # one value on every rank, bit for bit (checkpoints)
        return Evaluation(trainer.step, float(total), time.perf_counter() - start)


@contextlib.contextmanager
def cross_entropy_only(loss_fn: nn.Module | Any) -> Iterator[None]:
    """The loss function without its auxiliary (MoE balancing) term while the block runs."""
    weight = getattr(loss_fn, "aux_weight", None)
    if weight is None:
        yield
        return
    loss_fn.aux_weight = 0.0
    try:
        yield
    finally:
        loss_fn.aux_weight = weight
