"""The GPU evidence runs: every configuration as a Plan, turned into the profile job's spec.

Run here (the project venv, which has pydantic):  .venv/bin/python benchmarks/gpu/configs.py
It writes benchmarks/gpu/specs.jsonl, one line per run: {name, group, nproc, needs_te, spec}. The
GPU machine has no pydantic, so runner.py there reads only that file. Each spec carries the exact
Plan (spec["plan"]) so estimate_memory / step_time can be compared with the measurement offline.

Groups: 'target' (issue-7 throughput targets), 'memory' (memory validation sweep), 'recommend'
(GPT 1.3B micro-batch x recompute sweep for the recommender check).
"""

from __future__ import annotations

import json
from pathlib import Path

from mcore_advisor.launcher.spec import job_spec
from mcore_advisor.schemas import Plan

HERE = Path(__file__).resolve().parent

GPT13 = {"name": "gpt3-1.3b"}
# GPT 2.7B as in TE-on-gpu.md: 32 layers, hidden 2560, 32 heads, 4h GeLU MLP, vocab 32768, RoPE.
GPT27 = {"name": "gpt3-1.3b", "num_layers": 32, "hidden_size": 2560, "num_attention_heads": 32, "ffn_hidden_size": 10240}
# A Llama-style GQA + SwiGLU + RMSNorm model of about 1.5B parameters.
GQA = {
    "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 4,
    "ffn_hidden_size": 5632, "vocab_size": 32000, "swiglu": True, "normalization": "RMSNorm",
    "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
}
# A small Mixtral-style MoE: 8 experts, top-2, every layer.
MOE = {
    "num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16, "num_query_groups": 4,
    "ffn_hidden_size": 2816, "vocab_size": 32000, "swiglu": True, "normalization": "RMSNorm",
    "add_bias_linear": False, "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
    "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2816, "moe_layer_freq": 1,
}
# Megatron-LM's command-line defaults (no distributed optimizer, no overlap), as the published
# pretrain_gpt.py runs of TE-on-gpu.md used.
MLM_DEFAULT_DDP = {"use_distributed_optimizer": False, "overlap_grad_reduce": False, "overlap_param_gather": False}
NO_GAF = {"gradient_accumulation_fusion": False}
LOCAL_SDPA = {"transformer_impl": "local", "attention_backend": "auto"}
LOCAL_UNFUSED = {"transformer_impl": "local", "attention_backend": "unfused"}
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
SEL = {"recompute_granularity": "selective"}


def plan(model, *, gpus=1, seq=2048, gbs=32, mbs=1, par=None, impl=None, train=None) -> Plan:
    return Plan(
        model=model,
        cluster={"gpu": "h200", "num_gpus": gpus},
        training={"seq_length": seq, "global_batch_size": gbs, "micro_batch_size": mbs, **(train or {})},
        parallelism=par or {},
        implementation=impl or {},
    )


