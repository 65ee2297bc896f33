"""Megatron FLOP accounting: published anchors, Megatron's own output, and relations."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.flops import (
    flops_per_iteration,
    flops_per_token_breakdown,
    gpt3_closed_form_flops,
    hardware_flops_per_iteration,
)
from mcore_advisor.schemas import ModelSpec, ParallelismSpec


def _shape(**kw):
    kw.setdefault("make_vocab_size_divisible_by", 1)
    return resolve_model(ModelSpec(**kw))


def _gpt(L, h, n, V=51200):
    return _shape(num_layers=L, hidden_size=h, num_attention_heads=n, vocab_size=V, swiglu=False)


LLAMA3_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                 vocab_size=128256, swiglu=True)
LLAMA3_70B = dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672,
                  vocab_size=128256, swiglu=True)


def test_megatron_0192_reference_value_for_llama3_8b_shape_is_reproduced():
    # /work/shared/reference/megatron-core-cpu.md §5 / App. B: megatron-core 0.19.2
    # num_floating_point_operations(gbs=128, seq=8192) = 5.3971e16 for this shape at TP4. The preview
    # script set args.padded_vocab_size = 128256 (unpadded: the tokenizer was never built).
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    f = flops_per_iteration(shape, 8192, 128, "causal", padded_vocab_size=128256)
    assert f == pytest.approx(5.3971e16, rel=5e-5)
    assert f / (128 * 8192) == pytest.approx(5.1470e10, rel=5e-5)


@pytest.mark.parametrize(
    "spec, seq, tok_s, tflops",
    [
        # NeMo 24.07 performance_summary.md (published-runs-dev.csv, NEMO_2407): tokens/s/GPU and Model TFLOP/s.
        (LLAMA3_8B, 8192, 12273, 711),
        (LLAMA3_70B, 8192, 1524, 734),
        (dict(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200, swiglu=False), 2048, 716, 771),
        (dict(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008, vocab_size=32000,
              swiglu=True), 4096, 16934, 780),
        (dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8, ffn_hidden_size=28672,
              vocab_size=32000, swiglu=True), 4096, 1728, 768),
        (dict(num_layers=96, hidden_size=18432, num_attention_heads=96, num_query_groups=8, ffn_hidden_size=73728,
              vocab_size=256000, swiglu=False), 4096, 326, 686),
    ],
)
def test_nemo_2407_tflops_are_tokens_per_s_times_full_convention_flops_per_token(spec, seq, tok_s, tflops):
    per_token = flops_per_token_breakdown(_shape(**spec), seq, "full").total_flops
    assert per_token * tok_s / 1e12 == pytest.approx(tflops, rel=5e-3)


def test_nemo_2407_tflops_do_not_match_the_causal_convention():
    # The same LLAMA3-8B row is 12% off in 'causal': the published figure is full-s^2 (estimators.md §0).
    per_token = flops_per_token_breakdown(_shape(**LLAMA3_8B), 8192, "causal").total_flops
    assert per_token * 12273 / 1e12 < 711 * 0.92


@pytest.mark.parametrize("time_s, mfu, hfu", [(13.75, 51.4, 52.8)])
def test_korthikanti_175b_selective_mfu_and_hfu_reproduce_the_paper(time_s, mfu, hfu):
    # Korthikanti et al. 2022 Table 5 (175B, TP8 PP8, 64 A100, B=64, s=2048, V=51200): 13.75 s with SP +
    # selective recompute; MFU 51.4% / HFU 52.8% against 312 TFLOP/s (old Megatron README).
    shape = _gpt(96, 12288, 96)
    model = flops_per_iteration(shape, 2048, 64, "full")
    hw = hardware_flops_per_iteration(shape, 2048, 64, "full", ParallelismSpec(recompute_granularity="selective"))
    denom = time_s * 64 * 312e12
    assert 100 * model / denom == pytest.approx(mfu, abs=0.05)
    assert 100 * hw / denom == pytest.approx(hfu, abs=0.05)


def test_full_recompute_hfu_is_narayanan_96_form():
    # Narayanan et al. 2021 eq. 3: with full recompute 96*B*s*L*h^2*(1 + s/(6h) + V/(16*L*h)).
    B, s, L, h, V = 512, 2048, 24, 2304, 51200
    shape = _gpt(L, h, 24, V)
    hw = hardware_flops_per_iteration(shape, s, B, "full", ParallelismSpec(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    assert hw == pytest.approx(96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-12)


def test_block_recompute_reruns_only_the_first_layers_of_each_chunk():
    shape = _gpt(32, 4096, 32)
    model_bd = flops_per_token_breakdown(shape, 4096, "causal")
    hw = hardware_flops_per_iteration(shape, 4096, 8, "causal", ParallelismSpec(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=2,
        pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2))
    # 32 layers / (PP4 * VP2) = 4 layers per chunk, 2 of them rerun: half the layer FLOPs get a third more.
    expected = (model_bd.total_flops + model_bd.layer_flops * 0.5 / 3) * 8 * 4096
    assert hw == pytest.approx(expected, rel=1e-12)


def test_gpt3_closed_form_equals_general_formula_in_full_convention():
    for L, h, n, s, V in [(96, 12288, 96, 2048, 51200), (24, 2048, 16, 4096, 32768), (48, 6144, 64, 2048, 50304)]:
        shape = _gpt(L, h, n, V)
        assert flops_per_iteration(shape, s, 32, "full") == pytest.approx(gpt3_closed_form_flops(32, s, L, h, V), rel=1e-12)


def test_causal_equals_full_minus_half_the_core_attention_term():
    shape = _shape(**LLAMA3_70B)
    full = flops_per_token_breakdown(shape, 8192, "full")
    causal = flops_per_token_breakdown(shape, 8192, "causal")
    assert causal.total_flops == pytest.approx(full.total_flops - full.core_attention_flops / 2, rel=1e-12)
    assert causal.attention_linear_flops == full.attention_linear_flops
    assert causal.dense_mlp_flops == full.dense_mlp_flops


def test_doubling_seq_length_doubles_only_the_core_attention_term_per_token():
    shape = _shape(**LLAMA3_8B)
    a = flops_per_token_breakdown(shape, 4096)
    b = flops_per_token_breakdown(shape, 8192)
    assert b.core_attention_flops == pytest.approx(2 * a.core_attention_flops)
    assert b.total_flops - a.total_flops == pytest.approx(a.core_attention_flops)
    # Per token everything else is independent of s; hand value of the core term: 6 * q * s * L (causal half).
    assert a.core_attention_flops == 6 * 4096 * 4096 * 32


def test_tensor_parallel_leaves_flops_unchanged_except_vocab_padding():
    shape = _shape(**{**LLAMA3_8B, "make_vocab_size_divisible_by": 128})
    f1 = flops_per_iteration(shape, 8192, 128, tensor_model_parallel_size=1)
    f8 = flops_per_iteration(shape, 8192, 128, tensor_model_parallel_size=8)
    # 128256 is a multiple of 128 but not of 1024: TP8 pads to 129024 (+768 rows of logits).
    assert f8 - f1 == pytest.approx(6 * 4096 * 768 * 128 * 8192, rel=1e-12)
    assert flops_per_iteration(shape, 8192, 128, padded_vocab_size=128256) == f1


def test_gqa_enters_only_the_kv_projection():
    mha = _shape(**{**LLAMA3_8B, "num_query_groups": 32})
    gqa = _shape(**LLAMA3_8B)
    a, b = flops_per_token_breakdown(mha, 8192), flops_per_token_breakdown(gqa, 8192)
    # K and V: 2 * h * g * d per layer, x6; g 32 -> 8 removes 24 groups of d=128.
    assert a.attention_linear_flops - b.attention_linear_flops == 6 * 2 * 4096 * 24 * 128 * 32
    assert a.core_attention_flops == b.core_attention_flops


def test_moe_counts_topk_routed_plus_shared_on_moe_layers_and_mtp_copies_last_layer_type():
    # DeepSeek-V3-like toy: first layer dense, rest MoE; 1 MTP layer (copies the MoE type).
    spec = dict(num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, vocab_size=1000,
                swiglu=True, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=512,
                moe_shared_expert_intermediate_size=512, moe_layer_freq=[0, 1, 1, 1], mtp_num_layers=1)
    bd = flops_per_token_breakdown(_shape(**spec), 1024)
    assert bd.dense_mlp_flops == 6 * 1024 * 4096 * 3 * 1
    assert bd.moe_routed_flops == 6 * 1024 * 512 * 2 * 3 * 4
    assert bd.moe_shared_flops == 6 * 1024 * 512 * 3 * 4
    assert bd.mtp_extra_flops == 6 * (3 * 1024 + 2 * 1024 * 1024)
    assert bd.logits_flops == 6 * 1024 * 1000 * 2
    assert bd.num_attention_layers == 5


def test_mla_terms_follow_megatron_transformer_flops():
    spec = dict(num_layers=2, hidden_size=7168, num_attention_heads=128, vocab_size=129280, multi_latent_attention=True,
                q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    bd = flops_per_token_breakdown(_shape(**spec), 4096)
    q_term = 1536 * (7168 + 128 * 192 + 1)
    lin = q_term + 512 * (7168 + 128 * 256 + 1) + 7168 * 64 + 128 * 128 * 7168
    assert bd.attention_linear_flops == 6 * lin * 2
    assert bd.core_attention_flops == 6 * 4096 * (128 * 192 + 128 * 128) / 2 * 2


def test_unknown_convention_is_rejected():
    with pytest.raises(ValueError, match="convention"):
        flops_per_token_breakdown(_gpt(2, 64, 4), 64, "half")  # type: ignore[arg-type]
