"""Step-time model: hand-derived terms, relations, and anchors against measured runs."""

from __future__ import annotations

import numpy as np
import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics import step_time as perf
from mcore_advisor.physics.layouts import Implementation, LayoutBatch
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.physics.step_time import (
    hardware_params,
    pipeline_bubble_fraction,
    ring_collective_s,
    step_time,
    step_time_arrays,
)
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)


def _plan(model: dict | str, *, gpu="h100-sxm", num_gpus=8, gpn=None, s=4096, gbs=8, mbs=1, precision="bf16",
          impl: dict | None = None, host=None, **par) -> Plan:
    spec = ModelSpec(name=model) if isinstance(model, str) else ModelSpec(**model)
    return Plan(
        model=spec,
        cluster=ClusterSpec(gpu=gpu, num_gpus=num_gpus, gpus_per_node=gpn, host_floor_ms_per_layer=host),
        training=TrainingSpec(seq_length=s, global_batch_size=gbs, micro_batch_size=mbs, precision=precision),
        parallelism=ParallelismSpec(**par),
        implementation=ImplementationSpec(**(impl or {})),
    )


# A GPT-3-style block (MHA, GeLU 4h, LayerNorm, biases, tied embeddings) with a tiny vocabulary, so
# that embedding and output layer do not unbalance pipeline stages.
GPT_SMALL_VOCAB = dict(num_layers=16, hidden_size=4096, num_attention_heads=32, vocab_size=128, swiglu=False,
                       normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute")


def _stage_time_per_microbatch(e) -> float:
    b = e.breakdown
    body = e.iteration_time_s - b.pipeline_bubble_s - b.pp_p2p_s - b.dp_comm_exposed_s - b.optimizer_s - b.overhead_s
    return body / e.num_microbatches


# --------------------------------------------------------------------------------------------- terms


def test_breakdown_terms_sum_to_the_iteration_time():
    e = step_time(_plan("llama3-70b", num_gpus=64, gbs=64, tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                        virtual_pipeline_model_parallel_size=5, sequence_parallel=True))
    assert sum(e.breakdown.model_dump().values()) == pytest.approx(e.iteration_time_s, rel=1e-9)
    assert e.tokens_per_s_per_gpu == pytest.approx(64 * 4096 / (e.iteration_time_s * 64))


def test_pipeline_bubble_is_p_minus_1_over_v_m_of_the_stage_time():
    # Narayanan et al. 2021 Sec. 2.2: bubble = (p - 1) / (v * m) of the ideal time, for equal stages.
    for vp, expected in ((None, 3 / 8), (2, 3 / 16)):
        e = step_time(_plan(GPT_SMALL_VOCAB, num_gpus=4, gbs=8, pipeline_model_parallel_size=4,
                            virtual_pipeline_model_parallel_size=vp, host=0))
        assert e.num_microbatches == 8
        ratio = e.breakdown.pipeline_bubble_s / (e.num_microbatches * _stage_time_per_microbatch(e))
        assert ratio == pytest.approx(expected, rel=0.03)
        assert ratio == pytest.approx(pipeline_bubble_fraction(4, vp or 1, 8), rel=0.03)


def test_ring_all_reduce_moves_2_t_minus_1_over_t_of_the_tensor():
    # TP all-reduce of one [s=4096, b=1, h=8192] bf16 activation (64 MiB) over 8 ranks at 306 GB/s bus
    # bandwidth, which a 64 MiB collective reaches to 64/(64+16) (NCCL ramp measured on H200 NV18):
    # 2 * 7/8 * 67,108,864 B / (306e9 * 0.8) = 479.7 us, + 10 us base + 2*7 steps * 1 us.
    S = 4096 * 8192 * 2
    ramp = S / (S + 16 * 2**20)
    assert ramp == pytest.approx(0.8)
    t = ring_collective_s(S, 8, 306.0, "all_reduce")
    assert t == pytest.approx(2 * 7 / 8 * S / (306e9 * ramp) + 10e-6 + 14 * 1e-6, rel=1e-12)
    # all-gather / reduce-scatter: half of the bytes and steps
    assert ring_collective_s(S, 8, 306.0, "all_gather") == pytest.approx(7 / 8 * S / (306e9 * ramp) + 10e-6 + 7e-6, rel=1e-12)
    assert ring_collective_s(S, 1, 306.0, "all_reduce") == 0.0
    # a 1 MiB all-gather over 2 GPUs is latency-bound: ~40 us (measured 36 us on 2 H200, NCCL, NV18)
    assert ring_collective_s(2**20, 2, 450 * perf.NVLINK_EFFICIENCY, "all_gather") == pytest.approx(36e-6, rel=0.15)


def test_tp_all_reduces_without_sp_are_two_exposed_forward_and_two_hidden_backward_per_layer():
    # TP2, no SP, one node: per layer the forward all-reduces after the attention projection and fc2
    # are exposed; the backward all-reduces of the input grads run behind the wgrad GEMMs (qkv, fc1),
    # costing only the SM tax. Plus the embedding all-reduce (fwd) and the output layer's input-grad
    # all-reduce (behind its wgrad). AR = 2*(1/2)*S / (450 GB/s * NVLINK_EFFICIENCY * ramp) + latency,
    # S = T*h*2 B = 64 MiB, ramp = 64/(64+16).
    model = dict(num_layers=4, hidden_size=8192, num_attention_heads=64, vocab_size=32768, swiglu=False)
    e = step_time(_plan(model, num_gpus=2, gbs=2, s=4096, tensor_model_parallel_size=2, sequence_parallel=False))
    T, h = 4096, 8192
    S = T * h * 2
    ar = 2 * (1 / 2) * S / (450e9 * perf.NVLINK_EFFICIENCY * 0.8) + perf.COLLECTIVE_LATENCY_S + 2 * perf.NVLINK_HOP_LATENCY_S
    tax = perf.OVERLAP_SM_TAX
    per_microbatch = 4 * (2 * ar + 2 * tax * ar) + tax * ar + ar
    assert e.breakdown.tp_comm_exposed_s == pytest.approx(2 * per_microbatch, rel=1e-6)


def test_dp_reduce_scatter_and_all_gather_move_the_local_parameters_once_each():
    # No overlap, distributed optimizer, TP1/PP1, 16 GPUs on 2 nodes: grads reduce-scattered in fp32
    # and params all-gathered in bf16 over DP=16, (N-1)/N of P each. P per layer of a GPT block with
    # biases and LayerNorm = 12h^2 + 13h (QKV 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h, 2 norms 4h),
    # plus the tied embedding V*h, the learned position embedding s*h and the final LayerNorm 2h (the
    # one rank holds them all: physics.memory.rank_params). A group with 8 ranks per node spanning nodes gets 8 NICs, capped by
    # NVLink: min(450 * 0.68, 8 * 50 * 0.85) = 306 GB/s, at the size ramp S/(S + 16 MiB).
    L, h, V = 4, 4096, 128
    model = dict(GPT_SMALL_VOCAB, num_layers=L)
    e = step_time(_plan(model, num_gpus=16, gbs=16, overlap_grad_reduce=False, overlap_param_gather=False))
    P = L * (12 * h * h + 13 * h) + V * h + 4096 * h + 2 * h
    assert e.breakdown.dp_comm_exposed_s == pytest.approx(_dp16_two_nodes_s(P), rel=1e-6)


def _dp16_two_nodes_s(P: float) -> float:
    """Reduce-scatter of P fp32 gradients + all-gather of P bf16 parameters over 16 ranks on 2 nodes."""
    bw = min(450e9 * perf.NVLINK_EFFICIENCY, 8 * 50e9 * perf.NETWORK_EFFICIENCY)
    lat = perf.COLLECTIVE_LATENCY_S + 15 * perf.NETWORK_HOP_LATENCY_S
    ramp = lambda S: S / (S + 16 * 2**20)  # noqa: E731
    rs = 15 / 16 * P * 4 / (bw * ramp(P * 4)) + lat
    ag = 15 / 16 * P * 2 / (bw * ramp(P * 2)) + lat
    return rs + ag


def test_dp_traffic_and_the_adam_step_cover_llama3_8bs_embedding_and_untied_output_layer():
    # Llama-3-8B on TP1 PP1 DP16: the one rank holds all 8,030,261,248 parameters (hand-derived in
    # tests/physics/test_stage_params.py), embedding and output layer included; the former averaged
    # count held one V*h, 6.5% short.
    P = 8_030_261_248
    plan = _plan("llama3-8b", num_gpus=16, gbs=16, overlap_grad_reduce=False, overlap_param_gather=False)
    e = step_time(plan)
    assert e.breakdown.dp_comm_exposed_s == pytest.approx(_dp16_two_nodes_s(P), rel=1e-9)
    # the Adam step streams the 1/16 shard and zeroes the whole fp32 gradient buffer
    hw = hardware_params(plan.cluster)
    stream = hw.hbm_bandwidth_gbps * 1e9 * hw.stream_fraction
    adam = (P / 16 * perf.ADAM_BYTES_PER_PARAM + P * 4) / stream + 20 * perf.KERNEL_LAUNCH_S
    assert e.breakdown.optimizer_s == pytest.approx(adam, rel=1e-9)


def test_selective_recompute_reruns_only_the_attention_forward():
    # Fused attention: forward F/r, backward 2.5 F/r (FlashAttention-2 recomputes QK^T), so the
    # recomputed forward is 1/3.5 of the attention time.
    # (s = 8192 so the per-kernel launch cost is under 1% of the attention kernel)
    e = step_time(_plan("llama3-8b", num_gpus=8, s=8192, gbs=8, recompute_granularity="selective"))
    assert e.breakdown.recompute_s == pytest.approx(e.breakdown.attention_s / 3.5, rel=0.01)


def test_full_recompute_costs_about_one_forward_pass():
    # TP2 at 8K tokens per micro-batch: ~5 TFLOP per layer, well above any host floor
    base = _plan("llama3-8b", num_gpus=8, s=8192, gbs=8, tensor_model_parallel_size=2, sequence_parallel=True)
    full = base.model_copy(update={"parallelism": base.parallelism.model_copy(
        update=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))})
    e0, e1 = step_time(base), step_time(full)
    # forward ~ 1/3 of fwd+bwd GEMM work; with attention (bwd 2.5x) and comm the share stays 25-40%
    added = e1.iteration_time_s - e0.iteration_time_s
    assert 0.25 < added / (e0.iteration_time_s - e0.breakdown.optimizer_s - e0.breakdown.overhead_s) < 0.40
    assert e1.breakdown.recompute_s == pytest.approx(added, rel=1e-6)
    assert e1.hfu_bf16_causal_pct > e1.mfu_bf16_causal_pct


