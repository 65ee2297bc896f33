"""Hybrid Mamba models, MLA and MTP as Megatron builds them: FLOPs, parameters per rank, saved
activations and step time, each against a hand derivation from Megatron's modules."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.anatomy import param_counts
from mcore_advisor.physics.evaluate import evaluate_plan
from mcore_advisor.physics.flops import flops_per_token_breakdown
from mcore_advisor.physics.mamba import hybrid_rank_params, mamba_activation_bytes, mamba_flops_per_token
from mcore_advisor.physics.memory import (
    ActivationOptions,
    layer_activation_terms,
    memory_breakdown,
    rank_params,
)
from mcore_advisor.physics.step_time import hardware_params, step_time
from mcore_advisor.planning.search import Fixed, SearchInputs, search
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "knowledge"))
import _hf_configs as HF  # noqa: E402
from _hf_configs import MOONLIGHT_16B_A3B, NEMOTRON_H_8B  # noqa: E402

H8B = resolve_model(ModelSpec(name="nemotron-h-8b"))
NANO = resolve_model(ModelSpec(name="nemotron-3-nano-30b-a3b"))
DSV3 = resolve_model(ModelSpec(name="deepseek-v3"))


def plan(model: dict, gpus=8, seq=8192, gbs=64, mbs=1, **par) -> Plan:
    return Plan(model=ModelSpec(**model), cluster=ClusterSpec(num_gpus=gpus),
                training=TrainingSpec(seq_length=seq, global_batch_size=gbs, micro_batch_size=mbs),
                parallelism=ParallelismSpec(**par))


def test_hybrid_flops_are_megatrons_hybrid_flops():
    # training.py hybrid_flops per token, x3: 24 Mamba + 24 MLP + 4 attention layers + logits.
    h, s, V = 4096, 8192, 131072
    d_in, N, G, heads = 2 * h, 128, 8, 128
    mamba = 3 * (2 * h * (2 * d_in + 2 * G * N + heads) + 7 * d_in * N + 2 * d_in * h)
    mlp = 3 * 4 * h * 21504  # squared ReLU: two h x f GEMMs
    q, kv = 32 * 128, 8 * 128
    attn = 3 * (4 * h * q + 4 * h * kv + 2 * s * q)  # 4*T*h*p*(h + h*g/n) + 2*T*s*h*p (causal)
    logits = 3 * 2 * h * V
    bd = flops_per_token_breakdown(H8B, s)
    assert bd.mamba_flops == 24 * mamba
    assert bd.total_flops == 24 * mamba + 24 * mlp + 4 * attn + logits
    # Megatron counts d_in = 2*hidden even where heads x head dim is smaller (Nano: 4096, counted 5376).
    assert mamba_flops_per_token(NANO) == 3 * (2 * 2688 * (4 * 2688 + 2 * 8 * 128 + 64) + 7 * 5376 * 128 + 2 * 5376 * 2688)


def test_mamba_parameters_split_over_tp_and_the_pre_norms_stay_whole():
    pc = param_counts(H8B)
    layers = list(range(52))
    dense, expert, _ = hybrid_rank_params(H8B, layers, tp=1, ep=1, etp=1)
    assert dense == pc.total - pc.embedding - pc.output - 4096 and expert == 0  # final norm lives on the stage
    dense2, _, _ = hybrid_rank_params(H8B, layers, tp=2, ep=1, etp=1)
    assert dense2 == (dense - 52 * 4096) / 2 + 52 * 4096  # every block split, one whole RMSNorm per layer
    nano_dense, nano_expert, _ = hybrid_rank_params(NANO, list(range(52)), tp=1, ep=8, etp=1)
    assert nano_expert == param_counts(NANO).moe_routed / 8


def test_mamba_saved_activations_hand_derived():
    # mamba_split_conv1d_scan_combined keeps the (b,l,d) copy of in_proj's output (18560 wide) and the
    # pre-gate SSM output (8192); the gated RMSNorm its input (8192) + fp32 rstd per group (8);
    # out_proj its input (8192).
    tok = 8192
    assert mamba_activation_bytes(H8B, tok, tp=1, fp8=False) == tok * (2 * 18560 + 2 * 8192 * 3 + 4 * 8)
    assert mamba_activation_bytes(H8B, tok, tp=2, fp8=True) == tok * (18560 + 8192 + 8192 + 16 + 4096)


def test_memory_of_a_hybrid_sums_its_layer_kinds():
    # Swapping the 24 Mamba layers for MLP layers changes the saved activations by exactly
    # 24 x (Mamba mixer - MLP activations) (one pre-norm each either way).
    mlp_only = {"name": "nemotron-h-8b", "hybrid_layer_pattern": H8B.hybrid_layer_pattern.replace("M", "-")}
    a = memory_breakdown(plan({"name": "nemotron-h-8b"}, tensor_model_parallel_size=2, sequence_parallel=True))
    b = memory_breakdown(plan(mlp_only, tensor_model_parallel_size=2, sequence_parallel=True))
    terms = layer_activation_terms(H8B, 8192, 1, False, ActivationOptions(tp=2, sequence_parallel=True))
    per_layer = mamba_activation_bytes(H8B, 8192, 2, False) - terms["mlp_activations"]
    assert a.stages[0].activations_bytes - b.stages[0].activations_bytes == pytest.approx(24 * per_layer, rel=1e-12)
    assert a.fits and a.stages[0].num_params == round(param_counts(H8B).total / 2 + 52 * 4096 / 2 + 4096 / 2)


def test_step_time_of_a_hybrid_times_only_its_attention_layers_and_adds_the_scan():
    # Llama-3-8B has Nemotron-H-8B's attention (32 heads, 8 groups x 128, h 4096): 4 of 52 layers
    # against 32 of 32 at the same micro-batching.
    kw = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    h8 = step_time(plan({"name": "nemotron-h-8b"}, **kw))
    ll = step_time(plan({"name": "llama3-8b"}, **kw))
    assert h8.breakdown.attention_s == pytest.approx(ll.breakdown.attention_s * 4 / 32, rel=1e-12)
    assert h8.breakdown.ssm_scan_s > 0 and ll.breakdown.ssm_scan_s == 0
    assert sum(h8.breakdown.model_dump().values()) == pytest.approx(h8.iteration_time_s, rel=1e-9)


@pytest.mark.parametrize("cfg,gpus,par", [
    (NEMOTRON_H_8B, 8, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    (MOONLIGHT_16B_A3B, 8, dict(expert_model_parallel_size=8)),
], ids=["nemotron-h-8b", "moonlight-16b-a3b"])
def test_evaluate_plan_of_an_imported_config_names_memory_and_time_terms(cfg, gpus, par):
    ev = evaluate_plan(plan({"hf_config": json.dumps(cfg)}, gpus=gpus, seq=4096, **par))
    assert ev.feasible and ev.memory.activations_gib > 0 and ev.memory.optimizer_gib > 0
    b = ev.performance.breakdown
    assert b.gemm_s > 0 and b.attention_s > 0
    assert (b.ssm_scan_s > 0) == (cfg is NEMOTRON_H_8B) and (b.ep_comm_s > 0) == (cfg is MOONLIGHT_16B_A3B)
    assert any(line.startswith("dominant costs: ") for line in ev.explanation)
    # The same model from the catalog gives the same figures.
    name = "nemotron-h-8b" if cfg is NEMOTRON_H_8B else "moonlight-16b-a3b"
    assert evaluate_plan(plan({"name": name}, gpus=gpus, seq=4096, **par)).memory.total_gib == ev.memory.total_gib


def test_a_name_and_an_hf_config_together_are_rejected():
    with pytest.raises(ValueError, match=r"model\.name and model\.hf_config"):
        evaluate_plan(plan({"name": "llama3-8b", "hf_config": NEMOTRON_H_8B}))


def test_mla_saved_activations_follow_megatrons_modules():
    # DeepSeek-V3, TP 2 with SP, 4096 tokens: down-projection outputs on the SP shard (q_compressed
    # 1536 + its normed copy 1536 + rstd; kv_combined 576 + normed kv 512 + rstd), query/key/value
    # (128/2 heads x (192 + 192 + 128)); the up-projection outputs are not saved.
    tok, tp = 4096, 2
    t = layer_activation_terms(DSV3, tok, 1, True, ActivationOptions(tp=tp, sequence_parallel=True, ep=64, etp=1))
    down = (2 * 1536 + 2 * 1536 + 4 + 2 * 576 + 2 * 512 + 4) * tok / tp
    assert t["qkv"] == down + 2 * tok * 64 * (192 + 192 + 128)
    rc = layer_activation_terms(DSV3, tok, 1, True, ActivationOptions(tp=tp, sequence_parallel=True, ep=64, etp=1,
                                                                      recompute_modules=frozenset({"mla_up_proj"})))
    assert rc["qkv"] == down + 2 * tok * 64  # query/key/value discarded; the gathered k_pos_emb kept


def test_mla_down_projections_are_whole_on_every_tp_rank():
    one = rank_params(DSV3, [3], first=False, last=False, tp=1, ep=8, etp=1, seq_length=4096)
    eight = rank_params(DSV3, [3], first=False, last=False, tp=8, ep=8, etp=1, seq_length=4096)
    replicated = 7168 * 1536 + 7168 * 576 + 1536 + 512 + 2 * 7168 + 7168 * 256  # downs, latent norms, pre-norms, router
    split = 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168 + 3 * 7168 * 2048  # up-projections, output, shared expert
    assert one.dense == replicated + split and eight.dense == replicated + split / 8


def test_mtp_holds_an_embedding_copy_on_the_last_stage():
    no_mtp = DSV3.model_copy(update={"mtp_num_layers": 0})
    args = dict(first=False, last=True, tp=8, ep=8, etp=1, seq_length=4096)
    with_mtp = rank_params(DSV3, [60], **args).dense - rank_params(no_mtp, [60], **args).dense
    mtp_layer = rank_params(DSV3, [60], first=False, last=False, tp=8, ep=8, etp=1, seq_length=4096).dense
    V = DSV3.padded_vocab_size(8)
    # one MoE-type layer + eh_proj (2h x h / TP) + enorm, hnorm, final norm + the embedding copy
    assert with_mtp == mtp_layer + 2 * 7168 * 7168 / 8 + 3 * 7168 + V * 7168 / 8


def test_mtp_runs_a_layer_and_an_output_layer_more_on_the_last_stage():
    par = dict(tensor_model_parallel_size=8, expert_model_parallel_size=8, sequence_parallel=True)
    spec = {"name": "deepseek-v3", "num_layers": 4, "moe_layer_freq": [0, 1, 1, 1]}
    t1 = step_time(plan(spec, gpus=8, seq=4096, gbs=8, **par))
    t0 = step_time(plan({**spec, "mtp_num_layers": 0}, gpus=8, seq=4096, gbs=8, **par))
    extra = t1.iteration_time_s - t0.iteration_time_s
    # about one MoE layer + one output layer and loss of the four layers + output layer of the step
    assert 0.12 < extra / t0.iteration_time_s < 0.45
    assert t1.breakdown.gemm_s > t0.breakdown.gemm_s


@pytest.mark.parametrize("pp", [1, 2])
def test_the_search_prices_a_hybrid_exactly_as_memory_and_step_time(pp):
    cl = ClusterSpec(num_gpus=8)
    model = ModelSpec(name="nemotron-h-8b")
    inp = SearchInputs(shape=H8B, gpu=gpu("h100-sxm"), hardware=hardware_params(cl), cluster=cl, seq_length=4096,
                       global_batch_size=32, precisions=("bf16",), implementation=ImplementationSpec(),
                       capacity_gib=80.0, required_headroom_gib=0.0, fixed=Fixed(pp=pp))
    out = search(inp)
    for i in random.Random(3).sample(range(len(out.mbs)), min(8, len(out.mbs))):
        lo = out.layouts[int(out.layout[i])]
        rc = int(out.recompute[i])
        p = Plan(model=model, cluster=cl,
                 training=TrainingSpec(seq_length=4096, global_batch_size=32, micro_batch_size=int(out.mbs[i])),
                 parallelism=ParallelismSpec(
                     tensor_model_parallel_size=lo.tp, pipeline_model_parallel_size=lo.pp,
                     decoder_first_pipeline_num_layers=lo.split.first, decoder_last_pipeline_num_layers=lo.split.last,
                     context_parallel_size=lo.cp, sequence_parallel=lo.sp, tp_comm_overlap=lo.tp_overlap,
                     use_distributed_optimizer=bool(out.dist_opt[i]), overlap_param_gather=bool(out.dist_opt[i]),
                     recompute_granularity=[None, "selective", "full", "full"][rc],
                     recompute_method=[None, None, "block", "uniform"][rc],
                     recompute_num_layers=int(out.recompute_num_layers[i]) if rc >= 2 else None))
        assert memory_breakdown(p).total_gib == pytest.approx(float(out.memory_total_gib[i]), rel=1e-9)
        assert step_time(p).tokens_per_s_per_gpu == pytest.approx(float(out.tokens_per_s_per_gpu[i]), rel=1e-9)


FAMILIES = ["LLAMA_3_1_8B", "QWEN2_5_7B", "QWEN3_8B", "QWEN3_30B_A3B", "MIXTRAL_8X7B", "DEEPSEEK_V2_LITE",
            "DEEPSEEK_V3", "MOONLIGHT_16B_A3B", "GPT_OSS_20B", "NEMOTRON_H_8B", "NEMOTRON_3_NANO_30B_A3B"]


@pytest.mark.parametrize("name", FAMILIES)
def test_evaluate_plan_takes_every_familys_config_json_text(name):
    # Text as pasted; 64 GPUs with EP 8 (MoE) is a plan every one of these can be evaluated on.
    cfg = getattr(HF, name)
    moe = any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    ev = evaluate_plan(plan({"hf_config": json.dumps(cfg)}, gpus=64, seq=4096, gbs=128,
                            tensor_model_parallel_size=2, sequence_parallel=True,
                            expert_model_parallel_size=8 if moe else 1))
    assert ev.memory is not None and ev.performance is not None
    assert ev.performance.model_tflops_per_gpu_causal > 0 and ev.memory.total_gib > 0


def test_recommend_parallelism_takes_a_hybrid_config_json():
    from mcore_advisor.planning.recommend import RecommendRequest, recommend_parallelism

    r = recommend_parallelism(RecommendRequest(model={"hf_config": json.dumps(NEMOTRON_H_8B)},
                                               cluster={"num_gpus": 16}, seq_length=8192, what_if=False, top_k=2))
    best = r.plans[0]
    assert best.evaluation.feasible and best.evaluation.model.num_mamba_layers == 24
    assert best.plan.parallelism.virtual_pipeline_model_parallel_size is None  # hybrid: no interleaving
