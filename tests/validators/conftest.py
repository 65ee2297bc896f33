"""Plan builders for the validator tests: a known-good baseline plus targeted overrides."""

from __future__ import annotations

import pytest

from mcore_advisor.schemas import Finding, Plan
from mcore_advisor.validators import validate

# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 32 layers, hidden 4096, 32 heads, 8 KV heads,
# ffn 14336, 8 experts, top-2, vocab 32000.
MIXTRAL = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    vocab_size=32000,
    swiglu=True,
    normalization="RMSNorm",
    untie_embeddings_and_output_weights=True,
    num_experts=8,
    moe_router_topk=2,
)

# DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json): 27 layers (first dense), hidden 2048,
# 16 heads, MLA kv_lora_rank 512, no q compression, qk_nope 128, qk_rope 64, v 128, 64 routed experts
# top-6 of width 1408, 2 shared experts (2816), vocab 102400.
DSV2_LITE = dict(
    num_layers=27,
    hidden_size=2048,
    num_attention_heads=16,
    ffn_hidden_size=10944,
    vocab_size=102400,
    swiglu=True,
    normalization="RMSNorm",
    untie_embeddings_and_output_weights=True,
    num_experts=64,
    moe_router_topk=6,
    moe_ffn_hidden_size=1408,
    moe_shared_expert_intermediate_size=2816,
    moe_layer_freq=[0] + [1] * 26,
    multi_latent_attention=True,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
)

# Baseline: Llama-3-70B on 64 H100s, TP8 x PP2 x DP4 with SP, 8k context, GBS 128 (32 micro-batches).
BASE = {
    "model": {"name": "llama3-70b"},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 64},
    "training": {"seq_length": 8192, "global_batch_size": 128, "micro_batch_size": 1},
    "parallelism": {
        "tensor_model_parallel_size": 8,
        "pipeline_model_parallel_size": 2,
        "sequence_parallel": True,
    },
    "implementation": {},
}


class Kit:
    """`plan(parallelism={...})` merges section overrides into BASE; `model=` replaces the model section."""

    MIXTRAL = MIXTRAL
    DSV2_LITE = DSV2_LITE

    def plan(self, model: dict | None = None, **sections: dict) -> Plan:
        data = {k: dict(v) for k, v in BASE.items()}
        if model is not None:
            data["model"] = dict(model)
        for name, overrides in sections.items():
            data[name].update(overrides)
        return Plan.model_validate(data)

    def findings(self, plan: Plan) -> list[Finding]:
        return validate(plan)

    def codes(self, plan: Plan) -> list[str]:
        return [f.code for f in validate(plan)]

    def one(self, plan: Plan, code: str) -> Finding:
        found = [f for f in validate(plan) if f.code == code]
        assert len(found) == 1, f"expected one {code!r}, got {[f.code for f in validate(plan)]}"
        return found[0]


@pytest.fixture
def kit() -> Kit:
    return Kit()