# --------------------------------------------------------------------------------------------- relations


def test_more_virtual_stages_shrink_the_bubble():
    kw = dict(num_gpus=64, gbs=64, tensor_model_parallel_size=4, pipeline_model_parallel_size=8, sequence_parallel=True)
    bubbles = [step_time(_plan("llama3-70b", virtual_pipeline_model_parallel_size=v, **kw)).breakdown.pipeline_bubble_s
               for v in (None, 2, 5)]
    assert bubbles[0] > bubbles[1] > bubbles[2]
    assert bubbles[1] / bubbles[0] == pytest.approx(1 / 2, rel=0.05)


def test_tp_spanning_nodes_is_slower_than_inside_one_nvlink_domain():
    # one host speed for both (two nodes would otherwise get the bare-metal default): the TP collectives compared
    kw = dict(num_gpus=16, gbs=16, tensor_model_parallel_size=16, sequence_parallel=True, host=5.5)
    inside = step_time(_plan("llama3-70b", gpn=16, **kw))
    across = step_time(_plan("llama3-70b", gpn=8, **kw))
    assert across.breakdown.tp_comm_exposed_s > 1.05 * inside.breakdown.tp_comm_exposed_s
    assert across.iteration_time_s > inside.iteration_time_s


def test_fp8_speeds_up_large_gemms_but_not_attention():
    kw = dict(num_gpus=64, gbs=64, tensor_model_parallel_size=4, pipeline_model_parallel_size=4, sequence_parallel=True)
    bf16 = step_time(_plan("llama3-70b", **kw))
    fp8 = step_time(_plan("llama3-70b", precision="fp8", **kw))
    assert fp8.breakdown.gemm_s < 0.7 * bf16.breakdown.gemm_s
    assert fp8.breakdown.attention_s == pytest.approx(bf16.breakdown.attention_s)
    assert fp8.iteration_time_s < bf16.iteration_time_s
    # MFU is reported against both peaks for FP8 only; FP8 peak = 2x BF16 on Hopper
    assert bf16.mfu_fp8_causal_pct is None
    assert fp8.mfu_fp8_causal_pct == pytest.approx(fp8.mfu_bf16_causal_pct * 989.4 / 1978.9)


