"""The GPU evidence runs: every configuration as a Plan, turned into the profile job's spec.

Run here (the project venv, which has pydantic):  .venv/bin/python benchmarks/gpu/configs.py
It writes benchmarks/gpu/specs.jsonl, one line per run: {name, group, nproc, needs_te, spec}. The
GPU machine has no pydantic, so runner.py there reads only that file. Each spec carries the exact
Plan (spec["plan"]) and the Megatron argv rendered for it (spec["megatron_argv"]); the profile job
runs Megatron-LM's own training loop on that argv (launcher/entry/profile.py), so every row is what
the user's pretrain_gpt.py run of the rendered script would show.

Groups (issue 14, deliverable 5; one H100):
- 'megatron': single-GPU runs: dense GPT 1.3B and a Llama-style 1B (GQA, SwiGLU, RMSNorm, untied),
  Transformer Engine and the local spec, recompute none / selective / full, seq 2k-16k, FP8 delayed
  and tensorwise, a small MoE with TE's grouped GEMM;
- 'at_scale': memory_at_scale (Megatron's --fake-process-group) of the memory model's most-loaded
  rank of recommend_parallelism's top plans for Llama-3-70B on 64 H100s, Llama-3.1-405B on 1,024,
  Mixtral-8x22B on 256 (EP) and DeepSeek-V3 on 1,024 (MLA, MTP). Their global batch is lowered to
  2 x PP micro-batches per data-parallel rank (more than Megatron's schedule ever holds in flight:
  1F1B holds at most PP, the interleaved schedule's warm-up (PP - r - 1) x 2 + (VP - 1) x PP + 1
  chunks, fewer than 2 x PP x VP), so two iterations take seconds, not many minutes, at the same
  peak; the rows carry the plan as run and are predicted for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from mcore_advisor.launcher.spec import job_spec
from mcore_advisor.schemas import Plan, parallel_dims, with_changes
from mcore_advisor.tools.recommend import RecommendRequest, recommend_parallelism

HERE = Path(__file__).resolve().parent
GPU = "h100-sxm"

GPT13 = {"name": "gpt3-1.3b"}
# A Llama-style model of about 0.85B parameters: GQA (16 heads, 4 K/V groups), SwiGLU, RMSNorm,
# no biases, untied embeddings, RoPE.
LLAMA1B = {
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
LOCAL = {"transformer_impl": "local"}
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
SEL = {"recompute_granularity": "selective"}
FP8 = {"precision": "fp8", "fp8_format": "hybrid"}
#: (model, GPUs, sequence length) of the at-scale plans the issue names
AT_SCALE = (("llama3-70b", 64, 8192), ("llama3.1-405b", 1024, 8192), ("mixtral-8x22b", 256, 4096),
            ("deepseek-v3", 1024, 4096))


def plan(model, *, seq=2048, tokens=65536, mbs=1, par=None, impl=None, train=None) -> Plan:
    """A one-GPU plan with `tokens` per step (global batch = tokens / seq)."""
    return Plan(
        model=model,
        cluster={"gpu": GPU, "num_gpus": 1},
        training={"seq_length": seq, "global_batch_size": tokens // seq, "micro_batch_size": mbs, **(train or {})},
        parallelism=par or {},
        implementation=impl or {},
    )


def at_scale_plan(model: str, gpus: int, seq: int) -> Plan:
    """recommend_parallelism's top plan with its global batch lowered to 2 x PP micro-batches per DP rank."""
    rec = recommend_parallelism(RecommendRequest(model={"name": model}, cluster={"gpu": GPU, "num_gpus": gpus},
                                                 seq_length=seq, top_k=1, what_if=False))
    top = rec.plans[0].plan
    d = parallel_dims(top)
    return with_changes(top, "training", global_batch_size=2 * d.pp * d.dp * top.training.micro_batch_size)


def runs() -> list[tuple[str, str, Plan, dict]]:
    """(name, group, plan, job_spec kwargs)."""
    quick = {"warmup_steps": 2, "measure_steps": 4, "profile_steps": None}
    traced = {"warmup_steps": 2, "measure_steps": 4, "profile_steps": (2, 2)}
    out = [
        ("d13_te_s2k_mbs4", "megatron", plan(GPT13, mbs=4), traced),
        ("d13_te_s2k_mbs8", "megatron", plan(GPT13, mbs=8), quick),
        ("d13_te_s2k_mbs8_fp8delayed", "megatron", plan(GPT13, mbs=8, train={**FP8, "fp8_recipe": "delayed"}), quick),
        ("d13_te_s2k_mbs8_fp8tensorwise", "megatron", plan(GPT13, mbs=8, train={**FP8, "fp8_recipe": "tensorwise"}), quick),
        ("d13_local_s2k_mbs4", "megatron", plan(GPT13, mbs=4, impl=LOCAL), quick),
        ("d13_te_s8k_mbs1_full", "megatron", plan(GPT13, seq=8192, par=FULL), quick),
        ("d13_te_s16k_mbs1_sel", "megatron", plan(GPT13, seq=16384, par=SEL), quick),
        ("l1b_te_s2k_mbs4", "megatron", plan(LLAMA1B, mbs=4), quick),
        ("l1b_te_s4k_mbs2_sel", "megatron", plan(LLAMA1B, seq=4096, mbs=2, par=SEL), quick),
        ("l1b_local_s2k_mbs2", "megatron", plan(LLAMA1B, mbs=2, impl=LOCAL), quick),
        ("moe8x_te_grouped_s2k_mbs4", "megatron", plan(MOE, mbs=4, impl={"moe_grouped_gemm": True}), quick),
    ]
    for model, gpus, seq in AT_SCALE:
        out.append((f"s_{model}_{gpus}", "at_scale", at_scale_plan(model, gpus, seq), {"mode": "memory_at_scale"}))
    # 'smoke': seconds-long checks of the entry on the machine before the evidence runs (not recorded)
    tiny = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1024}
    tiny_moe = {**tiny, "swiglu": True, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 256}
    out += [
        ("smoke_te", "smoke", plan(tiny, seq=512, tokens=4096, mbs=2, train=FP8), traced),
        ("smoke_scale", "smoke", Plan(model=tiny_moe, cluster={"gpu": GPU, "num_gpus": 64},
                                      training={"seq_length": 512, "global_batch_size": 64, "micro_batch_size": 1},
                                      parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                                   "context_parallel_size": 2, "expert_model_parallel_size": 4,
                                                   "expert_tensor_parallel_size": 1, "sequence_parallel": True},
                                      implementation={"moe_grouped_gemm": True}), {"mode": "memory_at_scale", "rank": 16}),
    ]
    return out


def main() -> None:
    lines = []
    for name, group, p, kw in runs():
        spec = job_spec(p, **kw)
        lines.append(json.dumps({
            "name": name,
            "group": group,
            "nproc": 1 if spec["mode"] == "memory_at_scale" else p.cluster.num_gpus,
            "needs_te": p.implementation.transformer_impl == "transformer_engine",
            "spec": spec,
        }))
    (HERE / "specs.jsonl").write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} runs to {HERE / 'specs.jsonl'}")


if __name__ == "__main__":
    main()
