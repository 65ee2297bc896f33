"""Memory model: hand-derived terms, Korthikanti Table 2, Megatron's estimator, measured H200 peaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.memory import (
    GIB,
    ActivationOptions,
    cross_entropy_peak_bytes_per_logit,
    in_flight_microbatches,
    layer_activation_terms,
    memory_breakdown,
    rank_params,
)
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)

GPT_1P3B = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=32768,
                swiglu=False, normalization="LayerNorm", add_bias_linear=True, untie_embeddings_and_output_weights=True,
                position_embedding_type="rope")


def _plan(model=None, *, gpus=1, gpu="h200", seq=2048, gbs=32, mbs=4, par=None, impl=None, **train):
    return Plan(
        model=ModelSpec(**(model or GPT_1P3B)),
        cluster=ClusterSpec(gpu=gpu, num_gpus=gpus),
        training=TrainingSpec(seq_length=seq, global_batch_size=gbs, micro_batch_size=mbs, **train),
        parallelism=ParallelismSpec(**(par or {})),
        implementation=ImplementationSpec(**(impl or {})),
    )


def _state_bytes_per_param(plan):
    st = memory_breakdown(plan).stages[0]
    return (st.weights_bytes + st.gradients_bytes + st.optimizer_bytes) / st.num_params


# ---- model state -------------------------------------------------------------------------


def test_model_state_is_18_bytes_per_param_without_distributed_optimizer():
    # bf16 param 2 + fp32 grad 4 + fp32 main param 4 + Adam m, v 8 (Megatron-LM #654; estimators.md §1a).
    plan = _plan(par=dict(use_distributed_optimizer=False))
    assert _state_bytes_per_param(plan) == pytest.approx(18.0)


def test_model_state_is_6_plus_12_over_dp_with_distributed_optimizer():
    plan = _plan(gpus=8, gbs=64, par=dict(use_distributed_optimizer=True))
    assert _state_bytes_per_param(plan) == pytest.approx(6 + 12 / 8)


def test_bf16_gradients_take_two_bytes_per_param():
    plan = _plan(gpus=8, gbs=64, impl=dict(grad_reduce_in_fp32=False))
    assert _state_bytes_per_param(plan) == pytest.approx(4 + 12 / 8)


def test_distributed_optimizer_with_dp8_shrinks_optimizer_state_eightfold():
    off = memory_breakdown(_plan(gpus=8, gbs=64, par=dict(use_distributed_optimizer=False)))
    on = memory_breakdown(_plan(gpus=8, gbs=64, par=dict(use_distributed_optimizer=True)))
    assert off.optimizer_gib / on.optimizer_gib == pytest.approx(8.0)


def test_distributed_optimizer_shards_over_dp_times_cp():
    plan = _plan(gpus=8, gbs=64, seq=8192, par=dict(context_parallel_size=2))
    assert _state_bytes_per_param(plan) == pytest.approx(6 + 12 / 8)


def test_first_stage_params_match_megatron_most_loaded_shard_for_llama3_8b_tp4_pp2():
    # megatron-core 0.19.2 report_theoretical_memory (shared/reference/megatron-core-cpu.md, App. B):
    # "Number of parameters in most loaded shard in billions: 1.0039", weights+optimizer 7180.33 MB
    # at 6 + 12/8 B/param (padded_vocab_size was 128256 there). Megatron also divides the (tiny)
    # norms by TP, we keep them replicated as Megatron-Core builds them.
    shape = resolve_model(ModelSpec(name="llama3-8b", make_vocab_size_divisible_by=1))
    rp = rank_params(shape, list(range(16)), first=True, last=False, tp=4, ep=1, etp=1, seq_length=8192)
    assert rp.dense == pytest.approx(1.0039e9, rel=5e-4)
    assert rp.dense * (6 + 12 / 8) / 2**20 == pytest.approx(7180.33, rel=5e-4)


def test_tied_embeddings_put_an_output_copy_on_the_last_stage_only_when_pipelined():
    shape = resolve_model(ModelSpec(**{**GPT_1P3B, "untie_embeddings_and_output_weights": False}))
    one = rank_params(shape, list(range(24)), first=True, last=True, tp=1, ep=1, etp=1, seq_length=2048)
    last = rank_params(shape, list(range(12, 24)), first=False, last=True, tp=1, ep=1, etp=1, seq_length=2048)
    emb = 32768 * 2048
    assert one.dense == pytest.approx(24 * 50_358_272 + emb + 4096)
    assert last.dense == pytest.approx(12 * 50_358_272 + emb + 4096)


def test_fp8_adds_cached_fp8_weight_and_transpose_unless_params_are_fp8():
    base = dict(gpus=8, gbs=64, gpu="h100-sxm")
    bf16 = memory_breakdown(_plan(**base)).weights_gib
    fp8 = memory_breakdown(_plan(precision="fp8", **base)).weights_gib
    fp8_pg = memory_breakdown(_plan(precision="fp8", fp8_param_gather=True, **base)).weights_gib
    layer_linear = 24 * (50_358_272 - 8192) / GIB  # linear weights+biases of all layers, norms excluded
    assert fp8 - bf16 == pytest.approx(2 * layer_linear, rel=1e-6)
    assert fp8_pg == pytest.approx(bf16)


# ---- activations: Korthikanti Table 2 ----------------------------------------------------

GPT3_175B = resolve_model(ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200,
                                    swiglu=False, position_embedding_type="learned_absolute"))
S, B = 2048, 1
SBH = S * B * 12288
AS_H = 96 * S / 12288  # a*s/h


def _korthikanti(tp, sp, selective):
    # Megatron-LM 2022 setting: unfused attention with bf16 softmax, dropout 0.1, no RoPE.
    o = ActivationOptions(tp=tp, sequence_parallel=sp, transformer_impl="local", unfused_attention=True,
                          fused_activation=True, attention_softmax_in_fp32=False, hidden_dropout=0.1,
                          attention_dropout=0.1, recompute_modules=frozenset({"core_attn"} if selective else ()))
    terms = layer_activation_terms(GPT3_175B, S, B, False, o)
    return sum(terms.values()) / SBH


@pytest.mark.parametrize(
    "tp, sp, selective, expected",
    [
        # Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, bytes per layer / (s*b*h).
        (1, False, False, 34 + 5 * AS_H),
        (8, False, False, 10 + 24 / 8 + 5 * AS_H / 8),
        (8, True, False, 34 / 8 + 5 * AS_H / 8),
        (8, False, True, 10 + 24 / 8),
        (8, True, True, 34 / 8),
    ],
)
def test_layer_activations_reduce_to_korthikanti_table_2(tp, sp, selective, expected):
    # Our terms add the norms' fp32 mean/rstd (16 B per token per layer), 0.01% of the total.
    assert _korthikanti(tp, sp, selective) == pytest.approx(expected, rel=2e-3)


def test_korthikanti_fig1_175b_activations_none_vs_selective_sp():
    # Korthikanti Fig. 1 (via Calculon validation.py), 175B TP8 PP8 (interleaved, VP 3 in Calculon's
    # replication), first GPU: 66.8 GiB with no recompute (TP, no SP) vs 12.4 GiB with SP +
    # selective. Rank 0 holds 2*7 + 2*8 + 1 = 31 chunks of 4 layers = 96 * (1 + 7/24) layers.
    layer_mbs = in_flight_microbatches(8, 3, 0, 64) * 12
    assert layer_mbs == 124
    none = _korthikanti(8, False, False) * SBH * layer_mbs / GIB
    seqsel = _korthikanti(8, True, True) * SBH * layer_mbs / GIB
    assert none == pytest.approx(66.8, rel=0.02)
    assert seqsel == pytest.approx(12.4, rel=0.02)


def test_gqa_rope_qkv_term_scales_with_n_plus_2g_not_3h():
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    te = layer_activation_terms(shape, 4096, 1, False, ActivationOptions(tp=1))
    local = layer_activation_terms(shape, 4096, 1, False, ActivationOptions(tp=1, transformer_impl="local"))
    q, kv = 32 * 128, 8 * 128
    # TE: RoPE'd q and k + a contiguous v; local: the whole QKV output (held by the v view) + RoPE'd q, k.
    assert te["qkv"] == 2 * 4096 * (q + 2 * kv)
    assert local["qkv"] == 2 * 4096 * (q + 2 * kv) + 2 * 4096 * (q + kv)


def test_swiglu_saves_2f_wide_input_and_f_wide_product_when_fused():
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    f, tok = 14336, 4096
    fused = layer_activation_terms(shape, tok, 1, False, ActivationOptions())
    unfused = layer_activation_terms(shape, tok, 1, False, ActivationOptions(fused_activation=False))
    fp8 = layer_activation_terms(shape, tok, 1, False, ActivationOptions(fp8=True))
    assert fused["mlp_activations"] == 2 * 2 * f * tok + 2 * f * tok
    assert unfused["mlp_activations"] == fused["mlp_activations"] + 2 * f * tok  # silu output
    assert fp8["mlp_activations"] == 2 * 2 * f * tok + 1 * f * tok  # fc2 keeps a 1-byte FP8 input


@pytest.mark.parametrize(
    "seq, fusion, fp32, dropout, per_score",
    [
        (2048, True, False, 0.0, 2),  # Megatron's fused masked-softmax kernel: its bf16 output
        (2048, True, True, 0.0, 2),  # the kernel ignores attention_softmax_in_fp32 (bf16 in and out)
        (2048, False, False, 0.0, 2),  # PyTorch softmax in bf16 (Megatron-LM's default precision)
        (2048, False, True, 0.0, 6),  # fp32 softmax output + the bf16 copy the PV matmul saves
        (8192, True, False, 0.0, 2),  # beyond 4,096 keys the kernel is not used: PyTorch bf16
        (8192, True, True, 0.0, 6),
        (2048, False, False, 0.1, 5),  # + 1-byte dropout mask + the dropped bf16 probabilities
        (2048, False, True, 0.1, 7),  # fp32 output + mask + dropped bf16 (the bf16 copy is not kept)
    ],
)
def test_local_spec_attention_saves_softmax_bytes_per_score(seq, fusion, fp32, dropout, per_score):
    # Megatron's DotProductAttention (fusions/fused_softmax.py FusedScaleMaskSoftmax) on 16 heads.
    shape = resolve_model(ModelSpec(**GPT_1P3B))
    o = ActivationOptions(transformer_impl="local", unfused_attention=True, masked_softmax_fusion=fusion,
                          attention_softmax_in_fp32=fp32, attention_dropout=dropout)
    terms = layer_activation_terms(shape, seq, 4, False, o)
    assert terms["attention_scores"] == per_score * 16 * 4 * seq * seq


def test_local_spec_gqa_saves_repeated_k_v_not_the_qkv_output():
    # DotProductAttention repeat_interleaves k and v to all n heads; the QK^T and PV matmuls save those,
    # the query is a reshaped copy (RoPE'd), and nothing keeps the grouped QKV GEMM output alive.
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    o = ActivationOptions(transformer_impl="local", unfused_attention=True)
    assert layer_activation_terms(shape, 4096, 1, False, o)["qkv"] == 3 * 2 * 4096 * 32 * 128
    # selective core_attn recompute checkpoints q, k, v as passed in: RoPE'd q, k (g heads) and the v view
    sel = ActivationOptions(transformer_impl="local", unfused_attention=True, recompute_modules=frozenset({"core_attn"}))
    q, kv = 32 * 128, 8 * 128
    assert layer_activation_terms(shape, 4096, 1, False, sel)["qkv"] == 2 * 4096 * (q + 2 * kv) + 2 * 4096 * (q + kv)


def test_sequence_parallel_divides_norm_and_dropout_terms_by_tp():
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    no_sp = layer_activation_terms(shape, 4096, 1, False, ActivationOptions(tp=4, hidden_dropout=0.1))
    sp = layer_activation_terms(shape, 4096, 1, False, ActivationOptions(tp=4, sequence_parallel=True, hidden_dropout=0.1))
    for k in ("norm_inputs", "norm_outputs", "dropout_masks"):
        assert sp[k] == pytest.approx(no_sp[k] / 4)
    for k in ("qkv", "attention_output", "mlp_activations"):
        assert sp[k] == no_sp[k]


def test_context_parallel_divides_activations_by_cp():
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    one = sum(layer_activation_terms(shape, 8192, 1, False, ActivationOptions()).values())
    two = sum(layer_activation_terms(shape, 8192, 1, False, ActivationOptions(cp=2)).values())
    assert two == pytest.approx(one / 2)


def test_doubling_micro_batch_doubles_activations():
    a = memory_breakdown(_plan(mbs=4, impl=dict(transformer_impl="local", attention_backend="flash")))
    b = memory_breakdown(_plan(mbs=8, impl=dict(transformer_impl="local", attention_backend="flash")))
    assert b.activations_gib == pytest.approx(2 * a.activations_gib)
    assert b.weights_gib == a.weights_gib


def test_full_recompute_keeps_only_2sbh_per_layer_plus_one_layer_working_set():
    plan = _plan(mbs=16, par=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                                  use_distributed_optimizer=False),
                 impl=dict(transformer_impl="local", attention_backend="flash"))
    st = memory_breakdown(plan).stages[0]
    tok, h = 2048 * 16, 2048
    layer_inputs = 24 * 2 * tok * h
    extras = 16 * tok + 2 * 2 * h * tok + 12 * tok  # ids; final-norm input + output-layer input; labels/mask
    assert st.activations_bytes == pytest.approx(layer_inputs + extras)


def test_block_recompute_of_all_layers_equals_uniform_with_one_layer_groups():
    par = dict(recompute_granularity="full", recompute_num_layers=24)
    block = memory_breakdown(_plan(par={**par, "recompute_method": "block"})).activations_gib
    uniform = memory_breakdown(_plan(par={**par, "recompute_method": "uniform", "recompute_num_layers": 1})).activations_gib
    assert block == pytest.approx(uniform)


# ---- pipeline schedule -------------------------------------------------------------------


def test_1f1b_rank_holds_pp_minus_rank_microbatches_capped_by_m():
    assert [in_flight_microbatches(4, 1, r, 16) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(8, 1, 0, 3) == 3


def test_interleaved_first_rank_holds_megatrons_penalty_factor():
    # Megatron theoretical_memory_usage: L * (1 + (p-1)/(p*v)) layer-microbatches on rank 0.
    p, v, L = 4, 5, 80
    chunks = in_flight_microbatches(p, v, 0, 64) * v
    assert chunks * L / (p * v) == pytest.approx(L * (1 + (p - 1) / (p * v)))


def test_first_stage_is_most_loaded_for_llama3_70b_1f1b():
    plan = _plan(dict(name="llama3-70b"), gpus=64, gpu="h100-sxm", seq=4096, gbs=128, mbs=1,
                 par=dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, sequence_parallel=True,
                          recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    bd = memory_breakdown(plan)
    assert bd.most_loaded_role == "first"
    assert [(s.pipeline_rank, s.role) for s in bd.stages] == [(0, "first"), (1, "middle"), (2, "middle"), (3, "last")]


def test_cross_entropy_bytes_per_logit_follow_each_implementation():
    # Hand count (physics/memory.py cross_entropy_peak_bytes_per_logit): unfused = bf16 logits 2 +
    # in-place fp32 copy 4; native fused = + Inductor's out-of-place fp32 buffer 4; TE = in place.
    assert cross_entropy_peak_bytes_per_logit(False, "native") == 6.0
    assert cross_entropy_peak_bytes_per_logit(False, "te") == 6.0  # the impl only matters when fused
    assert cross_entropy_peak_bytes_per_logit(True, "native") == 10.0
    assert cross_entropy_peak_bytes_per_logit(True, "te") == 2.0


def test_native_fused_cross_entropy_holds_10_bytes_per_logit_unfused_6_and_te_only_the_output_backward():
    base = dict(gpus=8, gbs=64, gpu="h100-sxm", par=dict(pipeline_model_parallel_size=2))
    native = memory_breakdown(_plan(impl=dict(cross_entropy_loss_fusion=True), **base)).stages[-1]
    te = memory_breakdown(_plan(impl=dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"), **base)).stages[-1]
    unfused = memory_breakdown(_plan(impl=dict(cross_entropy_loss_fusion=False), **base)).stages[-1]
    n_logits = 32768 * 2048 * 4  # vocab x tokens of one microbatch
    assert native.transient_bytes == pytest.approx(10 * n_logits)
    assert unfused.transient_bytes == pytest.approx(6 * n_logits)
    # TE: the peak is the output-layer backward: bf16 logits/grad + dgrad 2hT; with the (default)
    # gradient-accumulation fusion the bf16 weight gradient V*h is TE's cached dummy, a buffer ...
    assert te.transient_bytes == pytest.approx(2 * n_logits + 2 * 2048 * 2048 * 4)
    # ... and without the fusion a transient before main_grad.add_.
    te_unfused = memory_breakdown(_plan(impl=dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te",
                                                  gradient_accumulation_fusion=False), **base)).stages[-1]
    assert te_unfused.transient_bytes == pytest.approx(2 * n_logits + 2 * 32768 * 2048 + 2 * 2048 * 2048 * 4)
    # The keyword argument overrides the plan field.
    plan = _plan(impl=dict(cross_entropy_loss_fusion=True), **base)
    assert memory_breakdown(plan, cross_entropy_fusion_impl="te").stages[-1].transient_bytes == te.transient_bytes


def test_native_fusion_costs_a_quarter_gib_per_2048_token_sample_at_vocab_32768():
    # Our H200 sweep (benchmarks/results/gpu_recommend_sweep.jsonl, GPT 1.3B TE, native fused CE)
    # sat 0.25 GiB per sample above the unfused model: mbs 8 -2.0 GiB, mbs 16 -4.0 GiB, with and
    # without full recompute. 2048 tokens x 32768 logits x 4 B = 0.25 GiB.
    for rec in (None, "full"):
        par = dict(recompute_granularity=rec, recompute_method="uniform" if rec else None,
                   recompute_num_layers=1 if rec else None)
        fused = memory_breakdown(_plan(mbs=8, par=par, impl=dict(cross_entropy_loss_fusion=True)))
        plain = memory_breakdown(_plan(mbs=8, par=par, impl=dict(cross_entropy_loss_fusion=False)))
        assert fused.peak_allocated_gib - plain.peak_allocated_gib == pytest.approx(8 * 0.25)


def test_te_selective_core_attention_keeps_rope_q_k_and_the_whole_qkv_output():
    # Megatron's CheckpointFunction saves q, k, v as passed: RoPE'd q, k and v, a view of the QKV
    # GEMM output. GQA llama3-8b: q = 32*128, kv = 8*128 wide.
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    q, kv, tok = 32 * 128, 8 * 128, 4096
    sel = layer_activation_terms(shape, tok, 1, False, ActivationOptions(recompute_modules=frozenset({"core_attn"})))
    none = layer_activation_terms(shape, tok, 1, False, ActivationOptions())
    assert sel["qkv"] == 2 * tok * (q + kv) + 2 * tok * (q + 2 * kv)
    assert sel["qkv"] - none["qkv"] == 2 * tok * (q + kv)
    assert sel["attention_scores"] == 0 and none["attention_scores"] == 4 * 32 * tok  # fp32 LSE per head


def test_local_spec_selective_keeps_the_same_qkv_tensors_as_no_recompute():
    # The local spec already keeps the QKV output alive through the v view the attention saves.
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    sel = ActivationOptions(transformer_impl="local", recompute_modules=frozenset({"core_attn"}))
    none = ActivationOptions(transformer_impl="local")
    assert layer_activation_terms(shape, 4096, 1, False, sel)["qkv"] == layer_activation_terms(shape, 4096, 1, False, none)["qkv"]


def test_te_selective_recompute_needs_more_than_none_for_gpt_1p3b_as_measured():
    # gpu_recommend_sweep.jsonl r_gpt1.3b_mbs8_sel 54.74 vs r_gpt1.3b_mbs8_none 51.76 GiB (+2.98).
    # Hand count: 24 layers x 16384 tokens x (2 (q + kv) = 4h B kept QKV output - 4a B fp32 LSE no longer saved).
    sel = memory_breakdown(_plan(mbs=8, par=dict(recompute_granularity="selective")))
    none = memory_breakdown(_plan(mbs=8))
    expected = 24 * 16384 * (4 * 2048 - 4 * 16) / GIB
    assert sel.peak_allocated_gib - none.peak_allocated_gib == pytest.approx(expected)
    assert expected == pytest.approx(54.74 - 51.76, abs=0.02)


# ---- totals ------------------------------------------------------------------------------


def test_total_is_reserved_plus_context_and_headroom_is_capacity_minus_total():
    bd = memory_breakdown(_plan())
    assert bd.total_gib == pytest.approx(bd.peak_reserved_gib + bd.non_pytorch_gib)
    assert bd.headroom_gib == pytest.approx(bd.capacity_gib - bd.total_gib)
    assert bd.capacity_gib == 139.8
    assert bd.fits == (bd.total_gib <= bd.capacity_gib)


def test_expandable_segments_shrink_the_fragmentation_margin():
    off = memory_breakdown(_plan())
    on = memory_breakdown(_plan(impl=dict(expandable_segments=True)))
    assert on.peak_allocated_gib == off.peak_allocated_gib
    assert on.fragmentation_gib < off.fragmentation_gib / 3


def test_cluster_memory_override_sets_capacity():
    plan = Plan(model=ModelSpec(**GPT_1P3B), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=1, gpu_memory_gib=40.0))
    assert memory_breakdown(plan).capacity_gib == 40.0


# ---- measured ----------------------------------------------------------------------------

# shared/data/device-measurements-h200.jsonl (megatron-core 0.19.2, local spec, one H200, bf16,
# grad_reduce_in_fp32, Float16 optimizer without the distributed optimizer, dropout 0, GPT with
# RoPE/LayerNorm/GeLU 4h/biases/untied embeddings, vocab 32768): torch.cuda.max_memory_allocated().
# (layers, hidden, heads, seq, micro-batch, global batch, attention, recompute, measured GiB)
H200_ROWS = [
    (24, 2048, 16, 2048, 4, 32, "unfused", None, 74.84),
    (24, 2048, 16, 2048, 8, 32, "unfused", None, 126.97),
    (24, 2048, 16, 2048, 4, 32, "flash", None, 37.70),  # torch SDPA swapped into the local spec
    (24, 2048, 16, 2048, 8, 32, "flash", None, 52.78),
    (32, 2560, 32, 2048, 8, 32, "flash", None, 93.41),
    (24, 2048, 16, 4096, 4, 16, "flash", None, 52.82),
    (24, 2048, 16, 2048, 16, 32, "flash", "full", 31.83),  # recompute_method uniform, recompute_num_layers 1
]


# The device probe built TransformerConfig itself, so it ran TransformerConfig's defaults, not
# Megatron-LM's arguments: fp32 softmax, no masked-softmax/bias/RoPE fusions.
PROBE_DEFAULTS = dict(attention_softmax_in_fp32=True, masked_softmax_fusion=False, bias_activation_fusion=False,
                      bias_dropout_fusion=False, apply_rope_fusion=False)


def plan_from_h200_row(L, h, n, s, mbs, gbs, attn, recompute) -> Plan:
    full = recompute == "full"
    return Plan(
        model=ModelSpec(**{**GPT_1P3B, "num_layers": L, "hidden_size": h, "num_attention_heads": n, "ffn_hidden_size": 4 * h}),
        cluster=ClusterSpec(gpu="h200", num_gpus=1),
        training=TrainingSpec(seq_length=s, global_batch_size=gbs, micro_batch_size=mbs),
        parallelism=ParallelismSpec(use_distributed_optimizer=False, recompute_granularity=recompute,
                                    recompute_method="uniform" if full else None, recompute_num_layers=1 if full else None),
        implementation=ImplementationSpec(transformer_impl="local", attention_backend=attn, grad_reduce_in_fp32=True,
                                          cross_entropy_loss_fusion=False, **PROBE_DEFAULTS),
    )


# The 'flash' rows ran torch SDPA swapped into the local spec, which Megatron-LM never builds (its local
# spec always runs DotProductAttention): no plan describes them any more.
@pytest.mark.parametrize("row", [r for r in H200_ROWS if r[6] == "unfused"], ids=lambda r: f"L{r[0]}-s{r[3]}-b{r[4]}-{r[6]}-{r[7]}")
def test_peak_allocated_matches_h200_measurements_within_1_5_percent(row):
    # Achieved: -0.90% .. -0.85% (benchmarks/results/memory_accuracy.txt).
    *cfg, measured = row
    pred = memory_breakdown(plan_from_h200_row(*cfg)).peak_allocated_gib
    assert pred == pytest.approx(measured, rel=0.015)


def test_embedded_h200_rows_match_the_shared_measurement_file():
    path = Path(__file__).resolve().parents[3] / "shared" / "data" / "device-measurements-h200.jsonl"
    if not path.exists():
        pytest.skip("shared measurement file not present (CI)")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    got = sorted(r["peak_allocated_gib"] for r in rows)
    assert got == sorted(r[-1] for r in H200_ROWS)


# ---- our GPU sweep (issue 7) -------------------------------------------------------------

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SWEEP_FILES = ("gpu_memory_sweep.jsonl", "gpu_recommend_sweep.jsonl", "gpu_h200_runs.jsonl")


def _sweep_rows() -> list[tuple[str, Plan, float]]:
    """Committed H200 rows run through launcher/entry/profile.py: the exact plan, corrected to what
    the job ran (TE or local spec; the loss fused on a GPU with Megatron's 'native' kernel, which
    profile.py hard-codes), and the most-loaded rank's max_memory_allocated."""
    rows = []
    for name in SWEEP_FILES:
        path = RESULTS / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            it = json.loads(line)
            res = it.get("result") or {}
            if it.get("status") != "ok" or not res.get("peak_allocated_gib"):
                continue
            plan = Plan.model_validate(it["plan"])
            ran = {"cross_entropy_loss_fusion": res["settings"]["cross_entropy_loss_fusion"],
                   "cross_entropy_fusion_impl": "native"}
            if res.get("transformer_impl") in ("local", "transformer_engine"):
                ran["transformer_impl"] = res["transformer_impl"]
            if ran.get("transformer_impl") == "local":
                if plan.implementation.attention_backend != "unfused":
                    continue  # torch SDPA swapped into the local spec: not a Megatron-LM configuration
                ran.update(PROBE_DEFAULTS)  # the old job built TransformerConfig with its defaults
            plan = plan.model_copy(update={"implementation": plan.implementation.model_copy(update=ran)})
            rows.append((it["name"], plan, max(res["peak_allocated_gib"])))
    return rows