def test_overlapping_grad_reduce_and_param_gather_reduces_exposed_dp_time():
    kw = dict(num_gpus=64, gbs=64, tensor_model_parallel_size=8)
    exposed = {}
    for flags in ((False, False), (True, False), (True, True)):
        e = step_time(_plan("llama3-8b", overlap_grad_reduce=flags[0], overlap_param_gather=flags[1], **kw))
        exposed[flags] = e.breakdown.dp_comm_exposed_s
    assert exposed[(False, False)] > exposed[(True, False)] > exposed[(True, True)]


def test_local_spec_attention_is_megatrons_unfused_path_whatever_the_backend():
    kw = dict(num_gpus=1, gbs=8, s=2048, mbs=4)
    fused = step_time(_plan("gpt3-1.3b", impl=dict(attention_backend="fused"), **kw))
    local = {ab: step_time(_plan("gpt3-1.3b", impl=dict(transformer_impl="local", attention_backend=ab), **kw))
             for ab in ("auto", "flash", "fused", "local")}
    # gpt_layer_specs' LocalSpecProvider: DotProductAttention for every --attention-backend
    assert len({e.breakdown.attention_s for e in local.values()}) == 1
    assert local["auto"].breakdown.attention_s > 4 * fused.breakdown.attention_s
    local4k = step_time(_plan("gpt3-1.3b", s=4096, mbs=2, gbs=4, impl=dict(transformer_impl="local"), num_gpus=1))
    # same tokens per micro-batch, twice the sequence: unfused attention work doubles (b*s^2)
    assert local4k.breakdown.attention_s / local["auto"].breakdown.attention_s == pytest.approx(2.0, rel=0.05)


