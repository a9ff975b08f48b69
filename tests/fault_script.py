"""A small training script with an injected fault, for the tests under ``torch.distributed.run``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fault_script.py FAULT

FAULT: ``none``, ``raise`` (rank 1's stage raises in step 2), ``hang`` (rank 1's stage never
returns in step 2; the watchdog must stop the job), ``mismatch`` (rank 1 builds another schedule),
``between`` (rank 1 raises between steps 1 and 2, as a data loader might).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from cutpipe import generate
from cutpipe.models import mlp
from cutpipe.runtime import PipelineRunner


class Faulty(nn.Module):
    def __init__(self, inner: nn.Module, fault: str) -> None:
        super().__init__()
        self.inner, self.fault, self.calls = inner, fault, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 6:  # the second step's second forward
            if self.fault == "raise":
                raise RuntimeError("injected failure in a stage")
            if self.fault == "hang":
                while True:
                    time.sleep(0.05)
        return self.inner(x)


def main() -> None:
    fault = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = 8 if fault == "mismatch" and rank == 1 else 4
    schedule = generate("1f1b", world, m)
    model = mlp(blocks=2 * world, width=8, seed=0)
    per = len(model) // world
    inner = nn.Sequential(*list(model)[rank * per : (rank + 1) * per])
    stage = Faulty(inner, fault) if rank == 1 else inner
    runner = PipelineRunner(
        schedule, {rank: stage}, nn.MSELoss(), step_timeout=5, heartbeat=0.5, exit_after=5
    )
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for step in range(3):
        if fault == "between" and rank == 1 and step == 1:
            raise ValueError("the data loader broke")
        loss = runner.step(x, y)
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f}", flush=True)
    runner.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
