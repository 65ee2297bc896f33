"""The one layer anatomy (physics.anatomy): matrices and splits as Megatron builds them, the FLOPs and
parameter counts computed from them, and the profile job's use of it without pydantic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mcore_advisor.knowledge.models import model_catalog, resolve_model
from mcore_advisor.physics import anatomy as A
from mcore_advisor.physics.flops import flops_per_iteration, flops_per_token_breakdown
from mcore_advisor.schemas import ModelSpec, mamba_in_proj_width

CATALOG = sorted(model_catalog())


def _shape(name: str):
    return resolve_model(ModelSpec(name=name))


def _dump(shape) -> dict:
    """The model as the profile job reads it: the job spec's JSON (launcher/spec.py)."""
    return json.loads(json.dumps(shape.model_dump(mode="json")))


@pytest.mark.parametrize("name", CATALOG)
def test_the_profile_jobs_json_model_gives_the_cores_flops(name):
    shape = _shape(name)
    for convention in ("causal", "full"):
        for tp in (1, 8):
            V = shape.padded_vocab_size(tp)
            job = A.flops_per_iteration(_dump(shape), 4096, 32, convention, padded_vocab_size=V)
            assert job == flops_per_iteration(shape, 4096, 32, convention, tensor_model_parallel_size=tp)


def test_the_job_path_follows_a_custom_moe_layer_pattern():
    spec = ModelSpec(num_layers=12, hidden_size=1024, num_attention_heads=16, num_query_groups=4, vocab_size=32000,
                     swiglu=True, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2816,
                     moe_shared_expert_intermediate_size=1408, moe_layer_freq=2)
    shape = resolve_model(spec)
    h, V = 1024, shape.padded_vocab_size(1)
    attn = 6 * (h * (16 + 2 * 4) * 64 + 16 * 64 * h) + 6 * 2 * 16 * 64 * 2048 / 2
    dense, moe = 6 * 3 * h * shape.ffn_hidden_size, 6 * 3 * h * (2 * 2816 + 1408)  # layers 0, 2, ... are MoE
    want = (12 * attn + 6 * dense + 6 * moe + 6 * h * V) * 2048 * 7
    assert A.flops_per_iteration(_dump(shape), 2048, 7, "causal", padded_vocab_size=V) == want


@pytest.mark.parametrize("name", CATALOG)
def test_the_profile_jobs_json_model_gives_the_cores_parameter_counts_and_weights(name):
    # The counts themselves are checked against each model's published total (tests/knowledge/test_model_catalog.py).
    shape = _shape(name)
    for include_mtp in (True, False):
        assert A.param_counts(_dump(shape), 4096, include_mtp) == A.param_counts(shape, 4096, include_mtp)
    assert A.linear_weights(_dump(shape)) == A.linear_weights(shape)


def test_llama3_8b_linear_weights_are_megatrons_fused_qkv_and_gated_fc1():
    # h 4096, 32 heads and 8 KV groups of 128, SwiGLU ffn 14336: linear_qkv (n + 2g) * d = 6144 rows
    # (column-parallel), linear_proj 4096 x 4096 (row); fc1 gate + up 2 * 14336 rows (column), fc2 row.
    lw = A.linear_weights(_shape("llama3-8b"))
    assert lw["attention"] == ((6144, 4096, 0), (4096, 4096, 1))
    assert lw["mlp"] == ((28672, 4096, 0), (4096, 14336, 1))
    assert lw["expert"] == lw["shared_expert"] == lw["mamba"] == ()


def test_nemotron_h_8b_mamba_in_proj_is_the_validators_width():
    # 128 heads of 64 (d_inner 8192), 8 groups of state 128: z, x = 2 * 8192, B, C = 2 * 8 * 128, dt = 128.
    shape = _shape("nemotron-h-8b")
    assert A.linear_weights(shape)["mamba"] == ((18560, 4096, 0), (4096, 8192, 1))
    assert mamba_in_proj_width(shape) == mamba_in_proj_width(A._Fields(_dump(shape))) == 18560


def test_gpt_full_convention_from_the_json_model_is_narayanans_closed_form():
    # Narayanan et al. 2021 eq. 3 (full s^2): 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)); causal halves the s^2 term.
    m = _dump(_shape("gpt3-1.3b"))
    B, s, L, h, V = 32, 2048, 24, 2048, 32768
    want = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert A.flops_per_iteration(m, s, B, "full", padded_vocab_size=V) == pytest.approx(want, rel=1e-12)
    causal = A.flops_per_iteration(m, s, B, "causal", padded_vocab_size=V)
    assert want - causal == pytest.approx(72 * B * s * L * h * h * s / (6 * h) / 2, rel=1e-12)


def test_hybrid_flops_from_the_json_model_count_each_symbols_block():
    # nemotron-h-8b: 24 Mamba, 24 MLP, 4 attention layers (the job's former copy counted 52 GPT layers).
    shape = _shape("nemotron-h-8b")
    h, s, V = 4096, 8192, shape.padded_vocab_size(1)
    d_in, N, G, heads = 2 * h, 128, 8, 128
    mamba = 3 * (2 * h * (2 * d_in + 2 * G * N + heads) + 7 * d_in * N + 2 * d_in * h)
    mlp = 3 * 4 * h * 21504  # squared ReLU: two h x f GEMMs
    attn = 3 * (4 * h * 32 * 128 + 4 * h * 8 * 128 + 2 * s * 32 * 128)  # causal
    per_token = 24 * mamba + 24 * mlp + 4 * attn + 6 * h * V
    assert A.flops_per_iteration(_dump(shape), s, 1, "causal", padded_vocab_size=V) == per_token * s