def test_local_softmax_paths_order_fused_kernel_bf16_fp32_and_dropout_adds_its_pass():
    # bytes per score (UNFUSED_SOFTMAX_BYTES_PER_SCORE): fused kernel 22 < PyTorch bf16 (32 counted, runs as 52.5) < fp32 74
    kw = dict(num_gpus=1, gbs=8, s=2048, mbs=4)

    def attn(**im):
        return step_time(_plan("gpt3-1.3b", impl=dict(transformer_impl="local", **im), **kw)).breakdown.attention_s
    fused, bf16, fp32 = attn(), attn(masked_softmax_fusion=False), attn(masked_softmax_fusion=False, attention_softmax_in_fp32=True)
    assert fused < bf16 < fp32
    elems = 24 * 8 * 16 * 2048 * 2048  # layers x micro-batch samples x heads x s^2, one step
    bw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=1)).hbm_bandwidth_gbps * 1e9 * 0.853
    per = perf.UNFUSED_SOFTMAX_BYTES_PER_SCORE
    assert fp32 - bf16 == pytest.approx(elems * perf.UNFUSED_ATTENTION_BW_FACTOR * (per["fp32"] - per["bf16"]) / bw, rel=0.02)
    p = _plan("gpt3-1.3b", impl=dict(transformer_impl="local", masked_softmax_fusion=False), **kw)
    p = p.model_copy(update={"training": p.training.model_copy(update={"attention_dropout": 0.1})})
    assert step_time(p).breakdown.attention_s - bf16 == pytest.approx(
        elems * perf.UNFUSED_ATTENTION_BW_FACTOR * perf.ATTENTION_DROPOUT_BYTES_PER_SCORE / bw, rel=0.02)


def test_expert_all_to_all_across_nodes_is_slower_than_inside_a_node():
    kw = dict(num_gpus=16, gbs=16, expert_model_parallel_size=8, pipeline_model_parallel_size=2)
    inside = step_time(_plan("mixtral-8x7b", gpn=8, **kw))
    across = step_time(_plan("mixtral-8x7b", gpn=4, **kw))
    assert across.breakdown.ep_comm_s > 2 * inside.breakdown.ep_comm_s


def test_vectorised_path_matches_step_time_plan_by_plan():
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    hw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=64))
    tp = np.array([1, 2, 4, 8])
    pp = np.array([4, 2, 1, 1])
    dp = 64 // (tp * pp)
    r = step_time_arrays(LayoutBatch(shape, 4096, 256, tp=tp, pp=pp, dp=dp, micro_batch_size=1, sequence_parallel=tp > 1), hw)
    for i in range(4):
        e = step_time(_plan("llama3-8b", num_gpus=64, gbs=256, tensor_model_parallel_size=int(tp[i]),
                            pipeline_model_parallel_size=int(pp[i]), sequence_parallel=bool(tp[i] > 1)))
        assert r["iteration_time_s"][i] == pytest.approx(e.iteration_time_s, rel=1e-12)


def test_fp8_on_a_gpu_without_fp8_names_the_field():
    with pytest.raises(ValueError, match="training.precision"):
        step_time(_plan("llama3-8b", gpu="a100-80gb", precision="fp8"))


# --------------------------------------------------------------------------------------------- anchors


