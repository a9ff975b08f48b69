"""MoE routing one can watch and steer, in one process: statistics, the balancing bias, capacity.

The phased stage runs here with an expert-parallel group of one (``ExpertParallel(None, E)``):
every exchange is a local copy, but the plan, the dispatch (counted under a capacity), the
experts and the combine are the multi-rank code's own (tests/test_moe.py runs them on gloo).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from cutpipe.models import LanguageModelLoss, RoutingOptions, language_model
from cutpipe.models.router import over_capacity
from cutpipe.models.transformer import MoE
from cutpipe.parallel import (
    moe_stages,
    reset_routing_statistics,
    routing_statistics,
    update_routing_bias,
)
from cutpipe.parallel.exchange import CountedAllToAll, all_to_all
from cutpipe.parallel.expert_parallel import ExpertParallel, moe_layers
from cutpipe.spec import ModelSpec

SPEC = ModelSpec(
    name="routing", layers=3, hidden=16, heads=2, ffn=24, vocab=32, seq_len=8,
    microbatch_size=4, experts=4, top_k=2, shared_experts=1,
)  # fmt: skip


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (SPEC.microbatch_size, SPEC.seq_len)
    return (
        torch.randint(0, SPEC.vocab, shape, generator=generator),
        torch.randint(0, SPEC.vocab, shape, generator=generator),
    )


def phased(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as one phased stage, its MoE layers on an expert-parallel group of one."""
    for moe in moe_layers(model):
        moe.expert_parallel = ExpertParallel(None, moe.num_experts)
    return moe_stages(model, 1, [0])[0]


def hand_routing(moe: MoE, tokens: torch.Tensor) -> tuple[list[int], int]:
    """(choices per expert, choices over capacity), counted one token at a time."""
    with torch.no_grad():
        probabilities = moe.router(tokens).softmax(-1).tolist()
    load = [0] * moe.num_experts
    picks = []  # (expert, -probability, token, slot): the order capacity keeps them in
    for token, row in enumerate(probabilities):
        best = sorted(range(len(row)), key=lambda e: -row[e])[: moe.top_k]
        for slot, expert in enumerate(best):
            load[expert] += 1
            picks.append((expert, -row[expert], token, slot))
    limit = moe.capacity(len(probabilities))
    if limit is None:
        return load, 0
    return load, sum(max(0, n - limit) for n in load)


# -- statistics --------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [None, 1.0])
def test_statistics_count_what_a_hand_count_of_the_router_gives(factor):
    torch.manual_seed(0)
    moe = MoE(16, 24, experts=4, top_k=2, routing=RoutingOptions(capacity_factor=factor))
    tokens = [torch.randn(24, 16), torch.randn(24, 16)]
    balances = [moe(t.view(2, 12, 16))[1] for t in tokens]
    stats = routing_statistics(moe).layers[""]
    hands = [hand_routing(moe, t) for t in tokens]
    load = [sum(counts) for counts in zip(*(hand[0] for hand in hands), strict=True)]
    assert stats.microbatches == 2
    assert list(stats.load) == load and sum(load) == 2 * 24 * 2
    assert stats.dropped == sum(hand[1] for hand in hands)
    assert (stats.dropped > 0) == (factor is not None)
    assert stats.balance_loss == pytest.approx(float(sum(balances).detach()), rel=1e-6)
    assert stats.max_load == max(load) and stats.mean_load == sum(load) / 4
    assert stats.imbalance == pytest.approx(max(load) / (sum(load) / 4))


def test_statistics_are_kept_for_training_forwards_only_and_start_again_on_reset():
    model = language_model(SPEC, seed=0)
    x, _ = batch()
    with torch.no_grad():
        model(x)
    assert all(layer.microbatches == 0 for layer in routing_statistics(model).layers.values())
    model(x)
    model(x)
    read = routing_statistics(model, reset=True)
    assert set(read.layers) == {"layers.0.mlp", "layers.1.mlp", "layers.2.mlp"}
    assert all(layer.microbatches == 2 for layer in read.layers.values())
    assert all(sum(layer.load) == 2 * SPEC.tokens * 2 for layer in read.layers.values())
    assert all(layer.microbatches == 0 for layer in routing_statistics(model).layers.values())
    model(x)
    reset_routing_statistics(model)
    assert routing_statistics(model).layers["layers.1.mlp"].load == (0, 0, 0, 0)
    assert "max/mean load" in read.summary()


