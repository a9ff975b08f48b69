"""The Cut-in-half report's MoE experiment: 1F1B, DualPipe, Cut-in-half and ZB-V on an MoE
transformer (docs/formulas.md).

Real runs here through the trainer (gloo, PP 2 x EP 2 = 4 processes, a 6-layer MoE with 4
experts) beside the same schedules simulated at the report's scale (8 A100s as PP 4 x EP 2, 40
layers, 8 experts, batch 1024 x 2048 tokens), in the report's layout, with DualPipeV's overlap
hook measured on and off side by side, each rank's memory beside the simulator's prediction,
DualPipe and Cut-in-half emulated beside the simulator, and the report's claims checked. Same as ``cutpipe bench moe``; arguments pass
through (e.g. ``--steps 10``, ``--gpu H100``, ``--sim-only``, ``--json``).

    python benchmarks/moe_comparison.py
"""

from __future__ import annotations

import sys

from cutpipe.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe", *sys.argv[1:]]))