def runs() -> list[tuple[str, str, Plan, dict]]:
    """(name, group, plan, job_spec kwargs)."""
    # Targets: 5 warm-up iterations (the first after the traced one ran 3% slow), 12 measured.
    prof = {"warmup_steps": 5, "measure_steps": 12, "profile_steps": (3, 3)}
    quick = {"warmup_steps": 2, "measure_steps": 3, "profile_steps": None}
    quick_prof = {"warmup_steps": 2, "measure_steps": 3, "profile_steps": (2, 2)}
    out = [
        # (a) issue-7 targets
        ("t_gpt1.3b_te_bf16_mbs8", "target", plan(GPT13, mbs=8, par=MLM_DEFAULT_DDP), prof),
        ("t_gpt1.3b_te_fp8_mbs8", "target", plan(GPT13, mbs=8, par=MLM_DEFAULT_DDP, train={"precision": "fp8", "fp8_format": "hybrid"}), prof),
        ("t_gpt2.7b_te_tp2sp_mbs8", "target", plan(GPT27, gpus=2, gbs=64, mbs=8, par={**MLM_DEFAULT_DDP, "tensor_model_parallel_size": 2, "sequence_parallel": True}), prof),
        ("t_gpt1.3b_sdpa_mbs8", "target", plan(GPT13, mbs=8, par=MLM_DEFAULT_DDP, impl=LOCAL_SDPA), prof),
        # Like-for-like with Megatron-LM's reference runs, which had no Apex and so passed
        # --no-gradient-accumulation-fusion (the rows above let TE accumulate wgrad in the GEMM).
        ("t_gpt1.3b_te_bf16_mbs8_nogaf", "target", plan(GPT13, mbs=8, par=MLM_DEFAULT_DDP, impl=NO_GAF), prof),
        ("t_gpt1.3b_te_fp8_mbs8_nogaf", "target", plan(GPT13, mbs=8, par=MLM_DEFAULT_DDP, impl=NO_GAF, train={"precision": "fp8", "fp8_format": "hybrid"}), prof),
        ("t_gpt2.7b_te_tp2sp_mbs8_nogaf", "target", plan(GPT27, gpus=2, gbs=64, mbs=8, impl=NO_GAF, par={**MLM_DEFAULT_DDP, "tensor_model_parallel_size": 2, "sequence_parallel": True}), prof),
        # (b) memory validation sweep
        ("m_gpt1.3b_unfused_mbs4", "memory", plan(GPT13, mbs=4, par=MLM_DEFAULT_DDP, impl=LOCAL_UNFUSED), quick),
        ("m_gpt1.3b_sdpa_mbs8_full", "memory", plan(GPT13, mbs=8, par={**MLM_DEFAULT_DDP, **FULL}, impl=LOCAL_SDPA), quick),
        ("m_gpt1.3b_seq4096_mbs2", "memory", plan(GPT13, seq=4096, gbs=16, mbs=2), quick),
        ("m_gpt1.3b_seq8192_mbs1_sel", "memory", plan(GPT13, seq=8192, gbs=8, mbs=1, par=SEL), quick),
        ("m_gqa1.5b_seq4096_mbs2", "memory", plan(GQA, seq=4096, gbs=16, mbs=2), quick),
        ("m_gqa1.5b_seq4096_mbs4_sel", "memory", plan(GQA, seq=4096, gbs=16, mbs=4, par=SEL), quick),
        ("m_gqa1.5b_seq4096_mbs2_full", "memory", plan(GQA, seq=4096, gbs=16, mbs=2, par=FULL), quick),
        ("m_moe8x_top2_mbs4", "memory", plan(MOE, gbs=16, mbs=4), quick),
        ("m_gpt1.3b_tp2_mbs4", "memory", plan(GPT13, gpus=2, mbs=4, par={"tensor_model_parallel_size": 2}), quick_prof),
        ("m_gpt1.3b_tp2sp_mbs4", "memory", plan(GPT13, gpus=2, mbs=4, par={"tensor_model_parallel_size": 2, "sequence_parallel": True}), quick_prof),
        ("m_gpt1.3b_pp2_mbs2", "memory", plan(GPT13, gpus=2, mbs=2, par={"pipeline_model_parallel_size": 2}), quick_prof),
        ("m_gpt1.3b_dp2_distopt_mbs4", "memory", plan(GPT13, gpus=2, mbs=4, par={"use_distributed_optimizer": True}), quick_prof),
        ("m_gpt1.3b_dp2_nodistopt_mbs4", "memory", plan(GPT13, gpus=2, mbs=4, par={"use_distributed_optimizer": False, "overlap_param_gather": False}), quick_prof),
        ("m_moe8x_top2_ep2_mbs4", "memory", plan(MOE, gpus=2, gbs=16, mbs=4, par={"expert_model_parallel_size": 2}), quick_prof),
        ("m_gqa1.5b_pp2vp2_mbs1", "memory", plan(GQA, gpus=2, seq=4096, gbs=16, mbs=1, par={"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}), quick_prof),
    ]
    # (d) Megatron's --manual-gc: the PP2+VP2 row had a 0.36 s gen-2 collection inside a measured step
    gc_runs = {"warmup_steps": 2, "measure_steps": 12, "profile_steps": None}
    pp2vp2 = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    out += [
        ("g_gqa1.5b_pp2vp2_mbs1_autogc", "gc", plan(GQA, gpus=2, seq=4096, gbs=16, mbs=1, par=pp2vp2), gc_runs),
        ("g_gqa1.5b_pp2vp2_mbs1_manualgc", "gc", plan(GQA, gpus=2, seq=4096, gbs=16, mbs=1, par=pp2vp2,
                                                      impl={"manual_gc": True}), gc_runs),
    ]
    # (c) recommender check: GPT 1.3B, seq 2048, GBS 32, one H200, TE, micro-batch x recompute
    for mbs in (1, 2, 4, 8, 16):
        for rname, rc in (("none", {}), ("sel", SEL), ("full", FULL)):
            out.append((f"r_gpt1.3b_mbs{mbs}_{rname}", "recommend", plan(GPT13, mbs=mbs, par=rc), quick))
    return out


def main() -> None:
    lines = []
    for name, group, p, kw in runs():
        spec = job_spec(p, **kw)
        lines.append(json.dumps({
            "name": name,
            "group": group,
            "nproc": p.cluster.num_gpus,
            "needs_te": p.implementation.transformer_impl == "transformer_engine",
            "spec": spec,
        }))
    (HERE / "specs.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} runs to {HERE / 'specs.jsonl'}")


if __name__ == "__main__":
    main()
