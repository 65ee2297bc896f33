"""Megatron's model FLOPs per iteration, dependency-free, for the profile job.

A minimal copy of physics/flops.py (which the job cannot import: it needs pydantic). Both follow
`num_floating_point_operations` / `transformer_flops` in Megatron-LM megatron/training/training.py:
every GEMM x2 (multiply-add) x3 (forward, data-gradient, weight-gradient); norms, softmax,
activations, router and the embedding lookup are not counted; recompute is not counted.
'causal' counts half of the s x s core-attention matrix (Megatron since 2025-03, what 0.12+ logs);
'full' counts all of it (older Megatron, NeMo 24.x, Narayanan 2021). The test
tests/launcher/test_spec.py asserts this equals physics.flops.flops_per_iteration.

`model` is a resolved ModelShape dumped to a dict (spec["model"]).
"""

from __future__ import annotations

from typing import Any

_GEMM = 3 * 2  # fwd + dgrad + wgrad, 2 FLOPs per multiply-add


def padded_vocab_size(model: dict[str, Any], tensor_model_parallel_size: int) -> int:
    """Megatron's _vocab_size_with_padding: V rounded up to make_vocab_size_divisible_by * TP."""
    m = int(model.get("make_vocab_size_divisible_by", 128)) * tensor_model_parallel_size
    return -(-int(model["vocab_size"]) // m) * m


def flops_per_token(model: dict[str, Any], seq_length: int, convention: str = "causal", *, padded_vocab: int) -> float:
    """Training FLOPs per token (fwd+bwd) as Megatron counts them."""
    if convention not in ("causal", "full"):
        raise ValueError(f"convention must be 'causal' or 'full', got {convention!r}")
    cf = 0.5 if convention == "causal" else 1.0
    h, n, s = model["hidden_size"], model["num_attention_heads"], seq_length
    mtp = int(model.get("mtp_num_layers") or 0)
    L = model["num_layers"]
    pattern = list(model.get("moe_layer_pattern") or [0] * L)
    if model.get("num_experts"):
        moe = sum(pattern)
        dense = L - moe
        # MTP layers copy the type of the last decoder layer (Megatron's MTP block spec).
        last_moe = pattern[-1] if pattern else 0
        moe += last_moe * mtp
        dense += (1 - last_moe) * mtp
    else:
        dense, moe = L + mtp, 0
    attn_layers = L + mtp

    if model.get("multi_latent_attention"):
        d_qk, d_rope, d_v = model["qk_head_dim"], model["qk_pos_emb_head_dim"], model["v_head_dim"]
        r_kv, q_lora = model["kv_lora_rank"], model.get("q_lora_rank")
        q_term = h * n * (d_qk + d_rope) if q_lora is None else q_lora * (h + n * (d_qk + d_rope) + 1)
        linear = q_term + r_kv * (h + n * (d_qk + d_v) + 1) + h * d_rope + n * d_v * h
        core = s * (n * (d_qk + d_rope) + n * d_v) * cf
    else:
        d = model["kv_channels"]
        q = n * d
        linear = h * (q + 2 * model["num_query_groups"] * d) + q * h
        core = q * s * cf * 2  # QK^T and PV
    ffn_mult = 3 if model.get("swiglu") else 2  # SwiGLU fc1 is h -> 2f
    total = _GEMM * (linear + core) * attn_layers
    total += _GEMM * h * model["ffn_hidden_size"] * ffn_mult * dense
    total += _GEMM * h * (model.get("moe_ffn_hidden_size") or 0) * (model.get("moe_router_topk") or 0) * ffn_mult * moe
    total += _GEMM * h * (model.get("moe_shared_expert_intermediate_size") or 0) * ffn_mult * moe
    total += _GEMM * mtp * (3 * h + 2 * h * h)  # MTP eh-norms and eh-projection
    total += _GEMM * h * padded_vocab * (mtp + 1)  # logits
    return float(total)


def flops_per_iteration(
    model: dict[str, Any], seq_length: int, global_batch_size: int, convention: str = "causal", *, padded_vocab: int
) -> float:
    """Model FLOPs of one global batch: Megatron's num_floating_point_operations(args, gbs)."""
    return flops_per_token(model, seq_length, convention, padded_vocab=padded_vocab) * global_batch_size * seq_length
