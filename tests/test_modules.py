"""Cutting any module into stages by block names (``cutpipe.runtime.stages``), and
``PipelineRunner.from_module``: every parameter keeps the unsplit model's name."""

from __future__ import annotations

import copy
from itertools import pairwise

import module_workers as workers
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from module_workers import DENSE, MOE, Tower
from torch import nn

from cutpipe import generate
from cutpipe.launch import run
from cutpipe.models import LanguageModelLoss, language_model, mlp
from cutpipe.runtime import PipelineRunner
from cutpipe.runtime.stages import Chain, Stage, cut_module, default_blocks

LAYERS = [f"layers.{i}" for i in range(DENSE.layers)]
SPLITS = [None, ["layers.0"], ["layers.2", "layers.5", "head"], [1, 6, 1], [2, 2, 2, 2]]


def run_stages(stages: dict[int, nn.Module], *inputs):
    value = inputs
    for stage in sorted(stages):
        value = stages[stage](*value)
        value = value if isinstance(value, tuple) else (value,)
    return value


def check_names_kept(model: nn.Module, stages: dict[int, Stage]) -> None:
    """The stages' names are the model's, each parameter and state key in exactly one stage."""
    names = [n for stage in stages.values() for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    parameters = dict(model.named_parameters())
    for stage in stages.values():
        assert all(p is parameters[n] for n, p in stage.named_parameters())
    keys = [k for stage in stages.values() for k in stage.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())


def test_a_language_model_has_meaningful_names_and_blocks():
    model = language_model(MOE)
    names = dict(model.named_parameters())
    assert {"embed.table.weight", "layers.3.attention.q.weight", "head.out.weight"} <= set(names)
    assert "layers.1.mlp.experts.2.up.weight" in names and "layers.0.mlp.up.weight" in names
    assert default_blocks(model) == ["embed", *LAYERS, "head"]
    assert len(model) == DENSE.layers + 2 and list(model)[1] is model.layers[0]


@pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_stages_of_a_language_model_keep_its_names_and_compute_it(spec, split):
    model = language_model(spec, seed=1)
    stages = cut_module(model, split, num_stages=None if split else 3)
    check_names_kept(model, stages)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len))
    with torch.no_grad():
        expected = model(tokens)
        got = run_stages(stages, tokens)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class Deep(nn.Module):
    """Runs layers nested two levels down, which only explicit block names reach."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder.inner(x))


DEEP = ["encoder.inner.0", "encoder.inner.1", "encoder.inner.2", "out"]


@pytest.mark.parametrize(
    ("model", "split", "blocks", "groups"),
    [
        (Tower(), None, None, [["stem", "body.0", "body.1"], ["body.2", "body.3", "neck.0"], ["neck.1", "out"]]),
        (Tower(), ["body.1", "neck.1"], None, [["stem", "body.0"], ["body.1", "body.2", "body.3", "neck.0"], ["neck.1", "out"]]),
        (Tower(), [1, 1, 3], ["stem", "body", "neck.0", "neck.1", "out"], [["stem"], ["body"], ["neck.0", "neck.1", "out"]]),
        (Deep(), ["encoder.inner.2"], DEEP, [DEEP[:2], DEEP[2:]]),
    ],
    ids=["even", "names", "counts", "deep"],
)  # fmt: skip
def test_stages_of_a_users_nested_module_keep_its_names(model, split, blocks, groups):
    stages = cut_module(model, split, blocks=blocks, num_stages=3 if split is None else None)
    assert [list(stage.block_names) for stage in stages.values()] == groups
    check_names_kept(model, stages)
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(run_stages(stages, x)[0], model(x))


@settings(max_examples=40)
@given(st.sets(st.integers(1, 7)))
def test_any_cut_of_a_users_module_keeps_its_names_and_output(starts):
    model = Tower(seed=3)
    blocks = default_blocks(model)
    by_name = cut_module(model, [blocks[i] for i in sorted(starts)])
    counts = [b - a for a, b in pairwise([0, *sorted(starts), len(blocks)])]
    by_count = cut_module(model, counts)
    assert [s.block_names for s in by_name.values()] == [s.block_names for s in by_count.values()]
    assert len(by_name) == len(starts) + 1
    check_names_kept(model, by_name)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(run_stages(by_name, x)[0], model(x))


def test_from_sequential_keeps_the_sequentials_names():
    model = mlp(blocks=6, width=4)
    runner = PipelineRunner.from_sequential(generate("dualpipev", 1, 2), model, nn.MSELoss())
    assert set(runner.state_dict()) == set(model.state_dict())
    assert runner.modules[1].block_names == ("3", "4", "5")
    assert "3.0.weight" in runner.named_parameters()
    language = language_model(DENSE)  # a sequence of its blocks, as it was as a Chain
    runner = PipelineRunner.from_sequential(generate("dualpipev", 1, 2), language)
    assert runner.modules[1].block_names == ("layers.3", "layers.4", "layers.5", "head")
    assert set(runner.state_dict()) == set(language.state_dict())
    with pytest.raises(ValueError, match="6 blocks cannot fill 8 stages"):
        PipelineRunner.from_sequential(generate("zbv", 4, 8), model)


def test_from_module_on_one_rank_trains_like_the_model():
    model = language_model(MOE, seed=4)
    twin = copy.deepcopy(model)
    schedule = generate("dualpipev", 1, 2)
    runner = PipelineRunner.from_module(schedule, model, LanguageModelLoss(), split=["layers.3"])
    assert runner.modules[0].block_names == ("embed", "layers.0", "layers.1", "layers.2")
    x, y = workers.batch("moe", 4)
    loss = float(runner.step(x, y))
    assert loss == pytest.approx(workers.reference(twin, LanguageModelLoss(), x, y, 2), rel=1e-6)
    twins = dict(twin.named_parameters())
    named = runner.named_parameters()
    assert set(named) == set(twins)
    assert max(workers.relative_error(p.grad, twins[n].grad) for n, p in named.items()) < 1e-6
    twin.load_state_dict(runner.state_dict())  # strict: every key, no other


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (2, [("zbv", 4, "dense", None), ("dualpipe", 4, "moe", [5, 3]),
             ("dualpipev", 3, "tower", ["body.1", "body.3", "out"])]),
        (4, [("zbv", 8, "moe", None), ("dualpipe", 5, "dense", ["layers.0", "layers.2", "layers.5"]),
             ("dualpipev", 8, "tower", None)]),
    ],
)  # fmt: skip
def test_from_module_matches_the_single_process_reference_by_name(world, cases):
    ranks = run(workers.exactness, world, (cases,), timeout=200)
    for index, case in enumerate(cases):
        results = [by_rank[index] for by_rank in ranks]
        for result in results:
            label = result["case"]
            assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), label
            assert result["grad_error"] <= 1e-6, label
            assert result["same_objects"] and result["state_equal"], label
        expected_names, expected_keys = results[0]["all_names"], results[0]["all_state_keys"]
        assert sorted({n for r in results for n in r["names"]}) == expected_names, case
        assert sorted({k for r in results for k in r["state_keys"]}) == expected_keys, case


class Loose(nn.Module):
    """A parameter of its own, outside every block."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(2, 2), nn.Linear(2, 2)
        self.bias = nn.Parameter(torch.zeros(2))


