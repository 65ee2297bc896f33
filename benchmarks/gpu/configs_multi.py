"""Multi-GPU evidence runs (issue 20): every plan on one machine of N GPUs, through the profile job.

Run here (the project venv):  .venv/bin/python benchmarks/gpu/configs_multi.py [--gpus 2|4]
It writes benchmarks/gpu/specs_multi.jsonl in runner.py's format ({name, group, nproc, needs_te,
spec}); benchmarks/gpu/multi_gpu.sh runs it on the device machine. Two groups:
- 'multi': the plan on all N GPUs (Megatron's own loop on render_launch_script's argv), traced at
  iteration 3 so exposed communication comes from the torch.profiler trace;
- 'multi_fake': the same plan as `--fake-process-group` on one GPU (memory_at_scale mode, the rank
  the memory model finds most loaded), what a user's one-GPU memory check of the plan shows.
  tp_comm_overlap plans have no fake row: TE's userbuffers exchange CUDA IPC handles with real peers.

Layouts (N = 2; N = 4 doubles each degree where the model allows): TP with and without SP and
tp_comm_overlap, PP with and without VP, CP at 16k and 32k tokens, DP with the distributed
optimizer and grad/param overlap (and plain DDP), MoE (8 experts top-2 and 64 experts top-8, each
with a shared expert, grouped GEMM) under EP with the alltoall and allgather dispatchers, TE bf16
and FP8 (delayed and tensorwise current scaling). Rows are listed most-wanted first: runner.py
starts them in this order and stops at its deadline.

Held-out rule (fixed before any run): a row is held out when crc32(name) % 3 == 0 (`held_out`);
held-out rows are reported separately and never used to derive a constant.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

from configs import FP8, GPU, LLAMA1B, MOE, SEL  # the one-GPU set's models and settings

from mcore_advisor.launcher.spec import job_spec
from mcore_advisor.schemas import Plan, with_changes

HERE = Path(__file__).resolve().parent
SPECS = HERE / "specs_multi.jsonl"

MOE8 = {**MOE, "moe_shared_expert_intermediate_size": 2816}
# Fine-grained: 64 experts of a quarter of the 8-expert width, top-8, same shared expert.
MOE64 = {**MOE, "num_experts": 64, "moe_router_topk": 8, "moe_ffn_hidden_size": 704,
         "moe_shared_expert_intermediate_size": 2816}
DELAYED = {**FP8, "fp8_recipe": "delayed"}
TENSORWISE = {**FP8, "fp8_recipe": "tensorwise"}
NO_DP_OVERLAP = {"use_distributed_optimizer": False, "overlap_grad_reduce": False, "overlap_param_gather": False}
#: traced at iteration 3 (2 is the profiler's warm-up, 4 its export): 7 iterations in all
RUN = {"warmup_steps": 1, "measure_steps": 3, "profile_steps": (3, 3)}


#: the second set (session s5): the same layouts on models whose GPU work per layer and micro-batch
#: outweighs this VM's host (~10 ms to issue a TE layer's forward + backward, s4's traces), the
#: regime users train in; more measured iterations against the run-to-run spread of a VM's steps.
#: Llama-3-8B's layer (GQA 32/8, SwiGLU 14,336), 8 of them; MoE twice s4's width.
LLAMA_L = {**LLAMA1B, "num_layers": 8, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
           "ffn_hidden_size": 14336}
MOE8_L = {**MOE8, "num_layers": 8, "hidden_size": 2048, "ffn_hidden_size": 5632, "moe_ffn_hidden_size": 5632,
          "moe_shared_expert_intermediate_size": 5632}
MOE64_L = {**MOE8_L, "num_experts": 64, "moe_router_topk": 8, "moe_ffn_hidden_size": 1408}
RUN_L = {"warmup_steps": 1, "measure_steps": 6, "profile_steps": (3, 3)}
RUN_PEAK = {"warmup_steps": 2, "measure_steps": 5, "profile_steps": (4, 4)}
#: the job's switch that replays what is live at iteration 2's memory peak (launcher/entry/mem_peak.py)
MEMORY_PEAK_ENV = {"MCORE_ADVISOR_MEMORY_PEAK": "1"}


def held_out(name: str) -> bool:
    """The crc32 third; every O_* row (the fresh set, declared held out before it ran)."""
    return name.startswith("O_") or zlib.crc32(name.encode()) % 3 == 0


def plan(model: dict, n: int, *, seq: int, gbs: int, mbs: int = 1, par: dict | None = None,
         impl: dict | None = None, train: dict | None = None) -> Plan:
    return Plan(model=model, cluster={"gpu": GPU, "num_gpus": n},
                training={"seq_length": seq, "global_batch_size": gbs, "micro_batch_size": mbs, **(train or {})},
                parallelism=par or {}, implementation=impl or {})


def dense_rows(n: int) -> list[tuple[str, Plan]]:
    """TP, PP, CP and DP of the 0.85B Llama-style model; 32k tokens per step, 64k for DP."""
    tp, sp, pp, cp = {"tensor_model_parallel_size": n}, {"sequence_parallel": True}, {"pipeline_model_parallel_size": n}, {"context_parallel_size": n}
    vp = {**pp, "virtual_pipeline_model_parallel_size": 2}
    m = LLAMA1B
    return [
        (f"tp{n}_sp", plan(m, n, seq=4096, gbs=8, mbs=2, par={**tp, **sp})),
        (f"tp{n}", plan(m, n, seq=4096, gbs=8, mbs=2, par=tp)),
        (f"tp{n}_sp_tpoverlap", plan(m, n, seq=4096, gbs=8, mbs=2, par={**tp, **sp, "tp_comm_overlap": True})),
        (f"pp{n}", plan(m, n, seq=4096, gbs=8, par=pp)),
        (f"pp{n}_vp2", plan(m, n, seq=4096, gbs=8, par=vp)),
        (f"cp{n}_s16k", plan(m, n, seq=16384, gbs=2, par=cp)),
        (f"cp{n}_s32k", plan(m, n, seq=32768, gbs=1, par=cp)),
        (f"dp{n}_distopt_overlap", plan(m, n, seq=4096, gbs=8 * n, mbs=2)),
        (f"dp{n}_ddp_nooverlap", plan(m, n, seq=4096, gbs=8 * n, mbs=2, par=NO_DP_OVERLAP)),
    ]


def moe_rows(n: int) -> list[tuple[str, Plan]]:
    """EP over all N GPUs (the dense part data-parallel), grouped GEMM, 16k tokens per GPU per step."""
    ep = {"expert_model_parallel_size": n}
    out = []
    for tag, model in (("moe8top2", MOE8), ("moe64top8", MOE64)):
        for disp in ("alltoall", "allgather"):
            out.append((f"{tag}_ep{n}_{disp}", plan(model, n, seq=4096, gbs=4 * n, par=ep,
                                                    impl={"moe_grouped_gemm": True, "moe_token_dispatcher_type": disp})))
    return out


def fp8_rows(n: int) -> list[tuple[str, Plan]]:
    tpsp = {"tensor_model_parallel_size": n, "sequence_parallel": True}
    ep = {"expert_model_parallel_size": n}
    rows = []
    for tag, train in (("fp8delayed", DELAYED), ("fp8tensorwise", TENSORWISE)):
        rows += [(f"tp{n}_sp_{tag}", plan(LLAMA1B, n, seq=4096, gbs=8, mbs=2, par=tpsp, train=train)),
                 (f"dp{n}_{tag}", plan(LLAMA1B, n, seq=4096, gbs=8 * n, mbs=2, train=train))]
    rows.append((f"moe8top2_ep{n}_alltoall_fp8delayed", plan(MOE8, n, seq=4096, gbs=4 * n, par=ep, train=DELAYED,
                                                             impl={"moe_grouped_gemm": True})))
    return rows


def extra_rows(n: int) -> list[tuple[str, Plan]]:
    """Second-priority variations: recompute under TP, TP inside an EP group, a longer PP schedule."""
    return [
        (f"tp{n}_sp_sel_s8k", plan(LLAMA1B, n, seq=8192, gbs=4, mbs=1, par={"tensor_model_parallel_size": n,
                                                                            "sequence_parallel": True, **SEL})),
        (f"moe8top2_tp{n}_sp_ep{n}_etp1", plan(MOE8, n, seq=4096, gbs=4, par={
            "tensor_model_parallel_size": n, "sequence_parallel": True, "expert_model_parallel_size": n,
            "expert_tensor_parallel_size": 1}, impl={"moe_grouped_gemm": True})),
        (f"pp{n}_vp2_mb16", plan(LLAMA1B, n, seq=4096, gbs=16, par={"pipeline_model_parallel_size": n,
                                                                     "virtual_pipeline_model_parallel_size": 2})),
        (f"dp{n}_distopt_overlap_mbs1", plan(LLAMA1B, n, seq=4096, gbs=8 * n, mbs=1)),
    ]


def runs(n: int) -> list[tuple[str, Plan]]:
    """All plans, most-wanted first: one of each layout, then FP8, then the rest."""
    d, m, f, x = dense_rows(n), moe_rows(n), fp8_rows(n), extra_rows(n)
    # tp_sp, dp_distopt, moe8 alltoall, pp_vp2, cp_s16k, tp_sp fp8 delayed, moe8 allgather,
    # tp_sp_tpoverlap, moe64 alltoall, pp, dp fp8 tensorwise
    first = [d[0], d[7], m[0], d[4], d[5], f[0], m[1], d[2], m[2], d[3], f[3]]
    rest = [r for r in d + m + f + x if r not in first]
    return first + rest


def _lines(rows: list[tuple[str, Plan]], n: int) -> tuple[list[dict], list[dict]]:
    real, fake = [], []
    for name, p in rows:
        base = {"needs_te": p.implementation.transformer_impl == "transformer_engine", "held_out": held_out(name)}
        real.append({"name": name, "group": "multi", "nproc": n, **base, "spec": job_spec(p, **RUN)})
        if not p.parallelism.tp_comm_overlap:
            fake.append({"name": f"fake_{name}", "group": "multi_fake", "nproc": 1, **base,
                         "spec": job_spec(p, mode="memory_at_scale")})
    return real, fake


#: on 4 GPUs, the 2-GPU plans that need Transformer Engine (the 2 x H200 lease ran without it), run
#: two at a time on GPU pairs between the 4-GPU plans
TE_ONLY_2GPU = ("tp2_sp", "tp2_sp_tpoverlap", "cp2_s16k", "cp2_s32k", "tp2_sp_fp8delayed", "dp2_fp8tensorwise",
                "moe8top2_ep2_alltoall_fp8delayed", "tp2_sp_sel_s8k", "moe8top2_tp2_sp_ep2_etp1", "dp2_fp8delayed",
                "tp2_sp_fp8tensorwise")


#: the one-GPU memory_at_scale rows of configs.py that still lack a measurement (issue 14)
AT_SCALE_ROWS = ("s_llama3-70b_64", "s_mixtral-8x22b_256")


def _at_scale_rows() -> list[dict]:
    rows = [json.loads(x) for x in (HERE / "specs.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["name"] in AT_SCALE_ROWS]


def spec_lines(n: int) -> list[dict]:
    """Run order: the first 11 plans on n GPUs; on 4 GPUs then the at-scale memory rows and the fake
    rows of those 11 (one GPU each, four at a time), and the TE-only 2-GPU plans (two at a time);
    then the other n-GPU plans and their fake rows."""
    rows = runs(n)
    real, fake = _lines(rows[:11], n)
    if n != 4:
        r3, f3 = _lines(rows[11:], n)
        return real + r3 + fake + f3
    r2, f2 = _lines([r for r in runs(2) if r[0] in TE_ONLY_2GPU], 2)
    r3, f3 = _lines(rows[11:], n)
    return real + _at_scale_rows() + fake + r2 + r3 + f3 + f2


def large_rows(n: int) -> list[tuple[str, Plan]]:
    """The second set's plans on n GPUs (names L_*): micro-batches sized so each rank's GPU work per
    layer and micro-batch is about twice or more the ~10 ms this VM's host needs to issue it."""
    tp, sp = {"tensor_model_parallel_size": n}, {"sequence_parallel": True}
    pp, cp, ep = {"pipeline_model_parallel_size": n}, {"context_parallel_size": n}, {"expert_model_parallel_size": n}
    vp = {**pp, "virtual_pipeline_model_parallel_size": 2}
    m = LLAMA_L
    grouped = {"moe_grouped_gemm": True}
    return [
        (f"L_tp{n}_sp", plan(m, n, seq=4096, gbs=32, mbs=8, par={**tp, **sp})),
        (f"L_dp{n}_distopt_overlap", plan(m, n, seq=4096, gbs=8 * n, mbs=2)),
        (f"L_moe8top2_ep{n}_alltoall", plan(MOE8_L, n, seq=4096, gbs=8 * n, mbs=4, par=ep,
                                            impl={**grouped, "moe_token_dispatcher_type": "alltoall"})),
        (f"L_pp{n}_vp2", plan(m, n, seq=4096, gbs=16, mbs=2, par=vp)),
        (f"L_cp{n}_s16k", plan(m, n, seq=16384, gbs=2, par=cp)),
        (f"L_tp{n}_sp_fp8delayed", plan(m, n, seq=4096, gbs=32, mbs=8, par={**tp, **sp}, train=DELAYED)),
        (f"L_moe8top2_ep{n}_allgather", plan(MOE8_L, n, seq=4096, gbs=8 * n, mbs=4, par=ep,
                                             impl={**grouped, "moe_token_dispatcher_type": "allgather"})),
        (f"L_tp{n}_sp_tpoverlap", plan(m, n, seq=4096, gbs=32, mbs=8, par={**tp, **sp, "tp_comm_overlap": True})),
        (f"L_moe64top8_ep{n}_alltoall", plan(MOE64_L, n, seq=4096, gbs=8 * n, mbs=4, par=ep,
                                             impl={**grouped, "moe_token_dispatcher_type": "alltoall"})),
        (f"L_pp{n}", plan(m, n, seq=4096, gbs=16, mbs=2, par=pp)),
        (f"L_dp{n}_fp8tensorwise", plan(m, n, seq=4096, gbs=8 * n, mbs=2, train=TENSORWISE)),
        (f"L_tp{n}", plan(m, n, seq=4096, gbs=32, mbs=8, par=tp)),
        (f"L_cp{n}_s32k", plan(m, n, seq=32768, gbs=1, par=cp)),
        (f"L_dp{n}_ddp_nooverlap", plan(m, n, seq=4096, gbs=8 * n, mbs=2, par=NO_DP_OVERLAP)),
        (f"L_tp{n}_sp_sel_s8k", plan(m, n, seq=8192, gbs=8, mbs=2, par={**tp, **sp, **SEL})),
        (f"L_moe8top2_tp{n}_sp_ep{n}_etp1", plan(MOE8_L, n, seq=4096, gbs=16, mbs=4, par={
            **tp, **sp, **ep, "expert_tensor_parallel_size": 1}, impl=grouped)),
        (f"L_moe8top2_ep{n}_alltoall_fp8delayed", plan(MOE8_L, n, seq=4096, gbs=8 * n, mbs=4, par=ep,
                                                        train=DELAYED, impl=grouped)),
        (f"L_pp{n}_vp2_mb16", plan(m, n, seq=4096, gbs=32, mbs=2, par=vp)),
    ]


