"""Measure a model's items on this machine: what ``cutpipe profile`` runs.

``profile_model`` builds one embedding, one dense layer and/or one MoE layer, and the head of the model
(``cutpipe.models.transformer``), and for each runs what the runtime runs: a forward with its
``nn.Linear`` layers deferring their weight gradients (``WeightSplitter``), the input-gradient
backward, then the deferred weight gradients. It times each phase (median of ``repeats``, after
``warmup`` rounds), adds up the bytes of the tensors autograd saves (the activation memory F
leaves live until B, parameters excluded) and of the tensors kept for W, and counts parameters.
Activations measured in one dtype are scaled to the model's (a CPU profile runs in fp32 for a
bf16 model).

It sits above the models, the runtime and the planner (it builds the first, runs what the second
runs and returns the third's torch-free ``Profile``), so that the planner never imports torch.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from cutpipe.models.transformer import Embedding, Head, LanguageModelLoss, Layer
from cutpipe.plan.costs.model import ItemCost, gpu, model_items
from cutpipe.plan.costs.profile import DTYPES, Profile
from cutpipe.runtime.compute.deferral import WeightGradients, WeightSplitter
from cutpipe.spec import DTYPE_BYTES, ModelSpec

TORCH_DTYPES = dict(zip(DTYPES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _storages(tensors, exclude: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors``, leaving out those in ``exclude``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in exclude:
            seen[pointer] = storage.nbytes()
    return sum(seen.values())


def _measure_item(
    name: str, module: torch.nn.Module, make_inputs: Callable[[], tuple], finish: Callable,
    device: torch.device, repeats: int, warmup: int,
) -> tuple[ItemCost, float]:  # fmt: skip
    """Time F, B, W of ``module`` and weigh its activations; also the fraction kept for W."""
    splitter = WeightSplitter(module)
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    saved_bytes = kept_bytes = 0
    for round_ in range(warmup + repeats):
        inputs = make_inputs()
        gradients = WeightGradients()
        gradients.defer = True
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor, saved: list[torch.Tensor] = saved) -> torch.Tensor:
            saved.append(tensor)  # autograd keeps it until B: activation memory
            return tensor

        _synchronize(device)
        start = time.perf_counter()
        with (
            splitter.deferring(gradients),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            outputs, seeds = finish(module(*inputs))
        _synchronize(device)
        forward_end = time.perf_counter()
        torch.autograd.backward(outputs, seeds)
        _synchronize(device)
        backward_end = time.perf_counter()
        kept = [t for entry in gradients.pending for t in entry[2:]]
        kept_now = _storages(kept, parameters)
        gradients.run()
        _synchronize(device)
        weight_end = time.perf_counter()
        if round_ >= warmup:
            times["F"].append(forward_end - start)
            times["B"].append(backward_end - forward_end)
            times["W"].append(weight_end - backward_end)
            saved_bytes = _storages(saved, parameters)
            kept_bytes = kept_now
        module.zero_grad(set_to_none=True)
    splitter.close()
    experts = getattr(getattr(module, "mlp", None), "experts", None)
    item = ItemCost(
        name=name,
        forward=statistics.median(times["F"]),
        backward=statistics.median(times["B"]),
        weight=statistics.median(times["W"]),
        activation=float(saved_bytes),
        parameters=float(sum(p.numel() for p in module.parameters())),
        expert_parameters=float(sum(p.numel() for p in experts.parameters())) if experts else 0.0,
    )
    return item, (kept_bytes / saved_bytes if saved_bytes else 0.0)


def _free_bytes(device: torch.device) -> float:
    """Memory this process could still allocate on ``device``."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_fits(model: ModelSpec, device: str = "cpu", dtype: str | None = None) -> None:
    """A ValueError, before anything is built, if one of each item of ``model`` (what
    ``profile_model`` holds at once) cannot fit in the memory ``device`` has free.

    The estimate: parameters, their gradients and the deferred weight gradients of every kind
    of item, plus twice the largest activation, in the dtype the measurement runs in.
    """
    target = torch.device(device)
    name = dtype or ("fp32" if target.type == "cpu" else model.dtype)
    size = DTYPE_BYTES.get(name, 4)
    items = model_items(model, gpu("A100"))  # sizes only: the hardware does not matter
    kinds = {"embedding": items[0], "head": items[-1]}
    for item in items[1:-1]:
        kinds.setdefault("moe_layer" if item.expert_parameters else "dense_layer", item)
    scale = size / model.element_bytes
    need = 3 * size * sum(i.parameters for i in kinds.values()) + 2 * scale * max(
        i.activation for i in kinds.values()
    )
    free = _free_bytes(target)
    if need > 0.8 * free:
        raise ValueError(
            f"profiling {model.name} builds one of each of its items ({', '.join(kinds)}) on "
            f"{target}, which needs about {need / 1e9:.1f} GB; {free / 1e9:.1f} GB are free: "
            "profile on a device with more memory, or a smaller model"
        )


def profile_model(
    model: ModelSpec, device: str = "cpu", dtype: str | None = None, repeats: int = 3,
    warmup: int = 1, seed: int = 0,
) -> Profile:  # fmt: skip
    """Measure ``model``'s items on ``device`` (``dtype`` default: fp32 on CPU, the model's on GPU)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    target = torch.device(device)
    name = dtype or ("fp32" if target.type == "cpu" else model.dtype)
    if name not in DTYPES:
        raise ValueError(f"cannot profile in {name!r}: use one of {', '.join(DTYPES)}")
    torch_dtype = TORCH_DTYPES[name]
    generator = torch.Generator().manual_seed(seed)
    shape = (model.microbatch_size, model.seq_len)

    def hidden() -> tuple:
        x = torch.randn(*shape, model.hidden, generator=generator).to(target, torch_dtype)
        return x.requires_grad_(), torch.zeros((), device=target)

    def tokens() -> tuple:
        return (torch.randint(model.vocab, shape, generator=generator).to(target),)

    def through(result) -> tuple:  # a stage in the middle: its gradients come from the next
        live = [t for t in result if t.requires_grad]
        return live, [torch.randn_like(t) if t.dim() else torch.ones_like(t) for t in live]

    targets = torch.randint(model.vocab, shape, generator=generator).to(target)
    loss = LanguageModelLoss()

    def last(result) -> tuple:  # the head computes the loss
        return (loss(result, targets),), (None,)

    torch.manual_seed(seed)
    kinds: dict[str, tuple] = {
        "embedding": (Embedding(model), tokens, through),
        "head": (Head(model), hidden, last),
    }
    if not model.moe or model.dense_layers:
        kinds["dense_layer"] = (Layer(model, 0), hidden, through)
    if model.moe:
        kinds["moe_layer"] = (Layer(model, model.dense_layers), hidden, through)
    items, kept = {}, []
    scale = model.element_bytes / torch.tensor([], dtype=torch_dtype).element_size()
    for kind, (module, make_inputs, finish) in kinds.items():
        module = module.to(target, torch_dtype)
        item, fraction = _measure_item(kind, module, make_inputs, finish, target, repeats, warmup)
        items[kind] = replace(item, activation=item.activation * scale)
        if kind.endswith("layer"):
            kept.append(fraction)
    return Profile(model, str(target), name, items, min(1.0, max(kept)))
