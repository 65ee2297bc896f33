"""Model shape against the layout: heads, groups, widths, layers, experts, sequence, vocab."""

from __future__ import annotations

from mcore_advisor.validators import validate

TP = "parallelism.tensor_model_parallel_size"
PP = "parallelism.pipeline_model_parallel_size"
VP = "parallelism.virtual_pipeline_model_parallel_size"


def _custom(**kw):
    base = dict(num_layers=24, hidden_size=4096, num_attention_heads=32, vocab_size=32000)
    base.update(kw)
    return base


def test_tp3_with_64_heads_suggests_2_4_or_8(kit):
    p = kit.plan(
        parallelism={"tensor_model_parallel_size": 3, "pipeline_model_parallel_size": 1},
        cluster={"num_gpus": 48},
    )
    f = kit.one(p, "heads_not_divisible_by_tp")
    assert f.severity == "error"
    assert f.fields == [TP, "model.num_attention_heads"]
    assert f.message == "num_attention_heads (64) must be a multiple of tensor_model_parallel_size (3)"
    assert f.fix.endswith("2, 4 or 8")


def test_28_heads_on_tp8_suggests_4_or_7(kit):
    # STYLE.md's example; MHA, ffn 4h = 14336 = 2^11 * 7, and 56 GPUs so TP 7 keeps DP an integer.
    model = _custom(num_layers=28, hidden_size=3584, num_attention_heads=28)
    p = kit.plan(model=model, cluster={"num_gpus": 56}, parallelism={"pipeline_model_parallel_size": 1})
    f = kit.one(p, "heads_not_divisible_by_tp")
    assert f.message == "num_attention_heads (28) must be a multiple of tensor_model_parallel_size (8)"
    assert "4" in f.fix and "7" in f.fix and "8" not in f.fix.split("to")[-1]


def test_query_groups_neither_multiple_nor_divisor_of_tp(kit):
    model = _custom(hidden_size=3072, num_attention_heads=24, num_query_groups=6)
    p = kit.plan(
        model=model,
        cluster={"num_gpus": 48},
        parallelism={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1},
        training={"global_batch_size": 120},
    )
    f = kit.one(p, "query_groups_incompatible_with_tp")
    assert f.severity == "error"
    assert f.message == "num_query_groups (6) must be a multiple or divisor of tensor_model_parallel_size (4)"
    # TP must divide 24 heads and be a divisor or multiple of 6 groups: 3 and 6 are the closest to 4.
    assert f.fix.endswith("2, 3 or 6")


