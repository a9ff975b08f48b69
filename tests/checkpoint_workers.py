"""What the checkpoint tests run on every rank (spawned processes import them), and the toy model
they share with the single-process tests.

Each rank holds some blocks of one unsplit model under the model's own names, as a pipeline rank
does: ``holding(model, names)`` registers the same block objects at their dotted paths. Layouts:
a 4-rank DualPipe (rank r and rank 3-r hold the same two stages), a 2-rank V (two stages each),
4 ranks of another split, one process holding everything.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cutpipe.train.checkpoint import Checkpointer, load, save

WIDTH = 8


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))  # a saved buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x)))) * self.scale


class Toy(nn.Module):
    def __init__(self, blocks: int = 8, width: int = WIDTH, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList(Block(width, hidden) for _ in range(blocks))
        self.head = nn.Linear(width, 3)


def full_model(seed: int, width: int = WIDTH, hidden: int = 16) -> Toy:
    torch.manual_seed(seed)
    return Toy(width=width, hidden=hidden)


def holding(model: nn.Module, names: list[str]) -> nn.Module:
    """A module holding ``model``'s blocks ``names`` under the same dotted paths."""
    root = nn.Module()
    for name in names:
        parent = root
        *path, last = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(last, model.get_submodule(name))
    return root


ALL = ["embed", *[f"layers.{i}" for i in range(8)], "head"]
DUALPIPE = [ALL[0:3], ALL[3:5], ALL[5:7], ALL[7:10]]  # 4 stages; rank r holds r and 3 - r
V = [ALL[0:4], ALL[4:6], ALL[6:8], ALL[8:10]]  # 4 stages; rank r of 2 holds r and 3 - r
OTHER = [ALL[0:2], ALL[2:5], ALL[5:8], ALL[8:10]]  # 4 stages, one per rank


def names_of(layout: str, rank: int) -> list[str]:
    if layout == "dualpipe":
        return DUALPIPE[rank] + DUALPIPE[3 - rank]
    if layout == "v":
        return V[rank] + V[3 - rank]
    if layout == "other":
        return OTHER[rank]
    return list(ALL)


def optimizer_for(module: nn.Module) -> torch.optim.AdamW:
    """AdamW with two groups (no weight decay for vectors), as training code does."""
    matrices = [p for p in module.parameters() if p.dim() >= 2]
    vectors = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, foreach=False)


def scheduler_for(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=8)


def build(layout: str, rank: int, seed: int, width: int = WIDTH, hidden: int = 16):
    """This rank's module, optimizer and scheduler (the whole model is built, then cut)."""
    module = holding(full_model(seed, width, hidden), names_of(layout, rank))
    optimizer = optimizer_for(module)
    return module, optimizer, scheduler_for(optimizer)


