"""Activation recompute on phased MoE stages: exact gradients, one rerun per piece in B, no
all-to-all run again, the F&B overlap kept, less memory.

One process runs the MoE layers through an expert-parallel group of one (``local_experts``: the
same phases, exchanges that copy in place); the EP 2 checks run on 2 gloo processes. Without the
runner, a step runs every microbatch's forward (under ``splitter.deferring`` when the B/W split
is on), then each microbatch's B and W (or its BW), under a ``SavedMeter``.
"""

from __future__ import annotations

import moe_recompute_workers as workers
import pytest
import torch
from dispatch_counts import CountMatmuls
from op_steps import OpSteps
from torch import nn

from cutpipe.launch import run
from cutpipe.models import LanguageModelLoss, language_model
from cutpipe.models.transformer import Layer
from cutpipe.parallel.exchange import AllToAll
from cutpipe.parallel.moe_stage import MoEStage, moe_stages
from cutpipe.parallel.routing import routing_statistics
from cutpipe.runtime.compute.phased import Compute
from cutpipe.runtime.compute.phased_recompute import PhasedRecompute, recompute_pieces
from cutpipe.runtime.compute.recompute import apply_recompute
from cutpipe.runtime.compute.saved import SavedMeter
from cutpipe.sim.costs import RECOMPUTE_MODES
from cutpipe.spec import ModelSpec

SPEC = workers.SPEC
#: the phased twin of tests/test_recompute.py's MoE model, for the activation peaks
MEASURED = ModelSpec(
    name="moe", layers=4, hidden=64, heads=4, ffn=128, vocab=128, seq_len=64, dtype="fp32",
    experts=4, top_k=2, shared_experts=1, dense_layers=1, kv_heads=2,
)  # fmt: skip
MODES = RECOMPUTE_MODES


def whole_stage(spec: ModelSpec, seed: int = 4) -> MoEStage:
    """The whole model as one phased stage (embedding to head), experts in a group of one."""
    model = workers.local_experts(language_model(spec, seed=seed))
    return moe_stages(model, 1, [0])[0]