#: the second set on 2 GPUs (two at a time between the 4-GPU plans)
LARGE_2GPU = ("L_tp2_sp", "L_cp2_s32k", "L_tp2_sp_fp8delayed", "L_dp2_fp8tensorwise",
              "L_moe8top2_ep2_alltoall_fp8delayed", "L_moe8top2_tp2_sp_ep2_etp1")


def large_spec_lines() -> list[dict]:
    """The second set on a 4-GPU machine: 4-GPU plans first (the first 15 most wanted), the 2-GPU ones
    after them, then the rest; no fake rows (s4 compared those)."""
    four = large_rows(4)
    two = [r for r in large_rows(2) if r[0] in LARGE_2GPU]
    out = []
    for rows, n in ((four[:15], 4), (two, 2), (four[15:], 4)):
        out += [{"name": name, "group": "multi", "nproc": n, "held_out": held_out(name),
                 "needs_te": True, "spec": job_spec(p, **RUN_L)} for name, p in rows]
    return out


def routing_rows(n: int) -> list[tuple[str, Plan]]:
    """The third set (session s6, issues 15 and 20): the L set's MoE plans on n GPUs with the router as
    it is (untrained, on mock data) and with --moe-router-force-load-balancing (random logits: what
    Megatron-Bridge's performance tables run), the job recording tokens per expert; and the L set's
    dense layouts on n GPUs that no lease has run, predicted before they ran."""
    ep, grouped = {"expert_model_parallel_size": n}, {"moe_grouped_gemm": True}
    forced = {"moe_router_force_load_balancing": True}
    tp, pp, cp = {"tensor_model_parallel_size": n}, {"pipeline_model_parallel_size": n}, {"context_parallel_size": n}
    rows = []
    for tag, model in (("moe8top2", MOE8_L), ("moe64top8", MOE64_L)):
        for disp in ("alltoall", "allgather"):
            impl = {**grouped, "moe_token_dispatcher_type": disp}
            rows.append((f"R_{tag}_ep{n}_{disp}", plan(model, n, seq=4096, gbs=8 * n, mbs=4, par=ep, impl=impl)))
            rows.append((f"R_{tag}_ep{n}_{disp}_forced", plan(model, n, seq=4096, gbs=8 * n, mbs=4, par=ep,
                                                              impl={**impl, **forced})))
    m = LLAMA_L
    rows += [
        (f"R_pp{n}_vp2", plan(m, n, seq=4096, gbs=16, mbs=2, par={**pp, "virtual_pipeline_model_parallel_size": 2})),
        (f"R_dp{n}_distopt_overlap", plan(m, n, seq=4096, gbs=8 * n, mbs=2)),
        (f"R_tp{n}", plan(m, n, seq=4096, gbs=32, mbs=8, par=tp)),
        (f"R_cp{n}_s16k", plan(m, n, seq=16384, gbs=2, par=cp)),
        (f"R_pp{n}", plan(m, n, seq=4096, gbs=16, mbs=2, par=pp)),
        (f"R_dp{n}_ddp_nooverlap", plan(m, n, seq=4096, gbs=8 * n, mbs=2, par=NO_DP_OVERLAP)),
    ]
    return rows


