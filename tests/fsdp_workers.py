"""What the FSDP tests run on every rank of a PP x DP mesh (spawned processes import it)."""

from __future__ import annotations

import copy
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from cutpipe import generate
from cutpipe.models import LanguageModelLoss, language_model, mlp
from cutpipe.parallel.fsdp import FsdpReducer, shard_stages
from cutpipe.runtime import PipelineRunner, even_split
from cutpipe.runtime.stages import cut_module, sequence_blocks
from cutpipe.spec import ModelSpec

WIDTH, PER_MICROBATCH, LR = 16, 3, 1e-3


class Case(NamedTuple):
    schedule: str
    microbatches: int
    model: str = "mlp"  # or "transformer"
    reshard_after_forward: bool = False
    in_runner: bool = True  # the runner drives the reducer (else the worker, after each step)
    per_block: bool = True

    @property
    def name(self) -> str:
        return (
            f"{self.schedule} m={self.microbatches} {self.model} "
            f"reshard_after_forward={self.reshard_after_forward} in_runner={self.in_runner} "
            f"per_block={self.per_block}"
        )


#: a tiny decoder: embedding, 6 layers (norms, attention, gated MLP), head: 8 blocks
TRANSFORMER = ModelSpec(name="tiny", layers=6, hidden=16, heads=2, ffn=24, vocab=32, seq_len=8)


def _model(kind: str) -> tuple[nn.Module, nn.Module]:
    """(model of 8 blocks, loss function): "mlp" (Linear + tanh blocks, fp32) or "transformer"
    (fp64: in fp32 one process alone ends 3 AdamW steps 1e-5 away from the exact parameters,
    Adam dividing rounding noise by small gradients, so only fp64 compares it sharply)."""
    if kind == "mlp":
        return mlp(blocks=8, width=WIDTH, seed=3), nn.MSELoss()
    return language_model(TRANSFORMER, seed=3).double(), LanguageModelLoss()


