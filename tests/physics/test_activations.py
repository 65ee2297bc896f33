"""Saved activations from the layer anatomy: one dense GQA layer and one MoE layer written out tensor
by tensor (Megatron-Core's forward, Korthikanti et al. 2022's accounting), and the anatomy's widths
moving the bytes by exactly the tensors they size."""

from __future__ import annotations

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.activations import (
    ActivationOptions,
    block_activation_terms,
    layer_activation_terms,
    layer_backward_working_pieces,
    layer_kinds,
)
from mcore_advisor.physics.anatomy import anatomy, block
from mcore_advisor.physics.mamba import mamba_activation_bytes
from mcore_advisor.schemas import ModelSpec

LLAMA3_8B = resolve_model(ModelSpec(name="llama3-8b"))  # h 4096, 32 heads, 8 groups x 128, SwiGLU f 14336, RMSNorm, RoPE
MIXTRAL = resolve_model(ModelSpec(name="mixtral-8x7b"))  # Llama-3-8B's attention; 8 experts, top-2, SwiGLU f 14336
S = 4096


def _saved(shape, o=None, moe=False, seq=S, mbs=1):
    return sum(layer_activation_terms(shape, seq, mbs, moe, o or ActivationOptions()).values())


def test_llama3_8b_layer_saves_the_hand_summed_tensors_with_te_flash_attention():
    # One layer, s 4096, b 1, TP 1, TE + flash attention, bf16, no dropout, bytes per token:
    norms = 2 * (2 * 4096 + 4)  # two pre-norm inputs (bf16) + fp32 rstd each (RMSNorm)
    norm_outputs = 2 * 2 * 4096  # the QKV and fc1 inputs (LayerNormLinear's normalised input)
    qkv = 2 * (4096 + 1024 + 1024)  # RoPE'd q (32 x 128) and k (8 x 128), TE's contiguous v (8 x 128)
    core = 4 * 32 + 2 * 4096  # fp32 log-sum-exp per head; the attention output = linear_proj's input
    mlp = 2 * 2 * 14336 + 2 * 14336  # fused SwiGLU's input (fc1 output, gate + up) + fc2's input
    assert _saved(LLAMA3_8B) == S * (norms + norm_outputs + qkv + core + mlp) == S * 139_400


def test_llama3_8b_layer_under_fp8_keeps_1_byte_gemm_inputs():
    # FP8: the QKV, fc1 and fc2 inputs are 1-byte copies; the proj input adds a 1-byte copy beside
    # the bf16 attention output flash attention saves; everything else is as in bf16.
    fewer = 2 * 4096 + 14336 - 4096
    assert _saved(LLAMA3_8B, ActivationOptions(fp8=True)) == S * (139_400 - fewer)


def test_mixtral_moe_layer_saves_the_hand_summed_tensors():
    # The MoE block instead of the MLP, TP 1: router logits (bf16), scores and probs (fp32) and the
    # routing map (1 B) per expert; k = 2 dispatched copies of each token (fc1's input, h wide);
    # per copy the fused SwiGLU input (2 x 14336) and fc2's input (14336); the unpermute saves none.
    attention_half = 2 * (2 * 4096 + 4) + 2 * 2 * 4096 + 2 * (4096 + 2048) + 4 * 32 + 2 * 4096
    router = (2 + 4 + 4 + 1) * 8
    dispatched = 2 * 2 * 4096
    experts = 2 * (2 * 2 * 14336 + 2 * 14336)
    terms = layer_activation_terms(MIXTRAL, S, 1, True, ActivationOptions())
    assert terms["moe_router"] == S * router and terms["moe_dispatched_tokens"] == S * dispatched
    assert sum(terms.values()) == S * (attention_half + router + dispatched + experts) == S * 241_888


def test_expert_parallelism_leaves_the_saved_bytes_and_expert_tp_gathers_tokens():
    # EP exchanges tokens evenly: a rank's experts see k copies of its tokens whatever EP is. With
    # TP 2 + SP and expert TP 1 the MoE block sees s/2 tokens and each expert keeps the whole f.
    tp2 = ActivationOptions(tp=2, sequence_parallel=True, etp=1)
    base = layer_activation_terms(MIXTRAL, S, 1, True, tp2)
    assert base == layer_activation_terms(MIXTRAL, S, 1, True, ActivationOptions(tp=2, sequence_parallel=True, ep=8, etp=1))
    assert base["moe_expert_activations"] == S / 2 * 2 * (2 * 2 * 14336 + 2 * 14336)
    etp2 = layer_activation_terms(MIXTRAL, S, 1, True, ActivationOptions(tp=2, sequence_parallel=True, etp=2))
    # gathered over the 2 expert-TP ranks: twice the tokens at half the width
    assert etp2["moe_dispatched_tokens"] == 2 * base["moe_dispatched_tokens"]
    assert etp2["moe_expert_activations"] == base["moe_expert_activations"]


