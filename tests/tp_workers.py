"""Functions the tensor-parallel tests run on every rank (spawned processes import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from cutpipe import generate
from cutpipe.models import LanguageModelLoss, language_model
from cutpipe.parallel.tensor_parallel import parallelize_stage, tp_plan
from cutpipe.runtime import PipelineRunner
from cutpipe.runtime.compute.deferral import WeightGradients, WeightSplitter
from cutpipe.spec import ModelSpec

#: a tiny dense decoder: 4 heads, so 2 per TP rank
SPEC = dict(name="t", layers=4, hidden=32, heads=4, ffn=64, vocab=64, seq_len=8)
LR = 1e-3


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, as the other runtime tests measure gradients."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered over its mesh (a collective: every TP rank calls
    it), a plain one as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def batches(spec: ModelSpec, rows: int, steps: int, seed: int) -> list[tuple]:
    """``steps`` batches of (tokens, next-token targets), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(spec.vocab, (rows, spec.seq_len), generator=generator)
        out.append((tokens, tokens.roll(-1, dims=1)))
    return out


class CountedW:
    """While open, counts the weight gradients the W passes compute, and those of DTensors."""

    def __init__(self) -> None:
        self.deferred = self.sharded = 0
        self._run = WeightGradients.run
        counter = self

        def run(gradients: WeightGradients) -> None:
            counter.deferred += len(gradients.pending)
            counter.sharded += sum(isinstance(w, DTensor) for w, *_ in gradients.pending)
            counter._run(gradients)

        WeightGradients.run = run  # type: ignore[method-assign]

    def close(self) -> None:
        WeightGradients.run = self._run  # type: ignore[method-assign]


def _replicas_agree(parameters: list[torch.Tensor], group: dist.ProcessGroup) -> bool:
    """Whether every TP rank holds bit-for-bit the same replicated (plain) parameters."""
    plain = [p.detach().reshape(-1) for p in parameters if not isinstance(p, DTensor)]
    mine = torch.cat(plain)
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(theirs, mine, group=group)
    return all(torch.equal(mine, other) for other in theirs)


def case_name(name: str, m: int, split: bool, kv_heads: int, dtype: str) -> str:
    return f"{name} m={m} split_backward={split} kv_heads={kv_heads} {dtype}"


