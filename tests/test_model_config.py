"""Model files: cutpipe's own, and Hugging Face config.json files mapped onto ``ModelSpec``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cutpipe.model_config import (
    is_hf_config,
    load_model_config,
    load_training_model,
    spec_from_hf_config,
)
from cutpipe.models import language_model
from cutpipe.spec import MlpSpec, ModelSpec

EXAMPLES = Path(__file__).parents[1] / "examples" / "models"

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072,
    "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "attention_bias": False,
    "attention_dropout": 0.0, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "initializer_range": 0.02, "pretraining_tp": 1, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.0", "use_cache": True,
}  # fmt: skip

MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": None,
    "output_router_logits": False, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0,
    "rope_theta": 1e6, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}  # fmt: skip

DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "vocab_size": 129280,
    "max_position_embeddings": 163840, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
    "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
}  # fmt: skip

QWEN_MOE = {
    "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 5632,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
    "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 8192, "use_sliding_window": False,
}  # fmt: skip


def write(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_a_llama_config_maps_onto_the_dense_fields(tmp_path):
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    spec = load_model_config(write(folder, LLAMA))
    assert spec == ModelSpec(
        name="Llama-3.1-8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
        vocab=128256, seq_len=131072, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
        rope_original_positions=8192, norm_eps=1e-5,
    )  # fmt: skip
    # a head size of its own: the projections are heads x head_dim wide (Qwen3, Gemma)
    assert load_model_config(write(tmp_path, {**LLAMA, "head_dim": 64})).attention_head_dim == 64
    assert load_model_config(folder, max_seq_len=4096).seq_len == 4096  # a folder: its config
    assert load_model_config(folder, max_seq_len=10**6).seq_len == 131072


def test_a_mixtral_config_gives_experts_of_the_intermediate_size(tmp_path):
    spec = load_model_config(write(tmp_path, MIXTRAL, "mixtral.json"), max_seq_len=4096)
    assert (spec.name, spec.experts, spec.top_k, spec.ffn) == ("mixtral", 8, 2, 14336)
    assert (spec.dense_layers, spec.shared_experts, spec.kv_heads, spec.seq_len) == (0, 0, 8, 4096)


def test_a_deepseek_config_gives_dense_layers_and_shared_experts():
    spec = spec_from_hf_config(DEEPSEEK, "dsv3")
    assert (spec.experts, spec.top_k, spec.ffn, spec.shared_experts) == (256, 8, 2048, 1)
    assert (spec.dense_layers, spec.dense_ffn, spec.layers, spec.heads) == (3, 18432, 61, 128)
    assert spec.kv_heads == 0  # as many as heads
    shipped = ModelSpec.load(EXAMPLES / "deepseek-v3-like.yaml")
    assert spec.hidden == shipped.hidden and spec.vocab == shipped.vocab


def test_a_qwen_moe_config_counts_its_shared_expert_in_expert_sizes():
    spec = spec_from_hf_config(QWEN_MOE)
    assert (spec.experts, spec.top_k, spec.ffn, spec.shared_experts) == (60, 4, 1408, 4)
    dense = spec_from_hf_config({**QWEN_MOE, "mlp_only_layers": [0, 1]})
    assert (dense.dense_layers, dense.dense_ffn) == (2, 5632)


def test_a_small_config_builds_a_model_that_runs(tmp_path):
    small = {**DEEPSEEK, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 16,
             "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
             "vocab_size": 64, "n_group": 2, "topk_group": 1, "kv_lora_rank": 16,
             "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
             "v_head_dim": 8}  # fmt: skip
    spec = load_model_config(write(tmp_path, small), max_seq_len=8)
    model = language_model(spec)
    assert model.layers[0].mlp.up.out_features == 48  # the dense layer
    assert len(model.layers[1].mlp.experts) == 4 and len(model.layers[2].mlp.shared) == 1
    with torch.no_grad():
        logits, aux = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, 64) and float(aux) > 0


def test_cutpipe_files_load_as_before_and_are_capped(tmp_path):
    for path in EXAMPLES.glob("*.yaml"):
        if path.stem != "mlp":  # the example MLP is no transformer
            assert load_model_config(path) == ModelSpec.load(path)
    as_json = write(tmp_path, {"layers": 2, "hidden": 8, "heads": 2, "ffn": 16, "vocab": 32,
                               "seq_len": 64}, "mine.json")  # fmt: skip
    spec = load_model_config(as_json, max_seq_len=16, name="renamed")
    assert (spec.name, spec.seq_len, spec.layers) == ("renamed", 16, 2)
    assert not is_hf_config(json.loads(as_json.read_text())) and is_hf_config(LLAMA)


def test_the_tiny_examples_split_over_four_ranks_with_a_v_schedule():
    dense = load_model_config(EXAMPLES / "tiny-dense.yaml")
    moe = load_model_config(EXAMPLES / "tiny-moe.yaml")
    for spec in (dense, moe):
        assert (spec.vocab, spec.seq_len, spec.layers, spec.microbatch_size) == (256, 128, 8, 4)
    assert not dense.moe and 4 <= moe.experts <= 8 and moe.top_k == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_local_experts": 8, "n_routed_experts": 16}, r"expert counts disagree"),
        ({"num_experts_per_tok": 2}, r"num_experts_per_tok set but no experts"),
        ({"num_key_value_heads": 5}, r"num_key_value_heads 5 must divide"),
        ({"hidden_act": "swish"}, r"hidden_act 'swish' is not built by cutpipe"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor 0.5: cutpipe rotates whole"),
        ({"rope_scaling": {"rope_type": "su"}}, r"rope_type 'su' is not one of default"),
        ({"hidden_size": 4097, "head_dim": None}, r"hidden 4097 must be a multiple of heads 32"),
        ({"num_hidden_layers": True}, r"num_hidden_layers must be a whole number"),
        ({"vocab_size": None}, r"missing vocab_size"),
        ({"max_position_embeddings": None}, r"give the sequence length with cutpipe train --seq"),
        ({"hidden_activation": "gelu", "final_logit_softcapping": 30}, r"unknown keys \['final"),
        ({"layers": 4}, r"mixes Hugging Face keys with cutpipe fields \['layers'\]"),
    ],
)
def test_unknown_and_contradictory_llama_keys_are_named(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        load_model_config(write(tmp_path, {**LLAMA, **change}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": None}, r"256 experts but no num_experts_per_tok"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq 2: only models whose layers past"),
        ({"mlp_only_layers": [0, 1]}, r"first_k_dense_replace 3 disagrees with mlp_only_layers"),
        ({"mlp_only_layers": [5]}, r"only the first layers can be dense"),
        ({"num_experts_per_tok": 300}, r"top_k 300 is more than the 256 experts"),
        ({"shared_expert_intermediate_size": 3000}, r"not a multiple of the experts' 2048"),
        ({"shared_expert_intermediate_size": 4096}, r"n_shared_experts 1 disagrees"),
    ],
)
def test_unbuildable_deepseek_variants_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config({**DEEPSEEK, **change}, source="ds.json")


def test_unreadable_files_say_so(tmp_path):
    with pytest.raises(ValueError, match="cannot read model file"):
        load_model_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="directory without a config.json"):
        load_model_config(tmp_path)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="does not parse as JSON"):
        load_model_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="max_seq_len must be a whole number"):
        load_model_config(write(tmp_path, LLAMA), max_seq_len=0)


def test_the_sequence_length_of_a_run_fills_a_config_without_max_position_embeddings(tmp_path):
    small = {
        **LLAMA,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "vocab_size": 256,
    }
    del small["max_position_embeddings"]
    path = write(tmp_path, small)
    with pytest.raises(ValueError, match="--seq-len") as error:
        load_training_model(path)
    assert str(error.value) == (
        f"{path}: missing max_position_embeddings: give the sequence length with cutpipe train "
        "--seq-len N (seq_len=N in code), or add max_position_embeddings to the file"
    )
    spec = load_training_model(path, seq_len=64)
    assert isinstance(spec, ModelSpec) and (spec.seq_len, spec.layers, spec.kv_heads) == (64, 2, 2)
    assert load_model_config(path, seq_len=64, max_seq_len=16).seq_len == 16
    with torch.no_grad():
        logits, _ = language_model(spec)(torch.zeros(1, 64, dtype=torch.long))
    assert logits.shape == (1, 64, 256)


def test_a_sequence_length_replaces_the_files_and_is_checked(tmp_path):
    assert load_model_config(write(tmp_path, LLAMA), seq_len=4096).seq_len == 4096
    assert load_training_model(EXAMPLES / "tiny-dense.yaml", seq_len=32).seq_len == 32
    assert isinstance(load_training_model("mlp"), MlpSpec)
    for model in ("mlp", EXAMPLES / "mlp.yaml"):
        with pytest.raises(ValueError, match="example MLP .* no sequence length: drop --seq-len"):
            load_training_model(model, seq_len=32)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match=f"seq_len must be a whole number >= 1, got {bad}"):
            load_model_config(write(tmp_path, LLAMA), seq_len=bad)


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        ({"router_scoring": "x"}, "router_scoring must be one of softmax, sigmoid, got 'x'"),
        ({"router_scale": 0}, "router_scale must be a number > 0, got 0"),
        ({"router_groups": 3, "router_top_groups": 1}, "router_groups 3 must divide the 4"),
        ({"router_groups": 2, "router_top_groups": 1, "top_k": 3},
         "top_k 3 is more than the 2 experts of the router_top_groups 1 groups"),
        ({"router_scoring": "sigmoid", "router_groups": 4, "router_top_groups": 2},
         "sigmoid scoring ranks a group by its two best experts"),
        ({"kv_lora_rank": 8}, r"latent attention \(kv_lora_rank\) also needs qk_rope_head_dim"),
        ({"kv_lora_rank": 8, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_heads": 1},
         "latent attention has as many key/value heads as heads, got 1"),
    ],
)  # fmt: skip
def test_routing_and_latent_attention_fields_are_checked(fields, refusal):
    base = dict(name="m", layers=2, hidden=8, heads=2, ffn=8, vocab=8, seq_len=8, experts=4,
                top_k=2)  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        ModelSpec(**{**base, **fields})
