"""The optimizer step of pipelined training (cutpipe.train.optim): decay groups, warm-up + cosine,
clipping over the whole pipeline and gradient accumulation, and 20 steps of pipelined training on
2 and 4 gloo ranks that follow one process training the unsplit model."""

from __future__ import annotations

import copy
import functools
import itertools
import math

import optim_workers as workers
import pytest
import torch
from torch import nn

from cutpipe import generate
from cutpipe.launch import run
from cutpipe.runtime import PipelineRunner, even_split
from cutpipe.runtime.clipping import clip_grad_norm, mirror_copies
from cutpipe.train.optim import (
    WarmupCosine,
    accumulate,
    build_optimizer,
    decay_groups,
    decays,
    warmup_cosine,
)

SCHEDULES = ["dualpipe", "dualpipev", "zbv", "1f1b"]
M = 8  # valid for every schedule on 2 and 4 ranks
STEPS = 20  # 5 of warm-up, then the whole cosine


# -- decay groups and the optimizer -------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)  # an embedding whose name does not say so
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(()))
        self.frozen = nn.Parameter(torch.ones(4, 4), requires_grad=False)


def _names(group: dict, source) -> set[str]:
    named = dict(source)
    ids = {id(p) for p in group["params"]}
    return {name for name, p in named.items() if id(p) in ids}


def test_matrices_decay_and_vectors_scalars_and_embeddings_do_not():
    assert decays("layers.0.proj.weight", torch.zeros(4, 4))
    assert decays("conv.weight", torch.zeros(2, 3, 3, 3))
    assert not decays("layers.0.proj.bias", torch.zeros(4))
    assert not decays("norm.weight", torch.zeros(4))
    assert not decays("scale", torch.zeros(()))
    assert not decays("tok_embeddings.weight", torch.zeros(10, 4))
    assert not decays("Embed.weight", torch.zeros(10, 4))
    assert not decays("table.weight", torch.zeros(10, 4), embedding=True)


def test_decay_groups_from_modules_know_embeddings_by_type():
    block = Block()
    decay, rest = decay_groups(block, 0.1)
    assert (decay["name"], decay["weight_decay"]) == ("decay", 0.1)
    assert (rest["name"], rest["weight_decay"]) == ("no_decay", 0.0)
    assert _names(decay, block.named_parameters()) == {"proj.weight"}
    assert _names(rest, block.named_parameters()) == {
        "table.weight", "norm.weight", "norm.bias", "proj.bias", "gain",
    }  # fmt: skip
    # by name alone the embedding's matrix is a matrix: modules are the surer source
    decay, _ = decay_groups(block.named_parameters(), 0.1)
    assert _names(decay, block.named_parameters()) == {"proj.weight", "table.weight"}


def test_decay_groups_of_stage_modules_take_each_parameter_once():
    shared = nn.Linear(4, 4)
    stages = {1: nn.Sequential(shared, nn.Tanh()), 0: nn.Sequential(nn.Linear(4, 4), shared)}
    decay, rest = decay_groups(stages, 0.01)
    assert len(decay["params"]) == 2 and len(rest["params"]) == 2
    assert decay["params"][0] is stages[0][0].weight  # stage order, as runner.parameters()
    empty = decay_groups({0: nn.Tanh()}, 0.01)
    assert [g["params"] for g in empty] == [[], []]  # a stage without parameters: same layout


def test_build_optimizer_is_adamw_with_the_two_groups():
    block = Block()
    optimizer = build_optimizer(block, 3e-4, 0.05, betas=(0.8, 0.9), eps=1e-6)
    assert isinstance(optimizer, torch.optim.AdamW)
    decay, rest = optimizer.param_groups
    assert (decay["weight_decay"], rest["weight_decay"]) == (0.05, 0.0)
    assert decay["lr"] == rest["lr"] == 3e-4
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "lr must be"),
        ({"lr": float("nan")}, "lr must be"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"betas": (0.9, 1.0)}, "betas must be"),
        ({"eps": 0.0}, "eps must be"),
    ],
)
def test_build_optimizer_says_which_setting_is_wrong(kwargs, message):
    settings = {"lr": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=message):
        build_optimizer(Block(), **settings)