def test_sweep_peak_allocated_meets_issue_7_targets():
    # Issue 7: median |err| <= 3%, max <= 8% on our sweep. Achieved: median 0.11%, max 0.44% over
    # 31 rows (benchmarks/results/memory_accuracy.txt); before the native-CE and TE-selective terms
    # it was 3.9% / 11.6%.
    rows = _sweep_rows()
    if len(rows) < 10:
        pytest.skip("GPU sweep results not present")
    errs = {name: abs(memory_breakdown(plan).peak_allocated_gib / measured - 1.0) for name, plan, measured in rows}
    ordered = sorted(errs.values())
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else sum(ordered[len(ordered) // 2 - 1:len(ordered) // 2 + 1]) / 2
    assert median <= 0.03, errs
    assert max(errs.values()) <= 0.08, errs


def test_te_gradient_accumulation_fusion_keeps_one_bf16_dummy_per_distinct_weight_shape():
    # Measured on H200 (benchmarks/results/gpu_h200_runs.jsonl, fused vs _nogaf): +96 MiB on GPT 1.3B
    # (qkv 6144x2048, proj 2048x2048, fc1 8192x2048, fc2 2048x8192 in bf16) and +75 MiB on GPT 2.7B
    # at TP2 (3840x2560, 2560x1280, 5120x2560, 2560x5120) -- with Megatron's output layer unfused (no Apex).
    def peak(model, tp, gaf, out=None):
        plan = Plan(model=ModelSpec(name=model) if isinstance(model, str) else ModelSpec(**model),
                    cluster=ClusterSpec(gpu="h200", num_gpus=tp),
                    training=TrainingSpec(seq_length=2048, global_batch_size=32, micro_batch_size=8),
                    parallelism=ParallelismSpec(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                                use_distributed_optimizer=False),
                    implementation=ImplementationSpec(gradient_accumulation_fusion=gaf))
        return memory_breakdown(plan, output_layer_wgrad_fusion=out).peak_allocated_gib * 2**30

    mib = 2**20
    assert peak("gpt3-1.3b", 1, True, False) - peak("gpt3-1.3b", 1, False) == pytest.approx(96 * mib)
    gpt27 = dict(num_layers=32, hidden_size=2560, num_attention_heads=32, ffn_hidden_size=10240, vocab_size=32768,
                 swiglu=False, normalization="LayerNorm", add_bias_linear=True, position_embedding_type="rope")
    assert peak(gpt27, 2, True, False) - peak(gpt27, 2, False) == pytest.approx(75 * mib)


def test_memory_arrays_on_a_mixed_batch_is_memory_breakdown_row_by_row():
    # One batch mixing layouts, micro-batches, precisions, recompute kinds and uneven splits: each row is
    # what memory_breakdown (the one-row view) reports for the same plan.
    from mcore_advisor.physics.layouts import LayoutBatch
    from mcore_advisor.physics.memory import memory_arrays

    rows = [
        dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=5,
             sequence_parallel=True),
        dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, recompute_granularity="selective",
             sequence_parallel=True),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=8, recompute_granularity="full",
             recompute_method="block", recompute_num_layers=3, use_distributed_optimizer=False),
        dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=18,
             decoder_last_pipeline_num_layers=22, recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=2, context_parallel_size=2, sequence_parallel=True),
    ]
    plans = [_plan(dict(name="llama3-70b"), gpus=64, gpu="h100-sxm", seq=8192, gbs=128, mbs=1 + i % 2, par=par,
                   precision="fp8" if i % 2 else "bf16") for i, par in enumerate(rows)]
    shape = resolve_model(plans[0].model)
    one = [LayoutBatch.from_plan(p, shape) for p in plans]
    cols = {n: [getattr(b, n)[0] for b in one] for n in ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "num_gpus",
            "micro_batch_size", "sequence_parallel", "fp8", "use_distributed_optimizer", "recompute",
            "recompute_block", "recompute_num_layers", "first_stage_layers", "last_stage_layers")}
    m = memory_arrays(LayoutBatch(shape, 8192, 128, one[0].impl, **cols))
    for i, p in enumerate(plans):
        bd = memory_breakdown(p)
        assert m.total_gib[i] == pytest.approx(bd.total_gib, rel=1e-12)
        assert m.peak_allocated_bytes[i] == pytest.approx(bd.peak_allocated_gib * GIB, rel=1e-12)