def batches(spec: ModelSpec, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = workers.tokens(spec, count * spec.microbatch_size)
    return list(zip(x.chunk(count), y.chunk(count), strict=True))


class Exchanges:
    """Counts the exchanges ``AllToAll`` starts (dispatch and combine, either way) while the
    monkeypatch holds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        own = AllToAll._launch

        def counted(exchange, *args):
            self.count += 1
            return own(exchange, *args)

        monkeypatch.setattr(AllToAll, "_launch", counted)


class TapeMeter(SavedMeter):
    """A ``SavedMeter`` that also counts what a phased stage's tape holds without autograd
    saving it (piece outputs, the rows an exchange sent or delivered), until it is freed."""

    def hold(self, tensors: tuple) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self._pack(tensor)


class Step(OpSteps):
    """One step of a phased stage, op by op, under a ``SavedMeter`` (``tape``: a ``TapeMeter``);
    counts each piece's runs."""

    def __init__(self, stage: MoEStage, mode: str, split: bool, data, tape: bool = False) -> None:
        inputs = [tensor for batch in data for tensor in batch]
        meter = (TapeMeter if tape else SavedMeter)(exclude=[*stage.parameters(), *inputs])
        self.pieces = workers.PieceCalls([stage], meter.hold if tape else None)
        self.recompute = apply_recompute(stage, mode, units=Layer)
        super().__init__(stage, meter, split)
        self.stage = stage

    def enter(self, kind: str) -> None:
        self.pieces.phase = kind

    def gradients_by_name(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.stage.named_parameters() if p.grad is not None}


def linear_weights(module: nn.Module) -> list[nn.Parameter]:
    return [m.weight for m in module.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("split", [True, False], ids=["split", "bw"])
@pytest.mark.parametrize("mode", MODES)
def test_gradients_are_exact_each_piece_reruns_once_in_b_and_no_exchange_again(
    mode, split, monkeypatch
):
    data = batches(SPEC, 2)
    plain = Step(whole_stage(SPEC), "none", split, data)
    plain.run(data)
    exchanges = Exchanges(monkeypatch)
    step = Step(whole_stage(SPEC), mode, split, data)
    assert step.stage.phased
    for microbatch, (tokens, targets) in enumerate(data):
        step.forward(microbatch, tokens, targets)
    weights = linear_weights(step.stage)
    for microbatch in range(len(data)):
        before = [None if w.grad is None else w.grad.clone() for w in weights]
        step.backward(microbatch)
        if split:  # the B left every linear's weight gradient to the W
            for weight, old in zip(weights, before, strict=True):
                assert weight.grad is None if old is None else torch.equal(weight.grad, old)
        step.weight(microbatch)
    ours, theirs = step.gradients_by_name(), plain.gradients_by_name()
    assert workers.identical(ours, theirs)  # bit for bit: the rerun rebuilds the same values
    reference = language_model(SPEC, seed=4)  # the model without expert parallelism
    for tokens, targets in data:
        LanguageModelLoss()(reference(tokens), targets).backward()
    theirs = {n: p.grad for n, p in reference.named_parameters()}
    assert workers.relative_error(ours, theirs) <= 1e-6
    pieces = [p.name for p in step.stage.program if isinstance(p, Compute)]
    reruns = 0 if mode == "none" else len(data)
    for piece in pieces:
        assert step.pieces.calls[(0, piece, "F")] == len(data)
        assert step.pieces.calls[(0, piece, "B")] == reruns  # one rerun per microbatch, in B
        assert step.pieces.calls[(0, piece, "W")] == 0  # the W reruns nothing
    layers = SPEC.layers - SPEC.dense_layers  # each: dispatch and combine, each way
    assert exchanges.count == len(data) * layers * 2 * 2
    assert step.meter.current == 0  # every saved or kept byte was let go
    # the routing is counted once per microbatch, not again by the rerun
    counted = routing_statistics(step.stage).layers
    assert len(counted) == layers
    assert all(layer.microbatches == len(data) for layer in counted.values())
    assert counted == routing_statistics(plain.stage).layers


def peaks(
    split: bool, spec: ModelSpec = MEASURED, microbatches: int = 4, tape: bool = False
) -> dict[str, tuple[int, int]]:
    """Per mode, a step of one phased stage (the whole model; forwards, then each microbatch's
    B and W): (the bytes the first F left, the peak). ``tape``: with what the tape holds."""
    data, found = batches(spec, microbatches), {}
    for mode in MODES:
        step = Step(whole_stage(spec), mode, split, data, tape)
        step.run(data)
        first = next(op for op in step.meter.ops if op.kind == "F")
        found[mode] = (first.after - first.before, step.meter.peak)
    return found


def table() -> None:
    """The table of docs/moe.md ("Activation recompute"): saved bytes, then with the tape."""
    print(
        "| mode | kept by F per microbatch | peak with the B/W split | peak with full backwards |"
    )
    print("|---|---|---|---|")
    counted = {tape: (peaks(True, tape=tape), peaks(False, tape=tape)) for tape in (False, True)}
    for mode in MODES:
        cells = [
            " / ".join(f"{counted[tape][column][mode][part]:,}" for tape in (False, True))
            for column, part in ((1, 0), (0, 1), (1, 1))
        ]
        print(f"| {mode} | {' | '.join(cells)} |")


@pytest.mark.parametrize("split", [True, False], ids=["split", "bw"])
def test_recompute_lowers_the_activation_peak_of_a_phased_stage(split):
    for tape in (False, True):
        found = peaks(split, SPEC, 2, tape)
        kept = {mode: first for mode, (first, _) in found.items()}
        peak = {mode: high for mode, (_, high) in found.items()}
        assert 2 * kept["full"] < kept["none"]  # a forward leaves much less
        assert peak["full"] < peak["selective"] < peak["none"]


def test_selective_rerun_replays_the_matmuls_and_full_runs_them_again():
    (tokens, targets), counted = batches(SPEC, 1)[0], {}
    for mode in MODES:
        stage = whole_stage(SPEC)
        apply_recompute(stage, mode)
        loss = LanguageModelLoss()(stage(tokens), targets)
        with CountMatmuls() as matmuls:
            loss.backward()
        counted[mode] = matmuls.count
    assert counted["selective"] == counted["none"]
    assert counted["full"] > counted["none"]


def test_inference_runs_the_pieces_plainly():
    stage, (tokens, _) = whole_stage(SPEC), batches(SPEC, 1)[0]
    with torch.no_grad():
        expected = stage(tokens)
    apply_recompute(stage, "full")
    with torch.no_grad():
        for ours, theirs in zip(stage(tokens), expected, strict=True):
            assert torch.equal(ours, theirs)


def test_pieces_are_the_units_of_a_phased_stage_and_close_gives_them_back():
    stage = whole_stage(SPEC)
    program = list(stage.program)
    recompute = apply_recompute(stage, "selective", units=Layer)
    assert isinstance(recompute, PhasedRecompute)
    assert recompute.units == []  # no layer's forward is wrapped: a piece holds parts of two
    assert recompute.pieces == [p.name for p in program if isinstance(p, Compute)]
    assert recompute.pieces[:2] == ["embedding+layer+route2", "experts2"]
    with pytest.raises(ValueError, match="close\\(\\) the Recompute"):
        apply_recompute(stage, "full")
    recompute.close()
    assert stage.program == program
    layers = [m for m in stage.modules() if isinstance(m, Layer)]
    inner = apply_recompute(layers[0], "full", units=Layer)
    with pytest.raises(ValueError, match="a Layer inside MoEStage is recomputed already"):
        apply_recompute(stage, "full")
    inner.close()
    with pytest.raises(ValueError, match="recomputes 'selective' or 'full', not 'none'"):
        recompute_pieces(stage, "none")
    assert apply_recompute(stage, "none").units == []
    assert stage.program == program


def test_an_moe_stage_without_expert_parallelism_recomputes_its_layers():
    """No exchanges: the stage runs its blocks one after the other, so its layers are the
    units, as in any stage (the trainer's ``units=Layer`` call works for both)."""
    stage = moe_stages(language_model(SPEC, seed=4), 1, [0])[0]
    assert not stage.phased
    recompute = apply_recompute(stage, "full", units=Layer)
    assert not isinstance(recompute, PhasedRecompute)
    assert recompute.units == [m for m in stage.modules() if isinstance(m, Layer)]
    tokens, targets = batches(SPEC, 1)[0]
    LanguageModelLoss()(stage(tokens), targets).backward()  # a layer's rerun routes again
    counted = routing_statistics(stage).layers.values()
    assert [layer.microbatches for layer in counted] == [1] * (SPEC.layers - SPEC.dense_layers)
    recompute.close()


CASES = [("dualpipev", True), ("dualpipev", False), ("zbv", False)]


@pytest.mark.parametrize(("name", "overlap"), CASES)
def test_the_runner_overlaps_recomputed_pairs_with_exact_gradients(name, overlap, monkeypatch):
    """DualPipeV on one rank: F&B pairs through the overlap hook, a last B then W; ZB-V: B then
    W for every microbatch. Recompute changes no gradient bit and no exchange."""
    microbatches, x_y = 4, workers.tokens(SPEC, 4 * SPEC.microbatch_size)
    runs = {}
    for mode in MODES:
        exchanges = Exchanges(monkeypatch)
        model = workers.local_experts(language_model(SPEC, seed=4))
        runs[mode] = workers.pipeline_step(model, mode, name, overlap, *x_y, microbatches)
        runs[mode]["exchanges"] = exchanges.count
        monkeypatch.undo()
    plain = runs["none"]
    for mode, result in runs.items():
        assert result["loss"] == plain["loss"], mode
        assert workers.identical(result["grads"], plain["grads"]), mode
        assert result["exchanges"] == plain["exchanges"], mode  # no all-to-all runs again
        for (stage, piece, _), calls in result["pieces"].items():
            runs_per_microbatch = 1 if mode == "none" else 2  # the forward, one rerun in B
            assert calls == runs_per_microbatch * microbatches, (mode, stage, piece)
        pairs = name == "dualpipev" and overlap
        assert (workers.interleaved(result["trace"]) > 0) == pairs, mode


@pytest.mark.timeout(240)
def test_expert_parallel_2_recompute_is_exact_and_runs_no_all_to_all_again():
    ranks = run(workers.ep_two, 2, (CASES, 4), timeout=220)
    for rank in ranks:
        assert rank["hook"] == dict.fromkeys(MODES, True)  # the hook on and off: the same bits
        for result in rank["results"]:
            case = result["case"]
            assert result["loss"] == result["plain_loss"], case
            assert result["identical"], case
            assert result["reference_error"] <= 1e-6, case
            assert result["all_to_alls"] == result["plain_all_to_alls"], case
            for key, calls in result["pieces"].items():
                expected = result["plain_pieces"][key] * (1 if result["mode"] == "none" else 2)
                assert calls == expected, (case, key)
            if "dualpipev overlap=True" in case:
                assert result["interleaved"] > 0, case
