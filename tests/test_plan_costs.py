"""The analytic cost model and model files (cutpipe.plan.costs.model), and measured profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cutpipe.plan.costs.model import (
    ELEMENTWISE_PER_KEPT_BYTE,
    PASS_OVERHEAD,
    gpu,
    layer_cost,
    model_items,
    p2p_time,
    summarize,
    w_memory,
)
from cutpipe.plan.costs.profile import Profile
from cutpipe.profiling import profile_model
from cutpipe.spec import ModelSpec

EXAMPLES = Path(__file__).parent.parent / "examples" / "models"
TINY = ModelSpec(name="tiny", layers=4, hidden=64, heads=4, ffn=128, vocab=300, seq_len=32,
                 experts=4, top_k=2, dense_layers=1)  # fmt: skip


def test_dense_7b_has_llama_2_7b_parameter_count():
    model = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
    total = summarize(model_items(model, gpu("H100")))["parameters"]
    assert total == pytest.approx(6.74e9, rel=0.005)


def test_example_models_load_and_moe_is_moe():
    names = {p.stem: ModelSpec.load(p) for p in EXAMPLES.glob("*.yaml") if p.stem != "mlp"}
    assert set(names) == {"dense-7b", "moe-40l", "deepseek-v3-like", "llama3-405b", "tiny-dense",
                          "tiny-moe", "tiny-bpe"}  # fmt: skip
    assert not names["dense-7b"].moe and names["moe-40l"].moe
    assert not names["tiny-dense"].moe and names["tiny-moe"].moe
    assert names["moe-40l"].layers == 40 and names["moe-40l"].experts == 8
    deepseek = summarize(model_items(names["deepseek-v3-like"], gpu("H100")))
    assert 6.0e11 < deepseek["parameters"] < 7.5e11  # DeepSeek-V3: 671B


def test_b_exceeds_w_by_two_score_matmuls_and_f_by_one():
    model = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
    hardware = gpu("H100")
    layer = layer_cost(model, hardware, 0)
    d = model.hidden // model.heads
    causal_scores = model.tokens * model.seq_len * model.hidden  # 2*T*s*h MACs, halved
    score_time = 2 * causal_scores / hardware.gemm_throughput(d)
    assert layer.backward - layer.forward == pytest.approx(score_time)
    elementwise = layer.forward - layer.weight - score_time
    assert elementwise == pytest.approx(
        ELEMENTWISE_PER_KEPT_BYTE * layer.activation / hardware.memory_bandwidth
    )
    assert 0.4 < layer.weight / layer.forward < 0.8  # not 1.0: F carries norms, softmax, SiLU


def test_small_microbatches_are_memory_bound():
    model = ModelSpec(name="m", layers=2, hidden=4096, heads=32, ffn=11008, vocab=32000, seq_len=1)
    layer, hardware = layer_cost(model, gpu("H100"), 0), gpu("H100")
    streaming = layer.parameters * 2 / hardware.memory_bandwidth
    assert layer.forward == pytest.approx(streaming + PASS_OVERHEAD)
    assert layer.weight == pytest.approx(streaming + PASS_OVERHEAD)


def test_w_memory_near_the_zero_bubble_papers_32_of_34():
    model = ModelSpec(name="gpt", layers=1, hidden=4096, heads=32, ffn=16384, vocab=1000,
                      seq_len=1024, gated_mlp=False)  # fmt: skip
    assert w_memory(model) == pytest.approx(32 / 34, abs=0.06)


def test_expert_parallelism_shards_experts_and_costs_all_to_alls():
    model = ModelSpec.load(EXAMPLES / "moe-40l.yaml")
    h100 = gpu("H100")
    alone, spread = layer_cost(model, h100, 5, ep=1), layer_cost(model, h100, 5, ep=8)
    assert alone.ep_forward == 0 and spread.ep_forward > 0
    assert spread.expert_parameters == pytest.approx(alone.expert_parameters / 8)
    assert alone.parameters - spread.parameters == pytest.approx(alone.expert_parameters * 7 / 8)
    across = layer_cost(model, h100, 5, ep=8, ep_within_node=False)
    assert across.ep_forward > 5 * spread.ep_forward  # 50 GB/s network vs 450 GB/s NVLink
    with pytest.raises(ValueError, match="does not divide the 8 experts"):
        model_items(model, h100, ep=3)


def test_pipeline_transfer_is_one_activation_over_the_link():
    model = ModelSpec.load(EXAMPLES / "dense-7b.yaml")
    hardware = gpu("H100")
    share = model.tokens * model.hidden * 2 / (450e9 * hardware.p2p_bandwidth_share)
    expected = hardware.p2p_overhead + 5e-6 + share
    assert p2p_time(model, gpu("H100"), within_node=True) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("layers: 2\nhidden: 8\nheads: 2\nffn: 8\nvocab: 10\n", r"missing fields \['seq_len'\]"),
        ("layers: -2\nhidden: 8\nheads: 2\nffn: 8\nvocab: 10\nseq_len: 4\n", "layers must be >= 1, got -2"),
        ("layers: 2\nhidden: 8\nheads: 2\nffn: 8\nvocab: 10\nseq_len: 4\nexperts: -1\n", "experts must be >= 0"),
        ("layers: 2\nhidden: 8\nheads: 2\nffn: 8\nvocab: 10\nseq_len: 4\nhiden: 3\n", r"unknown fields \['hiden'\]"),
        ("layers: two\nhidden: 8\nheads: 2\nffn: 8\nvocab: 10\nseq_len: 4\n", "layers must be int"),
        ("layers: 2\nhidden: 9\nheads: 2\nffn: 8\nvocab: 10\nseq_len: 4\n", "multiple of heads"),
        ("layers: [2\n", "does not parse"),
        ("- 1\n- 2\n", "expected a mapping"),
    ],
)  # fmt: skip
def test_bad_model_files_say_which_field_is_wrong(tmp_path, text, message):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        ModelSpec.load(path)


def test_missing_model_file_and_unknown_gpu():
    with pytest.raises(ValueError, match="cannot read model file"):
        ModelSpec.load("/nonexistent/model.yaml")
    with pytest.raises(
        ValueError,
        match="unknown GPU 'V100'; known: A100-40GB, A100-80GB, H100, H800, H200, B200, MI300X",
    ):
        gpu("V100")


@pytest.fixture(scope="module")
def tiny_profile() -> Profile:
    return profile_model(TINY, repeats=2, warmup=1)


def test_profile_measures_every_kind_of_item(tiny_profile):
    assert set(tiny_profile.items) == {"embedding", "dense_layer", "moe_layer", "head"}
    for kind in ("dense_layer", "moe_layer", "head"):
        item = tiny_profile.items[kind]
        assert item.forward > 0 and item.backward > 0 and item.weight > 0
    assert 0 < tiny_profile.w_memory < 1
    assert tiny_profile.dtype == "fp32" and tiny_profile.device == "cpu"


def test_profile_parameters_match_the_analytic_count_and_activations_are_close(tiny_profile):
    analytic = model_items(TINY, gpu("H100"))
    assert tiny_profile.items["dense_layer"].parameters == analytic[1].parameters
    assert tiny_profile.items["moe_layer"].parameters == analytic[2].parameters
    assert tiny_profile.items["moe_layer"].expert_parameters == analytic[2].expert_parameters
    for measured, modelled in ((tiny_profile.items["dense_layer"], analytic[1]),
                               (tiny_profile.items["moe_layer"], analytic[2])):  # fmt: skip
        assert 0.6 < measured.activation / modelled.activation < 1.6


def test_profile_round_trips_and_replaces_compute_but_keeps_network_costs(tmp_path, tiny_profile):
    path = tmp_path / "profile.json"
    tiny_profile.save(path)
    loaded = Profile.load(path)
    assert loaded == tiny_profile
    items = loaded.items_for(gpu("H100"), ep=2)
    assert [i.name for i in items] == [i.name for i in model_items(TINY, gpu("H100"), ep=2)]
    moe = items[2]
    assert moe.forward == tiny_profile.items["moe_layer"].forward
    assert moe.ep_forward == model_items(TINY, gpu("H100"), ep=2)[2].ep_forward > 0
    assert moe.expert_parameters == tiny_profile.items["moe_layer"].expert_parameters / 2


def test_bad_profile_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Profile.load(tmp_path / "none.json")
    (tmp_path / "other.json").write_text(json.dumps({"schedule": "zbv"}))
    with pytest.raises(ValueError, match="not a cutpipe profile"):
        Profile.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="cannot profile in 'int8'"):
        profile_model(TINY, dtype="int8")


def test_llama3_405b_has_its_published_parameter_count():
    model = ModelSpec.load(EXAMPLES / "llama3-405b.yaml")
    total = summarize(model_items(model, gpu("H100")))["parameters"]
    assert total == pytest.approx(405e9, rel=0.02)