#: rows of the third set that also record what is live at the memory peak (launcher/entry/mem_peak.py)
MEMORY_PEAK_ROWS = ("R_moe8top2_ep2_alltoall", "R_moe8top2_ep2_alltoall_forced")


def routing_spec_lines(n: int) -> list[dict]:
    """The third set in run order: unforced MoE first (the routing record), each with its forced twin."""
    out = []
    for name, p in routing_rows(n):
        peak = name in MEMORY_PEAK_ROWS
        row = {"name": name, "group": "multi", "nproc": n, "held_out": held_out(name), "needs_te": True,
               "spec": job_spec(p, **(RUN_PEAK if peak else RUN_L))}
        if peak:  # the history is recorded in iteration 2: a warm-up iteration in these rows
            row["env"] = dict(MEMORY_PEAK_ENV)
        out.append(row)
    return out


#: the fourth set (session s7, issue 15): fine-grained MoE on one H100 at the per-rank shapes of the layouts
#: the model was furthest off on (128 experts, top-8 or top-4, experts 768-2,880 wide; a 16-local-expert rank of
#: Qwen3-235B-A22B's intra-node EP8), every layer MoE, predicted before they ran
QWEN30_F = {**MOE, "num_layers": 4, "hidden_size": 2048, "num_attention_heads": 32, "num_query_groups": 4,
            "ffn_hidden_size": 6144, "num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768,
            "qk_layernorm": True}
#: a GPT-OSS EP2 rank's experts (64 local, 128 tokens each at 4,096 tokens: its top-4 of 128), one layer to fit
#: (the first version, 32 experts top-1, is what Megatron rejects without --moe-router-pre-softmax)
GPTOSS_RANK_F = {**MOE, "num_layers": 1, "hidden_size": 2880, "num_attention_heads": 64, "num_query_groups": 8,
                 "kv_channels": 64, "ffn_hidden_size": 2880, "num_experts": 64, "moe_router_topk": 2,
                 "moe_ffn_hidden_size": 2880}
QWEN235_RANK_F = {**MOE, "num_layers": 4, "hidden_size": 4096, "num_attention_heads": 64, "num_query_groups": 4,
                  "ffn_hidden_size": 12288, "num_experts": 16, "moe_router_topk": 2, "moe_ffn_hidden_size": 1536,
                  "qk_layernorm": True}


def fine_rows() -> list[tuple[str, Plan]]:
    grouped = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall"}
    forced = {**grouped, "moe_router_force_load_balancing": True}
    return [
        ("F_qwen30like_e128k8_s4k", plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1, impl=grouped)),
        ("F_qwen30like_e128k8_s4k_forced", plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1, impl=forced)),
        ("F_qwen30like_e128k8_s4k_mbs4", plan(QWEN30_F, 1, seq=4096, gbs=16, mbs=4, impl=forced)),
        ("F_gptossrank_e64k2_s4k", plan(GPTOSS_RANK_F, 1, seq=4096, gbs=8, mbs=1, impl=forced)),
        ("F_qwen235rank_e16k2_s4k", plan(QWEN235_RANK_F, 1, seq=4096, gbs=8, mbs=1, impl=forced)),
        ("F_qwen235rank_e16k2_s4k_mbs4", plan(QWEN235_RANK_F, 1, seq=4096, gbs=16, mbs=4, impl=forced)),
        ("F_qwen30like_e128k8_s4k_sequential", plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1,
                                                    impl={"moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": False,
                                                          "moe_router_force_load_balancing": True})),
        # the same plans again in a second lease: how far a machine's steps and its host probe move
        ("F_qwen30like_e128k8_s4k_again", plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1, impl=grouped)),
        ("F_qwen235rank_e16k2_s4k_again", plan(QWEN235_RANK_F, 1, seq=4096, gbs=8, mbs=1, impl=forced)),
    ]


def fine_spec_lines() -> list[dict]:
    return [{"name": name, "group": "multi", "nproc": 1, "held_out": held_out(name), "needs_te": True,
             "spec": job_spec(p, **RUN_L)} for name, p in fine_rows()]


#: the fifth set (session s8, issue 20): the rows the model was furthest under (CP at 16k-32k, selective recompute
#: at 8k, EP without TP) as they ran (Megatron-LM's default seq x seq attention mask built by the data loader:
#: 256 MiB per 16k sample, pinned and copied every micro-batch) and with --no-create-attention-mask-in-dataloader
NO_MASK = {"create_attention_mask_in_dataloader": False}


