"""The cost model's per-projection shapes, latent attention, sequence and context parallelism
(cutpipe.plan.costs.model; docs/plan.md, "Model and hardware")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cutpipe.plan.costs.model import (
    PASS_OVERHEAD,
    REPLICATED_WITHOUT_SP,
    Training,
    attention_matmuls,
    context_exchange,
    gpu,
    layer_cost,
    model_items,
    p2p_time,
    score_macs,
    summarize,
    training_flops_per_token,
)
from cutpipe.spec import ModelSpec

H100 = gpu("H100")
#: Llama-3-70B's layer: 64 heads of 128, 8 key/value heads, a gated MLP of 28,672
LLAMA = ModelSpec("llama", 4, 8192, 64, 28672, 128256, 8192, kv_heads=8, flash_attention=True)
MHA = replace(LLAMA, kv_heads=0)
#: DeepSeek-V3's latent attention: 128 heads, query rank 1536, key/value rank 512
MLA = ModelSpec("mla", 4, 7168, 128, 18432, 129280, 4096, flash_attention=True, q_lora_rank=1536,
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip


def test_grouped_heads_make_only_the_key_value_projections_narrow():
    queries, keys, output = attention_matmuls(LLAMA, 4096, 8)
    assert queries == (4096 * 8192 * 8192 / 8, 1024)  # h x h/8: as wide as without GQA
    assert keys == (2 * 4096 * 8192 * 128, 128)  # h x kv*d/8: one key/value head per rank
    assert output == (4096 * 8192 * 8192 / 8, 1024)


def test_grouped_heads_are_never_slower_than_full_heads():
    """Fewer FLOPs at the same widths elsewhere: a GQA layer costs less than its full-head twin
    at every TP (the old single narrow width made it dearer)."""
    for tp in (1, 2, 4, 8):
        training = Training(tp=tp)
        gqa, full = (layer_cost(m, H100, 0, training=training) for m in (LLAMA, MHA))
        assert gqa.forward < full.forward and gqa.weight < full.weight
        assert gqa.parameters < full.parameters


def test_each_matmul_is_costed_at_its_own_width_under_tensor_parallelism():
    """At TP 8 the MLP multiplies h x f/8 = 8192 x 3584 and the queries h x h/8: near peak;
    only the keys and values run at the narrow 128."""
    T = LLAMA.tokens
    layer = layer_cost(LLAMA, H100, 0, training=Training(tp=8))
    shapes = [(T * 8192 * 1024, 1024), (2 * T * 8192 * 128, 128), (T * 1024 * 8192, 1024),
              (2 * T * 8192 * 3584, 3584), (T * 3584 * 8192, 3584)]  # fmt: skip
    matmuls = sum(2 * macs / H100.gemm_throughput(width) for macs, width in shapes)
    assert layer.weight == pytest.approx(matmuls + PASS_OVERHEAD)
    everything_at_128 = sum(2 * macs / H100.gemm_throughput(128) for macs, _ in shapes)
    assert everything_at_128 > 1.5 * matmuls  # what a single narrow width charged


def test_latent_attention_scores_use_its_own_head_sizes():
    macs, narrowest = score_macs(MLA, 1)
    assert macs == 4096 * 128 * (192 + 128) * 0.5 and narrowest == 128
    # not 128 heads of 7168/128 = 56: 2.86 times the score work of that reading
    assert macs / (2 * 4096 * 7168 * 0.5) == pytest.approx(320 / 112)


def test_latent_attention_down_projections_are_whole_on_every_tp_rank():
    one, eight = (layer_cost(MLA, H100, 0, training=Training(tp=t)) for t in (1, 8))
    down = 7168 * (512 + 64) + 7168 * 1536
    norms_and_small = 2 * 7168 + 1536 + 512
    split = one.parameters - down - norms_and_small
    assert eight.parameters == pytest.approx(down + norms_and_small + split / 8)


def test_training_flops_count_latent_attention_scores():
    flops = training_flops_per_token(MLA)
    plain = training_flops_per_token(replace(MLA, q_lora_rank=0, kv_lora_rank=0,
                                             qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0))  # fmt: skip
    weights_gap = 6 * 4 * (sum(m for m, _ in attention_matmuls(MLA, 1, 1)) - 4 * 7168**2)
    scores_gap = 6 * 4 * 4096 * 0.5 * (128 * 320 - 2 * 7168)
    assert flops - plain == pytest.approx(weights_gap + scores_gap)


def test_sequence_parallelism_splits_what_tensor_parallelism_replicates():
    """Korthikanti et al.: 10sbh of a layer's 34sbh is whole on every TP rank without it."""
    with_sp, without = (layer_cost(LLAMA, H100, 0, training=Training(tp=8, sequence_parallel=sp))
                        for sp in (True, False))  # fmt: skip
    whole = REPLICATED_WITHOUT_SP * 2 * LLAMA.tokens * 8192
    assert without.activation - with_sp.activation == pytest.approx(whole * (1 - 1 / 8))
    assert without.forward > with_sp.forward  # norms and dropout over the whole sequence
    assert without.weight == with_sp.weight  # the matmuls are the same
    # the same bytes cross the node either way, and the boundary carries a TP rank's share
    assert p2p_time(LLAMA, H100, False, Training(tp=8, sequence_parallel=False)) == p2p_time(
        LLAMA, H100, False, Training(tp=8)
    )
    assert layer_cost(LLAMA, H100, 0, training=Training(sequence_parallel=False)) == layer_cost(
        LLAMA, H100, 0
    )  # nothing to split without TP