def tied() -> nn.Module:
    model = language_model(DENSE)
    model.head.out.weight = model.embed.table.weight
    return model


@pytest.mark.parametrize(
    ("model", "options", "error", "message"),
    [
        (language_model(DENSE), {"split": ["layers.9"]}, ValueError, r"split point 'layers.9' is not a block"),
        (language_model(DENSE), {"split": ["embed"]}, ValueError, r"'embed' is the first block: stage 0 would be empty"),
        (language_model(DENSE), {"split": ["layers.2", "layers.2"]}, ValueError, r"'layers.2' is given twice"),
        (language_model(DENSE), {"split": ["layers.3", "layers.1"]}, ValueError, r"'layers.1' comes before 'layers.3'"),
        (language_model(DENSE), {"split": [3, 3]}, ValueError, r"split \[3, 3\] must give every stage at least one block and 8"),
        (language_model(DENSE), {"split": [0, 8]}, ValueError, r"at least one block"),
        (language_model(DENSE), {"split": ["layers.2", 3]}, TypeError, r"all block names .* or all block counts"),
        (language_model(DENSE), {"split": "layers.2"}, TypeError, r"got the string 'layers.2': write \['layers.2'\]"),
        (language_model(DENSE), {"num_stages": 9}, ValueError, r"8 blocks cannot fill 9 stages"),
        (language_model(DENSE), {"split": [4, 4], "num_stages": 3}, ValueError, r"makes 2 stages but the schedule has 3"),
        (language_model(DENSE), {}, ValueError, r"give split=\[...\] or the number of stages"),
        (language_model(DENSE), {"split": [8], "held": [1]}, ValueError, r"there is no stage 1"),
        (language_model(DENSE), {"blocks": ["embed", "layers.0.attn"]}, ValueError, r"no submodule 'layers.0.attn' to use as a block; its default blocks are embed, layers.0"),
        (language_model(DENSE), {"blocks": ["embed", "embed"]}, ValueError, r"block 'embed' is listed twice"),
        (language_model(DENSE), {"blocks": ["layers", "layers.0"]}, ValueError, r"'layers.0' is inside block 'layers'"),
        (language_model(DENSE), {"blocks": ["embed", "head"]}, ValueError, r"in no block: layers.0.attention_norm.weight"),
        (language_model(DENSE), {"blocks": "embed"}, TypeError, r"blocks must be a list of block names"),
        (Loose(), {"num_stages": 2}, ValueError, r"Loose has parameters or buffers in no block: bias"),
        (tied(), {"num_stages": 2, "held": [0]}, ValueError, r"blocks 'embed' \(stage 0\) and 'head' \(stage 1\) share the parameter 'embed.table.weight'"),
        (nn.Module(), {"num_stages": 1}, ValueError, r"Module has no blocks to cut"),
    ],
)  # fmt: skip
def test_bad_blocks_and_splits_say_what_to_change(model, options, error, message):
    with pytest.raises(error, match=message):
        cut_module(model, **options)