def train(module: nn.Module, optimizer, scheduler, steps: range) -> None:
    """A toy loss per held block, on data that depends on the block, the step and both global
    random generators: two ranks holding the same blocks take the same steps, and a resumed run
    takes the same steps only if its RNG states were restored."""
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for index, name in enumerate(ALL):
            try:
                block = module.get_submodule(name)
            except AttributeError:
                continue
            generator = torch.Generator().manual_seed(100 * step + index + random.randrange(7))
            width = (block if isinstance(block, nn.Linear) else block.up).in_features
            x = torch.randn(5, width, generator=generator)
            x = x * (torch.rand(5, width) > 0.2)  # dropout from the global generator
            loss = loss + block(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()


def snapshot(module: nn.Module, optimizer, scheduler) -> dict:
    """Everything a checkpoint should carry, keyed by FQN, as plain tensors and values."""
    names = {id(p): name for name, p in module.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    groups = {
        names[id(p)]: {k: v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
        for p in group["params"]
    }
    model = {k: v.clone() for k, v in module.state_dict().items()}
    return {"model": model, "optim": state, "groups": groups, "scheduler": scheduler.state_dict()}


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


# -- multi-process workers -------------------------------------------------------------------------


def save_dualpipe(rank: int, world: int, directory: str, truth: str) -> dict:
    """Train 3 steps in the DualPipe layout, checkpoint in the background, record the truth."""
    seed_everything(0)
    module, optimizer, scheduler = build("dualpipe", rank, seed=0)
    train(module, optimizer, scheduler, range(3))
    with Checkpointer(directory) as checkpoints:
        checkpoints.save(3, module, optimizer, scheduler, {"position": 3, "epoch": 0})
        checkpoints.wait()
    torch.save(snapshot(module, optimizer, scheduler), Path(truth) / f"rank{rank}.pt")
    return {"stall": checkpoints.stall}


def load_layout(rank: int, world: int, directory: str, layout: str, out: str) -> dict:
    """Load into a fresh model of ``layout`` (another seed: every value must come from disk),
    record what was loaded, and save it again synchronously (for the size comparison)."""
    seed_everything(1)
    module, optimizer, scheduler = build(layout, rank, seed=1)
    restored = load(directory, module, optimizer, scheduler)
    torch.save(snapshot(module, optimizer, scheduler), Path(out) / f"rank{rank}.pt")
    save(Path(out) / "again", restored.step, module, optimizer, scheduler, restored.extra)
    return {
        "step": restored.step,
        "extra": restored.extra,
        "rng": restored.rng_restored,
        "notes": list(restored.notes),
    }


def save_then_load(
    rank: int, world: int, directory: str, truth: str, layout: str, out: str
) -> dict:
    """``save_dualpipe``, then, once every rank has saved, ``load_layout``: one launch."""
    save_dualpipe(rank, world, directory, truth)
    dist.barrier()
    return load_layout(rank, world, directory, layout, out)


def resume(rank: int, world: int, directory: str) -> dict:
    """Six steps straight, against three steps, a checkpoint, a fresh process state (other
    seeds, other weights), a load and three more steps: the same bits at the end."""
    seed_everything(5)
    module, optimizer, scheduler = build("v", rank, seed=5)
    train(module, optimizer, scheduler, range(6))
    straight = snapshot(module, optimizer, scheduler)

    seed_everything(5)
    module, optimizer, scheduler = build("v", rank, seed=5)
    train(module, optimizer, scheduler, range(3))
    with Checkpointer(directory, keep=1) as checkpoints:
        checkpoints.save(3, module, optimizer, scheduler, {"position": 3})
    del module, optimizer, scheduler
    seed_everything(99)
    module, optimizer, scheduler = build("v", rank, seed=99)
    restored = load(directory, module, optimizer, scheduler)
    train(module, optimizer, scheduler, range(restored.extra["position"], 6))
    resumed = snapshot(module, optimizer, scheduler)
    mismatched = [
        k for k, v in straight["model"].items() if not torch.equal(v, resumed["model"][k])
    ]
    for name, state in straight["optim"].items():
        mismatched += [
            f"{name}.{k}" for k, v in state.items() if not torch.equal(v, resumed["optim"][name][k])
        ]
    return {
        "mismatched": mismatched,
        "scheduler": straight["scheduler"] == resumed["scheduler"],
        "rng": restored.rng_restored,
        "extra": restored.extra,
    }


class Crashing(Checkpointer):
    """Rank 0 dies at one point of completing the checkpoint of ``step``."""

    def __init__(self, directory: str, step: int, where: str) -> None:
        super().__init__(directory)
        self.crash_step, self.where = step, where

    def _crash(self, where: str, folder: Path) -> None:
        if self.where == where and folder.name.endswith(f"{self.crash_step:06d}"):
            os._exit(3)

    def _mark(self, folder, manifest) -> None:
        self._crash("before-mark", folder)
        super()._mark(folder, manifest)

    def _point(self, folder) -> None:
        self._crash("before-pointer", folder)
        super()._point(folder)


def crash(rank: int, world: int, directory: str, where: str) -> None:
    """A complete checkpoint at step 2, then a crash while checkpointing step 4: rank 0 before
    the mark or before the pointer (every rank's part written), or rank 1 as the save begins."""
    seed_everything(0)
    module, optimizer, scheduler = build("v", rank, seed=0)
    checkpoints = Crashing(directory, 4, where)
    train(module, optimizer, scheduler, range(2))
    checkpoints.save(2, module, optimizer, scheduler, {"position": 2})
    checkpoints.wait()
    train(module, optimizer, scheduler, range(2, 4))
    if where == "rank-dies" and rank == 1:
        os._exit(3)
    checkpoints.save(4, module, optimizer, scheduler, {"position": 4})
    checkpoints.wait()
    dist.barrier()


def stall(rank: int, world: int, directory: str, width: int, repeats: int) -> dict:
    """Seconds ``save`` blocks the training loop, asynchronous against synchronous, for a
    DualPipe layout of a model with blocks of ``width``."""
    module, optimizer, scheduler = build("dualpipe", rank, seed=0, width=width, hidden=4 * width)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # builds the optimizer state
    figures = {}
    for asynchronous in (True, False):
        kind = "async" if asynchronous else "sync"
        times = []
        with Checkpointer(Path(directory) / kind, keep=1, asynchronous=asynchronous) as checkpoints:
            for step in range(1, repeats + 1):
                dist.barrier()  # every rank starts together: a late peer's delay is not the save's
                checkpoints.save(step, module, optimizer, scheduler, {"position": step})
                times.append(checkpoints.stall)
                checkpoints.wait()  # the next save starts from a finished one: stall alone
        figures[kind] = sorted(times)[len(times) // 2]
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    return {**figures, "bytes": size * 3}  # parameters and AdamW's two moments


def four_ranks(
    rank: int, world: int, saved: tuple[str, str, str, str], stalled: tuple[str, int, int]
) -> dict:
    """The 4-rank launches in one: ``save_then_load`` with ``saved``, then ``stall`` with
    ``stalled``."""
    loaded = save_then_load(rank, world, *saved)
    dist.barrier()
    return {"loaded": loaded, "stall": stall(rank, world, *stalled)}