def mask_rows() -> list[tuple[str, Plan, int]]:
    """(name, plan, GPUs): each plan with the data loader's mask (Megatron's default) and without it."""
    ep, grouped = {"expert_model_parallel_size": 4}, {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall"}
    tp4sp = {"tensor_model_parallel_size": 4, "sequence_parallel": True}
    base = [
        ("M_cp4_s16k", plan(LLAMA_L, 4, seq=16384, gbs=2, par={"context_parallel_size": 4}), 4),
        ("M_tp4_sp_sel_s8k", plan(LLAMA_L, 4, seq=8192, gbs=8, mbs=2, par={**tp4sp, **SEL}), 4),
        ("M_moe8top2_ep4_alltoall", plan(MOE8_L, 4, seq=4096, gbs=32, mbs=4, par=ep, impl=grouped), 4),
        ("M_moe64top8_ep4_alltoall", plan(MOE64_L, 4, seq=4096, gbs=32, mbs=4, par=ep, impl=grouped), 4),
        ("M_cp2_s32k", plan(LLAMA_L, 2, seq=32768, gbs=1, par={"context_parallel_size": 2}), 2),
        ("M_cp2_s16k", plan(LLAMA_L, 2, seq=16384, gbs=2, par={"context_parallel_size": 2}), 2),
    ]
    out = []
    for name, p, n in base:
        out += [(name, p, n), (name + "_nomask", with_changes(p, "implementation", **NO_MASK), n)]
    return out


#: the L set's other layouts without the mask (run after the pairs, on the same lease)
MASK_MORE = ("L_tp4_sp", "L_dp4_distopt_overlap", "L_pp4_vp2", "L_moe8top2_ep4_allgather",
             "L_moe8top2_ep4_alltoall_fp8delayed", "L_tp4", "L_moe8top2_ep2_alltoall_fp8delayed", "L_tp2_sp",
             "L_pp4", "L_tp4_sp_fp8delayed", "L_dp4_ddp_nooverlap", "L_dp4_fp8tensorwise", "L_tp4_sp_tpoverlap")


def mask_more_rows() -> list[tuple[str, Plan, int]]:
    rows = {name: p for n in (4, 2) for name, p in large_rows(n)}
    return [("M" + name[1:] + "_nomask", with_changes(rows[name], "implementation", **NO_MASK), rows[name].cluster.num_gpus)
            for name in MASK_MORE]


def mask_spec_lines() -> list[dict]:
    return [{"name": name, "group": "multi", "nproc": n, "held_out": held_out(name), "needs_te": True,
             "spec": job_spec(p, **RUN_L)} for name, p, n in mask_rows() + mask_more_rows()]


#: the sixth set (session s9, issues 15 and 20): does an expert GEMM row count met for the first time cost the host
#: a cuBLASLt heuristic query (0.12-0.30 ms each on H100: results/gpu_h100_gemm_shape_probe.json)? The EP rows the
#: model is furthest under (64 experts as routed) over 14 measured iterations, with cuBLASLt's heuristics cache as it
#: is, off (CUBLASLT_HEURISTICS_CACHE_CAPACITY=0: every GEMM pays the query) and 8x larger; forced routing (few
#: distinct counts) beside them; the job records each iteration's new row counts. All without the data loader's mask.
RUN_C = {"warmup_steps": 1, "measure_steps": 14, "profile_steps": (3, 3)}
CACHE_OFF, CACHE_BIG = {"CUBLASLT_HEURISTICS_CACHE_CAPACITY": "0"}, {"CUBLASLT_HEURISTICS_CACHE_CAPACITY": "65536"}


def cache_rows() -> list[tuple[str, Plan, int, dict]]:
    """(name, plan, GPUs, env)."""
    a2a = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", **NO_MASK}
    forced = {**a2a, "moe_router_force_load_balancing": True}
    ep4, ep2 = {"expert_model_parallel_size": 4}, {"expert_model_parallel_size": 2}
    e64 = plan(MOE64_L, 4, seq=4096, gbs=32, mbs=4, par=ep4, impl=a2a)
    e8 = plan(MOE8_L, 4, seq=4096, gbs=32, mbs=4, par=ep4, impl=a2a)
    return [
        ("C_moe64top8_ep4_alltoall", e64, 4, {}),
        ("C_moe64top8_ep4_alltoall_cache0", e64, 4, CACHE_OFF),
        ("C_moe64top8_ep4_alltoall_forced", plan(MOE64_L, 4, seq=4096, gbs=32, mbs=4, par=ep4, impl=forced), 4, {}),
        ("C_moe64top8_ep4_alltoall_cachebig", e64, 4, CACHE_BIG),
        ("C_moe8top2_ep4_alltoall", e8, 4, {}),
        ("C_moe8top2_ep4_alltoall_cache0", e8, 4, CACHE_OFF),
        ("C_qwen30like_e128k8_s4k", plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1, impl=a2a), 1, {}),
        ("C_moe64top8_ep2_allgather", plan(MOE64_L, 2, seq=4096, gbs=16, mbs=4, par=ep2,
                                           impl={**a2a, "moe_token_dispatcher_type": "allgather"}), 2, {}),
        ("C_moe8top2_ep2_alltoall_fp8delayed", plan(MOE8_L, 2, seq=4096, gbs=16, mbs=4, par=ep2, impl=a2a,
                                                    train=DELAYED), 2, {}),
        ("C_qwen30like_e128k8_s4k_cache0", plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1, impl=a2a), 1, CACHE_OFF),
    ]


def cache_spec_lines() -> list[dict]:
    out = []
    for name, p, n, env in cache_rows():
        row = {"name": name, "group": "multi", "nproc": n, "held_out": held_out(name), "needs_te": True,
               "spec": job_spec(p, **RUN_C)}
        if env:
            row["env"] = env
        out.append(row)
    return out