def pipeline_exactness(
    rank: int, world: int, cases: list[tuple], steps: int = 3, seed: int = 0
) -> list[dict]:
    """PP 2 x TP 2 on a ``("pp", "tp")`` mesh. Per case (schedule, microbatches, split_backward,
    kv_heads, dtype): ``steps`` AdamW steps of the TP-sharded pipeline, and of the unsharded model
    in this process on the same microbatches; the relative errors of the loss, of the gradients
    (each step) and of the parameters after the steps, over this rank's parameters (DTensors as
    full tensors); whether the TP ranks' replicated parameters agree; what the W passes did."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
    results = []
    for name, m, split_backward, kv_heads, dtype in cases:
        spec = ModelSpec(**SPEC, kv_heads=kv_heads)
        kind = getattr(torch, dtype)
        model = parallelize_stage(language_model(spec, seed=seed).to(kind), mesh["tp"])
        twin = language_model(spec, seed=seed).to(kind)
        initial = {k: v.detach().clone() for k, v in twin.named_parameters()}
        counted = CountedW()
        runner = PipelineRunner.from_module(
            generate(name, 2, m), model, LanguageModelLoss(), group=mesh.get_group("pp"),
            split_backward=split_backward,
        )  # fmt: skip
        held = runner.named_parameters()
        twins = dict(twin.named_parameters())
        optimizer = torch.optim.AdamW(held.values(), lr=LR)
        reference = torch.optim.AdamW(twin.parameters(), lr=LR)
        grad_errors: list[float] = []
        loss_error = 0.0
        for tokens, targets in batches(spec, 2 * m, steps, seed + 1):
            optimizer.zero_grad()
            loss = runner.step(tokens, targets)  # every TP rank feeds the same microbatches
            reference.zero_grad()
            expected = 0.0
            for x, y in zip(tokens.chunk(m), targets.chunk(m), strict=True):
                part = LanguageModelLoss()(twin(x), y) / m
                part.backward()
                expected += float(part)
            loss_error = max(loss_error, abs(float(loss) - expected) / abs(expected))
            grad_errors.append(
                max(relative_error(full(p.grad), twins[k].grad) for k, p in held.items())
            )
            optimizer.step()
            reference.step()
        with torch.no_grad():
            parameter_error = max(
                relative_error(full(p.detach()), twins[k].detach()) for k, p in held.items()
            )
            moved = max(relative_error(twins[k].detach(), initial[k]) for k in held)
        results.append(
            {
                "case": case_name(name, m, split_backward, kv_heads, dtype),
                "grad_errors": grad_errors,  # per step
                "parameter_error": parameter_error,  # after the AdamW steps
                "loss_error": loss_error,
                "moved": moved,  # how far the steps moved the reference's parameters
                "sharded": sum(isinstance(p, DTensor) for p in held.values()),
                "plain": sum(not isinstance(p, DTensor) for p in held.values()),
                "replicas_agree": _replicas_agree(list(held.values()), mesh.get_group("tp")),
                "deferred": counted.deferred,  # weight gradients the W passes computed
                "deferred_sharded": counted.sharded,  # of DTensor weights
            }
        )
        counted.close()
        runner.close()
    return results


def tp_only(rank: int, world: int) -> dict:
    """TP alone (no pipeline) on a small MoE model and a dense one: the plan, what is sharded,
    the type of a layer's output, one forward and backward against the unsharded model; then
    what ``parallelize_stage`` says to sizes that do not divide and to a second call."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    spec = ModelSpec(**{**SPEC, "layers": 2}, experts=4, top_k=2, dense_layers=1)
    model = language_model(spec, seed=0)
    plans = [sorted(tp_plan(layer, world)) for layer in model.layers]
    parallelize_stage(model, mesh)
    twin = language_model(spec, seed=0)
    tokens, targets = batches(spec, 4, 1, seed=5)[0]
    hidden, aux = model.embed(tokens)
    boundary = model.layers[0](hidden, aux)
    collectives = _layer_collectives(model.layers[0], hidden.detach(), aux)
    model.zero_grad(set_to_none=True)
    LanguageModelLoss()(model(tokens), targets).backward()
    LanguageModelLoss()(twin(tokens), targets).backward()
    twins = dict(twin.named_parameters())
    named = dict(model.named_parameters())
    said = []
    for wrong in ({"heads": 2, "kv_heads": 1}, {"heads": 1}, {"ffn": 63}):
        try:
            parallelize_stage(language_model(ModelSpec(**{**SPEC, **wrong})), mesh)
        except ValueError as error:
            said.append(str(error))
    try:
        parallelize_stage(model, mesh)
    except ValueError as error:
        said.append(str(error))
    return {
        "plans": plans,
        "sharded": sorted(k for k, p in named.items() if isinstance(p, DTensor)),
        "boundary_types": [type(t).__name__ for t in boundary],
        "local_heads": [
            (layer.attention.heads, layer.attention.kv_heads) for layer in model.layers
        ],
        "grad_error": max(relative_error(full(p.grad), twins[k].grad) for k, p in named.items()),
        "said": said,
        "collectives": collectives,
    }


def _layer_collectives(layer: torch.nn.Module, hidden: torch.Tensor, aux: torch.Tensor) -> dict:
    """The collectives of one layer's F, B and W, with its B/W split deferring."""
    splitter, gradients = WeightSplitter(layer), WeightGradients()
    counts = {}
    with CommDebugMode() as forward, splitter.deferring(gradients):
        out, _ = layer(hidden.requires_grad_(), aux)
    gradients.defer = True
    with CommDebugMode() as backward:
        out.sum().backward()
    deferred = len(gradients)
    with CommDebugMode() as weight:
        gradients.run()
    splitter.close()
    for name, mode in (("F", forward), ("B", backward), ("W", weight)):
        counts[name] = {str(op): n for op, n in mode.get_comm_counts().items()}
    return {**counts, "deferred": deferred}
