"""One trainer for every ``cutpipe train`` run: its options (declared once), what it trains (the
task), where the stages go (the layout, or a plan file), how they are parallelized, the
optimizer step, DCP checkpoints that reshard, and metrics (docs/training.md)."""