def _batch(kind: str, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        x = torch.randn(rows, WIDTH, generator=generator)
        return x, torch.randn(rows, WIDTH, generator=generator)
    tokens = torch.randint(
        0, TRANSFORMER.vocab, (rows, TRANSFORMER.seq_len + 1), generator=generator
    )
    return tokens[:, :-1], tokens[:, 1:]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather over DP for a sharded one: every replica calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds now (each storage
    once: FSDP's unsharded parameters are views of one all-gather buffer per group)."""
    tensors: list[torch.Tensor] = []
    for module in modules:
        for parameter in module.parameters():  # unsharded during the step, else the shards
            tensors += [parameter, *([parameter.grad] if parameter.grad is not None else [])]
    for group in optimizer.param_groups:
        for parameter in group["params"]:  # the shards
            tensors += [parameter, *([parameter.grad] if parameter.grad is not None else [])]
            tensors += [v for v in optimizer.state[parameter].values() if v.numel() > 1]
    storages: dict[int, int] = {}
    for tensor in tensors:
        storage = _local(tensor.detach()).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _runner(
    schedule, stages, loss_fn: nn.Module, reducer: FsdpReducer, group, in_runner: bool
) -> PipelineRunner:
    """``in_runner``: the runner reports each stage done the moment its last backward has run
    and finishes before DualPipe's mirror sum (then of the sharded gradients). Otherwise the
    worker reduces after ``step`` (same math, no overlap; DualPipe's copies are then summed
    whole, before the reduce-scatter)."""
    options = {"reducer": reducer} if in_runner else {}
    return PipelineRunner(schedule, stages, loss_fn, group=group, **options)


def _step(
    runner: PipelineRunner,
    reducer: FsdpReducer,
    in_runner: bool,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """One training step; the bytes held before the reduction (0 if the runner reduces)."""
    if in_runner:
        reducer.prefetch()  # the all-gathers start before the first op
    loss = runner.step(x, y)
    during = 0
    if not in_runner:
        during = held_bytes(list(runner.modules.values()), optimizer)
        for stage in sorted(runner.modules):
            reducer.stage_done(stage, list(runner.modules[stage].parameters()))
        reducer.finish()
    return loss, during


def _case(mesh, case: Case, steps: int) -> dict:
    """Train ``steps`` AdamW steps of PP x DP FSDP and of one process on the whole batch."""
    name, m, kind, reshard, in_runner, per_block = case
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    pp_rank, dp_rank, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), mesh["dp"].size()
    schedule = generate(name, mesh["pp"].size(), m)
    model, loss_fn = _model(kind)
    twin = copy.deepcopy(model)
    blocks = sequence_blocks(model)
    stages = cut_module(
        model,
        even_split(len(blocks), schedule.num_stages),
        blocks=blocks,
        held=schedule.placement.stages_of(pp_rank),
    )
    sharded = shard_stages(stages, mesh["dp"], reshard_after_forward=reshard, per_block=per_block)
    if schedule.placement.num_pipes > 1 and pp_rank > 0:
        with torch.no_grad():  # the runner must start DualPipe's copies equal, shard by shard
            for module in sharded.values():
                for parameter in module.parameters():
                    parameter.add_(1.0)
    reducer = FsdpReducer(sharded)
    runner = _runner(schedule, sharded, loss_fn, reducer, pp_group, in_runner)
    optimizer = torch.optim.AdamW(runner.parameters(), lr=LR)
    reference = torch.optim.AdamW(twin.parameters(), lr=LR)
    twins = dict(twin.named_parameters())
    initial = {key: value.detach().clone() for key, value in twins.items()}
    grad_error = param_error = loss_error = 0.0
    during = between = 0
    sharded_params = all(isinstance(p, DTensor) for p in runner.parameters())
    started = time.perf_counter()
    for step in range(steps):
        x, y = _batch(kind, PER_MICROBATCH * m * dp, seed=11 + step)
        optimizer.zero_grad(set_to_none=True)
        loss, held = _step(
            runner, reducer, in_runner, optimizer, x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        )
        during = max(during, held)
        reference.zero_grad(set_to_none=True)
        expected = loss_fn(twin(x), y)
        expected.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        loss_error = max(loss_error, abs(float(mean) / dp - float(expected)) / float(expected))
        named = runner.named_parameters()
        for key, parameter in named.items():
            grad_error = max(grad_error, _relative_error(_full(parameter.grad), twins[key].grad))
        optimizer.step()
        reference.step()
        for key, parameter in named.items():
            param_error = max(param_error, _relative_error(_full(parameter.detach()), twins[key]))
        between = held_bytes(list(runner.modules.values()), optimizer)
    seconds = time.perf_counter() - started
    with torch.no_grad():  # leaves them all-gathered (with reshard_after_forward=False)
        runner.step(x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank])
    reducer.reshard()
    moved = max(_relative_error(twins[key].detach(), value) for key, value in initial.items())
    sharded_after = all(isinstance(p, DTensor) for p in runner.parameters())
    full = sum(p.numel() * p.element_size() for p in runner.named_parameters().values())
    runner.close()
    return {
        "case": case.name,
        "grad_error": grad_error,
        "param_error": param_error,
        "loss_error": loss_error,
        "moved": moved,  # how far the reference's parameters moved in the steps
        "sharded": sharded_params and sharded_after,  # before, and after an evaluation step
        "full_bytes": full,  # this rank's parameters, whole
        "during_bytes": during,  # before the reduction: unsharded parameters and gradients too
        "between_bytes": between,  # after the optimizer step: shards only
        "seconds": seconds,
    }


def training(rank: int, world: int, cases: list[Case], steps: int = 3) -> list[dict]:
    """Each case: PP x DP FSDP training on a ``(pp, dp)`` mesh with DP 2, against one process on
    the whole batch."""
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pp", "dp"))
    return [_case(mesh, case, steps) for case in cases]