#: the seventh set (session s9, issue 15): MoE shapes no lease has run, predicted by the model at the snapshot's
#: commit before they ran (the expert-GEMM cache model of the C set and the per-expert host share of its trace in
#: place); the job records each run's heuristic-cache miss share (an LRU replay of its row counts)
RUN_V = {"warmup_steps": 1, "measure_steps": 8, "profile_steps": (3, 3)}
MOE32_L = {**MOE64_L, "num_experts": 32, "moe_router_topk": 4, "moe_ffn_hidden_size": 2816}
MOE128_L = {**MOE64_L, "num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 704}
MOE16_L = {**MOE8_L, "num_experts": 16, "moe_router_topk": 2, "moe_ffn_hidden_size": 2816}


def validate_rows() -> list[tuple[str, Plan, int]]:
    a2a = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", **NO_MASK}
    forced = {**a2a, "moe_router_force_load_balancing": True}
    ep4, ep2 = {"expert_model_parallel_size": 4}, {"expert_model_parallel_size": 2}
    return [
        ("V_moe32top4_ep4_alltoall", plan(MOE32_L, 4, seq=4096, gbs=32, mbs=4, par=ep4, impl=a2a), 4),
        ("V_moe32top4_ep4_alltoall_forced", plan(MOE32_L, 4, seq=4096, gbs=32, mbs=4, par=ep4, impl=forced), 4),
        ("V_moe128top8_ep4_alltoall", plan(MOE128_L, 4, seq=4096, gbs=32, mbs=4, par=ep4, impl=a2a), 4),
        ("V_moe64top8_ep4_permfused_cache64k", plan(MOE64_L, 4, seq=4096, gbs=32, mbs=4, par=ep4, impl={
            **a2a, "moe_permute_fusion": True, "cublaslt_heuristics_cache_capacity": 65536}), 4),
        ("V_moe64top8_tp2_sp_ep2_etp1", plan(MOE64_L, 4, seq=4096, gbs=16, mbs=4, par={
            "tensor_model_parallel_size": 2, "sequence_parallel": True, **ep2, "expert_tensor_parallel_size": 1}, impl=a2a), 4),
        ("V_moe16top2_ep2_allgather", plan(MOE16_L, 2, seq=4096, gbs=16, mbs=4, par=ep2,
                                           impl={**a2a, "moe_token_dispatcher_type": "allgather"}), 2),
        ("V_moe64top8_ep2_alltoall_fp8tensorwise", plan(MOE64_L, 2, seq=4096, gbs=16, mbs=4, par=ep2, impl=a2a,
                                                        train=TENSORWISE), 2),
        ("V_qwen30like_e128k8_s4k_mbs4", plan(QWEN30_F, 1, seq=4096, gbs=16, mbs=4, impl=a2a), 1),
        ("V_qwen30like_e128k8_s4k_mbs4_forced", plan(QWEN30_F, 1, seq=4096, gbs=16, mbs=4, impl=forced), 1),
    ]


def validate_spec_lines() -> list[dict]:
    return [{"name": name, "group": "multi", "nproc": n, "held_out": held_out(name), "needs_te": True,
             "spec": job_spec(p, **RUN_V)} for name, p, n in validate_rows()]


#: the eighth set (session s10): Megatron-LM without Transformer Engine (--transformer-impl local: torch
#: norms, unfused attention, SequentialMLP experts), a regime no earlier lease ran on several GPUs; predicted at
#: the snapshot's commit before they ran. No host probe binds (as_ran reads only a TE probe): the plans run on
#: the GPU catalog's host figure, as a user's would. Sequence 2048 keeps the unfused s x s scores in memory.
RUN_N = {"warmup_steps": 1, "measure_steps": 6, "profile_steps": (3, 3)}
#: the local spec as a pip-installed Megatron-LM runs it: no Apex, so neither of its fusions (the G and A sets)
LOCAL_NO_APEX = {"transformer_impl": "local", "gradient_accumulation_fusion": False, "masked_softmax_fusion": False, **NO_MASK}


def local_rows() -> list[tuple[str, Plan, int]]:
    local = {"transformer_impl": "local", **NO_MASK}
    m = LLAMA_L
    tp4, tp2 = {"tensor_model_parallel_size": 4}, {"tensor_model_parallel_size": 2}
    pp4 = {"pipeline_model_parallel_size": 4}
    ep4, ep2 = {"expert_model_parallel_size": 4}, {"expert_model_parallel_size": 2}
    a2a, ag = {**local, "moe_token_dispatcher_type": "alltoall"}, {**local, "moe_token_dispatcher_type": "allgather"}
    return [
        ("N_tp4", plan(m, 4, seq=2048, gbs=32, mbs=8, par=tp4, impl=local), 4),
        ("N_dp4_distopt_overlap", plan(m, 4, seq=2048, gbs=32, mbs=2, impl=local), 4),
        ("N_moe8top2_ep4_alltoall", plan(MOE8_L, 4, seq=2048, gbs=32, mbs=4, par=ep4, impl=a2a), 4),
        ("N_pp4_vp2", plan(m, 4, seq=2048, gbs=16, mbs=2, par={**pp4, "virtual_pipeline_model_parallel_size": 2}, impl=local), 4),
        ("N_moe64top8_ep4_alltoall", plan(MOE64_L, 4, seq=2048, gbs=32, mbs=4, par=ep4, impl=a2a), 4),
        ("N_tp2_dp2", plan(m, 4, seq=2048, gbs=32, mbs=4, par=tp2, impl=local), 4),
        ("N_pp4", plan(m, 4, seq=2048, gbs=16, mbs=2, par=pp4, impl=local), 4),
        ("N_dp4_ddp_nooverlap", plan(m, 4, seq=2048, gbs=32, mbs=2, par=NO_DP_OVERLAP, impl=local), 4),
        ("N_moe8top2_ep4_allgather", plan(MOE8_L, 4, seq=2048, gbs=32, mbs=4, par=ep4, impl=ag), 4),
        ("N_tp2", plan(m, 2, seq=2048, gbs=16, mbs=8, par=tp2, impl=local), 2),
        ("N_moe8top2_ep2_alltoall", plan(MOE8_L, 2, seq=2048, gbs=16, mbs=4, par=ep2, impl=a2a), 2),
        ("N_pp2_vp2", plan(m, 2, seq=2048, gbs=16, mbs=2, par={"pipeline_model_parallel_size": 2,
                                                             "virtual_pipeline_model_parallel_size": 2}, impl=local), 2),
        ("N_moe16top2_ep2_allgather", plan(MOE16_L, 2, seq=2048, gbs=16, mbs=4, par=ep2, impl=ag), 2),
    ]


def _line(name: str, p: Plan, n: int, run: dict, *, te: bool, every_rank: bool = False, env: dict | None = None) -> dict:
    """One row of a spec file: the job's spec for plan p on n GPUs (every rank traced when asked) and its switches."""
    spec = job_spec(p, **run)
    if every_rank:
        spec["megatron_argv"] = _every_rank_traced(spec["megatron_argv"], n)
    row = {"name": name, "group": "multi", "nproc": n, "held_out": held_out(name), "needs_te": te, "spec": spec}
    return {**row, "env": env} if env else row


def _no_te_lines(rows: list[tuple[str, Plan, int]]) -> list[dict]:
    return [_line(name, p, n, RUN_N, te=False) for name, p, n in rows]


def local_spec_lines() -> list[dict]:
    return _no_te_lines(local_rows())


#: two N plans again with every rank traced at iteration 9 (after the first iterations' kernel loads) and the ops'
#: shapes recorded: which rank the others wait for inside each all-to-all, and why (session s10)
RUN_RANKS = {"warmup_steps": 1, "measure_steps": 6, "profile_steps": (9, 9)}


def _every_rank_traced(argv: list[str], ranks: int) -> list[str]:
    i = argv.index("--profile-ranks")
    return argv[:i + 1] + [str(r) for r in range(ranks)] + argv[i + 2:] + ["--pytorch-profiler-collect-shapes"]


def ranks_spec_lines() -> list[dict]:
    return [_line(f"{name}_ranks", p, n, RUN_RANKS, te=False, every_rank=True) for name, p, n in local_rows()
            if name in ("N_moe8top2_ep4_alltoall", "N_moe64top8_ep4_alltoall")]


#: the ninth set (session s10): more of Megatron-LM without Transformer Engine, on shapes the N set did not use
#: (GPT-3 style: LayerNorm, GeLU, biases, learned positions, tied embeddings; full and selective recompute; 4k
#: tokens), each plan with the two Apex fusions off as evaluate_plan's local_spec_fusions_need_apex advises, and
#: predicted at the committed code before it ran
GPT27_L = {"num_layers": 8, "hidden_size": 2560, "num_attention_heads": 32, "ffn_hidden_size": 10240, "vocab_size": 32000,
           "swiglu": False, "normalization": "LayerNorm", "add_bias_linear": True,
           "untie_embeddings_and_output_weights": False, "position_embedding_type": "learned_absolute"}
GPT67_L = {**GPT27_L, "hidden_size": 4096, "ffn_hidden_size": 16384}


def local_more_rows() -> list[tuple[str, Plan, int]]:
    local = LOCAL_NO_APEX
    tp4, tp2 = {"tensor_model_parallel_size": 4}, {"tensor_model_parallel_size": 2}
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return [
        ("G_gpt27_tp4", plan(GPT27_L, 4, seq=2048, gbs=32, mbs=8, par=tp4, impl=local), 4),
        ("G_gpt67_dp4_full", plan(GPT67_L, 4, seq=2048, gbs=32, mbs=4, par=full, impl=local), 4),
        ("G_gpt67_tp2_pp2_vp2", plan(GPT67_L, 4, seq=2048, gbs=32, mbs=2, par={
            **tp2, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, impl=local), 4),
        ("G_gpt27_dp4_sel", plan(GPT27_L, 4, seq=2048, gbs=32, mbs=4, par=SEL, impl=local), 4),
        ("G_llama8l_tp2_dp2_s4k", plan(LLAMA_L, 4, seq=4096, gbs=16, mbs=2, par=tp2, impl=local), 4),
        ("G_gpt27_pp4_mb16", plan(GPT27_L, 4, seq=2048, gbs=64, mbs=4, par={"pipeline_model_parallel_size": 4}, impl=local), 4),
        ("G_gpt67_tp2", plan(GPT67_L, 2, seq=2048, gbs=16, mbs=4, par=tp2, impl=local), 2),
        ("G_gpt27_dp2_ddp", plan(GPT27_L, 2, seq=2048, gbs=16, mbs=4, par=NO_DP_OVERLAP, impl=local), 2),
    ]


def local_more_spec_lines() -> list[dict]:
    return _no_te_lines(local_more_rows())


#: the tenth set (session s10): DeepSeek-V2-Lite's multi-latent attention (MLA without query compression, YaRN RoPE,
#: qk-layernorm) on 8 layers, without Transformer Engine, dense and with its 64 experts top-6 (first layer dense),
#: predicted at the committed code before it ran. Both failed in Megatron itself (MLA needs TE's attention), and the
#: validators now refuse these plans, so the set no longer renders: specs_multi_A.jsonl is the record of what ran
V2LITE_MLA = {"num_layers": 8, "hidden_size": 2048, "num_attention_heads": 16, "ffn_hidden_size": 10944, "vocab_size": 102400,
              "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
              "position_embedding_type": "rope", "multi_latent_attention": True, "kv_lora_rank": 512, "qk_head_dim": 128,
              "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rotary_base": 10000, "rope_scaling_factor": 40}
V2LITE_MOE = {**V2LITE_MLA, "num_experts": 64, "moe_router_topk": 6, "moe_ffn_hidden_size": 1408,
              "moe_shared_expert_intermediate_size": 2816, "moe_layer_freq": [0] + [1] * 7, "moe_router_score_function": "softmax"}


def mla_rows() -> list[tuple[str, Plan, int]]:
    local = LOCAL_NO_APEX
    return [
        ("A_mla_dense_tp2_dp2", plan(V2LITE_MLA, 4, seq=2048, gbs=32, mbs=4, par={"tensor_model_parallel_size": 2}, impl=local), 4),
        ("A_mla_moe64top6_ep4", plan(V2LITE_MOE, 4, seq=2048, gbs=32, mbs=2, par={"expert_model_parallel_size": 4},
                                     impl={**local, "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall"}), 4),
    ]


def mla_spec_lines() -> list[dict]:
    return _no_te_lines(mla_rows())


#: the eleventh set (session s11, issue 20): the GPT-2.7B layers at TP1 held 0.54-0.67 GiB more at the peak than the
#: model on every G row and rank; the same layers on two GPUs with what is live at the peak recorded
#: (launcher/entry/mem_peak.py), at TP1 (DP2, PP2) and TP2 to see how the gap scales; then two Llama-8B layer plans
def peak_rows() -> list[tuple[str, Plan, int]]:
    local = LOCAL_NO_APEX
    return [
        ("P_gpt27_dp2_ddp", plan(GPT27_L, 2, seq=2048, gbs=16, mbs=4, par=NO_DP_OVERLAP, impl=local), 2),
        ("P_gpt27_pp2_mb8", plan(GPT27_L, 2, seq=2048, gbs=32, mbs=4, par={"pipeline_model_parallel_size": 2}, impl=local), 2),
        ("P_gpt27_tp2", plan(GPT27_L, 2, seq=2048, gbs=16, mbs=4, par={"tensor_model_parallel_size": 2}, impl=local), 2),
        # the Llama-8B layers (SwiGLU, GQA, RoPE), where the model was above the measured peaks: N_tp2's plan
        ("P_llama8l_tp2", plan(LLAMA_L, 2, seq=2048, gbs=16, mbs=8, par={"tensor_model_parallel_size": 2}, impl=local), 2),
        ("P_llama8l_pp2_mb8", plan(LLAMA_L, 2, seq=2048, gbs=32, mbs=4, par={"pipeline_model_parallel_size": 2}, impl=local), 2),
    ]


def peak_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_PEAK, te=False, env=MEMORY_PEAK_ENV) for name, p, n in peak_rows()]