@pytest.mark.parametrize("factor", [None, 0.75])
def test_the_phased_stage_and_the_plain_model_report_the_same(factor):
    routing = RoutingOptions(capacity_factor=factor)
    plain = language_model(SPEC, seed=0, routing=routing)
    stage = phased(language_model(SPEC, seed=0, routing=routing))
    for seed in (1, 2):
        x, y = batch(seed)
        LanguageModelLoss()(plain(x), y).backward()
        LanguageModelLoss()(stage(x), y).backward()
    ours, theirs = routing_statistics(plain), routing_statistics({0: stage})
    assert ours == theirs and set(ours.layers) == {"layers.0.mlp", "layers.1.mlp", "layers.2.mlp"}
    assert (sum(layer.dropped for layer in ours.layers.values()) > 0) == (factor is not None)


def test_statistics_refuse_what_is_not_a_module():
    with pytest.raises(TypeError, match="expected modules .* got a str"):
        routing_statistics(["layers"])
    with pytest.raises(TypeError, match="reduce must be a process group"):
        routing_statistics(MoE(8, 8, 4, 2), reduce=3)
    with pytest.raises(ValueError, match="two MoE layers are named 'layers.0.mlp': pass the"):
        routing_statistics([language_model(SPEC), language_model(SPEC)])


# -- the balancing bias ------------------------------------------------------------------------


def train(model: torch.nn.Module, steps: int, rate: float | None) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = LanguageModelLoss()(model(x), y)
        loss.backward()
        optimizer.step()
        if rate is not None:
            update_routing_bias(model, rate)
        losses.append(loss.detach())
    return losses


