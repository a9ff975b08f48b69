"""What tests/test_train_eval.py runs on every rank (spawned processes import this module)."""

from __future__ import annotations

from typing import Any

import torch

from cutpipe.train.options import TrainOptions
from cutpipe.train.trainer import Trainer, train


def _routing(trainer: Trainer) -> dict[str, Any]:
    """An MoE rank's routing state: what its tallies counted, its biases and their pending
    loads (nothing for a dense model)."""
    from cutpipe.parallel.routing import moe_layers_of, routing_statistics

    if not trainer.task.is_moe:
        return {}
    layers = moe_layers_of(trainer.parallel.stages)
    stats = routing_statistics(trainer.parallel.stages)
    return {
        "microbatches": sum(layer.microbatches for layer in stats.layers.values()),
        "bias": {
            name: moe.routing_bias.tolist()
            for name, moe in layers.items()
            if moe.routing_bias is not None
        },
        "pending": sum(moe.bias_load is not None for moe in layers.values()),
    }


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor, gathered whole if it is an FSDP shard (a collective)."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def evaluate_around_steps(rank: int, world: int, options: TrainOptions) -> dict[str, Any]:
    """Evaluate at the first weights (twice), take two training steps (routing looked at
    around each evaluation), evaluate again; the weights this rank then holds, and (rank 0)
    whether the measured timeline is still the last training step's."""
    trainer = Trainer(options)
    try:
        before = trainer.evaluate().loss
        again = trainer.evaluate().loss
        routing = [_routing(trainer)]
        losses = [trainer.train_step()[0].loss for _ in range(2)]
        routing.append(_routing(trainer))
        timeline = trainer.runner.timeline()  # the last training step's (rank 0)
        after = trainer.evaluate().loss
        routing.append(_routing(trainer))
        kept = trainer.runner.timeline()
        same_timeline = None if timeline is None else timeline.to_dict() == kept.to_dict()
        # as lists: tensors would come back through shared memory, gone once the worker ends
        weights = {k: _whole(v).tolist() for k, v in trainer.held.state_dict().items()}
    finally:
        trainer.close()
    return {"at_start": [before, again], "after": after, "losses": losses,
            "routing": routing, "weights": weights, "same_timeline": same_timeline}  # fmt: skip


def eval_launch(rank: int, world: int, checks: list[TrainOptions], runs: list[TrainOptions]):
    """One launch for the whole module: ``checks`` through ``evaluate_around_steps``, then
    ``runs`` through ``cutpipe train``'s loop."""
    torch.manual_seed(0)
    return (
        [evaluate_around_steps(rank, world, options) for options in checks],
        [train(options) for options in runs],
    )
