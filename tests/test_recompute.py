"""Activation recompute with the B/W split: exact gradients, deferred Ws, one rerun, less memory.

Single process, fp32. A step runs every microbatch's forward (under ``splitter.deferring`` when
the B/W split is on), then each microbatch's B and W (or its BW), the way a pipeline's first
stage does in warm-up and cooldown, under a ``SavedMeter``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dispatch_counts import CountMatmuls
from op_steps import OpSteps
from torch import nn

from cutpipe.models.transformer import Embedding, Head, LanguageModelLoss, Layer
from cutpipe.plan.costs.model import w_memory
from cutpipe.runtime.compute.deferral import WeightGradients, WeightSplitter
from cutpipe.runtime.compute.recompute import apply_recompute, recompute_units
from cutpipe.runtime.compute.saved import SavedMeter, slot_bytes
from cutpipe.runtime.stages import Chain
from cutpipe.sim.costs import RECOMPUTE_MODES
from cutpipe.spec import ModelSpec

DENSE = ModelSpec(
    name="dense", layers=4, hidden=64, heads=4, ffn=256, vocab=128, seq_len=64, dtype="fp32"
)
MOE = ModelSpec(
    name="moe", layers=4, hidden=64, heads=4, ffn=128, vocab=128, seq_len=64, dtype="fp32",
    experts=4, top_k=2, shared_experts=1, dense_layers=1, kv_heads=2,
)  # fmt: skip
MODES = RECOMPUTE_MODES


def transformer(spec: ModelSpec) -> Chain:
    torch.manual_seed(0)
    return Chain(Embedding(spec), *(Layer(spec, i) for i in range(spec.layers)), Head(spec))


def batches(spec: ModelSpec, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    shape = (spec.microbatch_size, spec.seq_len)
    return [
        (
            torch.randint(0, spec.vocab, shape, generator=generator),
            torch.randint(0, spec.vocab, shape, generator=generator),
        )
        for _ in range(count)
    ]


class Step(OpSteps):
    """One step of a stage holding the whole model, op by op, counting each layer's forwards."""

    def __init__(self, model: nn.Module, split: bool, data: list[tuple[torch.Tensor, ...]]) -> None:
        inputs = [tensor for batch in data for tensor in batch]  # held by the caller throughout
        super().__init__(model, SavedMeter(exclude=[*model.parameters(), *inputs]), split)
        self.model = model
        self.phase = "F"
        self.forwards: dict[tuple[int, str], int] = {}
        layers = [m for m in model.modules() if isinstance(m, Layer)]
        for index, layer in enumerate(layers):  # attention_norm runs once per run of its layer
            layer.attention_norm.register_forward_pre_hook(self._counter(index))

    def enter(self, kind: str) -> None:
        self.phase = kind

    def _counter(self, index: int):
        def count(*_: object) -> None:
            key = (index, self.phase)
            self.forwards[key] = self.forwards.get(key, 0) + 1

        return count