@pytest.mark.parametrize("mbs, iteration_s", [(4, 1.169), (8, 1.068)])
def test_anchor_h200_megatron_pretrain_gpt_within_5_percent(mbs, iteration_s):
    # shared/reference/device-probe/TE-on-gpu.md: Megatron-LM's pretrain_gpt.py (megatron-core 0.19.2,
    # TE 2.20) on one H200 of this workplace, GPT 1.3B (24 x 2048, 16 heads, GeLU, LayerNorm, RoPE,
    # untied, V 32768), seq 2048, gbs 32, DDP without overlap, --no-gradient-accumulation-fusion, its
    # default NaN checks: 1,169 ms at micro-batch 4, 1,068 ms at 8. Neither row set a constant.
    plan = _plan(dict(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=32768,
                      swiglu=False, normalization="LayerNorm", add_bias_linear=True,
                      untie_embeddings_and_output_weights=True, position_embedding_type="rope"),
                 gpu="h200", num_gpus=1, s=2048, gbs=32, mbs=mbs, use_distributed_optimizer=False,
                 overlap_grad_reduce=False, overlap_param_gather=False,
                 impl=dict(cross_entropy_loss_fusion=False, gradient_accumulation_fusion=False))
    assert step_time(plan).iteration_time_s == pytest.approx(iteration_s, rel=0.05)


def test_anchor_korthikanti_175b_selective_iteration_time_within_10_percent():
    # Korthikanti et al. 2022 (arXiv 2205.05198) Table 5: GPT-3 175B, TP8 PP8, 64 A100-80GB, B=64,
    # s=2048, selective recompute + SP: 13.75 s per iteration. 2022 Megatron: no distributed
    # optimizer, no DP overlap, unfused attention with the fused softmax kernel.
    plan = _plan("gpt3-175b", gpu="a100-80gb", num_gpus=64, s=2048, gbs=64, tensor_model_parallel_size=8,
                 pipeline_model_parallel_size=8, sequence_parallel=True, recompute_granularity="selective",
                 use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False,
                 impl=dict(attention_backend="unfused", cross_entropy_loss_fusion=False))
    assert step_time(plan).iteration_time_s == pytest.approx(13.75, rel=0.10)


def test_anchor_nemo_llama2_70b_fp8_tokens_per_second_within_10_percent():
    # NeMo 24.07 performance summary (NVIDIA/NeMo docs/source/performance/performance_summary.md @
    # 8e3d65dcfe): Llama2-70B FP8 pretraining on 64 H100, TP4 PP4 VP20, mbs 1, gbs 128, seq 4096:
    # 1,728 tokens/s/GPU, on bare-metal DGX hosts (host floor 0, not the catalog's VM figure).
    plan = _plan("llama2-70b", num_gpus=64, gbs=128, precision="fp8", host=0, tensor_model_parallel_size=4,
                 pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=20, sequence_parallel=True,
                 tp_comm_overlap=True)
    assert step_time(plan).tokens_per_s_per_gpu == pytest.approx(1728, rel=0.10)


def test_vectorised_path_scores_moe_and_recompute_grids_in_one_call():
    shape = resolve_model(ModelSpec(name="mixtral-8x7b"))
    hw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=64))
    ep, rc = (x.ravel() for x in np.meshgrid([1, 2, 4, 8], [0, 1, 2], indexing="ij"))
    # routing measured balanced: routing_imbalance's sampling noise (tested in test_moe.py) grows with EP
    impl = Implementation.of(ImplementationSpec(moe_routing_imbalance=1.0))
    batch = LayoutBatch(shape, 4096, 256, impl=impl, tp=2, pp=4, dp=8, ep=ep, sequence_parallel=True, recompute=rc)
    r = {k: v.reshape(4, 3) for k, v in step_time_arrays(batch, hw).items()}
    t = r["iteration_time_s"]
    assert t.shape == (4, 3) and np.all(np.isfinite(t)) and np.all(t > 0)
    # recompute never speeds a step up; full costs more than selective
    assert np.all(t[:, 0] <= t[:, 1]) and np.all(t[:, 1] < t[:, 2])
    # more EP, fewer local experts: the expert GEMM time per GPU does not grow
    assert np.all(np.diff(r["gemm_s"][:, 0]) <= 1e-12)


