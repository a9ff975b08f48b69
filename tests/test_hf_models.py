"""cutpipe's transformer against ``transformers`` itself (docs/models.md): for tiny random models
of each family that ``transformers`` makes offline (dense, and mixtures of experts: Mixtral,
Qwen2/3-MoE, DeepSeek-V2/V3 with latent attention), the config read, the weights loaded, the
logits equal, the parameters counted alike; the model exported as a folder that
``transformers`` loads with equal logits; a pipelined run started from those weights begins at
``transformers``' loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cutpipe.model_config import load_model_config  # noqa: E402
from cutpipe.models import language_model  # noqa: E402
from cutpipe.models.hf import hf_buffers, hf_names, load_hf_weights, save_hf_folder  # noqa: E402

SIZES = dict(
    vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
)  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
}  # fmt: skip
#: each family with what sets it apart from the others
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                                  attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5)),
    "mistral": ("MistralConfig", dict(sliding_window=None, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("Qwen2Config", dict(hidden_act="silu", rope_parameters={
        "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    "qwen3": ("Qwen3Config", dict(head_dim=16, attention_bias=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a dense first layer, two shared experts' width behind a gate, unnormalised weights
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, norm_topk_prob=False,
                                         shared_expert_intermediate_size=32, mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, head_dim=16,
                                         moe_intermediate_size=16, norm_topk_prob=True)),
    # sigmoid scores in 2 of 4 groups, a correction bias, scaled; queries through a bottleneck
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    # softmax scores, groups by their best, a scale; plain queries; halves rotated... as pairs
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5)),
}  # fmt: skip
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2")


EXPORTED_AS = {"mistral": "LlamaForCausalLM"}
#: a cutpipe model file of another model (8 layers)
MOEFREE = Path(__file__).parents[1] / "examples" / "models" / "tiny-dense.yaml"


def hf_model(family: str, folder: Path, layers: int = 2) -> torch.nn.Module:
    """A tiny random model of ``family``, saved to ``folder``."""
    kind, extra = FAMILIES[family]
    config = getattr(transformers, kind)(**{**SIZES, "num_hidden_layers": layers, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases and norms, so that a misplaced one shows
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.normal_(0.0, 0.5 if name.endswith("bias") else 1.0)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's, that steers the choice
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


def tokens(count: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (count, length), generator=torch.Generator().manual_seed(1))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers_and_the_export_reloads_there(family, tmp_path):
    theirs = hf_model(family, tmp_path / "hf")
    spec = load_model_config(tmp_path / "hf")
    ours = language_model(spec).eval()
    loaded = load_hf_weights(ours, tmp_path / "hf", spec)
    held = [*ours.named_parameters(remove_duplicate=False), *hf_buffers(ours, spec)]
    assert sorted(loaded) == sorted(name for name, _ in held)
    x = tokens()
    with torch.no_grad():
        expected = theirs(x).logits
        got = ours(x)[0]
    assert relative(got, expected) <= 1e-5
    save_hf_folder(ours.state_dict(), spec, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    # Mistral's layers are Llama's: it comes back as a Llama, with the same logits
    assert type(again).__name__ == EXPORTED_AS.get(family, type(theirs).__name__)
    with torch.no_grad():
        assert relative(again(x).logits, got) <= 1e-5
    if family == "deepseek_v3":  # the correction bias is loaded, and it changes the choice
        theirs_bias = theirs.model.layers[1].mlp.gate.e_score_correction_bias
        assert torch.equal(ours.layers[1].mlp.routing_bias, theirs_bias)
        ours.layers[1].mlp.routing_bias.zero_()
        with torch.no_grad():
            assert relative(ours(x)[0], expected) > 1e-3


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])  # llama's is tied
def test_the_cost_model_counts_the_parameters_transformers_holds(family, tmp_path):
    from cutpipe.plan.costs.model import gpu, model_items

    theirs = hf_model(family, tmp_path / "hf")
    spec = load_model_config(tmp_path / "hf")
    counted = sum(item.parameters for item in model_items(spec, gpu("H100")))
    assert counted == theirs.num_parameters()
    assert counted == sum(p.numel() for p in language_model(spec).parameters())


def test_what_the_families_set_is_read():
    import json

    def spec_of(family: str, tmp: Path):
        hf_model(family, tmp)
        return load_model_config(tmp)

    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        llama = spec_of("llama", Path(folder) / "llama")
        config = json.loads((Path(folder) / "llama" / "config.json").read_text())
    assert config["dtype"] == "float32"  # current transformers writes it: read, not refused
    assert (llama.rope_type, llama.rope_factor, llama.rope_original_positions) == ("llama3", 8, 8)
    assert llama.tie_embeddings and llama.qkv_bias and llama.o_bias and llama.mlp_bias
    assert llama.norm_eps == 1e-5 and llama.kv_heads == 2
    with tempfile.TemporaryDirectory() as folder:
        qwen2 = spec_of("qwen2", Path(folder) / "q2")
        qwen3 = spec_of("qwen3", Path(folder) / "q3")
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.rope_type == "linear"
    assert qwen3.qk_norm and qwen3.head_dim == 16 and not qwen3.qkv_bias
    assert hf_names("layers.1.attention.kv.weight", qwen3) == [
        "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"
    ]  # fmt: skip


def test_what_the_moe_families_set_is_read(tmp_path):
    specs = {}
    for family in MOE_FAMILIES:
        hf_model(family, tmp_path / family)
        specs[family] = load_model_config(tmp_path / family)
    q2, q3, v3, v2 = (specs[f] for f in MOE_FAMILIES)
    assert (q2.experts, q2.top_k, q2.ffn, q2.dense_layers, q2.dense_ffn) == (4, 2, 16, 1, 48)
    assert (q2.shared_experts, q2.shared_expert_gate, q2.router_norm) == (2, True, False)
    assert q2.qkv_bias and not q2.o_bias and not q2.latent_attention
    assert (q3.qk_norm, q3.head_dim, q3.shared_experts, q3.router_norm) == (True, 16, 0, True)
    assert (v3.router_scoring, v3.router_norm, v3.router_scale) == ("sigmoid", True, 2.5)
    assert (v3.router_groups, v3.router_top_groups, v3.shared_experts) == (4, 2, 2)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim,
            v3.v_head_dim, v3.rope_interleave) == (24, 16, 8, 4, 12, True)  # fmt: skip
    assert (v3.head_dim, v3.kv_heads, v3.rotary_dim, v3.rope_type) == (0, 0, 4, "linear")
    assert (v2.router_scoring, v2.router_norm, v2.router_scale) == ("softmax", False, 1.5)
    assert (v2.router_groups, v2.q_lora_rank, v2.rope_interleave) == (4, 0, True)
    assert hf_names("layers.1.mlp.routing_bias", v3) == [
        "model.layers.1.mlp.gate.e_score_correction_bias"
    ]
    assert hf_names("layers.1.mlp.shared.0.up.weight", q2) == [
        "model.layers.1.mlp.shared_expert.up_proj.weight"
    ]
    assert hf_names("layers.1.attention.kv_up.weight", v2) == [
        "model.layers.1.self_attn.kv_b_proj.weight"
    ]


@pytest.mark.parametrize(
    ("family", "change", "refusal"),
    [
        ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step 2: only models whose"),
        ("qwen2_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers \[1\]: only the first layers"),
        ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob true: transformers' DeepSeek-V2"),
        ("deepseek_v2", {"topk_method": "x"}, "topk_method 'x' is not built"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func 'softmax' is not built"),
        ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads 2: latent attention"),
        ("deepseek_v3", {"qk_head_dim": 7}, "qk_head_dim 7 is not qk_nope_head_dim"),
        ("deepseek_v3", {"model_type": "llama"}, "kv_lora_rank: latent attention is read for"),
        ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                             "mscale_all_dim": 1.0}}, "mscale_all_dim with"),
    ],
)  # fmt: skip
def test_what_the_moe_families_do_not_build_is_refused_by_name(family, change, refusal, tmp_path):
    import json

    from cutpipe.model_config import spec_from_hf_config

    kind, extra = FAMILIES[family]
    getattr(transformers, kind)(**{**SIZES, **extra}).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())  # as a folder holds it
    spec_from_hf_config(config)  # as it is: read
    with pytest.raises(ValueError, match=refusal):
        spec_from_hf_config({**config, **change})


def test_a_model_no_family_builds_is_not_exported():
    from cutpipe.spec import ModelSpec

    like_deepseek = ModelSpec.load(MOEFREE.parent / "deepseek-v3-like.yaml")  # no latent attention
    with pytest.raises(ValueError, match="shared experts come with Qwen2-MoE's gate or DeepSeek"):
        hf_names("embed.table.weight", like_deepseek)


@pytest.mark.timeout(400)
def test_pipelined_runs_start_from_the_weights_and_export_for_transformers(tmp_path):
    """A 6-layer Llama with tied embeddings and llama3 rope: DualPipeV on 2 ranks and ZB-V on 4 take
    their first step from ``transformers``' loss on the same batch; the 2-rank run's checkpoint
    exports a folder that ``transformers`` reloads with cutpipe's logits."""
    import train_workers as workers

    from cutpipe.launch import run
    from cutpipe.models import LanguageModelLoss
    from cutpipe.train.checkpoint.export import model_state
    from cutpipe.train.options import TrainOptions
    from cutpipe.train.tasks import LanguageModelTask

    folder = tmp_path / "hf"
    theirs = hf_model("llama", folder, layers=6)  # 8 blocks: a V on 4 ranks
    spec = load_model_config(folder)
    settings = dict(
        init_from=str(folder), microbatches=8, global_batch=8, aux_weight=0.0, quiet=True
    )
    inputs, targets = next(LanguageModelTask(spec).loader(8, 0))
    with torch.no_grad():
        logits = theirs(inputs).logits
    expected = float(LanguageModelLoss(0.0)((logits, torch.zeros(())), targets))
    checkpoints = tmp_path / "ckpt"
    two = TrainOptions.build(schedule="dualpipev", steps=2, checkpoint_dir=str(checkpoints),
                             **settings)  # fmt: skip
    four = TrainOptions.build(schedule="zbv", steps=1, **settings)
    for options, ranks in ((two, 2), (four, 4)):
        result = run(workers.train_rank, ranks, (options,), timeout=300)[0]
        assert result["losses"][0] == pytest.approx(expected, rel=1e-5), options.schedule
    trained = model_state(checkpoints)
    save_hf_folder(trained, spec, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = language_model(spec).eval()
    ours.load_state_dict(trained)
    x = tokens()
    with torch.no_grad():
        assert relative(again(x).logits, ours(x)[0]) <= 1e-5
        assert relative(again(x).logits, theirs(x).logits) > 1e-3  # it trained


def test_tied_embeddings_need_the_head_beside_the_embedding(tmp_path):
    from cutpipe.train.layout import run_layout
    from cutpipe.train.options import TrainOptions
    from cutpipe.train.tasks import task_for

    hf_model("llama", tmp_path / "hf")
    options = TrainOptions.build(init_from=str(tmp_path / "hf"), schedule="1f1b", microbatches=4)
    with pytest.raises(ValueError, match="one rank must hold both, once; 1f1b puts them"):
        run_layout(options, 2, task_for(options))
    with pytest.raises(ValueError, match="holds another model than --model: layers 8 vs 2"):
        task_for(TrainOptions.build(init_from=str(tmp_path / "hf"), model=str(MOEFREE)))


@pytest.mark.timeout(300)
def test_mixtral_with_expert_parallelism_starts_from_transformers_loss(tmp_path):
    """PP 2 x EP 2 on 4 ranks, DualPipeV with the overlap hook: each rank reads its own experts
    (by their index in the whole model) and the first step's loss is ``transformers``'."""
    import train_workers as workers

    from cutpipe.launch import run
    from cutpipe.train.options import TrainOptions

    folder = tmp_path / "hf"
    expected = first_loss(hf_model("mixtral", folder), folder)
    options = TrainOptions.build(init_from=str(folder), schedule="dualpipev", ep=2, steps=1,
                                 microbatches=4, global_batch=8, aux_weight=0.0, quiet=True)  # fmt: skip
    result = run(workers.train_rank, 4, (options,), timeout=240)[0]
    assert result["losses"][0] == pytest.approx(expected, rel=1e-5)


def first_loss(theirs: torch.nn.Module, folder: Path) -> float:
    """``transformers``' loss on the trainer's first batch of 8 sequences (no balancing term)."""
    from cutpipe.models import LanguageModelLoss
    from cutpipe.train.tasks import LanguageModelTask

    inputs, targets = next(LanguageModelTask(load_model_config(folder)).loader(8, 0))
    with torch.no_grad():
        logits = theirs(inputs).logits
    return float(LanguageModelLoss(0.0)((logits, torch.zeros(())), targets))


@pytest.mark.timeout(400)
def test_deepseek_pipelined_and_expert_parallel_start_from_transformers_loss(tmp_path):
    """DeepSeek-V3 (latent attention, a dense layer, shared experts, grouped sigmoid routing with
    its correction bias): DualPipeV on 2 ranks, and PP 2 x EP 2 on 4 (the shared experts
    replicated, the routed ones sharded) take their first step from ``transformers``' loss."""
    import train_workers as workers

    from cutpipe.launch import run
    from cutpipe.train.options import TrainOptions

    folder = tmp_path / "hf"
    expected = first_loss(hf_model("deepseek_v3", folder), folder)
    settings = dict(init_from=str(folder), schedule="dualpipev", steps=1, microbatches=4, global_batch=8,
                    aux_weight=0.0, quiet=True)  # fmt: skip
    for ranks, ep in ((2, 1), (4, 2)):
        options = TrainOptions.build(ep=ep, **settings)
        result = run(workers.train_rank, ranks, (options,), timeout=240)[0]
        assert result["losses"][0] == pytest.approx(expected, rel=1e-5), (ranks, ep)
