"""Phased MoE stages with activation recompute: helpers for one process, and the EP 2 worker
(spawned processes import it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from moe_workers import grad_error, interleaved, reference
from torch import nn

from cutpipe import generate
from cutpipe.models import LanguageModelLoss, language_model
from cutpipe.models.transformer import MoE
from cutpipe.parallel.expert_parallel import ExpertParallel, expert_parameters, shard_experts
from cutpipe.parallel.mesh import build_mesh
from cutpipe.parallel.moe_stage import moe_stages
from cutpipe.runtime import PipelineRunner
from cutpipe.runtime.compute.phased import Compute, PhasedStage
from cutpipe.runtime.compute.recompute import apply_recompute
from cutpipe.sim.costs import RECOMPUTE_MODES
from cutpipe.spec import ModelSpec

#: a dense first layer (its ``Layer.forward`` runs inside the first piece), then MoE layers
SPEC = ModelSpec(
    name="tiny-moe", layers=4, hidden=16, heads=2, ffn=24, vocab=32, seq_len=8,
    microbatch_size=2, experts=4, top_k=2, shared_experts=1, dense_layers=1,
)  # fmt: skip


def local_experts(model: nn.Module) -> nn.Module:
    """Every MoE of ``model`` through an expert-parallel group of one: a phased stage in one
    process, whose exchanges copy the rows in place of sending them."""
    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.expert_parallel = ExpertParallel(None, moe.num_experts)
    return model


def tokens(spec: ModelSpec, batch: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, spec.seq_len)
    return (
        torch.randint(0, spec.vocab, shape, generator=generator),
        torch.randint(0, spec.vocab, shape, generator=generator),
    )


class PieceCalls:
    """Counts each compute piece's runs under ``phase`` (set by the caller): the forward's and
    the recompute reruns. Install before ``apply_recompute``, which then wraps the counting.
    ``seen``, if given, is called in the forward with each piece's inputs and outputs: the
    tensors the stage's tape holds until the backward."""

    def __init__(
        self, stages: list[PhasedStage], seen: Callable[[tuple], None] | None = None
    ) -> None:
        self.phase, self.seen = "F", seen
        self.calls: Counter[tuple[int, str, str]] = Counter()
        for number, stage in enumerate(stages):
            stage.program = [
                Compute(p.name, self._counted(number, p.name, p.fn))
                if isinstance(p, Compute)
                else p
                for p in stage.program
            ]

    def _counted(self, stage: int, name: str, fn: Callable) -> Callable:
        def run(context, *inputs):
            self.calls[(stage, name, self.phase)] += 1
            outputs = fn(context, *inputs)
            if self.seen is not None and self.phase == "F":
                self.seen((*inputs, *outputs))
            return outputs

        return run


class AllToAllCalls:
    """Counts ``torch.distributed.all_to_all_single`` calls (the counts, dispatch and combine
    exchanges) while active."""

    def __init__(self) -> None:
        self.count = 0
        self._own = dist.all_to_all_single

    def __enter__(self) -> AllToAllCalls:
        def counted(*args, **kwargs):
            self.count += 1
            return self._own(*args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *_: object) -> None:
        dist.all_to_all_single = self._own


def pipeline_step(
    model: nn.Module, mode: str, name: str, overlap: bool, x, y, microbatches: int, **runner
) -> dict:
    """One step of schedule ``name`` on one pipeline rank (every stage here), MoE stages
    recomputed in ``mode``: the loss, the gradients by name, piece runs, all-to-all calls."""
    schedule = generate(name, 1, microbatches)
    stages = moe_stages(
        model, schedule.num_stages, schedule.placement.stages_of(0), overlap=overlap
    )
    ordered = [stages[s] for s in sorted(stages)]
    pieces = PieceCalls(ordered)
    recomputes = [apply_recompute(stage, mode, units=type(model.layers[0])) for stage in ordered]
    trace: list = []
    for stage in ordered:
        stage.trace = trace
    runner = PipelineRunner(schedule, stages, LanguageModelLoss(), **runner)
    with AllToAllCalls() as calls:
        loss = runner.step(x, y)
    runner.close()
    for recompute in recomputes:
        recompute.close()
    return {
        "loss": float(loss),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "pieces": dict(pieces.calls),
        "all_to_alls": calls.count,
        "trace": trace,
    }


def relative_error(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == theirs.keys()
    return max(
        float((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max().clamp_min(1e-30))
        for n in ours
    )


def identical(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> bool:
    return ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def ep_two(rank: int, world: int, cases: list[tuple[str, bool]], microbatches: int) -> dict:
    """PP 1 x EP ``world``: every case (schedule, overlap) in every recompute mode, against the
    same case without recompute and against the model without expert parallelism; and per mode,
    whether the hook on and off gave the same gradients bit for bit (``hook``)."""
    mesh = build_mesh(1, world, experts=SPEC.experts, top_k=SPEC.top_k)
    x, y = tokens(SPEC, mesh.replicas * microbatches * SPEC.microbatch_size)
    twin = language_model(SPEC, seed=4)
    reference(twin, x, y, mesh.replicas, microbatches, "sum")
    results, grads = [], {}
    for name, overlap in cases:
        runs = {}
        for mode in RECOMPUTE_MODES:
            model = language_model(SPEC, seed=4)
            names = {id(p): n for n, p in model.named_parameters()}
            shard_experts(model, mesh.ep_group)
            reducer = mesh.gradient_reducer(expert_parameters(model))
            run = pipeline_step(
                model, mode, name, overlap, mesh.shard(x), mesh.shard(y), microbatches,
                group=mesh.pp_group, reducer=reducer, loss_reduction="sum",
            )  # fmt: skip
            run["reference_error"] = grad_error(list(model.parameters()), names, twin)
            runs[mode] = run
        plain = runs["none"]
        for mode, run in runs.items():
            grads[(name, overlap, mode)] = run["grads"]
            results.append(
                {
                    "case": f"{name} overlap={overlap} {mode}",
                    "mode": mode,
                    "loss": run["loss"],
                    "plain_loss": plain["loss"],
                    "identical": identical(run["grads"], plain["grads"]),
                    "grad_error": relative_error(run["grads"], plain["grads"]),
                    "reference_error": run["reference_error"],
                    "pieces": run["pieces"],
                    "plain_pieces": plain["pieces"],
                    "all_to_alls": run["all_to_alls"],
                    "plain_all_to_alls": plain["all_to_alls"],
                    "interleaved": interleaved(run["trace"]),
                }
            )
    hook = {
        mode: identical(grads[("dualpipev", True, mode)], grads[("dualpipev", False, mode)])
        for mode in RECOMPUTE_MODES
        if ("dualpipev", True, mode) in grads and ("dualpipev", False, mode) in grads
    }
    return {"results": results, "hook": hook}