def test_small_layers_are_held_to_the_host_floor():
    # GPT 1.3B at micro-batch 1 (2048 tokens): ~1.5 ms of GPU work per layer, under the host's time to
    # launch it: the reference layer itself (host_reference_kernels: TE, no wgrad fusion), so each
    # layer takes the catalog's host_floor_ms_per_layer (5.5 ms on this workplace's H200 VMs).
    floor = 5.5e-3
    kw = dict(gpu="h200", num_gpus=1, s=2048, gbs=32, impl=dict(gradient_accumulation_fusion=False))
    small = step_time(_plan("gpt3-1.3b", mbs=1, **kw))
    b = small.breakdown
    assert small.host_bound and b.host_bound_s > 0
    per_layer_mb = (small.iteration_time_s - b.optimizer_s - b.overhead_s - b.dp_comm_exposed_s) / (32 * 24)
    # layers at the floor, plus the output layer, loss and embedding and the sync waits per micro-batch
    assert floor < per_layer_mb < 1.15 * floor
    big = step_time(_plan("gpt3-1.3b", mbs=16, **kw))
    assert not big.host_bound and big.breakdown.host_bound_s < 0.1 * big.iteration_time_s


def test_host_syncs_follow_megatrons_nan_checks_and_moe_dispatch():
    # pretrain_gpt's loss_func: 2 loss checks per micro-batch; DDP check_grads: 2 per bucket of 40M params
    # (overlap_grad_reduce) once per step; MoE: one tokens-per-expert read per MoE layer and micro-batch.
    kw = dict(gpu="h100-sxm", num_gpus=1, s=2048, gbs=32, mbs=4)
    on = step_time(_plan("gpt3-1.3b", **kw))
    off = step_time(_plan("gpt3-1.3b", impl=dict(check_for_nan_in_loss_and_grad=False), **kw))
    hw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=1))
    k_f, _ = perf.host_reference_kernels()
    per_sync = hw.host_floor_s_per_layer * perf.HOST_FORWARD_SHARE / k_f * perf.HOST_SYNC_KERNELS
    buckets = np.ceil(memory_breakdown(_plan("gpt3-1.3b", **kw)).stages[0].num_params / 40e6)
    syncs = 2 * 8 + 2 * buckets
    assert on.breakdown.host_bound_s - off.breakdown.host_bound_s == pytest.approx(syncs * per_sync, rel=1e-6)


def test_the_host_floor_is_the_catalogs_unless_the_cluster_overrides_it():
    vm = step_time(_plan("gpt3-1.3b", gpu="h100-sxm", num_gpus=1, s=2048, gbs=32, mbs=1))
    assert vm.breakdown.host_bound_s > 0  # this workplace's H100 VMs (catalog 5.5 ms per reference layer)
    fast = step_time(_plan("gpt3-1.3b", gpu="h100-sxm", num_gpus=1, s=2048, gbs=32, mbs=1, host=0))
    assert fast.breakdown.host_bound_s == 0 and not fast.host_bound
    slow = step_time(_plan("gpt3-1.3b", gpu="h100-sxm", num_gpus=1, s=2048, gbs=32, mbs=1, host=9.0))
    assert slow.iteration_time_s > vm.iteration_time_s > fast.iteration_time_s


# A GPT-3-2.7B-like layer (32 heads of 80) and the same with heads of 128: attention kernels pad.
def _heads(d: int) -> dict:
    return dict(num_layers=4, hidden_size=32 * d, num_attention_heads=32, vocab_size=128, swiglu=False,
                normalization="LayerNorm", add_bias_linear=True, position_embedding_type="rope",
                ffn_hidden_size=10240)


def test_fused_attention_times_a_head_dim_of_80_as_128_and_flash_as_96():
    kw = dict(gpu="h200", num_gpus=1, s=2048, gbs=8, mbs=8)
    te80 = step_time(_plan(_heads(80), **kw)).breakdown.attention_s
    te128 = step_time(_plan(_heads(128), **kw)).breakdown.attention_s
    assert te80 == pytest.approx(te128, rel=1e-6)  # cuDNN fused kernels: tiles of 64 up to 128
    flash = dict(attention_backend="flash")
    fl80 = step_time(_plan(_heads(80), impl=flash, **kw)).breakdown.attention_s
    fl128 = step_time(_plan(_heads(128), impl=flash, **kw)).breakdown.attention_s
    # FlashAttention-2 (TE's flash backend): multiples of 32, so 80 runs as 96; the launch constant is tiny
    assert fl80 / fl128 == pytest.approx(96 / 128, rel=1e-3)