def reference_gradients(spec: ModelSpec, data) -> list[torch.Tensor]:
    model, loss_fn = transformer(spec), LanguageModelLoss()
    for tokens, targets in data:
        loss_fn(model(tokens), targets).backward()
    return [p.grad for p in model.parameters()]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("split", [True, False], ids=["split", "bw"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
def test_gradients_are_plain_autograds_and_each_layer_reruns_once_in_b(spec, mode, split):
    data = batches(spec, 2)
    model = transformer(spec)
    apply_recompute(model, mode, units=Layer)
    step = Step(model, split, data)
    for microbatch, (tokens, targets) in enumerate(data):
        step.forward(microbatch, tokens, targets)
    weights = linear_weights(model)
    for microbatch in range(len(data)):
        before = [None if w.grad is None else w.grad.clone() for w in weights]
        step.backward(microbatch)
        if split:  # the B left every linear's weight gradient to the W and did the rest
            for weight, old in zip(weights, before, strict=True):
                assert weight.grad is None if old is None else torch.equal(weight.grad, old)
            assert all(p.grad is not None for n, p in model.named_parameters() if "norm" in n)
        step.weight(microbatch)
        assert all(w.grad is not None for w in weights)
    for ours, theirs in zip(model.parameters(), reference_gradients(spec, data), strict=True):
        assert relative(ours.grad, theirs) <= 1e-6
    reruns = 0 if mode == "none" else len(data)
    for layer in range(spec.layers):
        assert step.forwards.get((layer, "F"), 0) == len(data)
        assert step.forwards.get((layer, "B"), 0) == reruns  # one rerun per microbatch, in B
        assert step.forwards.get((layer, "W"), 0) == 0  # the W reruns nothing
    assert step.meter.current == 0  # every saved or kept byte was let go


def peaks(split: bool) -> dict[str, int]:
    data, found = batches(DENSE, 4), {}
    for mode in MODES:
        model = transformer(DENSE)
        apply_recompute(model, mode, units=Layer)
        step = Step(model, split, data)
        step.run(data)
        found[mode] = step.meter.peak
    return found


@pytest.mark.parametrize("split", [True, False], ids=["split", "bw"])
def test_full_recompute_halves_the_activation_peak_and_selective_lies_between(split):
    found = peaks(split)
    assert 2 * found["full"] <= found["none"]
    assert found["full"] < found["selective"] < found["none"]


def test_selective_rerun_replays_the_matmuls_and_full_runs_them_again():
    (tokens, targets), counted = batches(DENSE, 1)[0], {}
    for mode in MODES:
        model = transformer(DENSE)
        apply_recompute(model, mode, units=Layer)
        loss = LanguageModelLoss()(model(tokens), targets)
        with CountMatmuls() as matmuls:
            loss.backward()
        counted[mode] = matmuls.count
    per_layer = 6  # q, kv, o, gate, up, down
    assert counted["selective"] == counted["none"]
    assert counted["full"] == counted["none"] + DENSE.layers * (per_layer - 1)  # stops before down


def test_w_share_against_the_cost_model():
    """Without recompute the measured share of a microbatch's activation its W keeps is near the
    cost model's ``w_memory``; with full recompute the W keeps more than the forward left."""
    shares = {}
    for mode in ("none", "full"):
        model = transformer(DENSE)
        apply_recompute(model, mode, units=Layer)
        data = batches(DENSE, 2)
        step = Step(model, True, data)
        step.run(data)
        slots = slot_bytes(step.meter.ops)
        assert sorted(slots) == [(0, 0), (0, 1)]
        for slot in slots.values():
            assert slot.b_frees + slot.w_frees == slot.activation
        shares[mode] = slots[(0, 0)].w_share
    assert abs(shares["none"] - w_memory(DENSE)) < 0.1
    assert shares["full"] > 1


def test_a_rerun_inside_another_forward_defers_into_its_own_microbatch():
    """An overlap hook may run microbatch 0's B in the middle of microbatch 1's forward."""
    (tokens, targets), loss_fn = batches(DENSE, 1)[0], LanguageModelLoss()
    model = transformer(DENSE)
    splitter = WeightSplitter(model)
    apply_recompute(model, "full", units=Layer)
    first, second = WeightGradients(), WeightGradients()
    with splitter.deferring(first):
        loss = loss_fn(model(tokens), targets)
    first.defer = True
    with splitter.deferring(second):
        loss.backward()
        assert splitter.current is second
    assert splitter.current is None
    assert len(second) == 0 and len(first) == len(linear_weights(model))
    first.run()
    for ours, theirs in zip(
        model.parameters(), reference_gradients(DENSE, [(tokens, targets)]), strict=True
    ):
        assert relative(ours.grad, theirs) <= 1e-6


def test_default_units_are_the_blocks_a_stage_runs_in_turn():
    model = transformer(DENSE)
    assert recompute_units(model) == list(model)  # embedding, every layer, head
    wrapped = Chain(model[0], nn.Sequential(*model[1:-1]), model[-1])
    assert recompute_units(wrapped) == list(model)  # a container of layers is looked through
    assert recompute_units(wrapped, units=Layer) == list(model[1:-1])
    named = nn.Module()  # embed, layers (a ModuleList), head: Hugging Face style names
    named.embed, named.layers, named.head = model[0], nn.ModuleList(model[1:-1]), model[-1]
    assert recompute_units(named) == list(model)
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
    assert recompute_units(blocks) == list(blocks)  # a block of lone ops is one unit
    assert recompute_units(nn.Sequential(nn.Linear(8, 8), nn.Tanh())) == []


class Shifted(nn.Module):
    """Adds to a linear's output in place, after the matmul that a selective unit keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x)
        hidden.add_(1.0)
        return self.b(torch.tanh(hidden))


@pytest.mark.parametrize("split", [True, False], ids=["split", "bw"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_blocks_that_change_a_matmul_output_in_place(mode, split):
    """Selective must run that matmul again rather than replay its changed output."""
    torch.manual_seed(3)
    blocks = nn.Sequential(Shifted(), Shifted(), Shifted())
    reference, inputs = copy.deepcopy(blocks), torch.randn(2, 5, 16)
    reference(inputs).square().sum().backward()
    splitter = WeightSplitter(blocks) if split else None
    assert len(apply_recompute(blocks, mode).units) == 3
    gradients = WeightGradients() if split else None
    if splitter is None:
        loss = blocks(inputs).square().sum()
    else:
        with splitter.deferring(gradients):
            loss = blocks(inputs).square().sum()
        gradients.defer = True
    loss.backward()
    if gradients is not None:
        gradients.run()
    for ours, theirs in zip(blocks.parameters(), reference.parameters(), strict=True):
        assert relative(ours.grad, theirs.grad) <= 1e-6


class Fickle(nn.Module):
    """Runs a different op depending on a flag flipped between its forward and its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4))
        self.flag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y.tanh() if self.flag else y.sigmoid().exp()


def test_a_rerun_that_runs_other_ops_is_refused_with_what_to_change():
    fickle = nn.Sequential(Fickle())
    apply_recompute(fickle, "full")
    loss = fickle(torch.randn(3, 4)).sum()
    fickle[0].flag = True
    with pytest.raises(RuntimeError, match="must run the same ops every time"):
        loss.backward()


def test_modes_units_and_close():
    model = transformer(DENSE)
    with pytest.raises(ValueError, match="choose one of none, selective, full"):
        apply_recompute(model, "some")
    with pytest.raises(ValueError, match="pass units= the class of its layers"):
        apply_recompute(model, "full", units=nn.GRU)
    recompute = apply_recompute(model, "full", units=Layer)
    assert recompute.units == list(model[1:-1])
    with pytest.raises(ValueError, match="close\\(\\) the Recompute"):
        apply_recompute(model, "selective", units=Layer)
    recompute.close()
    assert all("forward" not in layer.__dict__ for layer in model[1:-1])
    assert apply_recompute(model, "none").units == []