def test_importing_the_anatomy_loads_no_pydantic():
    code = ("import sys, mcore_advisor.physics.anatomy as A, mcore_advisor.launcher.entry.result; "
            "assert 'pydantic' not in sys.modules, sorted(m for m in sys.modules if 'pydantic' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mla_down_projections_are_replicated_and_only_the_output_projection_is_row_parallel():
    attn = A.anatomy(_shape("deepseek-v3")).blocks["attention"]
    splits = {m.name: (m.out_features, m.in_features, m.split) for m in attn.matrices}
    assert splits == {
        "linear_q_down_proj": (1536, 7168, "replicated"),
        "linear_q_up_proj": (128 * 192, 1536, "column"),
        "linear_kv_down_proj": (512 + 64, 7168, "replicated"),
        "linear_kv_up_proj": (128 * 256, 512, "column"),
        "linear_proj": (7168, 128 * 128, "row"),
    }
    assert attn.whole_params == 1536 + 512  # the q and kv latent RMSNorms


def test_row_parallel_biases_are_whole_on_every_tp_rank_as_megatron_counted_them():
    # gpt3-1.3b (catalog: h 2048, 24 layers, ffn 8192, LayerNorm, biases, untied, RoPE, V 32768) at
    # TP2: Megatron reported num_params_local = 671559680 on each rank (benchmarks/results/
    # gpu_memory_sweep.jsonl, m_gpt1.3b_tp2sp_mbs4). qkv and fc1 split with their biases; proj and
    # fc2 split, their biases (h each) whole; two LayerNorms (2h each) whole.
    h, tp = 2048, 2
    layer = (3 * h * h + 3 * h + 4 * h * h + 4 * h + h * h + 4 * h * h) / tp + 2 * h + 2 * 2 * h
    total = 24 * layer + 2 * 32768 * h / tp + 2 * h  # + embedding, untied output layer, final LayerNorm
    assert total == 671559680
    rp = A.rank_params(_shape("gpt3-1.3b"), list(range(24)), first=True, last=True, tp=tp, ep=1, etp=1, seq_length=2048)
    assert rp.dense == total and rp.expert == 0


def test_the_routers_weight_and_bias_are_whole_and_fp8_counts_only_linear_layers():
    # gpt-oss-20b MoE layer: h 2880, 64 heads and 8 KV groups of 64, 32 experts of 2880 (SwiGLU),
    # biases everywhere, RMSNorm. TopKRouter: E x h weight + E bias (add_bias_linear), whole.
    shape = _shape("gpt-oss-20b")
    h, E, f, tp, ep, etp = 2880, 32, 2880, 4, 8, 2
    qkv, proj = (80 * 64 * h + 80 * 64) / tp, 64 * 64 * h / tp + h
    router, norms = E * h + E, 2 * h
    expert = (2 * f * h + 2 * f) / etp + f * h / etp + h  # fc1 (gate + up) with its bias split, fc2's bias whole
    rp = A.rank_params(shape, [0], first=False, last=False, tp=tp, ep=ep, etp=etp, seq_length=4096)
    assert rp.dense == pytest.approx(qkv + proj + router + norms, rel=1e-15)
    assert rp.expert == pytest.approx(E / ep * expert, rel=1e-15)
    assert rp.fp8_eligible == pytest.approx(qkv + proj + E / ep * expert, rel=1e-15)


def test_tp_leaves_the_total_unchanged_except_replicated_parts():
    shape = _shape("deepseek-v3")
    a = A.anatomy(shape)
    one, eight = (a.layer_params_on_rank(a.layers[3], tp, 8, 1) for tp in (1, 8))
    whole = 7168 * 1536 + 7168 * 576 + 1536 + 512 + 2 * 7168 + (256 * 7168)  # downs, latent norms, pre-norms, router
    assert eight[0] == pytest.approx(whole + (one[0] - whole) / 8, rel=1e-15)
    assert one[1] == eight[1] == 256 * 3 * 7168 * 2048 / 8


def test_unknown_convention_is_rejected_by_the_job_path_too():
    with pytest.raises(ValueError, match="convention"):
        A.flops_per_iteration(_dump(_shape("gpt3-1.3b")), 64, 1, "half", padded_vocab_size=32768)  # type: ignore[arg-type]


def test_breakdown_parts_are_the_anatomys_blocks():
    # MoE toy with an MTP layer: counts per block kind times the block's FLOPs, logits once per head.
    bd = flops_per_token_breakdown(_shape("deepseek-v3"), 4096)
    a = A.anatomy(_shape("deepseek-v3"))
    assert bd.moe_routed_flops == a.blocks["moe"].expert_flops * (58 + 1)
    assert bd.dense_mlp_flops == a.blocks["mlp"].flops * 3
    assert bd.num_attention_layers == 62