def test_unfused_weight_gradient_accumulation_costs_a_streaming_add_per_weight():
    kw = dict(gpu="h200", num_gpus=1, s=2048, gbs=32, mbs=8)
    fused = step_time(_plan("gpt3-1.3b", **kw))
    unfused = step_time(_plan("gpt3-1.3b", impl=dict(gradient_accumulation_fusion=False), **kw))
    hw = hardware_params(ClusterSpec(gpu="h200", num_gpus=1))
    shape = resolve_model(ModelSpec(name="gpt3-1.3b"))
    h, f, L = shape.hidden_size, shape.ffn_hidden_size, shape.num_layers
    V = -(-shape.vocab_size // 128) * 128
    weights = L * (4 * h * h + 2 * h * f) + V * h  # qkv + proj + fc1 + fc2 per layer, output layer
    bw = hw.hbm_bandwidth_gbps * 1e9
    # unfused: bf16 grad + fp32 main_grad read, main_grad written (10 B at elementwise bandwidth);
    # fused: the wgrad GEMM reads 4 B and writes 4 B instead of 2 B, half of it exposed (3 B)
    # plus one add kernel per weight tensor (4 per layer + the output layer)
    per_mb = weights * 10.0 / (bw * hw.elementwise_fraction) - weights * 3.0 / bw + (4 * L + 1) * perf.KERNEL_LAUNCH_S
    extra = unfused.breakdown.elementwise_s - fused.breakdown.elementwise_s
    assert extra == pytest.approx(4 * per_mb, rel=1e-3)  # 4 micro-batches
    assert unfused.tokens_per_s_per_gpu < fused.tokens_per_s_per_gpu


def test_flash_attention_dropout_costs_its_philox_draws_forward_and_backward():
    # TE's fused kernel regenerates the dropout bits in backward: DROPOUT_RNG_OPS_PER_SCORE integer ops per
    # score over the causal half, at the INT32 rate (dense BF16 peak / 64 on Hopper).
    def attn(p):
        plan = _plan("gpt3-1.3b", num_gpus=1, gbs=8, s=2048, mbs=4, host=0)
        plan = plan.model_copy(update={"training": plan.training.model_copy(update={"attention_dropout": p})})
        return step_time(plan).breakdown.attention_s
    scores = 24 * 8 * 16 * 2048 * 2048  # layers x samples per step x heads x s^2
    rate = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=1)).peak_bf16_tflops * 1e12 / 64
    assert attn(0.1) - attn(0.0) == pytest.approx(perf.DROPOUT_RNG_OPS_PER_SCORE * 0.5 * scores / rate, rel=1e-6)


def test_a_host_bound_prediction_is_flagged_and_reported_as_a_finding():
    from mcore_advisor.physics.evaluate import evaluate_plan

    small = _plan("gpt3-1.3b", gpu="h100-sxm", num_gpus=1, s=2048, gbs=32, mbs=1)
    ev = evaluate_plan(small)
    assert ev.performance.host_bound
    hit = [f for f in ev.findings if f.code == "host_bound"]
    assert len(hit) == 1 and "training.micro_batch_size" in hit[0].fields and "host-bound" in hit[0].message
    # the way to a figure for the user's own host: one profile job there, its measured host speed back into the plan
    assert "run_profile_job" in hit[0].fix and "cluster.host_floor_ms_per_layer" in hit[0].fix
    fast_host = evaluate_plan(_plan("gpt3-1.3b", gpu="h100-sxm", num_gpus=1, s=2048, gbs=32, mbs=1, host=0))
    assert not fast_host.performance.host_bound and not any(f.code == "host_bound" for f in fast_host.findings)


def test_te_grouped_experts_cost_the_host_less_than_a_python_loop_over_experts():
    # TE's GroupedLinear launches the per-expert GEMMs from one call; SequentialMLP (moe_grouped_gemm off,
    # or the local spec) runs each expert's MLP module from Python.
    moe = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000, num_experts=8,
               moe_router_topk=2, moe_ffn_hidden_size=2816, swiglu=True)
    kw = dict(gpu="h100-sxm", num_gpus=1, s=2048, gbs=32, mbs=1)
    grouped = step_time(_plan(moe, impl=dict(moe_grouped_gemm=True), **kw))
    looped = step_time(_plan(moe, impl=dict(moe_grouped_gemm=False), **kw))
    assert looped.breakdown.host_bound_s > grouped.breakdown.host_bound_s > 0


# ---- at scale: TP userbuffers overlap, DP windows with interleaving, the network size ramp -------


def _ctx(plan: Plan):
    shape = resolve_model(plan.model)
    return perf._context(LayoutBatch.from_plan(plan, shape), hardware_params(plan.cluster), plan.training.precision == "fp8")


