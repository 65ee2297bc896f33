"""A Hugging Face `config.json` turned into a ModelSpec, field by field as Megatron-Bridge maps it.

Pure: JSON text or a dict in, a ModelSpec out (reading a file is the adapters' job). The common
fields follow Megatron-Bridge's `MegatronModelBridge.CONFIG_MAPPING`
(src/megatron/bridge/models/conversion/model_bridge.py); each family adds what its bridge sets:
the DeepSeek bridges (MLA, `first_k_dense_replace`, shared experts = `moe_intermediate_size *
n_shared_experts`, MTP from `num_nextn_predict_layers`), the Qwen MoE bridges (`decoder_sparse_step`,
`mlp_only_layers`), Mixtral and GPT-OSS (every layer MoE), Nemotron-H (`hybrid_override_pattern`,
`ssm_state_size` -> mamba_state_dim, `n_groups` -> mamba_num_groups, squared ReLU, no position
embedding). A field that would change the model's shape or cost and is not modelled raises
ValueError naming it and what to do; fields that only matter to tokenizers, inference or
initialisation are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from mcore_advisor.schemas import MAMBA_CONV_KERNEL, ModelSpec

# HF field -> ModelSpec (Megatron) field: Megatron-Bridge CONFIG_MAPPING, restricted to what a
# ModelSpec holds (rms_norm_eps -> layernorm_epsilon is Megatron's --norm-epsilon).
_COMMON = {
    "num_hidden_layers": "num_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups",
    "head_dim": "kv_channels",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "seq_length_max",
    "rms_norm_eps": "norm_epsilon",
    "mlp_bias": "add_bias_linear",
    "use_qk_norm": "qk_layernorm",
    "rope_theta": "rotary_base",
    "partial_rotary_factor": "rotary_percent",
    "num_experts_per_tok": "moe_router_topk",
    "moe_intermediate_size": "moe_ffn_hidden_size",
    "scoring_func": "moe_router_score_function",
    "n_group": "moe_router_num_groups",
    "topk_group": "moe_router_group_topk",
    "routed_scaling_factor": "moe_router_topk_scaling_factor",
}
_MLA = {
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_head_dim",
    "qk_rope_head_dim": "qk_pos_emb_head_dim",
    "v_head_dim": "v_head_dim",
}
_MAMBA = {
    "mamba_num_heads": "mamba_num_heads",
    "mamba_head_dim": "mamba_head_dim",
    "ssm_state_size": "mamba_state_dim",
    "n_groups": "mamba_num_groups",
    "attention_head_dim": "kv_channels",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "layer_norm_epsilon": "norm_epsilon",
    "norm_eps": "norm_epsilon",
    "use_bias": "add_bias_linear",
}
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts")

# Fields with no effect on the layer shapes, FLOPs or memory of training: tokenizer ids, dtype,
# initialisation, inference caches and kernels, router loss coefficients and normalisation.
_IGNORED = frozenset({
    "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "attention_dropout",
    "hidden_dropout", "quantization_config", "pretraining_tp", "max_window_layers", "output_router_logits",
    "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "norm_topk_prob", "topk_method", "ep_size",
    "router_jitter_noise", "num_logits_to_keep", "rescale_prenorm_residual", "residual_in_fp32",
    "time_step_min", "time_step_max", "time_step_floor", "time_step_limit", "time_step_rank", "chunk_size",
    "mamba_hidden_act", "use_mamba_kernels", "mamba_ssm_cache_dtype", "mamba_proj_bias", "use_conv_bias",
    "initial_context_length", "swiglu_limit", "sliding_window", "use_sliding_window", "layer_types",
    "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers",
    "shared_expert_intermediate_size", "experts_per_token", "num_nextn_predict_layers", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "hidden_act", "mlp_hidden_act", "attention_bias",
    "hybrid_override_pattern", "layers_block_type", "conv_kernel", "expand", "moe_latent_size",
    "mtp_hybrid_override_pattern", "moe_shared_expert_overlap", *_EXPERT_COUNT,
})

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3", "GptOssForCausalLM": "gpt_oss", "NemotronHForCausalLM": "nemotron_h",
}
_HYBRID_BLOCKS = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}
_FIX = "or describe the model with explicit model fields (num_layers, hidden_size, num_attention_heads, vocab_size, ...)"


def parse_hf_config(text: str) -> dict[str, Any]:
    """The JSON object of a config.json's text; ValueError (field hf_config) when it is not one."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"hf_config is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): paste the whole "
            "config.json text (the CLI also takes its path)"
        ) from None
    if not isinstance(cfg, dict):
        raise ValueError("hf_config must be a JSON object (the contents of config.json)")
    return cfg