def test_build_optimizer_rejects_what_is_not_parameters():
    with pytest.raises(TypeError, match="named_parameters"):
        build_optimizer([torch.zeros(2)], 1e-3)
    with pytest.raises(TypeError, match="stage1 must be a torch.nn.Module"):
        build_optimizer({1: "layer"}, 1e-3)


# -- warm-up and cosine --------------------------------------------------------------------------


def _lrs(warmup: int, total: int, ratio: float, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = warmup_cosine(optimizer, warmup, total, ratio)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_warmup_rises_linearly_from_the_first_step_then_cosine_falls_to_the_floor():
    lrs = _lrs(4, 12, 0.1, 15)
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])  # the first step already moves
    assert lrs[4] == pytest.approx(2.0)  # the cosine starts at the peak
    assert lrs[8] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # halfway down
    assert all(a > b for a, b in itertools.pairwise(lrs[4:13]))
    assert lrs[12:] == pytest.approx([0.2] * 3)  # the floor, held after total_steps


def test_warmup_cosine_edges():
    assert _lrs(0, 4, 0.0, 5) == pytest.approx([2.0, 2.0 * (0.5 + 0.5 * math.cos(math.pi / 4)), 1.0,
                                                2.0 * (0.5 - 0.5 * math.cos(math.pi / 4)), 0.0])  # fmt: skip
    assert _lrs(3, 3, 0.5, 5) == pytest.approx([2 / 3, 4 / 3, 2.0, 1.0, 1.0])
    assert WarmupCosine(2, 10, 0.0)(10**6) == 0.0


def test_warmup_cosine_state_survives_a_state_dict():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_cosine(optimizer, 3, 10, 0.2)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    fresh_optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = warmup_cosine(fresh_optimizer, 1, 2, 0.0)
    fresh.load_state_dict(state)
    assert fresh.lr_lambdas[0] == WarmupCosine(3, 10, 0.2)
    assert fresh.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize(
    ("warmup", "total", "ratio", "message"),
    [
        (11, 10, 0.0, r"warmup_steps \(11\) must not exceed total_steps \(10\)"),
        (-1, 10, 0.0, "warmup_steps must be an int >= 0"),
        (0, 0, 0.0, "total_steps must be an int >= 1"),
        (2.5, 10, 0.0, "warmup_steps must be an int"),
        (True, 10, 0.0, "warmup_steps must be an int"),
        (1, 10, 1.5, r"min_lr_ratio is a share of the lr in \[0, 1\]"),
    ],
)
def test_warmup_cosine_errors(warmup, total, ratio, message):
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=message):
        warmup_cosine(optimizer, warmup, total, ratio)


# -- clipping on one process ---------------------------------------------------------------------


def _twins(scale: float = 1.0, poison: float | None = None) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 3))
    net[3].requires_grad_(False)  # parameters without gradients are left alone
    (net(torch.randn(4, 5)).pow(2).sum() * scale).backward()
    if poison is not None:
        net[0].weight.grad[0, 0] = poison
    twin = copy.deepcopy(net)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    return net, twin


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clip_grad_norm_on_one_process_is_torchs(norm_type, max_norm):
    net, twin = _twins()
    ours = clip_grad_norm(net.parameters(), max_norm, norm_type=norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm, norm_type=norm_type)
    assert torch.equal(ours, theirs)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_norm_is_handled_as_torch_does(poison):
    net, twin = _twins(poison=poison)
    ours = clip_grad_norm(net.parameters(), 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    assert torch.equal(ours, theirs) or (ours.isnan() and theirs.isnan())
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        if p.grad is not None:
            assert torch.equal(p.grad.isnan(), q.grad.isnan())
    net, _ = _twins(poison=poison)
    before = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    with pytest.raises(RuntimeError, match="error_if_nonfinite=False"):
        clip_grad_norm(net.parameters(), 1.0, error_if_nonfinite=True)
    after = [p.grad for p in net.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) or a.isnan().any() for a, b in zip(after, before, strict=True))