def test_expert_gradients_in_the_backward_are_sized_like_the_saved_expert_tensors():
    # TP 2 + SP, expert TP 1: the backward's gradients of fc1's output and fc2's input are as wide
    # and as many as the tensors saved for them (s/2 x k tokens, 2f + f), plus three residual-stream
    # gradients (h over SP), the SP all-gather of a GEMM input and the largest bf16 weight gradient
    # (fc1 of the dense MLP shape, 2 x 14336 x 4096, over TP).
    o = ActivationOptions(tp=2, sequence_parallel=True, etp=1)
    saved = layer_activation_terms(MIXTRAL, S, 1, True, o)
    (piece,) = layer_backward_working_pieces(MIXTRAL, S, 1, True, o, saved)
    grads = 2 * (S / 2 * 2) * (2 * 14336 + 14336) + 3 * 2 * 4096 * S / 2
    assert piece == pytest.approx(grads + 2 * 4096 * S + 2 * 2 * 14336 * 4096 / 2, rel=1e-15)


def test_a_wider_ffn_moves_the_saved_bytes_by_the_mlp_tensors_it_widens():
    # f + 1024: the fused SwiGLU input grows by 2 x 1024 (bf16), fc2's input by 1024 (bf16, 1 B in
    # FP8); at TP 2 each rank holds half. Nothing else in the layer depends on f.
    wide = resolve_model(ModelSpec(name="llama3-8b", ffn_hidden_size=14336 + 1024))
    assert block(wide, "mlp").matrices[0].out_features == 2 * (14336 + 1024)
    assert _saved(wide) - _saved(LLAMA3_8B) == S * (2 * 2 * 1024 + 2 * 1024)
    fp8 = ActivationOptions(fp8=True)
    assert _saved(wide, fp8) - _saved(LLAMA3_8B, fp8) == S * (2 * 2 * 1024 + 1 * 1024)
    tp2 = ActivationOptions(tp=2)
    assert _saved(wide, tp2) - _saved(LLAMA3_8B, tp2) == S * (2 * 2 * 1024 + 2 * 1024) / 2


def test_more_query_groups_move_only_the_k_and_v_tensors():
    # 8 -> 16 groups of 128: TE keeps RoPE'd k and contiguous v, each 8 x 128 wider (bf16).
    gqa16 = resolve_model(ModelSpec(name="llama3-8b", num_query_groups=16))
    assert block(gqa16, "attention").core.kv_heads == 16
    assert _saved(gqa16) - _saved(LLAMA3_8B) == S * 2 * 2 * 8 * 128


def test_a_wider_expert_moves_the_expert_tensors_by_k_copies():
    wide = resolve_model(ModelSpec(name="mixtral-8x7b", moe_ffn_hidden_size=14336 + 512))
    assert _saved(wide, moe=True) - _saved(MIXTRAL, moe=True) == S * 2 * (2 * 2 * 512 + 2 * 512)
    assert _saved(wide) == _saved(MIXTRAL)  # a dense layer of the same model does not see it


def test_core_attention_describes_gqa_mha_and_mla():
    assert block(LLAMA3_8B, "attention").core.kind == "gqa"
    assert block(resolve_model(ModelSpec(name="llama2-7b")), "attention").core.kind == "mha"
    dsv3 = block(resolve_model(ModelSpec(name="deepseek-v3")), "attention")
    assert (dsv3.core.kind, dsv3.core.heads, dsv3.core.qk_dim, dsv3.core.v_dim) == ("mla", 128, 128 + 64, 128)
    # Megatron's core-attention FLOPs per key: QK^T over qk_dim, PV over v_dim, per head
    assert dsv3.core_width == 128 * (192 + 128) and block(LLAMA3_8B, "attention").core_width == 2 * 32 * 128


def test_a_block_no_layer_has_is_built_from_the_shape():
    # Qwen3-30B-A3B has only MoE layers; its dense MLP shape (ffn_hidden_size) is still what the
    # dense-layer figures use.
    qwen = resolve_model(ModelSpec(name="qwen3-30b-a3b"))
    assert "mlp" not in anatomy(qwen).blocks
    assert block(qwen, "mlp").matrices[1].in_features == qwen.ffn_hidden_size
    with pytest.raises(ValueError, match="block kind"):
        block(qwen, "conv")


def test_a_hybrid_layer_is_its_one_block_and_pre_norm():
    h8b = resolve_model(ModelSpec(name="nemotron-h-8b"))
    o = ActivationOptions(tp=2, sequence_parallel=True)
    kinds = layer_kinds(h8b, 8192, o)
    pre_norm = (2 * 4096 + 4 + 2 * 4096) * 8192 / 2  # input + rstd + normalised in_proj input, SP shard
    assert kinds[("mamba",)][0] == pytest.approx(pre_norm + mamba_activation_bytes(h8b, 8192, 2, False), rel=1e-15)
    gpt = layer_activation_terms(h8b, 8192, 1, False, o)
    assert kinds[("attention",)][0] + kinds[("mlp",)][0] == pytest.approx(sum(gpt.values()), rel=1e-15)
    with pytest.raises(ValueError, match="block kind"):
        block_activation_terms(h8b, "mtp", 8192, 1, o)