#: the twelfth set (session s11, issue 15): with Transformer Engine, the MoE rows still furthest off, traced again
#: (their s7/s8 traces were not kept): two one-GPU fine-grained rows with forced routing whose GPU idled half the
#: step where the model hides the host, and the 8-expert EP2 FP8 row (-27%) with its bf16 twin, every rank traced
RUN_T = {"warmup_steps": 1, "measure_steps": 6, "profile_steps": (5, 5)}


def te_trace_rows() -> list[tuple[str, Plan, int]]:
    forced = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", "moe_router_force_load_balancing": True}
    grouped, ep2 = {"moe_grouped_gemm": True}, {"expert_model_parallel_size": 2}
    return [
        ("T_qwen30like_e128k8_s4k_mbs4_forced", plan(QWEN30_F, 1, seq=4096, gbs=16, mbs=4, impl=forced), 1),
        ("T_gptossrank_e64k2_s4k_forced", plan(GPTOSS_RANK_F, 1, seq=4096, gbs=8, mbs=1, impl=forced), 1),
        ("T_moe8top2_ep2_alltoall_fp8delayed", plan(MOE8_L, 2, seq=4096, gbs=16, mbs=4, par=ep2, train=DELAYED,
                                                    impl=grouped), 2),
        ("T_moe8top2_ep2_alltoall_bf16", plan(MOE8_L, 2, seq=4096, gbs=16, mbs=4, par=ep2, impl=grouped), 2),
    ]


def te_trace_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_T, te=True, every_rank=True) for name, p, n in te_trace_rows()]


#: the thirteenth set (session s11, issues 20/14): the memory model's unfused-attention branches no run had measured
#: (fp32 softmax, attention and hidden dropout, 4k keys, selective recompute at PP2), without TE on 4 GPUs, predicted
#: at the committed code before they ran; the fp32 row also records what is live at its peak
def local_check_rows() -> list[tuple[str, Plan, int]]:
    local = LOCAL_NO_APEX
    fp32 = {**local, "attention_softmax_in_fp32": True}
    drop = {"attention_dropout": 0.1, "hidden_dropout": 0.1}
    tp2, tp4 = {"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 4}
    return [
        ("Q_gpt27_dp4_fp32softmax", plan(GPT27_L, 4, seq=2048, gbs=16, mbs=4, impl=fp32), 4),
        ("Q_gpt27_tp2_dropout", plan(GPT27_L, 4, seq=2048, gbs=16, mbs=4, par=tp2, impl=local, train=drop), 4),
        ("Q_llama8l_tp4_s4k", plan(LLAMA_L, 4, seq=4096, gbs=8, mbs=2, par=tp4, impl=local), 4),
        ("Q_gpt67_pp2_dp2_sel", plan(GPT67_L, 4, seq=2048, gbs=32, mbs=4, par={"pipeline_model_parallel_size": 2, **SEL},
                                     impl=local), 4),
        ("Q_gpt27_tp4_fp32_dropout", plan(GPT27_L, 4, seq=2048, gbs=16, mbs=8, par=tp4, impl=fp32, train=drop), 4),
        ("Q_llama8l_dp4_s4k", plan(LLAMA_L, 4, seq=4096, gbs=8, mbs=1, impl=local), 4),
    ]


def local_check_spec_lines() -> list[dict]:
    peak = "Q_gpt27_dp4_fp32softmax"
    return [_line(name, p, n, RUN_PEAK, te=False, env=MEMORY_PEAK_ENV) if name == peak else _line(name, p, n, RUN_N, te=False)
            for name, p, n in local_check_rows()]


#: the fourteenth set (session s12, issue 15): a Qwen3-30B-A3B EP8 rank's MoE block on 2 GPUs (32 experts top-8 at EP2:
#: 16 local experts of 768, 4,096 rows each at micro-batch 2, as Qwen3-30B-A3B's 128 top-8 at EP8), dropless with forced
#: routing against Megatron-Bridge's two other settings: the token all-to-alls overlapped by the combined 1F1B schedule
#: (--overlap-moe-expert-parallel-comm --delay-wgrad-compute) and token drop padded to capacity 1.0; bf16 and FP8-CS
Q30_RANK = {**QWEN30_F, "num_layers": 8, "num_experts": 32, "moe_router_topk": 8}
RUN_E = {"warmup_steps": 2, "measure_steps": 6, "profile_steps": (5, 5)}


def ep_overlap_rows() -> list[tuple[str, Plan, int]]:
    base = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", "moe_permute_fusion": True}
    forced = {**base, "moe_router_force_load_balancing": True}
    overlap = {**forced, "overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
    drop = {**base, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    ep2 = {"expert_model_parallel_size": 2}
    rows = []
    # micro-batch 4 (8,192 rows per expert) keeps the GPU ahead of this VM's host, so the overlap can show;
    # micro-batch 2 is the published rank's 4,096
    for tag, train in (("bf16", None), ("fp8cs", TENSORWISE)):
        for kind, impl in (("forced", forced), ("overlap", overlap), ("droppad", drop)):
            rows.append((f"E_q30rank_ep2_{kind}_{tag}", plan(Q30_RANK, 2, seq=4096, gbs=64, mbs=4, par=ep2, impl=impl,
                                                            train=train), 2))
    for kind, impl in (("forced", forced), ("overlap", overlap)):
        rows.append((f"E_q30rank_ep2_{kind}_bf16_mbs2", plan(Q30_RANK, 2, seq=4096, gbs=32, mbs=2, par=ep2, impl=impl), 2))
    return rows


def ep_overlap_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_E, te=True) for name, p, n in ep_overlap_rows()]


#: the fifteenth set (session s13, issue 15): the E rank's 32 experts on one H100 (EP 1: 32 local experts of 768, 2,048
#: rows each at micro-batch 2), dropless forced in bf16, FP8 delayed and FP8 current scaling, and padded to capacity in
#: FP8 delayed: the per-expert FP8 host launches that benchmarks/gpu/moe_host_probe.py measured on Megatron's TEGroupedMLP
#: alone, here inside Megatron-LM's own training loop, predicted before the run
RUN_H = {"warmup_steps": 2, "measure_steps": 6}


def fp8_experts_rows() -> list[tuple[str, Plan, int]]:
    forced = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", "moe_permute_fusion": True,
              "moe_router_force_load_balancing": True}
    drop = {**forced, "moe_router_force_load_balancing": False, "moe_expert_capacity_factor": 1.0,
            "moe_pad_expert_input_to_capacity": True}
    rows = [(f"H_q30rank_ep1_forced_{tag}", plan(Q30_RANK, 1, seq=4096, gbs=16, mbs=2, impl=forced, train=train), 1)
            for tag, train in (("bf16", None), ("fp8delayed", DELAYED), ("fp8cs", TENSORWISE))]
    rows.append(("H_q30rank_ep1_droppad_fp8delayed", plan(Q30_RANK, 1, seq=4096, gbs=16, mbs=2, impl=drop, train=DELAYED), 1))
    return rows


def fp8_experts_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_H, te=True) for name, p, n in fp8_experts_rows()]