def test_clip_grad_norm_errors_say_what_to_pass():
    net, _ = _twins()
    with pytest.raises(ValueError, match="max_norm must be"):
        clip_grad_norm(net.parameters(), -1.0)
    with pytest.raises(ValueError, match="copies is how many ranks"):
        clip_grad_norm(net.parameters(), 1.0, copies=0)
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        clip_grad_norm(net.parameters(), 1.0, norm_type=0)
    with pytest.raises(ValueError, match="pass the pipeline's process group, or copies=1"):
        clip_grad_norm(net.parameters(), 1.0, copies=2)


@pytest.mark.parametrize(
    ("name", "ranks", "copies"),
    [("dualpipe", 4, 2), ("dualpipe", 2, 2), ("dualpipev", 4, 1), ("zbv", 2, 1), ("1f1b", 4, 1),
     ("interleaved", 2, 1)],
)  # fmt: skip
def test_mirror_copies_counts_the_ranks_that_store_each_stage(name, ranks, copies):
    assert mirror_copies(generate(name, ranks, 8)) == copies


def test_mirror_copies_wants_a_schedule():
    with pytest.raises(TypeError, match="cutpipe Schedule"):
        mirror_copies("dualpipe")


# -- accumulation on one process -----------------------------------------------------------------


def test_accumulating_halves_equals_one_step_on_the_whole_batch_on_one_rank():
    schedule = generate("1f1b", 1, 4)
    x, y = workers.data(0, 4, 2 * workers.PER_MICROBATCH)
    grads = {}
    for mode in ("halves", "whole"):
        runner = PipelineRunner.from_sequential(schedule, workers.model(), nn.MSELoss())
        for p in runner.parameters():
            p.grad = torch.full_like(p, 7.0)  # leftovers: accumulate starts from none
        if mode == "halves":
            loss = accumulate(runner, [(x[:8], y[:8]), (x[8:], y[8:])])
        else:
            for p in runner.parameters():
                p.grad = None
            loss = runner.step(x, y)
        grads[mode] = (float(loss), [p.grad for p in runner.parameters()])
        runner.close()
    assert grads["halves"][0] == pytest.approx(grads["whole"][0], rel=1e-6)
    for a, b in zip(grads["halves"][1], grads["whole"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_accumulate_with_summed_losses_sums_the_batches():
    schedule = generate("1f1b", 1, 2)
    x, y = workers.data(1, 2)
    runner = PipelineRunner.from_sequential(
        schedule, workers.model(), nn.MSELoss(), loss_reduction="sum"
    )
    once = float(runner.step(x, y))
    single = [p.grad.clone() for p in runner.parameters()]
    twice = float(accumulate(runner, [(x, y), (x, y)]))
    assert twice == pytest.approx(2 * once, rel=1e-6)
    for p, g in zip(runner.parameters(), single, strict=True):
        torch.testing.assert_close(p.grad, 2 * g)
    runner.close()


def test_accumulate_errors():
    runner = PipelineRunner.from_sequential(generate("1f1b", 1, 2), workers.model(), nn.MSELoss())
    with pytest.raises(ValueError, match="at least one"):
        accumulate(runner, [])
    with pytest.raises(TypeError, match=r"\(inputs, targets\) pairs"):
        accumulate(runner, [torch.zeros(4, 16)])
    with torch.no_grad(), pytest.raises(ValueError, match="grad enabled"):
        accumulate(runner, [workers.data(0, 2)])
    runner.close()


# -- pipelined training against one process ------------------------------------------------------


@functools.cache
def _reference(m: int, steps: int) -> dict:
    return workers.reference(m, steps)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_pipelined_training_follows_one_process(world, request):
    """20 steps of AdamW with decay, warm-up + cosine and clipping that bites on most steps:
    every schedule's loss and pre-clip norm at every step, its final parameters on every rank
    (both DualPipe copies), and three norms of one more gradient match the unsplit model's."""
    expected = _reference(M, STEPS)
    assert sum(n > workers.SETTINGS["max_norm"] for n in expected["norms"]) >= 0.8 * STEPS
    if world == 2:  # from the launch of the two-rank checks below
        ranks = [rank["training"] for rank in request.getfixturevalue("two_ranks")]
    else:
        ranks = run(workers.training, world, (SCHEDULES, M, STEPS), timeout=360)
    layers = expected["layers"]
    for results in ranks:
        for result in results:
            case = result["case"]
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5), case
            assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5), case
            assert result["final_norms"] == pytest.approx(expected["final_norms"], rel=1e-5), case
            schedule = generate(result["name"], world, M)
            sizes = even_split(len(layers), schedule.num_stages)
            for stage, parameters in result["stages"].items():
                first = sum(sizes[:stage])
                wanted = [p for layer in layers[first : first + sizes[stage]] for p in layer]
                for got, want in zip(parameters, wanted, strict=True):
                    assert _relative(torch.tensor(got), want) <= 1e-5, (case, stage)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """The two-rank checks below and the two-rank pipelined training above, from one launch."""
    return run(workers.two_ranks, 2, (SCHEDULES, 4, 3, (M, STEPS)), timeout=360)