def test_tp_above_query_groups_warns_about_replicated_kv_heads(kit):
    p = kit.plan(
        model={"name": "llama3-8b"},
        cluster={"num_gpus": 32},
        parallelism={"tensor_model_parallel_size": 16, "pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "query_groups_replicated_over_tp")
    assert f.severity == "warning"
    assert "held by 2 TP ranks" in f.message
    assert "at most 8" in f.fix
    assert "query_groups_incompatible_with_tp" not in kit.codes(p)


def test_heads_must_be_a_multiple_of_query_groups(kit):
    p = kit.plan(
        model=_custom(num_query_groups=6),
        cluster={"num_gpus": 8},
        parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "heads_not_divisible_by_query_groups")
    assert f.severity == "error" and f.fields[0] == "model.num_query_groups"
    assert f.message == "num_attention_heads (32) is not divisible by num_query_groups (6)"
    assert "4" in f.fix and "8" in f.fix


def test_hidden_not_divisible_by_heads_needs_explicit_kv_channels(kit):
    kw = dict(
        cluster={"num_gpus": 8},
        parallelism={"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
    )
    p = kit.plan(model=_custom(hidden_size=1000, num_attention_heads=16), **kw)
    f = kit.one(p, "hidden_not_divisible_by_heads")
    assert f.severity == "error"
    assert "hidden_size (1000)" in f.message and "model.kv_channels" in f.fix
    p_ok = kit.plan(model=_custom(hidden_size=1000, num_attention_heads=16, kv_channels=64), **kw)
    assert "hidden_not_divisible_by_heads" not in kit.codes(p_ok)


def test_ffn_width_must_split_over_tp(kit):
    p = kit.plan(
        model=_custom(ffn_hidden_size=5004),
        cluster={"num_gpus": 8},
        parallelism={"pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "ffn_not_divisible_by_tp")
    assert f.severity == "error"
    assert f.fields == [TP, "model.ffn_hidden_size"]
    assert "ffn_hidden_size (5004)" in f.message
    assert f.fix.endswith("1, 2 or 4")  # 5004 = 4 * 1251


def test_expert_width_must_split_over_expert_tp(kit):
    model = dict(kit.MIXTRAL, moe_ffn_hidden_size=14340)
    p = kit.plan(
        model=model,
        cluster={"num_gpus": 8},
        parallelism={
            "tensor_model_parallel_size": 4,
            "pipeline_model_parallel_size": 1,
            "expert_tensor_parallel_size": 8,
        },
    )
    f = kit.one(p, "moe_ffn_not_divisible_by_etp")
    assert f.severity == "error" and f.fields[0] == "parallelism.expert_tensor_parallel_size"
    assert "moe_ffn_hidden_size (14340)" in f.message
    assert "4" in f.fix  # 14340 = 4 * 3585


def test_shared_expert_width_must_split_over_tp(kit):
    model = dict(kit.DSV2_LITE, moe_shared_expert_intermediate_size=2820)
    p = kit.plan(model=model, cluster={"num_gpus": 8}, parallelism={"pipeline_model_parallel_size": 1})
    f = kit.one(p, "shared_expert_ffn_not_divisible_by_tp")
    assert f.severity == "error"
    assert "(2820)" in f.message and TP in f.fields


def test_layers_must_divide_over_pp(kit):
    p = kit.plan(parallelism={"pipeline_model_parallel_size": 3}, cluster={"num_gpus": 48})
    f = kit.one(p, "layers_not_divisible_by_pp")
    assert f.severity == "error"
    assert f.fields == [PP, "model.num_layers"]
    assert "num_layers (80) should be divisible by pipeline_model_parallel_size (3)" in f.message
    # divisors of 80 that keep 48 / (TP8 * PP) an integer: 1 and 2; or an uneven split 26 | 28 | 26
    assert f.fix.startswith("set parallelism.pipeline_model_parallel_size to 1 or 2, or keep it")
    assert "decoder_first_pipeline_num_layers 26 and decoder_last_pipeline_num_layers 26" in f.fix


def test_uneven_first_and_last_stages_make_an_indivisible_layer_count_valid(kit):
    # Llama-3.1-405B-like 126 layers on PP16: 7 + 14 x 8 + 7 (first/last lighter: embedding and loss)
    model = {"num_layers": 126, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 32000}
    par = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 16,
           "decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 7}
    p = kit.plan(model=model, parallelism=par, cluster={"num_gpus": 16}, training={"global_batch_size": 16})
    assert "layers_not_divisible_by_pp" not in [f.code for f in validate(p)]
    bad = kit.plan(model=model, parallelism={**par, "decoder_first_pipeline_num_layers": 6},
                   cluster={"num_gpus": 16}, training={"global_batch_size": 16})
    f = kit.one(bad, "layers_not_divisible_by_pp")
    assert "decoder_first_pipeline_num_layers 7 and decoder_last_pipeline_num_layers 7" in f.fix


def test_layers_per_stage_must_divide_over_vp(kit):
    p = kit.plan(parallelism={"virtual_pipeline_model_parallel_size": 3})
    f = kit.one(p, "stage_layers_not_divisible_by_vp")
    assert f.severity == "error" and f.fields[0] == VP
    assert f.message.startswith("num_layers_per_pipeline_rank 40 should be divisible by vp_size 3")
    assert f.fix.endswith("2, 4 or 5")


def test_expert_parallel_on_a_dense_model_is_an_error(kit):
    p = kit.plan(parallelism={"expert_model_parallel_size": 2})
    f = kit.one(p, "expert_parallel_without_experts")
    assert f.severity == "error" and f.fields[0] == "parallelism.expert_model_parallel_size"
    assert "num_experts must be non None" in f.message


def test_ep_larger_than_the_number_of_experts(kit):
    p = kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 16},
        parallelism={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 16,
        },
    )
    f = kit.one(p, "experts_not_divisible_by_ep")
    assert f.severity == "error"
    assert "num_experts (8) should be a multiple of expert_model_parallel_size (16)" in f.message
    assert "cannot exceed" in f.message
    assert f.fix.endswith("2, 4 or 8")


def test_router_topk_cannot_exceed_the_experts(kit):
    p = kit.plan(
        model=dict(kit.MIXTRAL, moe_router_topk=10),
        cluster={"num_gpus": 8},
        parallelism={"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "router_topk_exceeds_experts")
    assert f.severity == "error" and "at most 8" in f.fix


def test_context_parallel_needs_seq_length_multiple_of_2cp(kit):
    p = kit.plan(
        training={"seq_length": 8190},
        parallelism={"pipeline_model_parallel_size": 1, "context_parallel_size": 2},
    )
    f = kit.one(p, "seq_not_divisible_by_2cp")
    assert f.severity == "error"
    assert f.fields == ["training.seq_length", "parallelism.context_parallel_size"]
    assert f.message.startswith("seq-length should be a multiple of 2 * context-parallel-size")
    # with SP the CP chunk must also split over TP8: multiples of 2*2*8 = 32
    assert "8160 or 8192" in f.fix


def test_sequence_parallel_needs_seq_length_divisible_by_tp(kit):
    p = kit.plan(training={"seq_length": 4100})
    f = kit.one(p, "seq_not_divisible_for_sequence_parallel")
    assert f.severity == "error"
    assert "First dimension of the tensor should be divisible by tensor parallel size" in f.message
    assert "4096 or 4104" in f.fix


def test_mtp_on_a_pipeline_is_info_with_the_last_stage_load(kit):
    p = kit.plan(model={"name": "llama3-70b", "mtp_num_layers": 1})
    f = kit.one(p, "mtp_on_last_stage")
    assert f.severity == "info"
    assert "1.02x" in f.message  # (40 + 1) / 40 layers on the last stage


def test_mtp_needs_rope_or_no_position_embedding(kit):
    p = kit.plan(
        model={"name": "llama3-70b", "mtp_num_layers": 1, "position_embedding_type": "learned_absolute"}
    )
    f = kit.one(p, "mtp_needs_rope")
    assert f.severity == "error"
    assert "not supported with learned_absolute position embedding type" in f.message


def test_mla_with_flash_backend_warns_about_unequal_head_dims(kit):
    p = kit.plan(
        model=kit.DSV2_LITE,
        cluster={"num_gpus": 8},
        parallelism={"pipeline_model_parallel_size": 1},
        implementation={"attention_backend": "flash"},
    )
    f = kit.one(p, "mla_head_dims_with_flash")
    assert f.severity == "warning"
    assert "192" in f.message and "128" in f.message


def test_padded_vocab_is_reported(kit):
    f = kit.one(kit.plan(), "vocab_padded")
    assert f.severity == "info"
    # ceil(128256 / (128 * 8)) * 1024 = 126 * 1024
    assert "padded to 129024" in f.message and "768 extra rows" in f.message


def test_seq_length_beyond_the_models_context_is_a_warning(kit):
    p = kit.plan(training={"seq_length": 16384})
    f = kit.one(p, "seq_length_exceeds_model")
    assert f.severity == "warning"
    assert "(16384)" in f.message and "(8192)" in f.message
    assert "8192" in f.fix


# Hybrid Mamba models (Megatron HybridModel / MambaMixer).
def _hybrid(**kw):
    base = dict(hybrid_layer_pattern="M-M*-M-", hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                vocab_size=32000, mamba_num_heads=128, mamba_head_dim=64, mamba_num_groups=8)
    base.update(kw)
    return base


def _one_gpu_each(kit, model, **par):
    return kit.plan(model=model, cluster={"num_gpus": par.pop("num_gpus", 8)},
                    parallelism={"pipeline_model_parallel_size": 1, **par}, training={"seq_length": 4096})


def test_nemotron_h_on_tp8_passes_every_mamba_rule(kit):
    p = _one_gpu_each(kit, {"name": "nemotron-h-8b"}, tensor_model_parallel_size=8)
    assert not [c for c in kit.codes(p) if "mamba" in c or "hybrid" in c]


def test_mamba_groups_not_divisible_by_tp(kit):
    p = _one_gpu_each(kit, _hybrid(mamba_num_groups=2), tensor_model_parallel_size=4)
    f = kit.one(p, "mamba_heads_not_divisible_by_tp")
    assert f.severity == "error" and f.fields[0] == TP
    assert f.message.startswith("mamba_num_heads (128) and mamba_num_groups (2) must both be divisible by "
                                "tensor_model_parallel_size (4)")
    assert f.fix.endswith("1 or 2")  # TP must also divide the 2 groups


def test_mamba_heads_not_divisible_by_groups(kit):
    p = _one_gpu_each(kit, _hybrid(mamba_num_heads=100), tensor_model_parallel_size=1)
    f = kit.one(p, "mamba_heads_not_divisible_by_groups")
    assert f.message == "mamba_num_heads (100) must be evenly divisible by mamba_num_groups (8)"
    assert f.fix == "set model.mamba_num_groups to 4, 5 or 10"


def test_mamba_heads_of_a_tp_rank_must_split_over_cp(kit):
    # TP2: 64 heads and 4 groups per rank; CP3 splits neither.
    p = kit.plan(model={"name": "nemotron-h-8b"}, cluster={"num_gpus": 48},
                 parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                              "context_parallel_size": 3},
                 training={"seq_length": 6144, "global_batch_size": 64})
    f = kit.one(p, "mamba_heads_not_divisible_by_tp_cp")
    assert f.severity == "error" and f.fields[0] == "parallelism.context_parallel_size"
    assert f.fix == "set parallelism.context_parallel_size to 2, 4 or 8"


def test_hybrid_models_do_not_interleave_without_pattern_segments(kit):
    p = kit.plan(model={"name": "nemotron-h-8b"}, cluster={"num_gpus": 16},
                 parallelism={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2,
                              "virtual_pipeline_model_parallel_size": 2})
    f = kit.one(p, "hybrid_interleaved_pipeline")
    assert f.fix == "unset parallelism.virtual_pipeline_model_parallel_size"


def test_fp8_needs_a_16_aligned_mamba_in_proj(kit):
    # 2 * 6400 + 2 * 4 * 128 + 100 = 13924, not a multiple of 16.
    model = _hybrid(mamba_num_heads=100, mamba_num_groups=4)
    p = kit.plan(model=model, cluster={"num_gpus": 8}, parallelism={"pipeline_model_parallel_size": 1,
                 "tensor_model_parallel_size": 4}, training={"precision": "fp8"})
    assert "13924" in kit.one(p, "mamba_fp8_in_proj_width").message
    assert "mamba_fp8_in_proj_width" not in kit.codes(_one_gpu_each(kit, _hybrid(), tensor_model_parallel_size=4))


def test_mla_on_the_local_spec_is_an_error_megatron_raises_at_model_build(kit):
    p = kit.plan(model=kit.DSV2_LITE, cluster={"num_gpus": 8}, parallelism={"pipeline_model_parallel_size": 1},
                 implementation={"transformer_impl": "local"})
    f = kit.one(p, "mla_needs_transformer_engine")
    assert f.severity == "error" and f.fields == ["model.multi_latent_attention", "implementation.transformer_impl"]
    assert "k_channels" in f.message and "transformer_engine" in f.fix
    te = kit.plan(model=kit.DSV2_LITE, cluster={"num_gpus": 8}, parallelism={"pipeline_model_parallel_size": 1})
    assert "mla_needs_transformer_engine" not in kit.codes(te)
