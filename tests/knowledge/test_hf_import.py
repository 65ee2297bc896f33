"""Hugging Face config.json import: every family's published config against the catalog and the
published parameter counts; field mappings as Megatron-Bridge makes them; clear errors."""

import json

import pytest
from _hf_configs import (
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    GPT_OSS_20B,
    LLAMA_3_1_8B,
    MIXTRAL_8X7B,
    MOONLIGHT_16B_A3B,
    NEMOTRON_3_NANO_30B_A3B,
    NEMOTRON_H_8B,
    QWEN2_5_7B,
    QWEN3_8B,
    QWEN3_30B_A3B,
)

from mcore_advisor.knowledge.hf_import import model_from_hf_config
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.anatomy import count_params, param_counts
from mcore_advisor.schemas import MODEL_SETTINGS, ModelSpec


def imported(cfg):
    return resolve_model(model_from_hf_config(cfg))


@pytest.mark.parametrize("cfg,key", [
    (LLAMA_3_1_8B, "llama3.1-8b"), (QWEN3_8B, "qwen3-8b"), (QWEN3_30B_A3B, "qwen3-30b-a3b"),
    (MIXTRAL_8X7B, "mixtral-8x7b"), (DEEPSEEK_V3, "deepseek-v3"), (DEEPSEEK_V2_LITE, "deepseek-v2-lite"),
    (MOONLIGHT_16B_A3B, "moonlight-16b-a3b"), (GPT_OSS_20B, "gpt-oss-20b"), (NEMOTRON_H_8B, "nemotron-h-8b"),
    (NEMOTRON_3_NANO_30B_A3B, "nemotron-3-nano-30b-a3b"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_an_imported_config_resolves_to_the_catalog_shape(cfg, key):
    # Two independent descriptions of one model (catalog entry written from the model card and
    # provider, import from config.json) agree on every resolved field that sets the model's cost
    # (MODEL_SETTINGS such as the RoPE base or norm epsilon are not all in the catalog).
    skip = {"name", *MODEL_SETTINGS}
    assert imported(cfg).model_dump(exclude=skip) == resolve_model(ModelSpec(name=key)).model_dump(exclude=skip)


def test_a_model_type_of_its_own_on_a_known_architecture_is_read_by_its_architecture():
    # Kimi-K2 ships model_type kimi_k2 on DeepseekV3ForCausalLM (the DeepSeek-V3 bridge converts it).
    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "first_k_dense_replace": 1,
            "num_attention_heads": 64, "num_nextn_predict_layers": 0}
    s = model_from_hf_config(kimi)
    assert s.num_experts == 384 and s.moe_layer_freq == [0] + [1] * 60 and s.multi_latent_attention


def test_text_and_dict_give_the_same_spec():
    assert model_from_hf_config(json.dumps(DEEPSEEK_V3)) == model_from_hf_config(DEEPSEEK_V3)


def test_common_fields_map_as_megatron_bridge_maps_them():
    s = model_from_hf_config(LLAMA_3_1_8B)
    assert (s.num_layers, s.hidden_size, s.ffn_hidden_size, s.num_attention_heads, s.num_query_groups) == (32, 4096, 14336, 32, 8)
    assert (s.rotary_base, s.rope_scaling_factor, s.norm_epsilon, s.seq_length_max) == (500000, 8.0, 1e-5, 131072)
    assert s.untie_embeddings_and_output_weights is True  # tie_word_embeddings false
    assert s.swiglu is True and s.add_bias_linear is False and s.normalization == "RMSNorm"
    assert model_from_hf_config({**LLAMA_3_1_8B, "tie_word_embeddings": True}).untie_embeddings_and_output_weights is False


def test_deepseek_v3_mla_moe_and_mtp():
    s = model_from_hf_config(DEEPSEEK_V3)
    assert s.multi_latent_attention and (s.q_lora_rank, s.kv_lora_rank, s.qk_head_dim, s.qk_pos_emb_head_dim, s.v_head_dim) == (1536, 512, 128, 64, 128)
    assert s.moe_layer_freq == [0, 0, 0] + [1] * 58  # first_k_dense_replace 3
    assert s.moe_shared_expert_intermediate_size == 2048  # moe_intermediate_size x n_shared_experts
    assert (s.moe_router_score_function, s.moe_router_topk_scaling_factor, s.moe_router_num_groups, s.moe_router_group_topk) == ("sigmoid", 2.5, 8, 4)
    assert s.mtp_num_layers == 1 and s.rope_scaling_factor == 40


def test_mla_without_query_compression():
    for cfg in (MOONLIGHT_16B_A3B, DEEPSEEK_V2_LITE):
        s = model_from_hf_config(cfg)
        assert s.q_lora_rank is None and s.multi_latent_attention and s.moe_shared_expert_intermediate_size == 2 * 1408
        assert not s.mtp_num_layers
    assert model_from_hf_config(MOONLIGHT_16B_A3B).rotary_base == 50000


def test_qwen_moe_layer_placement_follows_transformers():
    # Qwen2/3-MoE: layer i is sparse unless listed in mlp_only_layers, and when (i + 1) % step == 0.
    s = model_from_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert s.moe_layer_freq == [0, 1, 0, 1, 0, 0]
    assert model_from_hf_config(QWEN3_30B_A3B).moe_layer_freq == 1
    assert model_from_hf_config(QWEN3_8B).qk_layernorm is True


def test_nemotron_h_hybrid_fields():
    s = model_from_hf_config(NEMOTRON_H_8B)
    assert s.hybrid_layer_pattern == NEMOTRON_H_8B["hybrid_override_pattern"] and s.num_layers is None
    assert (s.mamba_num_heads, s.mamba_head_dim, s.mamba_state_dim, s.mamba_num_groups) == (128, 64, 128, 8)
    assert (s.swiglu, s.squared_relu, s.position_embedding_type, s.kv_channels) == (False, True, "none", 128)
    nano = model_from_hf_config(NEMOTRON_3_NANO_30B_A3B)
    assert (nano.num_experts, nano.moe_router_topk, nano.moe_shared_expert_intermediate_size) == (128, 6, 3712)
    # layers_block_type, the list spelling of newer configs, gives the same pattern.
    blocks = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}
    listed = {k: v for k, v in NEMOTRON_3_NANO_30B_A3B.items() if k != "hybrid_override_pattern"}
    listed["layers_block_type"] = [blocks[c] for c in NEMOTRON_3_NANO_30B_A3B["hybrid_override_pattern"]]
    assert model_from_hf_config(listed) == nano


def test_hand_derived_parameter_counts_of_imported_configs():
    # Nemotron-H-8B, part by part (Megatron MambaMixer / HybridModel; h 4096, V 131072):
    h, V = 4096, 131072
    d_inner, G, N, heads = 128 * 64, 8, 128, 128
    mamba = (2 * d_inner + 2 * G * N + heads) * h + d_inner * h + (d_inner + 2 * G * N) * 5 + 3 * heads + d_inner
    mlp = 2 * h * 21504
    attn = (32 * 128 + 2 * 8 * 128) * h + 32 * 128 * h
    total = 2 * V * h + 24 * mamba + 24 * mlp + 4 * attn + 52 * h + h  # one pre-norm per layer + final norm
    assert mamba == 109_635_968
    pc = param_counts(imported(NEMOTRON_H_8B))
    assert pc.mamba == 24 * mamba and pc.total == total == 8_100_852_736  # the checkpoint's count
    # DeepSeek-V3: 671,026,419,200 in the checkpoint without MTP, minus the 58 x 256 routing biases
    # that Megatron keeps as a buffer.
    assert count_params(imported(DEEPSEEK_V3), include_mtp=False) + 58 * 256 == 671_026_419_200
    assert count_params(imported(MIXTRAL_8X7B)) == 46_702_792_704
    # Published totals: Moonlight "16B", DeepSeek-V2-Lite 15.7B, Nemotron 3 Nano 31.6B, GPT-OSS-20B
    # 20.91B, Qwen2.5-7B 7.61B (its q/k/v biases, 0.13M, are not modelled).
    for cfg, billions, rel in ((MOONLIGHT_16B_A3B, 16.0, 0.01), (DEEPSEEK_V2_LITE, 15.7, 0.005),
                               (NEMOTRON_3_NANO_30B_A3B, 31.6, 0.005), (GPT_OSS_20B, 20.91, 0.005),
                               (QWEN2_5_7B, 7.61, 0.005)):
        assert count_params(imported(cfg)) / 1e9 == pytest.approx(billions, rel=rel)


@pytest.mark.parametrize("cfg,field", [
    ("{not json", "not valid JSON"),
    ({**LLAMA_3_1_8B, "model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}, "model_type 'gemma3' is not supported"),
    ({"text_config": LLAMA_3_1_8B, "model_type": "llava"}, "text_config"),
    ({**LLAMA_3_1_8B, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({**LLAMA_3_1_8B, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096}, "sliding-window"),
    ({**NEMOTRON_H_8B, "conv_kernel": 3}, "conv_kernel 3"),
    ({**NEMOTRON_3_NANO_30B_A3B, "moe_latent_size": 1024}, "moe_latent_size"),
    ({**NEMOTRON_3_NANO_30B_A3B, "num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({**NEMOTRON_H_8B, "num_hidden_layers": 50}, "has 52 layers but num_hidden_layers is 50"),
    ({k: v for k, v in LLAMA_3_1_8B.items() if k != "vocab_size"}, "hf_config.vocab_size is missing"),
    ({**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "longrope"}}, "rope_scaling type 'longrope'"),
    ({**LLAMA_3_1_8B, "hidden_size": -4}, "invalid value"),
])
def test_configs_it_cannot_describe_raise_a_value_error_naming_the_field(cfg, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace("*", r"\*")) as e:
        model_from_hf_config(cfg)
    assert "hf_config" in str(e.value)