def model_from_hf_config(config: str | Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json (its text or the parsed dict).

    Supported model_type: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v2,
    deepseek_v3 (MLA, MoE, MTP), gpt_oss and nemotron_h (hybrid Mamba). Raises ValueError naming
    the field when the config is not one of those or holds an architecture feature not modelled.
    """
    cfg = dict(parse_hf_config(config) if isinstance(config, str) else config)
    family = _family(cfg)
    unknown = sorted(k for k in cfg if k not in _IGNORED and k not in _COMMON and k not in _MLA and k not in _MAMBA)
    if unknown:
        raise ValueError(
            f"hf_config field(s) {', '.join(unknown)} not understood for model_type {family!r}: if they only "
            f"concern tokenizers, inference or initialisation, delete them and retry, {_FIX}"
        )
    for field in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if cfg.get(field) is None:
            raise ValueError(f"hf_config.{field} is missing: every {family} config.json has it")
    # Bridge defaults: RoPE, no linear biases unless mlp_bias (family functions override both).
    spec = {"position_embedding_type": "rope", "add_bias_linear": False, **_mapped(cfg, _COMMON)}
    spec.update(_rope(cfg))
    spec.update(_FAMILIES[family](cfg, family))
    # transformers' config classes of these families default tie_word_embeddings to False.
    spec.update(untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False), normalization="RMSNorm")
    if spec.get("position_embedding_type") == "none":
        for key in ("rotary_base", "rotary_percent", "rope_scaling_factor"):
            spec.pop(key, None)
    try:
        return ModelSpec(**spec)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"hf_config gives model.{err['loc'][0]} an invalid value: {err['msg']}") from None


def _family(cfg: dict) -> str:
    # model_type first; a model_type of its own on a known architecture (Kimi-K2's kimi_k2 on
    # DeepseekV3ForCausalLM) resolves through the architecture, as Megatron-Bridge registers bridges.
    family = cfg.get("model_type")
    if family not in _FAMILIES:
        family = next((_ARCHITECTURES[a] for a in cfg.get("architectures") or [] if a in _ARCHITECTURES), family)
    if family not in _FAMILIES:
        if "text_config" in cfg:
            raise ValueError("hf_config has a text_config (a multimodal wrapper): pass the text_config object itself")
        raise ValueError(
            f"hf_config.model_type {family!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}, {_FIX}"
        )
    return family


def _mapped(cfg: dict, table: dict[str, str]) -> dict:
    out: dict = {}
    for hf, ours in table.items():
        if cfg.get(hf) is not None and ours not in out:
            out[ours] = cfg[hf]
    return out


def _rope(cfg: dict) -> dict:
    """RoPE base and context-extension factor; transformers >= 5 nests them in rope_parameters."""
    out: dict = {}
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is not None:
        out["rotary_base"] = int(theta)  # Megatron's --rotary-base is an int
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in ("llama3", "yarn", "linear", "dynamic") and scaling.get("factor") is not None:
        out["rope_scaling_factor"] = scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"hf_config.rope_scaling type {kind!r} is not understood: it does not change the model's "
                         "cost, so delete rope_scaling and retry")
    return out


def _gated_silu(cfg: dict, family: str) -> dict:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hf_config.hidden_act {act!r}: {family} MLPs are modelled as gated SiLU (Megatron --swiglu) "
                         f"only; {_FIX.removeprefix('or ')}")
    return {"swiglu": True}


def _full_attention(cfg: dict, family: str) -> None:
    """Sliding-window layers change attention FLOPs and memory: only GPT-OSS's are accepted (documented)."""
    windowed = cfg.get("use_sliding_window", cfg.get("sliding_window") is not None and family in ("mistral", "mixtral", "llama"))
    types = set(cfg.get("layer_types") or ["full_attention"])
    if windowed or types != {"full_attention"}:
        raise ValueError(f"hf_config.sliding_window / layer_types: sliding-window attention of {family} is not "
                         f"modelled (full attention would be overestimated); {_FIX.removeprefix('or ')}")


def _experts(cfg: dict) -> int | None:
    return next((cfg[k] for k in _EXPERT_COUNT if cfg.get(k)), None)


def _dense(cfg: dict, family: str) -> dict:
    _full_attention(cfg, family)
    out = _gated_silu(cfg, family)
    # Bridge Qwen3: per-head q/k RMSNorm. Not modelled: Qwen2's q/k/v biases and attention_bias
    # (n*d + 2*g*d per layer, < 0.01% of these models).
    if family.startswith("qwen3"):
        out["qk_layernorm"] = True
    return out


def _every_layer_moe(cfg: dict, family: str) -> dict:
    """Mixtral and GPT-OSS: every layer's MLP is an MoE of intermediate_size-wide experts."""
    if family != "gpt_oss":
        _full_attention(cfg, family)
    out = _gated_silu(cfg, family)
    out.update(num_experts=_experts(cfg), moe_ffn_hidden_size=cfg["intermediate_size"], moe_layer_freq=1,
               moe_router_topk=cfg.get("num_experts_per_tok") or cfg.get("experts_per_token"))
    if family == "gpt_oss":
        # Bridge GPT-OSS: biases on QKV, output, experts and router (attention_bias).
        out["add_bias_linear"] = bool(cfg.get("attention_bias", True))
    return out


def _qwen_moe(cfg: dict, family: str) -> dict:
    out = _dense(cfg, family)
    L, step, dense_only = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    # transformers Qwen2/3-MoE: layer i is sparse when i is not in mlp_only_layers and (i + 1) % step == 0.
    freq = [0 if i in dense_only or (i + 1) % step else 1 for i in range(L)]
    out.update(num_experts=_experts(cfg), moe_layer_freq=1 if all(freq) else freq)
    if cfg.get("shared_expert_intermediate_size"):
        out["moe_shared_expert_intermediate_size"] = cfg["shared_expert_intermediate_size"]
    return out


def _deepseek(cfg: dict, family: str) -> dict:
    out = _gated_silu(cfg, family)
    out.update(_mapped(cfg, _MLA), multi_latent_attention=True, q_lora_rank=cfg.get("q_lora_rank"))
    out["num_query_groups"] = None  # MLA has no K/V groups (num_key_value_heads = heads in these configs)
    E = _experts(cfg)
    if E:
        L, k, freq = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        # modeling_deepseek: layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0.
        pattern = [1 if i >= k and i % freq == 0 else 0 for i in range(L)]
        out.update(num_experts=E, moe_layer_freq=1 if all(pattern) else pattern)
        if cfg.get("n_shared_experts"):
            out["moe_shared_expert_intermediate_size"] = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    if cfg.get("num_nextn_predict_layers"):
        out["mtp_num_layers"] = cfg["num_nextn_predict_layers"]
    return out


def _nemotron_h(cfg: dict, family: str) -> dict:
    pattern = _hybrid_pattern(cfg)
    _reject_unmodelled_mamba(cfg)
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"hf_config.mlp_hidden_act {act!r}: Nemotron-H MLPs are modelled as squared ReLU only")
    out = _mapped(cfg, _MAMBA)
    # Bridge Nemotron-H: squared-ReLU MLPs, no position embedding in the attention layers.
    out.update(hybrid_layer_pattern=pattern, swiglu=False, squared_relu=True, position_embedding_type="none",
               add_bias_linear=bool(cfg.get("use_bias", False)), num_layers=None)
    if cfg.get("mamba_num_heads") is None and cfg.get("expand", 2) != 2:
        out["mamba_num_heads"] = cfg["expand"] * cfg["hidden_size"] // cfg.get("mamba_head_dim", 64)
    if "E" in pattern:
        # Bridge Nemotron-H: sigmoid router with an aux-loss-free expert bias.
        out.update(num_experts=_experts(cfg), moe_router_topk=cfg.get("num_experts_per_tok"),
                   moe_router_score_function="sigmoid")
    return out