@pytest.mark.timeout(300)
def test_accumulating_two_batches_equals_one_step_on_both_on_every_schedule(two_ranks):
    """Three optimizer steps, each over two accumulated half batches, against three on the whole
    batches: DualPipe's copy sums must not count an earlier step's gradients twice."""
    for rank in two_ranks:
        for result in rank["accumulation"]:
            case = result["case"]
            assert result["clipped"] >= 1, case
            for key in ("loss_error", "norm_error", "grad_error", "param_error"):
                assert result[key] <= 1e-5, (case, key, result[key])


@pytest.mark.timeout(300)
def test_clipping_over_ranks_counts_copies_once_and_agrees_on_non_finite_norms(two_ranks):
    norm = math.sqrt(2 * 25 + 4 * 1 + 4 * 4)  # both ranks' gradients as one vector
    for rank, outcome in enumerate(ranks["clipping"] for ranks in two_ranks):
        assert outcome["copies"] == pytest.approx(5.0, rel=1e-6)
        assert outcome["norm"] == pytest.approx(norm, rel=1e-6)
        scale = 1.0 / (norm + 1e-6)
        assert outcome["clipped"][0] == pytest.approx([3 * scale, 0.0, 4 * scale], rel=1e-6)
        assert outcome["clipped"][1] == pytest.approx([(rank + 1) * scale] * 4, rel=1e-6)
        for poison in ("nan", "inf"):
            for norm_type in ("2.0", "inf"):
                key = f"{poison} {norm_type}"
                value = outcome[key]
                assert math.isnan(value) if poison == "nan" else value == math.inf, key
                assert outcome[key + " raised"], key


@pytest.mark.timeout(300)
def test_clipping_counts_dtensor_shards_once(two_ranks):
    """FSDP's gradients are DTensor shards over DP: their squares are summed over the shards,
    replicated DTensors and plain tensors counted once, and the local shards scaled."""
    norm = math.sqrt(3**2 + 4**2 + 2 * 1 + 2 * 4)
    scale = 1.0 / (norm + 1e-6)
    for rank, outcome in enumerate(ranks["clipping"] for ranks in two_ranks):
        assert outcome["sharded"] == pytest.approx(norm, rel=1e-6)
        assert outcome["sharded inf"] == pytest.approx(4.0)
        shard = [3 * scale, 0.0] if rank == 0 else [4 * scale]  # 3 rows on 2 ranks: 2 and 1
        assert outcome["sharded clipped"][0] == pytest.approx(shard, rel=1e-6)
        assert outcome["sharded clipped"][1] == pytest.approx([scale, scale], rel=1e-6)
        assert outcome["sharded clipped"][2] == pytest.approx([2 * scale, 2 * scale], rel=1e-6)