def test_tied_weights_in_one_stage_are_fine():
    stages = cut_module(tied(), num_stages=1)
    assert "head.out.weight" in stages[0].state_dict()


def test_tied_weights_in_two_stages_of_one_rank_are_one_parameter():
    """A V schedule's first rank holds the embedding's stage and the head's: one parameter."""
    stages = cut_module(tied(), num_stages=2)
    assert stages[0].embed.table.weight is stages[1].head.out.weight


def test_from_module_checks_the_split_against_the_schedule():
    with pytest.raises(ValueError, match="makes 3 stages but the schedule has 2"):
        PipelineRunner.from_module(generate("dualpipev", 1, 2), Tower(), split=[2, 3, 3])


def test_stages_whose_names_clash_are_refused_by_name():
    runner = PipelineRunner(
        generate("dualpipev", 1, 2), {0: Chain(nn.Linear(2, 2)), 1: Chain(nn.Linear(2, 2))}
    )
    with pytest.raises(ValueError, match=r"name different tensors '0.weight': build the runner"):
        runner.named_parameters()
    with pytest.raises(ValueError, match=r"name different tensors '0.weight'"):
        runner.state_dict()


def test_a_model_built_in_parts_holds_the_whole_models_values():
    """A pipeline rank builds only its blocks (the rest stay on the meta device, never
    allocated), and each holds what one process building the whole model holds."""
    whole = language_model(MOE, seed=5)
    part = language_model(MOE, seed=5, blocks=["layers.1", "head"])
    built = {name for name, p in part.named_parameters() if p.device.type != "meta"}
    assert built and all(n.startswith(("layers.1.", "head.")) for n in built)
    assert all(p.is_meta for n, p in part.named_parameters() if n not in built)
    expected = dict(whole.named_parameters())
    for name, parameter in part.named_parameters():
        if name in built:
            assert torch.equal(parameter, expected[name]), name
    assert not torch.equal(whole.layers[1].mlp.router.weight, whole.layers[2].mlp.router.weight)
    with pytest.raises(ValueError, match="has no block 'layers.9'"):
        language_model(MOE, blocks=["layers.9"])