#: the sixteenth set (session s14, issue 15): s4's and s3's MoE plans again, as stored in their results files, now with
#: the job's host probe and six measured iterations (those leases measured three, right after the profiler, and no
#: host): s4's set read every plan 1.3-2.3x slower than predicted, its dense plans too (tp4_sp -51%, dp4_ddp_nooverlap
#: -42% at 2% host share), s3's local MoE plans 22-42% faster; two of s4's dense plans ride along as the lease's control
RUN_W = {"warmup_steps": 2, "measure_steps": 6, "profile_steps": None}
RERUN = {"gpu_h100x4_runs.jsonl": ("moe8top2_ep4_alltoall", "moe8top2_ep4_allgather", "moe64top8_ep4_alltoall",
                                   "moe64top8_ep4_allgather", "moe8top2_ep2_alltoall_fp8delayed",
                                   "moe8top2_tp2_sp_ep2_etp1", "tp4_sp", "dp4_ddp_nooverlap"),
         "gpu_h200x2_runs.jsonl": ("moe8top2_ep2_alltoall", "moe8top2_ep2_allgather", "moe64top8_ep2_alltoall",
                                   "moe64top8_ep2_allgather")}


def _stored_plans(fname: str) -> dict[str, dict]:
    return {r["name"]: r for r in map(json.loads, (HERE.parent / "results" / fname).read_text().splitlines())
            if r.get("group") == "multi"}


def rerun_rows() -> list[tuple[str, Plan, int]]:
    """W_<name> (s4's rows) and W_local_<name> (s3's): the stored plan of each, on the GPUs it ran on."""
    rows = []
    for fname, names in RERUN.items():
        stored = _stored_plans(fname)
        tag = "W_local_" if "h200x2" in fname else "W_"
        rows += [(tag + n, Plan.model_validate(stored[n]["plan"]), stored[n]["nproc"]) for n in names]
    return rows


def rerun_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_W, te=p.implementation.transformer_impl == "transformer_engine")
            for name, p, n in rerun_rows()]


#: the seventeenth set (session s14, issue 15): four one-GPU MoE plans of the F and H sets again on one H100, three of
#: them twice or three times, interleaved, in one lease: how far one job's host probe and one job's step move between
#: jobs of the same machine, and whether the median with the machine's earlier probes (as_ran.earlier_machine_probes,
#: by the hostname these jobs record) predicts the steps better than each job's own probe
REPEAT = (("X_q30rank_bf16_a", "gpu_h100_H_runs.jsonl", "H_q30rank_ep1_forced_bf16"),
          ("X_qwen30like_mbs4_a", "gpu_h100_F_runs.jsonl", "F_qwen30like_e128k8_s4k_mbs4"),
          ("X_gptossrank_a", "gpu_h100_F_runs.jsonl", "F_gptossrank_e64k2_s4k"),
          ("X_qwen235rank_a", "gpu_h100_F_runs.jsonl", "F_qwen235rank_e16k2_s4k"),
          ("X_q30rank_bf16_b", "gpu_h100_H_runs.jsonl", "H_q30rank_ep1_forced_bf16"),
          ("X_qwen30like_mbs4_b", "gpu_h100_F_runs.jsonl", "F_qwen30like_e128k8_s4k_mbs4"),
          ("X_gptossrank_b", "gpu_h100_F_runs.jsonl", "F_gptossrank_e64k2_s4k"),
          ("X_q30rank_bf16_c", "gpu_h100_H_runs.jsonl", "H_q30rank_ep1_forced_bf16"))


def repeat_rows() -> list[tuple[str, Plan, int]]:
    return [(name, Plan.model_validate(_stored_plans(fname)[src]["plan_requested"]), 1) for name, fname, src in REPEAT]


def repeat_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_W, te=True) for name, p, n in repeat_rows()]


#: the Y set (session s15, issue 15): what an expert GEMM's new row count costs inside Megatron-LM's loop on one H100,
#: the C set's one-GPU 128-expert plan as routed with cuBLASLt's heuristics cache as it is, off and 8x larger, and
#: forced (few distinct counts) beside them, two of them twice; the job records each run's miss share
RUN_Y = {"warmup_steps": 2, "measure_steps": 10, "profile_steps": None}
MISSES = (("Y_qwen30like_cache", {}), ("Y_qwen30like_cache0", CACHE_OFF), ("Y_qwen30like_cachebig", CACHE_BIG),
          ("Y_qwen30like_forced", None), ("Y_qwen30like_cache0_b", CACHE_OFF), ("Y_qwen30like_cachebig_b", CACHE_BIG))


def misses_rows() -> list[tuple[str, Plan, int, dict]]:
    """(name, plan, GPUs, env): env None is the forced-routing plan."""
    a2a = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", **NO_MASK}
    forced = {**a2a, "moe_router_force_load_balancing": True}
    return [(name, plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1, impl=a2a if env is not None else forced), 1, env or {})
            for name, env in MISSES]


def misses_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_Y, te=True, env=env or None) for name, p, n, env in misses_rows()]


#: the Z set (session s16, issue 15): CUDA graphs in Megatron-LM's loop on one H100, predicted before the run: the H set's
#: 32-expert Qwen3-30B-like rank (forced routing; dropless with the router and preprocess captured, drop-and-pad with the
#: whole layer captured) and a host-bound 0.85B Llama-style dense model (whole layer, attention only), each beside its
#: plan without graphs; the capture happens at iteration 3 (cuda_graph_warmup_steps), so five warm-up iterations
RUN_Z = {"warmup_steps": 5, "measure_steps": 8, "profile_steps": None}
ROUTER_GRAPHS = ["attn", "moe_router", "moe_preprocess"]


def graphs_rows() -> list[tuple[str, Plan, int]]:
    forced = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", "moe_permute_fusion": True,
              "moe_router_force_load_balancing": True, **NO_MASK}
    drop = {**forced, "moe_router_force_load_balancing": False, "moe_expert_capacity_factor": 1.0,
            "moe_pad_expert_input_to_capacity": True}
    te, local = {"cuda_graph_impl": "transformer_engine"}, {"cuda_graph_impl": "local"}

    def q30(impl: dict) -> Plan:
        return plan(Q30_RANK, 1, seq=4096, gbs=16, mbs=2, impl=impl)

    def dense(impl: dict) -> Plan:
        return plan(LLAMA1B, 1, seq=2048, gbs=16, mbs=1, impl={**NO_MASK, **impl})

    return [("Z_q30rank_forced", q30(forced), 1),
            ("Z_q30rank_forced_te_router", q30({**forced, **te, "cuda_graph_modules": ROUTER_GRAPHS}), 1),
            ("Z_llama1b", dense({}), 1),
            ("Z_llama1b_local_layer", dense(local), 1),
            ("Z_q30rank_droppad", q30(drop), 1),
            ("Z_q30rank_droppad_local_layer", q30({**drop, **local}), 1),
            ("Z_llama1b_te_attn", dense({**te, "cuda_graph_modules": ["attn"]}), 1),
            # ran in s16 (Z_q30rank_forced_local_router: the local impl's capture failed) and refused by the validators since
            ("Z_llama1b_te_layer", dense(te), 1),
            ("Z_qwen30like_forced_te_router", plan(QWEN30_F, 1, seq=4096, gbs=8, mbs=1, impl={
                **forced, **te, "cuda_graph_modules": ROUTER_GRAPHS}), 1),
            # the same lease again, after the rest: how far this machine's steps move between jobs
            ("Z_q30rank_forced_b", q30(forced), 1),
            ("Z_q30rank_forced_te_router_b", q30({**forced, **te, "cuda_graph_modules": ROUTER_GRAPHS}), 1),
            ("Z_llama1b_b", dense({}), 1),
            # a second lease: which half of the dense layer's host the attention graph leaves (s16: it removed a third)
            ("Z_llama1b_te_mlp", dense({**te, "cuda_graph_modules": ["mlp"]}), 1),
            ("Z_llama1b_c", dense({}), 1),
            ("Z_llama1b_te_attn_b", dense({**te, "cuda_graph_modules": ["attn"]}), 1),
            ("Z_llama1b_local_attn", dense({**local, "cuda_graph_modules": ["attn"]}), 1)]


def graphs_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_Z, te=True) for name, p, n in graphs_rows()]