def test_context_parallelism_splits_the_sequence_and_exchanges_keys_and_values():
    one = layer_cost(LLAMA, H100, 0)
    two = layer_cost(LLAMA, H100, 0, training=Training(cp=2))
    assert two.activation == pytest.approx(one.activation / 2)
    assert two.weight - PASS_OVERHEAD < (one.weight - PASS_OVERHEAD) / 2 * 1.05  # half the tokens
    # one block of 4,096 tokens' keys and values (8 heads of 128, bf16) over NVLink
    block = 4096 * 2 * 8 * 128 * 2
    assert context_exchange(LLAMA, H100, Training(cp=2), 4096) == pytest.approx(
        block / H100.intra_bandwidth + H100.intra_latency
    )
    # across nodes beyond a node's GPUs, and hidden behind the scores while they are longer
    assert context_exchange(LLAMA, H100, Training(tp=8, cp=2), 4096) == pytest.approx(
        block / 8 / H100.inter_bandwidth + H100.inter_latency
    )
    items = model_items(LLAMA, H100, training=Training(cp=4))
    assert summarize(items)["parameters"] == summarize(model_items(LLAMA, H100))["parameters"]


def test_context_parallel_ranks_share_the_weights_zero_shards_over():
    assert Training(zero=1, dp=4, cp=2).state_bytes_per_parameter == 2 + 2 + 12 / 8
    assert Training(dp=8, cp=2).replicas(4) == 4
    assert p2p_time(LLAMA, H100, True, Training(cp=2)) < p2p_time(LLAMA, H100, True)


def test_a_training_setting_refuses_a_bad_cp_or_sequence_parallel():
    with pytest.raises(ValueError, match="cp must be a whole number >= 1"):
        Training(cp=0)
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        Training(sequence_parallel="yes")


def test_gradients_are_reduced_over_the_data_and_context_parallel_ranks():
    """CP ranks hold the same weights as DP ranks: a plan with DP=2 x CP=2 reduces its gradients
    over four ranks, as DP=4 does, and its expert all-to-alls leave the node sooner."""
    from cutpipe.plan.recommend.evaluate import evaluate, job_items
    from cutpipe.plan.recommend.job import Job, Layout

    model = replace(LLAMA, layers=8, seq_len=4096)
    job = Job(model, H100, devices=16, global_batch=32)
    four = evaluate(job, Layout(2, 4, 1, "1f1b", 8, tp=2), Training(dp=4, tp=2))
    two_by_two = evaluate(job, Layout(2, 2, 1, "1f1b", 16, tp=2, cp=2),
                          Training(dp=2, tp=2, cp=2))  # fmt: skip
    assert four.breakdown["dp_reduction"] == pytest.approx(two_by_two.breakdown["dp_reduction"])
    moe = replace(model, experts=8, top_k=2)
    within = job_items(Job(moe, H100, devices=16), 4, Training(dp=4, tp=2))
    across = job_items(Job(moe, H100, devices=16), 4, Training(dp=4, tp=2, cp=2))
    assert across[1].ep_forward > within[1].ep_forward  # EP 4 x TP 2 x CP 2 spans two nodes