def test_local_spec_stores_the_scores_whatever_the_attention_backend():
    # Megatron-LM's local spec always builds DotProductAttention (LocalSpecProvider.core_attention), so
    # 'auto' is not torch SDPA: GPT 1.3B mbs 4 holds 2 B x 16 heads x 4 x 2048^2 per layer more than TE's.
    def plan(**im):
        return Plan(model=ModelSpec(name="gpt3-1.3b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=1),
                    training=TrainingSpec(seq_length=2048, global_batch_size=32, micro_batch_size=4),
                    implementation=ImplementationSpec(**im))
    peaks = {ab: memory_breakdown(plan(transformer_impl="local", attention_backend=ab)).peak_allocated_gib
             for ab in ("auto", "flash", "fused", "local")}
    assert len(set(peaks.values())) == 1
    te = memory_breakdown(plan()).activations_gib
    local = memory_breakdown(plan(transformer_impl="local")).activations_gib
    assert local - te > 24 * 2 * 16 * 4 * 2048 * 2048 / GIB


def test_hidden_dropout_keeps_a_one_byte_mask_per_bias_dropout_add_output():
    # two bias-dropout-adds per layer, each a 1-byte mask of s x b x h: 24 layers x 2 x 2048 x 4 x 2048 B
    def acts(p):
        return memory_breakdown(Plan(model=ModelSpec(name="gpt3-1.3b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=1),
                                     training=TrainingSpec(seq_length=2048, global_batch_size=32, micro_batch_size=4,
                                                           hidden_dropout=p))).activations_gib
    assert (acts(0.1) - acts(0.0)) * GIB == pytest.approx(24 * 2 * 2048 * 4 * 2048)