def test_recomputed_unfused_core_attention_holds_its_softmax_again_in_the_backward():
    # Megatron's DotProductAttention (local spec), bf16 softmax without the fused kernel: 2 B per score saved,
    # 8 B live at the peak of its backward. Without recompute the backward adds the 6 B beyond what is saved;
    # with core_attn recomputed nothing is saved, and the rerun forward brings all 8 B back: the working
    # piece grows by exactly the 2 B per score the saved activations lost.
    local = dict(transformer_impl="local", unfused_attention=True, masked_softmax_fusion=False)
    plain = ActivationOptions(**local)
    sel = ActivationOptions(**local, recompute_modules=frozenset({"core_attn"}))
    saved_plain = layer_activation_terms(LLAMA3_8B, 2048, 1, False, plain)
    saved_sel = layer_activation_terms(LLAMA3_8B, 2048, 1, False, sel)
    scores = 32 * 2048 * 2048
    assert saved_plain["attention_scores"] == 2 * scores and saved_sel["attention_scores"] == 0
    piece_plain = layer_backward_working_pieces(LLAMA3_8B, 2048, 1, False, plain, saved_plain)[1]
    piece_sel = layer_backward_working_pieces(LLAMA3_8B, 2048, 1, False, sel, saved_sel)[1]
    freed = (saved_plain["mlp_activations"] + saved_plain["attention_output"]
             - saved_sel["mlp_activations"] - saved_sel["attention_output"])
    assert piece_sel - piece_plain == pytest.approx(2 * scores + freed, rel=1e-12)


def test_unfused_bf16_softmax_backward_piece_is_three_score_tensors_and_two_residual_gradients():
    # What the s11 memory peaks replayed (2 x H200, GPT-2.7B and Llama-8B layers, local spec, no Apex) at the
    # last layer's core-attention backward: beyond the saved activations, three more b x n x s x s bf16 tensors
    # (autograd's CopySlices for the in-place masked_fill_ on a view: incoming gradient, result buffer,
    # contiguous clone, masked_fill output, with the softmax output already freed) and two h-wide gradients on
    # the residual stream; the layer's MLP tensors and the projection's input are freed by then.
    o = ActivationOptions(transformer_impl="local", unfused_attention=True, masked_softmax_fusion=False)
    mbs, s, h = 4, 2048, 4096
    saved = layer_activation_terms(LLAMA3_8B, s, mbs, False, o)
    piece = layer_backward_working_pieces(LLAMA3_8B, s, mbs, False, o, saved)[1]
    scores = 2.0 * 32 * mbs * s * s  # one bf16 score tensor: 1 GiB here
    residual_grads = 2 * 2.0 * h * mbs * s
    freed = saved["mlp_activations"] + saved["attention_output"]
    assert piece == pytest.approx(3 * scores + residual_grads - freed, rel=1e-12)
    # Measured on P_llama8l_pp2_mb8's rank 0 (these layers, 4 x 2,048 tokens): 3.125 GiB from the autograd thread
    assert (piece + freed) / 2**30 == pytest.approx(3.125, rel=1e-3)


def test_unfused_fp32_softmax_backward_piece_holds_three_fp32_gradients_beyond_its_output():
    # --attention-softmax-in-fp32 saves the fp32 output (4 B) and the PV matmul's bf16 copy (2 B); at the peak of
    # the backward the copy is freed and three fp32 gradients stand beside the output (Q_gpt27_dp4_fp32softmax,
    # s11, 4 x H200: 6.08 GiB from the autograd thread = 3 x 2 GiB + two residual gradients): 10 B beyond what is saved.
    o = ActivationOptions(transformer_impl="local", unfused_attention=True, masked_softmax_fusion=False,
                          attention_softmax_in_fp32=True)
    mbs, s, h = 4, 2048, 4096
    saved = layer_activation_terms(LLAMA3_8B, s, mbs, False, o)
    piece = layer_backward_working_pieces(LLAMA3_8B, s, mbs, False, o, saved)[1]
    scores = 32 * mbs * s * s
    assert saved["attention_scores"] == 6 * scores
    freed = saved["mlp_activations"] + saved["attention_output"]
    assert piece == pytest.approx(10 * scores + 2 * 2.0 * h * mbs * s - freed, rel=1e-12)
    # the measured row's own layers (GPT-2.7B: h 2,560, 32 heads, GeLU 10,240): the autograd thread's 6.08 GiB is the
    # piece plus what it frees (the MLP tensors, the projection's input and the bf16 copy of the scores)
    gpt27 = resolve_model(ModelSpec(num_layers=8, hidden_size=2560, num_attention_heads=32, ffn_hidden_size=10240,
                                    vocab_size=32000, swiglu=False, normalization="LayerNorm", add_bias_linear=True,
                                    position_embedding_type="learned_absolute"))
    saved = layer_activation_terms(gpt27, s, mbs, False, o)
    piece = layer_backward_working_pieces(gpt27, s, mbs, False, o, saved)[1]
    freed = saved["mlp_activations"] + saved["attention_output"] + 2 * scores
    assert (piece + freed) / 2**30 == pytest.approx(6.078, rel=2e-3)