def test_a_bias_at_rate_0_changes_nothing_bitwise():
    plain = language_model(SPEC, seed=0)
    biased = language_model(SPEC, seed=0, routing=RoutingOptions(bias=True))
    assert [torch.equal(a, b) for a, b in zip(train(plain, 3, None), train(biased, 3, 0.0),
                                              strict=True)] == [True] * 3  # fmt: skip
    for (name, a), b in zip(plain.named_parameters(), biased.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert all(not moe.routing_bias.any() for moe in moe_layers(biased))
    assert "layers.0.mlp.routing_bias" in biased.state_dict()
    assert not any("routing_bias" in key for key in plain.state_dict())


def test_the_bias_moves_a_skewed_router_toward_balance():
    torch.manual_seed(0)
    moe = MoE(16, 8, experts=4, top_k=1, routing=RoutingOptions(bias=True))
    tokens = torch.randn(256, 16)
    tokens[:, 0] = 1.0
    with torch.no_grad():
        moe.router.weight[0, 0] = 3.0  # every token prefers expert 0 by far
    imbalance = []
    for _ in range(150):
        moe(tokens.unsqueeze(0))
        imbalance.append(routing_statistics(moe, reset=True).layers[""].imbalance)
        update_routing_bias(moe, rate=0.005)
    assert imbalance[0] == 4.0  # every token on expert 0
    assert max(imbalance[-10:]) < 1.25
    assert moe.routing_bias[0] < 0 < moe.routing_bias[1:].min()
    weights = moe.route(tokens)[1]
    assert torch.equal(weights, torch.ones_like(weights))  # top-1: p / p, the bias is not in it


def test_the_bias_update_says_what_is_wrong():
    with pytest.raises(ValueError, match="rate must be a number >= 0, got -0.1"):
        update_routing_bias(MoE(8, 8, 4, 2, routing=RoutingOptions(bias=True)), -0.1)
    with pytest.raises(ValueError, match=r"no MoE layer here has a routing bias: build"):
        update_routing_bias(MoE(8, 8, 4, 2), 0.001)
    update_routing_bias(MoE(8, 8, 4, 2), 0.0)  # nothing to move, nothing asked
    update_routing_bias(torch.nn.Linear(2, 2), 0.001)  # a stage without MoE layers


# -- capacity ----------------------------------------------------------------------------------


def test_capacity_keeps_each_experts_highest_scores_then_the_earliest():
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    scores = torch.tensor([[0.5, 0.2], [0.6, 0.3], [0.5, 0.1], [0.9, 0.5]])
    dropped = over_capacity(chosen, scores, limit=2)
    # expert 0: 0.6 (token 1) and the earliest 0.5 (token 0) stay; token 2's and 3's 0.5 go
    # expert 1: 0.9 and 0.2 stay, 0.1 goes
    assert dropped.tolist() == [[False, False], [False, False], [True, True], [False, True]]


def test_no_capacity_drops_nothing():
    plain = language_model(SPEC, seed=0)
    x, y = batch()
    LanguageModelLoss()(plain(x), y).backward()
    assert all(layer.dropped == 0 for layer in routing_statistics(plain).layers.values())
    assert all(moe.capacity(SPEC.tokens) is None for moe in moe_layers(plain))


def test_a_capacity_that_drops_gives_the_plain_model_and_the_phased_stage_the_same_outputs():
    routing = RoutingOptions(capacity_factor=0.75)
    plain = language_model(SPEC, seed=0, routing=routing)
    stage = phased(copy.deepcopy(plain))
    names = [phase.name for phase in stage.program]
    assert "dispatch1" in names and not any(name.startswith("counts") for name in names)
    x, y = batch()
    ours, theirs = plain(x), stage(x)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    LanguageModelLoss()(ours, y).backward()
    LanguageModelLoss()(theirs, y).backward()
    for (name, a), b in zip(plain.named_parameters(), stage.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7), name
    stats = routing_statistics(plain).layers
    limit = math.ceil(0.75 * SPEC.tokens * SPEC.top_k / SPEC.experts)
    for layer in stats.values():
        assert layer.dropped == sum(max(0, n - limit) for n in layer.load) > 0


def test_a_plan_refuses_choices_over_the_capacity_it_is_given():
    chosen = torch.tensor([[0, 1], [0, 2], [0, 3], [4, 1]])  # 4: a dropped choice
    route = ExpertParallel(None, 4).plan(chosen, capacity=3)
    assert route.send_splits == [7] and route.tokens.tolist() == [0, 1, 2, 0, 3, 1, 2]
    with pytest.raises(ValueError, match="an expert has 3 rows, over the capacity of 2: plan"):
        ExpertParallel(None, 4).plan(chosen, capacity=2)


def test_routing_options_say_what_to_change():
    with pytest.raises(ValueError, match=r"capacity_factor must be a number > 0 \(or None"):
        RoutingOptions(capacity_factor=0)
    with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
        RoutingOptions(capacity_factor=float("nan"))
    with pytest.raises(ValueError, match="bias must be True or False, got 'yes'"):
        RoutingOptions(bias="yes")


# -- the counted dispatch -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_counted_all_to_all_delivers_its_rows_and_counts_and_sends_gradients_back(dtype):
    counts = torch.tensor([[300, 0, 7]])  # one peer (this rank), three parts; 300 > bf16's 256
    rows = torch.randn(307, 4).to(dtype).requires_grad_()
    exchange = CountedAllToAll(None, counts, capacity=300)
    received = all_to_all(rows, exchange)
    assert torch.equal(received, rows) and torch.equal(exchange.received_counts, counts)
    received.sum().backward()
    assert torch.equal(rows.grad, torch.ones_like(rows))
    with pytest.raises(ValueError, match="more than a counted dispatch carries"):
        CountedAllToAll(None, counts, capacity=256**3)