def test_userbuffers_leave_only_the_pipelined_reduce_scatter_tail_when_the_gemms_are_longer():
    # TE initialize_ub defaults: ring-exchange gathers, the forward reduce-scatter in 4 pipelined splits (the
    # last one exposed), bulk re-gather / reduce-scatter beside dgrad / wgrad. With every GEMM far longer than
    # its collective, hand-derived:
    c = _ctx(_plan("llama3-70b", num_gpus=8, precision="fp8", tensor_model_parallel_size=8,
                   sequence_parallel=True, tp_comm_overlap=True))
    tc = perf._TpComm(c)
    ag, ag_ub = float(tc.ag[0]), float(tc.ag_ub[0])
    # FP8 all-gather buffers: half the bytes of the bf16 activation [4096 tokens, 8192]
    S = 4096 * 8192 * 2
    assert ag == pytest.approx(ring_collective_s(S, 8, 306.0, "all_gather"), rel=1e-9)
    assert ag_ub == pytest.approx(ring_collective_s(S / 2, 8, 306.0, "all_gather"), rel=1e-9)
    big = 1.0
    fwd, bwd = tc.userbuffers(big, big, big, big, big, 1.0)
    # the collectives hide; the five GEMMs beside them (column fwd, row fwd, row dgrad, column dgrad and
    # wgrad) stretch by UB_GEMM_STRETCH (their split and the SMs the userbuffers kernels hold)
    stretch = perf.UB_GEMM_STRETCH - 1.0
    assert float(fwd[0]) == pytest.approx(ag / 4 + 2 * stretch * big, rel=1e-9)
    assert float(bwd[0]) == pytest.approx(3 * stretch * big, rel=1e-9)
    # GEMMs shorter than the collectives expose the difference
    fwd0, _ = tc.userbuffers(0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
    assert float(fwd0[0]) == pytest.approx(ag_ub + ag, rel=1e-9)


def test_tp_comm_overlap_hides_most_tp_traffic_of_a_tp8_fp8_layout():
    # Llama-3.1-405B on 1,024 H100 as NeMo's recipe runs it (TP8 PP8 CP2 VP8, FP8, tp_comm_overlap):
    # overlapped, the TP term (the exposed tails plus the stretched GEMMs) is below the unoverlapped one, and
    # the step 3-15% shorter.
    par = dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, context_parallel_size=2,
               virtual_pipeline_model_parallel_size=8, sequence_parallel=True,
               account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    kw = dict(num_gpus=1024, s=8192, gbs=512, precision="fp8", impl={"grad_reduce_in_fp32": False})
    off, on = step_time(_plan("llama3.1-405b", **kw, **par)), step_time(_plan("llama3.1-405b", **kw, **par, tp_comm_overlap=True))
    assert on.breakdown.tp_comm_exposed_s < 0.8 * off.breakdown.tp_comm_exposed_s
    assert 0.85 < on.iteration_time_s / off.iteration_time_s < 0.97


def test_network_collectives_ramp_up_at_the_nvlink_start_up_time_scaled_to_their_rate():
    # The ramp is one start-up time (16 MiB at 450 GB/s x 0.68 = 55 us): on one 42.5 GB/s NIC a 2 MiB
    # message reaches 2 / (2 + 0.055e-3 * 42.5e9 / 2**20) of the link, not 2 / (2 + 16).
    bw = 50e9 * perf.NETWORK_EFFICIENCY
    half = 16 * 2**20 / (450e9 * perf.NVLINK_EFFICIENCY) * bw
    assert perf._ramp(2 * 2**20, bw) == pytest.approx(2 * 2**20 / (2 * 2**20 + half), rel=1e-12)
    assert perf._ramp(2 * 2**20, 450e9 * perf.NVLINK_EFFICIENCY) == pytest.approx(2 / 18, rel=1e-12)


def test_interleaving_widens_the_data_parallel_overlap_window():
    # Megatron reduces each model chunk's grads after its last micro-batch: with VP the earlier chunks hide
    # behind the pp micro-batches of the later ones, so exposed DP time falls with VP at a fixed layout.
    base = dict(num_gpus=512, s=4096, gbs=256, tensor_model_parallel_size=8, pipeline_model_parallel_size=8,
                sequence_parallel=True)
    flat = step_time(_plan("llama3-70b", **base))
    inter = step_time(_plan("llama3-70b", **base, virtual_pipeline_model_parallel_size=5))
    assert inter.breakdown.dp_comm_exposed_s < flat.breakdown.dp_comm_exposed_s