def _hybrid_pattern(cfg: dict) -> str:
    blocks = cfg.get("layers_block_type")
    pattern = cfg.get("hybrid_override_pattern") or ("".join(_HYBRID_BLOCKS.get(b, "?") for b in blocks) if blocks else None)
    if not pattern:
        raise ValueError("hf_config.hybrid_override_pattern (or layers_block_type) is missing: a nemotron_h config "
                         "names each layer's type")
    if len(pattern) != cfg["num_hidden_layers"]:
        raise ValueError(f"hf_config.hybrid_override_pattern has {len(pattern)} layers but num_hidden_layers is "
                         f"{cfg['num_hidden_layers']}: make them agree")
    return pattern


def _reject_unmodelled_mamba(cfg: dict) -> None:
    if cfg.get("conv_kernel", MAMBA_CONV_KERNEL) != MAMBA_CONV_KERNEL:
        raise ValueError(f"hf_config.conv_kernel {cfg['conv_kernel']}: Megatron's MambaMixer builds a "
                         f"{MAMBA_CONV_KERNEL}-wide convolution; such a model cannot be trained with Megatron-LM as is")
    if cfg.get("mamba_proj_bias") or cfg.get("use_conv_bias") is False:
        raise ValueError("hf_config.mamba_proj_bias / use_conv_bias: Megatron's MambaMixer asserts no projection "
                         "bias and a convolution bias; such a model cannot be trained with Megatron-LM as is")
    if cfg.get("moe_latent_size"):
        raise ValueError("hf_config.moe_latent_size: latent MoE projections are not modelled; "
                         + _FIX.removeprefix("or "))
    if cfg.get("num_nextn_predict_layers") or cfg.get("mtp_hybrid_override_pattern"):
        raise ValueError("hf_config.num_nextn_predict_layers / mtp_hybrid_override_pattern: MTP in hybrid models is "
                         "not modelled; delete them to plan the main model alone")


_FAMILIES: dict[str, Callable[[dict, str], dict]] = {
    "llama": _dense, "mistral": _dense, "qwen2": _dense, "qwen3": _dense,
    "mixtral": _every_layer_moe, "gpt_oss": _every_layer_moe,
    "qwen2_moe": _qwen_moe, "qwen3_moe": _qwen_moe,
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
    "nemotron_h": _nemotron_h,
}
