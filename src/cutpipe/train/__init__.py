"""A training run around the pipeline runner: options, the trainer, the optimizer step with
global clipping, DCP checkpoints that reshard, metrics, and the elastic launch (docs/training.md)."""
