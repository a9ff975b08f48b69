"""Train the example model with any cutpipe schedule under torchrun.

    torchrun --standalone --nproc-per-node 4 examples/torchrun_train.py --schedule dualpipev

Multi-node works the same way (torchrun --nnodes ... --rdzv-endpoint ...): cutpipe only needs the
process group that torchrun's environment gives ``init_process_group``. With ``--backend nccl``
each process uses the GPU of its local rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from cutpipe import generate
from cutpipe.models import mlp
from cutpipe.runtime import PipelineRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = parser.parse_args()

    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    schedule = generate(args.schedule, dist.get_world_size(), args.microbatches)
    model = mlp(blocks=16, width=64, seed=0).to(device)
    runner = PipelineRunner.from_sequential(schedule, model, nn.MSELoss(), loss_reduction="mean")
    parameters = runner.parameters()
    optimizer = torch.optim.SGD(parameters, lr=0.5)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * args.microbatches, 64, generator=generator).to(device)
    y = torch.tanh(x.flip(1))
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = runner.step(x, y)
        optimizer.step()
        if dist.get_rank() == 0:
            print(f"step {step} loss {float(loss):.6f}", flush=True)
    runner.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