#: the O set (session s17, issue 15): MoE shapes no constant was chosen on, predicted at the committed code before they
#: ran (gpu_h100_O_predicted.txt), every row reported as held out: OLMoE-1B-7B's layer (64 experts of 1,024 top-8,
#: query/key norms, MHA), Mixtral-8x7B's (8 of 14,336 top-2), Granite-3.0-3B-A800M's (40 of 512 top-8), Qwen1.5-MoE's
#: (60 of 1,408 top-4 and a 5,632 shared expert) and DeepSeek-V2-Lite's (MLA, 64 of 1,408 top-6, two shared, the first
#: layer dense), a few layers each to fit one H100; routed as Megatron routes an untrained model unless forced
OLMOE = {**MOE, "num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 16,
         "ffn_hidden_size": 1024, "num_experts": 64, "moe_router_topk": 8, "moe_ffn_hidden_size": 1024,
         "vocab_size": 50304, "qk_layernorm": True}
MIXTRAL_L2 = {**MOE, "num_layers": 2, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
              "ffn_hidden_size": 14336, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 14336}
GRANITE = {**MOE, "num_layers": 8, "hidden_size": 1536, "num_attention_heads": 24, "num_query_groups": 8,
           "ffn_hidden_size": 512, "num_experts": 40, "moe_router_topk": 8, "moe_ffn_hidden_size": 512, "vocab_size": 49152}
QWEN15 = {**MOE, "num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 16,
          "ffn_hidden_size": 5632, "num_experts": 60, "moe_router_topk": 4, "moe_ffn_hidden_size": 1408,
          "moe_shared_expert_intermediate_size": 5632, "vocab_size": 151936}
V2LITE_TE = {**V2LITE_MOE, "num_layers": 4, "moe_layer_freq": [0, 1, 1, 1]}
RUN_O = {"warmup_steps": 2, "measure_steps": 6, "profile_steps": None}


def fresh_rows() -> list[tuple[str, Plan, int]]:
    a2a = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", **NO_MASK}
    forced, fused = {**a2a, "moe_router_force_load_balancing": True}, {**a2a, "moe_permute_fusion": True}
    ag = {**a2a, "moe_token_dispatcher_type": "allgather"}
    drop = {**a2a, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}

    def one(model: dict, impl: dict, mbs: int = 1, train: dict | None = None) -> Plan:
        return plan(model, 1, seq=4096, gbs=8 * mbs, mbs=mbs, impl=impl, train=train)

    return [("O_olmoe", one(OLMOE, a2a), 1),
            ("O_mixtral_l2", one(MIXTRAL_L2, a2a), 1),
            ("O_granite_mbs2", one(GRANITE, a2a, 2), 1),
            ("O_qwen15_shared", one(QWEN15, a2a), 1),
            ("O_v2lite", one(V2LITE_TE, a2a), 1),
            ("O_olmoe_forced_mbs2", one(OLMOE, forced, 2), 1),
            ("O_mixtral_l2_allgather", one(MIXTRAL_L2, ag), 1),
            ("O_olmoe_fp8cs", one(OLMOE, a2a, train=TENSORWISE), 1),
            ("O_granite_droppad", one(GRANITE, drop, 2), 1),
            ("O_qwen15_permfused", one(QWEN15, fused), 1),
            ("O_v2lite_forced_mbs2", one(V2LITE_TE, forced, 2), 1),
            ("O_olmoe_b", one(OLMOE, a2a), 1),
            ("O_mixtral_l2_forced", one(MIXTRAL_L2, forced), 1)]


def fresh_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_O, te=True) for name, p, n in fresh_rows()]


def fresh_ep2_rows() -> list[tuple[str, Plan, int]]:
    """The O set's families under EP2 on two GPUs (the dense part data-parallel), held out like the O set."""
    a2a = {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall", **NO_MASK}
    forced = {**a2a, "moe_router_force_load_balancing": True}
    ep2 = {"expert_model_parallel_size": 2}

    def two(model: dict, impl: dict, mbs: int = 1) -> Plan:
        return plan(model, 2, seq=4096, gbs=16 * mbs, mbs=mbs, par=ep2, impl=impl)

    return [("O_olmoe_ep2", two(OLMOE, a2a), 2),
            ("O_granite_ep2_mbs2_forced", two(GRANITE, forced, 2), 2),
            ("O_qwen15_ep2", two(QWEN15, a2a), 2),
            ("O_mixtral_l2_ep2_forced", two(MIXTRAL_L2, forced), 2),
            ("O_v2lite_ep2", two(V2LITE_TE, a2a), 2),
            ("O_olmoe_ep2_forced", two(OLMOE, forced), 2)]


def fresh_ep2_spec_lines() -> list[dict]:
    return [_line(name, p, n, RUN_O, te=True) for name, p, n in fresh_ep2_rows()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2, choices=(2, 4))
    ap.add_argument("--out", default=str(SPECS))
    ap.add_argument("--set", choices=("small", "large", "routing", "fine", "mask", "cache", "validate", "local", "ranks", "local_more", "mla", "peak", "te_trace", "local_check", "ep_overlap", "fp8_experts", "rerun", "repeat", "misses", "graphs", "fresh", "fresh_ep2"), default="small",
                    help="small: s4's 0.85B / 0.3B models; large: the L_* plans (Llama-3-8B layers); "
                         "routing: the R_* plans (MoE routing as is and forced, new dense layouts); "
                         "fine: the F_* plans (fine-grained MoE at per-rank shapes, one GPU); "
                         "mask: the M_* plans (with and without the data loader's attention mask); "
                         "cache: the C_* plans (expert GEMM shapes and cuBLASLt's heuristics cache); "
                         "validate: the V_* plans (MoE shapes predicted before they ran); "
                         "local: the N_* plans (Megatron-LM without Transformer Engine); "
                         "ranks: two N MoE plans with every rank traced; "
                         "local_more: the G_* plans (GPT-3 style without Transformer Engine); "
                         "mla: the A_* plans (DeepSeek-V2-Lite's MLA, dense and MoE, without Transformer Engine); "
                         "peak: the P_* plans (GPT-2.7B layers without TE, what is live at the memory peak); "
                         "te_trace: the T_* plans (the TE MoE rows furthest off, every rank traced); "
                         "local_check: the Q_* plans (unfused attention's fp32 softmax, dropout, 4k keys without TE); "
                         "ep_overlap: the E_* plans (the all-to-all overlap and token drop on a Qwen3-30B EP8 rank's MoE); "
                         "fp8_experts: the H_* plans (32 local experts on one GPU, bf16 and FP8 delayed / current scaling); "
                         "rerun: the W_* plans (s4's and s3's MoE plans again, with the host probe); "
                         "repeat: the X_* plans (one-GPU MoE plans of F and H again, some twice, on one machine); "
                         "misses: the Y_* plans (one-GPU 128 experts as routed, cuBLASLt's heuristics cache as is, off, 8x); "
                         "graphs: the Z_* plans (CUDA graphs on one GPU: MoE router/preprocess, drop-and-pad whole layer, dense); "
                         "fresh: the O_* plans (MoE shapes no constant was chosen on, one GPU, all held out); "
                         "fresh_ep2: the same families under EP2 on two GPUs (O_*_ep2, held out)")
    a = ap.parse_args(argv)
    try:
        lines = {"large": large_spec_lines, "routing": lambda: routing_spec_lines(a.gpus), "fine": fine_spec_lines,
                 "mask": mask_spec_lines, "cache": cache_spec_lines, "validate": validate_spec_lines,
                 "local": local_spec_lines, "ranks": ranks_spec_lines,
                 "local_more": local_more_spec_lines, "mla": mla_spec_lines, "peak": peak_spec_lines,
                 "te_trace": te_trace_spec_lines, "local_check": local_check_spec_lines,
                 "ep_overlap": ep_overlap_spec_lines, "fp8_experts": fp8_experts_spec_lines,
                 "rerun": rerun_spec_lines, "repeat": repeat_spec_lines, "misses": misses_spec_lines,
                 "graphs": graphs_spec_lines, "fresh": fresh_spec_lines,
                 "fresh_ep2": fresh_ep2_spec_lines}.get(
            a.set, lambda: spec_lines(a.gpus))()
    except ValueError as e:  # a plan the validators refuse (the mla set since they know MLA needs TE)
        raise SystemExit(f"configs_multi --set {a.set}: {e}") from None
    Path(a.out).write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"wrote {len(lines)} runs ({sum(x['nproc'] == a.gpus for x in lines)} on {a.gpus} GPUs) to {a.out}")


if __name__ == "__main__":
    main()
