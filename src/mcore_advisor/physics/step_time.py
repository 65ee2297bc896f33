"""Step time of a Megatron-Core training iteration from physics: FLOPs, bytes and links.

Public API
----------
step_time(plan) -> PerfEstimate
    Predicted iteration time with a per-term breakdown, tokens/s/GPU, model TFLOP/s/GPU in both
    FLOP conventions ('causal', 'full'), MFU against the dense BF16 peak (and, for FP8 runs, also
    against the dense FP8 peak), HFU (recomputed forward counted). Never reads published runs.
step_time_arrays(shape, hardware, seq_length, global_batch_size, **layout) -> dict[str, ndarray]
    The same model on plain numbers: every layout argument (tp, pp, dp, cp, ep, etp, vp,
    micro_batch_size, sequence_parallel, recompute, ...) may be a numpy array; they broadcast, so
    one call scores thousands of candidate layouts (a recommender's inner loop). Returns
    `iteration_time_s`, `tokens_per_s_per_gpu` and every breakdown term as arrays.
    `hardware_params(plan.cluster)` gives the `hardware` argument; resolve the shape once.
    Divisibility and memory are not checked here (validators.layout_errors and physics.memory do).

Model (per GPU of the slowest pipeline stage, per micro-batch, then the 1F1B schedule):
- GEMMs: per-GEMM time on its real (M, N, K) after TP/CP/EP splits: FLOPs at the GPU's sustained
  rate (measured here for H100/H200: `_MEASURED`; else peak x gpu.matmul_efficiency x
  SUSTAINED_GEMM_FRACTION, FP8 peak x FP8_GEMM_EFFICIENCY) divided by the wave-quantization
  efficiency of the output tiles over the SMs, plus the output write the mainloop does not hide
  (GEMM_EPILOGUE_EXPOSED) and KERNEL_LAUNCH_S. Backward = dgrad (M, K, N) + wgrad (K, N, M).
- Core attention: fused (cuDNN = TE 'auto'/'fused') at ATTENTION_EFFICIENCY of the BF16 peak with a
  sequence-length ramp s/(s + ATTENTION_HALF_RATE_SEQ), causal half executed, backward = 2.5x the
  forward work (the kernel recomputes QK^T); 'flash' (FlashAttention-2) at FLASH2_RELATIVE_RATE of
  that. Unfused/local: batched GEMMs over the full s x s plus softmax/mask bytes per score element
  (UNFUSED_*_BYTES_PER_SCORE) at streaming bandwidth.
- Elementwise (norms, bias/dropout/residual, activation, RoPE, FP8 casts, embedding): bytes over
  the measured elementwise bandwidth, plus KERNEL_LAUNCH_S per kernel; without SP the norm/residual
  work is repeated on every TP rank; the local spec runs more, unfused kernels than TE. Cross
  entropy and the optimizer are streaming passes (bytes per logit / per parameter).
- Collectives: ring cost (bytes x (n-1)/n, x2 for all-reduce) at the achieved bus bandwidth:
  NVLink x NVLINK_EFFICIENCY, or NICs x NETWORK_EFFICIENCY (a group with r ranks per node gets r
  NICs), times the size ramp S/(S + COLLECTIVE_HALF_BANDWIDTH_BYTES), plus latency. TP/SP: exposed
  in forward; the backward ones Megatron/TE launch asynchronously hide behind the paired
  dgrad/wgrad GEMM; tp_comm_overlap hides them behind their GEMMs. CP: ring K/V exchange hidden
  behind each chunk's attention. EP: four all-to-alls per MoE layer (DeepEP sends a token once per
  remote node). DP: reduce-scatter (or all-reduce) of grads and all-gather of params over dp*cp;
  overlap hides all but the last bucket behind one micro-batch's backward/forward. Hidden
  communication still costs OVERLAP_SM_TAX of its time (NCCL kernels occupy SMs). PP: p2p sends.
- Pipeline: m * t_stage_max + (sum of stage times - t_stage_max) / vp, i.e. the bubble
  (pp-1)/(vp*m) for equal stages (Narayanan et al. 2021, Sec. 2.2.2).
- Recompute: selective reruns the chosen modules' forward (core attention by default); full
  reruns the forward of the recomputed layers (flops.recomputed_layer_fraction).
- Optimizer: Adam over the local shard, bandwidth-bound; plus ITERATION_OVERHEAD_S.

Efficiency parameters (module constants below, each with how it was measured or derived) are few
and global; kernel rates come from micro-benchmarks on this workplace's H100/H200 (no training
run, published or measured, was used to fit them). Not modelled: MoE routing imbalance and
all-to-all/compute overlap, host (CPU) launch limits and syncs, stragglers at scale, CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import GpuSpec, gpu
from mcore_advisor.knowledge.models import linear_weights, resolve_model
from mcore_advisor.physics.flops import (
    attention_flops_per_token_per_layer,
    flops_per_iteration,
    hardware_flops_per_iteration,
    recomputed_layer_fraction,
)
from mcore_advisor.schemas import ClusterSpec, ModelShape, Plan, layers_per_stage, parallel_dims

# ---------------------------------------------------------------------------------------------
# Efficiency parameters. Kernel-level ones were fitted on benchmarks/kernel_probe.py and
# benchmarks/nccl_probe.py run on an H100 80GB HBM3 and on H200s of this workplace (torch 2.11,
# CUDA 13.0; raw results in benchmarks/results/kernel_probe_{h100,h200}.jsonl and
# nccl_probe_h200x2.jsonl), never on published training runs.
# ---------------------------------------------------------------------------------------------

# Sustained rates measured here, as fractions of the dense peaks, fitted with the GEMM-time model
# below (waves + exposed epilogue + launch) over 91 transformer-shaped bf16 GEMMs (tokens
# 2048/8192 x hidden 2048-12288 x TP 1-8, forward and weight-gradient shapes; RMS error 7.6%)
# and 9 fp8 GEMMs (torch._scaled_mm, e4m3, per-tensor scales; RMS 2.5%); elementwise = mean of
# copy, GeLU forward and LayerNorm forward bandwidth over the datasheet HBM bandwidth
# (H100 2856/2856/2231 GB/s of 3350; H200 3896/3120/2493 of 4800).
_MEASURED = {
    "h100-sxm": {"gemm_bf16": 0.758, "gemm_fp8": 0.680, "elementwise": 0.79, "stream": 0.853},
    "h200": {"gemm_bf16": 0.733, "gemm_fp8": 0.657, "elementwise": 0.66, "stream": 0.812},
}
# "stream" = device-to-device copy bandwidth over the datasheet (H100 2856, H200 3896 GB/s): the
# rate of the long streaming passes (unfused softmax over s x s scores, cross entropy over the
# vocabulary, the Adam step), which measured at the same bytes per element on both GPUs.

SUSTAINED_GEMM_FRACTION = 0.95
"""For GPUs not measured here: sustained transformer-GEMM rate = peak x catalog matmul_efficiency
(a short 8192^3 burst) x 0.95, the H100 ratio (750 TFLOP/s fitted vs 790 in the first burst of the
same run: clocks drop under sustained power)."""

FP8_GEMM_EFFICIENCY = 0.67
"""For GPUs not measured here: sustained FP8 GEMM rate over the dense FP8 peak (H100 0.680,
H200 0.657 measured)."""

ELEMENTWISE_BW_EFFICIENCY = 0.75
STREAM_BW_EFFICIENCY = 0.8
"""For GPUs not measured here: achieved fraction of HBM bandwidth by elementwise kernels (H100
0.79, H200 0.66 measured) and by long streaming passes (H100 0.853, H200 0.812)."""

GEMM_EPILOGUE_EXPOSED = 0.5
"""Fraction of a GEMM's bf16 output write (2*M*N bytes at HBM speed) not hidden by the mainloop.
Fitted jointly with the rate; it is what makes small-K GEMMs (TP-split output projections,
K = h/t) slow: measured 362 TFLOP/s at M=8192, N=2048, K=256 on H100."""

KERNEL_LAUNCH_S = 4e-6
"""Fixed cost per kernel (launch gap, prologue/ramp); same fit (square 1024^3 GEMM: 10 us)."""

ATTENTION_EFFICIENCY = 0.58
ATTENTION_HALF_RATE_SEQ = 1380.0
FLASH2_RELATIVE_RATE = 0.6
"""Fused causal attention (cuDNN, as TE's FusedAttention on Hopper), head dim 128, forward +
backward (backward counted as 2.5x forward FLOPs): rate = bf16 peak x 0.58 x s/(s + 1380).
Fit on torch SDPA cuDNN backend, 9 shapes (s 2048-16384, MHA and GQA): 335-350 TFLOP/s at
s=2048, 413-437 at 4096, 430-483 at 8192, 528 at 16384. attention_backend 'flash' (TE's
FlashAttention backend, FlashAttention-2 unless FA3 is installed) runs at FLASH2_RELATIVE_RATE of
that: torch's flash backend measured 195-313 TFLOP/s on the same 9 shapes (0.55-0.62x cuDNN)."""

ATTENTION_HEAD_DIM_TILE = 64.0
ATTENTION_MIN_PADDED_HEAD_DIM = 128.0
"""The fused kernels compute in head-dim tiles: a head dim between 64 and 128 costs as 128 (H200,
TE 2.20 cuDNN fused attention, GPT 2.7B TP2 trace: head dim 80 with 16 local heads took 1.10 ms per
layer and micro-batch where the 1.3B's head dim 128 with 16 heads and the same b, s took 1.16 ms, not
the 0.73 ms its FLOPs would give); above 128 the dim rounds up to a multiple of 64 (192 for MLA).
FlashAttention-2 kernels (attention_backend 'flash', torch SDPA in the local spec) are built for
multiples of 32 (FLASH_HEAD_DIM_TILE): the same head dim 80 through torch SDPA on the H200 probe ran at
the rate of its own FLOPs (2.7B mbs 8 row within 1% before any padding was modelled)."""
FLASH_HEAD_DIM_TILE = 32.0

UNFUSED_LOCAL_BYTES_PER_SCORE = 108.0
"""Megatron local-spec DotProductAttention without the compiled masked-softmax kernel (baddbmm ->
.float() -> masked_fill -> softmax -> bf16 -> bmm, and backward): HBM bytes per score element
(b * heads * s_q * s_k) at streaming (copy) bandwidth, beyond the GEMM FLOPs. Fit: 0.0385-0.0391
ns per element fwd+bwd on H100 (104.5 B at 2856 GB/s) and 0.0302-0.0312 on H200 (112 B at
3896 GB/s), 4 shapes each (s 2048/4096), minus the GEMM time."""

UNFUSED_TE_BYTES_PER_SCORE = 24.0
"""TE UnfusedDotProductAttention / Megatron with the fused scale-mask-softmax kernel: bf16 scores
written and read once per GEMM (QK^T out, PV in; dP out, dS out and read twice) plus a fused
softmax (read+write fwd, read 2 + write 1 bwd): 2+2+2+2+4+4+2+6 = 24 B. Derived, not measured."""

CROSS_ENTROPY_UNFUSED_BYTES_PER_LOGIT = 53.0
"""Vocab-parallel cross entropy without fusion (fp32 upcast, max, exp, sum, grad), fwd+bwd:
0.0186-0.019 ns per logit on H100 and 0.0135-0.0143 on H200 (F.cross_entropy on fp32-upcast bf16
logits, V 32768/128256) = 53 B at copy bandwidth on both."""

CROSS_ENTROPY_FUSED_BYTES_PER_LOGIT = 12.0
"""Fused cross entropy (cross_entropy_loss_fusion): bf16 logits read in forward, read again and
grad written in backward, plus the GEMM's logits write/read: about 6 passes of 2 B. Derived."""

ADAM_BYTES_PER_PARAM = 38.0
"""Optimizer step per parameter of the local shard: Adam reads fp32 param, grad, m, v (16 B),
writes param, m, v (12 B) = 28 B (fused AdamW measured 0.0107 ns/param on H100, 0.0080 on H200 =
31 B at copy bandwidth); plus the grad-norm read (4 B) and the fp32 -> bf16 model-param copy (4 + 2 B)."""

NVLINK_EFFICIENCY = 0.68
COLLECTIVE_HALF_BANDWIDTH_BYTES = 16 * 2**20
"""Achieved NCCL bus bandwidth over NVLink = 450 GB/s x 0.68 x S/(S + 16 MiB) for a collective
of full size S (so 1 MiB collectives are latency-bound, 1 GiB ones near 0.68). Fit on 2 H200 with
NV18 links, NCCL of torch 2.11, NVLS off (benchmarks/nccl_probe.py): all-reduce bus bandwidth
269/302/328 GB/s at 64/256/1024 MiB, all-gather 214/242/270, reduce-scatter 193/232/266, and
36-45 us at 1 MiB. (NVIDIA quotes ~360 GB/s ring all-reduce on 8x H100; not measurable here.)
The same size ramp is applied to network collectives."""

NETWORK_EFFICIENCY = 0.85
"""Achieved fraction of a 400 Gb/s NIC's 50 GB/s per direction in NCCL collectives (~42-45 GB/s
bus bandwidth per NIC on InfiniBand NDR). Literature value, not measured here."""

OVERLAP_SM_TAX = 0.15
"""Compute slowdown per second of communication hidden behind it: NCCL's kernels hold one SM per
channel while they run (16-32 channels on NVLink, fewer on InfiniBand, of 132 SMs on H100 =
12-24%) and share HBM bandwidth, so an overlapped collective is not free. Midpoint of that range;
an estimate from NCCL's channel counts, not fitted."""

COLLECTIVE_LATENCY_S = 10e-6
NVLINK_HOP_LATENCY_S = 1e-6
NETWORK_HOP_LATENCY_S = 5e-6
"""Per-collective base latency and per-ring-step latency (n-1 steps for all-gather/reduce-scatter,
2(n-1) for all-reduce), on top of the bandwidth ramp above: launch + a few us per InfiniBand hop.
They matter only for small models and long rings."""

HOST_SELECTIVE_EXTRA = 1.7 / 6.1
HOST_FULL_EXTRA = 4.2 / 6.1
"""Host (CPU) floor per transformer layer and micro-batch: the Python and launch work of
Megatron-Core's layer, which the GPU cannot outrun however small its kernels. The floor itself is a
property of the host (GpuSpec.host_floor_ms_per_layer, ClusterSpec override): 6.1 ms forward +
backward on this workplace's H200 VMs, where Megatron-LM's own pretrain_gpt.py at micro-batch 4
(1169 ms for 8 micro-batches x 24 layers) and our profile job at micro-batch 1 (146 ms / 24) sit on
it with 1.5 to 5.5 ms of GPU work. Published bare-metal runs bound it below their layers' time
(MCore README GPT 32B, TP8: 4.6 ms per layer and micro-batch in all), so elsewhere it is 0 unless
given. Recompute adds host work in proportion, measured on the same VM: selective (core_attn) 1.7 ms
and full 4.2 ms more (7.8 and 10.3 ms floors)."""

# MoE layers have a larger host cost (router, permutation, the alltoall dispatcher's device-to-host
# read of tokens per expert): a 12-layer 8-expert model ran 26 ms per layer and micro-batch on the
# H200 VM (benchmarks/results/gpu_memory_sweep.jsonl), but published large-MoE runs on bare-metal
# hosts (Qwen3-235B, MoE Model Zoo) rule out a floor that high there. Host speed varies too much
# between machines to carry one MoE figure over, so no MoE-specific floor is modelled.

ITERATION_OVERHEAD_S = 0.005
"""Per-iteration fixed cost outside the schedule: loss reduction and logging, grad-norm
all-reduce, optimizer launches, data loader. An estimate; it matters only for very short steps."""

# Streaming multiprocessors per GPU (wave quantization). NVIDIA architecture whitepapers; H100 SXM
# 132 confirmed by torch.cuda.get_device_properties on this workplace's H100 and H200.
_SM_COUNT = {"h100-sxm": 132, "h100-pcie": 114, "h200": 132, "a100-80gb": 108, "a100-40gb": 108, "b200": 148, "gb200": 152}
_SM_BY_ARCH = {"ampere": 108, "hopper": 132, "blackwell": 148}

# Megatron-Core DDP default bucket: max(40M, 1M * dp) elements (distributed/distributed_data_parallel.py).
_BUCKET_MIN_PARAMS = 40_000_000
_BUCKET_PARAMS_PER_DP = 1_000_000

_RECOMPUTE_CODES = {None: 0, "selective": 1, "full": 2}


# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HardwareParams:
    """The numbers the time model needs from a GPU and its cluster (catalog + overrides)."""

    key: str
    peak_bf16_tflops: float
    peak_fp8_tflops: float | None
    matmul_efficiency: float
    hbm_bandwidth_gbps: float
    nvlink_bandwidth_gbps: float
    scaleout_bandwidth_gbps: float
    gpus_per_node: int
    num_sms: int
    gemm_bf16_fraction: float
    gemm_fp8_fraction: float
    elementwise_fraction: float
    stream_fraction: float
    host_floor_s_per_layer: float = 0.0


def hardware_params(cluster: ClusterSpec, spec: GpuSpec | None = None) -> HardwareParams:
    """Catalog entry for cluster.gpu with the cluster's bandwidth / node-size overrides applied."""
    g = spec or gpu(cluster.gpu)
    nvlink = cluster.nvlink_bandwidth_gbps or g.nvlink_bandwidth_gbps
    if nvlink is None:  # PCIe-only parts: intra-node collectives cross PCIe Gen5 x16
        nvlink = 64.0
    meas = _MEASURED.get(g.key, {})
    return HardwareParams(
        key=g.key,
        peak_bf16_tflops=g.bf16_dense_tflops,
        peak_fp8_tflops=g.fp8_dense_tflops,
        matmul_efficiency=g.matmul_efficiency,
        hbm_bandwidth_gbps=g.hbm_bandwidth_gbps,
        nvlink_bandwidth_gbps=nvlink,
        scaleout_bandwidth_gbps=cluster.scaleout_bandwidth_gbps or g.scaleout_bandwidth_gbps,
        gpus_per_node=cluster.gpus_per_node or g.gpus_per_node,
        num_sms=_SM_COUNT.get(g.key, _SM_BY_ARCH.get(g.architecture, 132)),
        gemm_bf16_fraction=meas.get("gemm_bf16", g.matmul_efficiency * SUSTAINED_GEMM_FRACTION),
        gemm_fp8_fraction=meas.get("gemm_fp8", FP8_GEMM_EFFICIENCY),
        elementwise_fraction=meas.get("elementwise", ELEMENTWISE_BW_EFFICIENCY),
        stream_fraction=meas.get("stream", STREAM_BW_EFFICIENCY),
        host_floor_s_per_layer=1e-3 * (cluster.host_floor_ms_per_layer if cluster.host_floor_ms_per_layer is not None
                                       else g.host_floor_ms_per_layer),
    )


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


class StepTimeBreakdown(BaseModel):
    """Seconds per iteration on the critical path; the terms sum to iteration_time_s.

    Compute terms are the slowest pipeline stage's work times the number of micro-batches; the
    bubble is the pipeline fill/drain of all stages; *_exposed_s is communication not hidden.
    """

    model_config = ConfigDict(frozen=True)

    gemm_s: float = Field(description="Dense-layer, expert and output-layer GEMMs, forward + backward.")
    attention_s: float = Field(description="Core attention (QK^T, softmax, PV), forward + backward.")
    elementwise_s: float = Field(description="Norms, activations, bias/dropout/residual, RoPE, FP8 casts, cross-entropy, embedding, MoE permutes.")
    recompute_s: float = Field(description="Forward work rerun in backward by activation recomputation.")
    tp_comm_exposed_s: float = Field(description="Tensor/sequence-parallel collectives not hidden behind GEMMs.")
    cp_comm_exposed_s: float = Field(description="Context-parallel K/V ring exchange not hidden behind attention.")
    ep_comm_s: float = Field(description="MoE token all-to-all (dispatch + combine, forward + backward).")
    pp_p2p_s: float = Field(description="Pipeline send/receive of activations and gradients on the critical path.")
    pipeline_bubble_s: float = Field(description="Pipeline fill and drain: (sum of stage times - slowest stage) / VP; (pp-1)/(vp*m) of the schedule for equal stages.")
    dp_comm_exposed_s: float = Field(description="Data-parallel gradient reduce-scatter/all-reduce and parameter all-gather not overlapped.")
    optimizer_s: float = Field(description="Adam step over the local parameter shard (HBM-bound).")
    host_bound_s: float = Field(description="GPU idle waiting for the host to launch kernels: small layers whose GPU work is under the host floor (GpuSpec.host_floor_ms_per_layer).")
    overhead_s: float = Field(description="Fixed per-iteration overhead.")


class PerfEstimate(BaseModel):
    """Predicted speed of one plan. FLOP figures name their convention; MFU names its peak."""

    model_config = ConfigDict(frozen=True)

    iteration_time_s: float
    breakdown: StepTimeBreakdown
    num_microbatches: int
    pipeline_bubble_fraction: float = Field(description="Bubble / iteration time.")
    tokens_per_s: float = Field(description="Whole job: global_batch_size * seq_length / iteration_time_s.")
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu_causal: float = Field(description="Megatron >= 2025-03 log figure (causal-half core attention), model FLOPs.")
    model_tflops_per_gpu_full: float = Field(description="Pre-2025-03 / NeMo 24.x figure (full s^2 core attention), model FLOPs.")
    hardware_tflops_per_gpu_causal: float = Field(description="Model FLOPs + recomputed forward, causal convention.")
    hardware_tflops_per_gpu_full: float = Field(description="Model FLOPs + recomputed forward, full convention.")
    peak_bf16_tflops: float = Field(description="Dense BF16 peak of the GPU: the MFU denominator.")
    peak_fp8_tflops: float | None = Field(description="Dense FP8 peak; None where the GPU has no FP8.")
    mfu_bf16_causal_pct: float = Field(description="Model FLOPs (causal) / dense BF16 peak, %.")
    mfu_bf16_full_pct: float = Field(description="Model FLOPs (full) / dense BF16 peak, %.")
    mfu_fp8_causal_pct: float | None = Field(description="FP8 runs only: model FLOPs (causal) / dense FP8 peak, %.")
    mfu_fp8_full_pct: float | None = Field(description="FP8 runs only: model FLOPs (full) / dense FP8 peak, %.")
    hfu_bf16_causal_pct: float = Field(description="Hardware FLOPs (with recompute, causal) / dense BF16 peak, %.")
    hfu_bf16_full_pct: float = Field(description="Hardware FLOPs (with recompute, full) / dense BF16 peak, %.")
    assumptions: list[str] = Field(description="How plan choices were timed (kernel paths, overlap).")


# ---------------------------------------------------------------------------------------------
# Array helpers: every function below works on Python floats and numpy arrays alike.
# ---------------------------------------------------------------------------------------------

_TILES = ((128, 256), (256, 128), (128, 128))


def _attention_kernel_dim(d: float, flash: bool = False) -> float:
    """Head dim the fused attention kernels are timed at (ATTENTION_HEAD_DIM_TILE)."""
    if flash:
        return float(np.ceil(d / FLASH_HEAD_DIM_TILE) * FLASH_HEAD_DIM_TILE)
    if d <= ATTENTION_HEAD_DIM_TILE:
        return ATTENTION_HEAD_DIM_TILE
    if d <= ATTENTION_MIN_PADDED_HEAD_DIM:
        return ATTENTION_MIN_PADDED_HEAD_DIM
    return float(np.ceil(d / ATTENTION_HEAD_DIM_TILE) * ATTENTION_HEAD_DIM_TILE)


def _wgrad_accumulation_s(weights, n_tensors, impl: _Impl, bw, bw_ew):
    """Adding one micro-batch's weight gradients into main_grad (fp32 with grad_reduce_in_fp32).

    Fused (gradient_accumulation_fusion: TE layers natively, Megatron's own with Apex): the wgrad GEMM
    reads and writes main_grad in its epilogue instead of writing a bf16 gradient, the exposed part
    of the extra bytes at GEMM_EPILOGUE_EXPOSED. Unfused: a separate add per weight reads the bf16
    gradient and main_grad and writes main_grad (the H200 bf16 1.3B trace: 24.8 ms of fp32 adds per
    4-micro-batch iteration; fusion measured +0.7% to +1.4% tokens/s there, +1.2% on 2.7B TP2+SP)."""
    mg = 4.0 if impl.grad_reduce_in_fp32 else 2.0
    if impl.grad_acc_fusion:
        return GEMM_EPILOGUE_EXPOSED * (2.0 * mg - 2.0) * weights / bw
    return weights * (2.0 + 2.0 * mg) / bw_ew + n_tensors * KERNEL_LAUNCH_S


def _local_weights(weights, tp):
    """Elements of these linear weights on one TP rank (replicated ones whole)."""
    return sum(r * c / (tp if split is not None else 1.0) for r, c, split in weights)


def _wave_efficiency(m, n, groups, sms):
    """Best output-tile wave efficiency over the tile shapes cuBLAS/CUTLASS pick on Hopper/Ampere."""
    best = 0.0
    for tm, tn in _TILES:
        tiles = np.ceil(m / tm) * np.ceil(n / tn) * groups
        best = np.maximum(best, tiles / (np.ceil(tiles / sms) * sms))
    return best


def _gemm_s(m, n, k, rate_flops, bw_bytes, sms, groups=1.0):
    """One (grouped) GEMM: FLOPs at the sustained rate over the wave efficiency + exposed epilogue."""
    m = np.maximum(m, 1.0)
    flops = 2.0 * m * n * k * groups
    return flops / (rate_flops * _wave_efficiency(m, n, groups, sms)) + GEMM_EPILOGUE_EXPOSED * 2.0 * m * n * groups / bw_bytes + KERNEL_LAUNCH_S


def _linear_s(m, n, k, rate_flops, bw_bytes, sms, groups=1.0):
    """(forward, dgrad, wgrad) of y[m,n] = x[m,k] @ w[k,n]."""
    return (
        _gemm_s(m, n, k, rate_flops, bw_bytes, sms, groups),
        _gemm_s(m, k, n, rate_flops, bw_bytes, sms, groups),
        _gemm_s(k, n, m, rate_flops, bw_bytes, sms, groups),
    )


def _ramp(bytes_total):
    """Bus-bandwidth fraction reached by a collective of this full size (NCCL protocol ramp)."""
    return bytes_total / (bytes_total + COLLECTIVE_HALF_BANDWIDTH_BYTES)


def _ring_s(bytes_total, n, bw_bytes, hop_latency, steps_per_rank=1.0):
    """Ring all-gather/reduce-scatter (steps_per_rank=1) or all-reduce (2) of a bytes_total tensor over n ranks."""
    n = np.maximum(n, 1.0)
    active = (n > 1) & (bytes_total > 0)
    eff_bw = bw_bytes * _ramp(np.maximum(bytes_total, 1.0))
    t = steps_per_rank * (n - 1) / n * bytes_total / eff_bw + COLLECTIVE_LATENCY_S + steps_per_rank * (n - 1) * hop_latency
    return np.where(active, t, 0.0)


def _group_link(stride, size, gpn, nvlink_bytes, net_bytes):
    """(bus bandwidth B/s, hop latency) of a process group of `size` ranks spaced `stride` apart.

    Inside one node: NVLink. Spanning nodes: NCCL spreads rings over the NICs of the group's ranks
    on each node (r = ranks per node), capped by NVLink.
    """
    span = stride * size
    inside = span <= gpn
    per_node = np.maximum(1.0, np.minimum(size, np.floor(gpn / np.maximum(stride, 1.0))))
    bw = np.where(inside, nvlink_bytes, np.minimum(nvlink_bytes, per_node * net_bytes))
    lat = np.where(inside, NVLINK_HOP_LATENCY_S, NETWORK_HOP_LATENCY_S)
    return bw, lat


def _f(x) -> float:
    return float(np.asarray(x).reshape(-1)[0]) if np.ndim(x) else float(x)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Impl:
    """Plan choices that change kernels, not layout (scalars)."""

    fp8: bool = False
    fp8_current_scaling: bool = False
    fp8_param_gather: bool = False
    te: bool = True
    attention: Literal["fused", "flash", "unfused_te", "unfused_local"] = "fused"
    grad_reduce_in_fp32: bool = True
    grad_acc_fusion: bool = True
    moe_dispatcher: str = "alltoall"
    moe_grouped_gemm: bool = True
    ce_fusion: bool = True
    recompute_modules: tuple[str, ...] = ("core_attn",)


def step_time_arrays(
    shape: ModelShape,
    hardware: HardwareParams,
    seq_length: int,
    global_batch_size: Any,
    *,
    tp: Any = 1,
    pp: Any = 1,
    dp: Any = 1,
    cp: Any = 1,
    ep: Any = 1,
    etp: Any = None,
    vp: Any = 1,
    micro_batch_size: Any = 1,
    sequence_parallel: Any = False,
    recompute: Any = 0,
    recompute_fraction: Any = 1.0,
    use_distributed_optimizer: Any = True,
    overlap_grad_reduce: Any = True,
    overlap_param_gather: Any = True,
    tp_comm_overlap: Any = False,
    precision: Literal["bf16", "fp8"] = "bf16",
    fp8_recipe: str = "delayed",
    fp8_param_gather: bool = False,
    transformer_impl: Literal["transformer_engine", "local"] = "transformer_engine",
    attention_backend: str = "auto",
    grad_reduce_in_fp32: bool = True,
    gradient_accumulation_fusion: bool = True,
    moe_token_dispatcher_type: str = "alltoall",
    moe_grouped_gemm: bool = True,
    cross_entropy_loss_fusion: bool = True,
    recompute_modules: tuple[str, ...] | list[str] | None = None,
    stage_layers: tuple[Any, Any, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Vectorised step time: layout arguments may be numpy arrays (they broadcast together).

    recompute: 0 none, 1 selective (recompute_modules, default core_attn), 2 full;
    recompute_fraction: with full recompute, the fraction of each model chunk's layers rerun
    (flops.recomputed_layer_fraction). vp = 1 means not interleaved. etp None = tp.
    stage_layers: (first, largest middle, last) stage layer counts (numbers or arrays) of the
    pipeline split (decoder_first/last_pipeline_num_layers); None = the even split, ceil(L / pp) each.
    Returns arrays: iteration_time_s, tokens_per_s_per_gpu, num_microbatches, and the
    StepTimeBreakdown terms (`gemm_s`, ..., `overhead_s`).
    """
    impl = _Impl(
        fp8=precision == "fp8",
        fp8_current_scaling=fp8_recipe in ("tensorwise",),
        fp8_param_gather=bool(fp8_param_gather),
        te=transformer_impl == "transformer_engine",
        attention=_attention_path(transformer_impl, attention_backend),
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        grad_acc_fusion=bool(gradient_accumulation_fusion),
        moe_dispatcher=moe_token_dispatcher_type,
        moe_grouped_gemm=moe_grouped_gemm,
        ce_fusion=cross_entropy_loss_fusion,
        recompute_modules=tuple(recompute_modules) if recompute_modules is not None else ("core_attn",),
    )
    f64 = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    etp_v = tp if etp is None else etp
    return _model(
        shape, hardware, impl, float(seq_length), f64(global_batch_size),
        f64(tp), f64(pp), f64(dp), f64(cp), f64(ep), f64(etp_v), f64(vp), f64(micro_batch_size),
        f64(sequence_parallel), f64(recompute), f64(recompute_fraction), f64(use_distributed_optimizer),
        f64(overlap_grad_reduce), f64(overlap_param_gather), f64(tp_comm_overlap), stage_layers,
    )


def _attention_path(transformer_impl: str, attention_backend: str) -> Literal["fused", "flash", "unfused_te", "unfused_local"]:
    # The project's launcher (launcher/entry/profile.py) and Megatron: with TE, 'unfused' is TE's
    # UnfusedDotProductAttention (fused softmax kernel), 'local' Megatron's DotProductAttention,
    # 'flash' FlashAttention-2, 'fused' and 'auto' cuDNN FusedAttention (TE's choice on Hopper).
    # The local spec runs torch SDPA for 'auto'/'flash' (torch picks FlashAttention-2 on Hopper:
    # the H200 SDPA measurements match that rate) and 'fused' (cuDNN), and Megatron's unfused
    # DotProductAttention with the PyTorch fp32 softmax for 'unfused'/'local' (no compiled
    # masked-softmax kernel), as the device probe ran it.
    if transformer_impl == "local":
        return {"auto": "flash", "flash": "flash", "fused": "fused"}.get(attention_backend, "unfused_local")
    return {"flash": "flash", "unfused": "unfused_te", "local": "unfused_local"}.get(attention_backend, "fused")


def _model(shape: ModelShape, hw: HardwareParams, impl: _Impl, s: float, gbs, tp, pp, dp, cp, ep, etp, vp, b, sp,
           recompute, recompute_fraction, dist_opt, overlap_grad, overlap_param, tp_overlap,
           stage_layers=None) -> dict[str, np.ndarray]:
    h = float(shape.hidden_size)
    n_heads = float(shape.num_attention_heads)
    g = float(shape.num_query_groups)
    L = float(shape.num_layers)
    L_moe = float(shape.num_moe_layers)
    swiglu = shape.swiglu
    fc1_mult = 2.0 if swiglu else 1.0
    bias = shape.add_bias_linear
    gpn = float(hw.gpus_per_node)
    sms = float(hw.num_sms)
    bw = hw.hbm_bandwidth_gbps * 1e9
    bw_ew = bw * hw.elementwise_fraction
    bw_st = bw * hw.stream_fraction
    nv = hw.nvlink_bandwidth_gbps * 1e9 * NVLINK_EFFICIENCY
    net = hw.scaleout_bandwidth_gbps * 1e9 * NETWORK_EFFICIENCY
    rate_bf16 = hw.peak_bf16_tflops * 1e12 * hw.gemm_bf16_fraction
    fp8 = impl.fp8 and hw.peak_fp8_tflops is not None
    rate = hw.peak_fp8_tflops * 1e12 * hw.gemm_fp8_fraction if fp8 else rate_bf16
    sp = np.where(tp > 1, sp, 0.0)
    tp_overlap = tp_overlap * sp  # TE userbuffers overlap needs SP
    full_rc = np.where(recompute == 2, 1.0, 0.0) * recompute_fraction
    sel = np.where(recompute == 1, 1.0, 0.0)
    mods = impl.recompute_modules

    m = np.maximum(1.0, np.floor(gbs / np.maximum(b * dp, 1.0)))
    T = b * s / cp  # tokens per GPU per micro-batch (sequence split by CP)
    T_sp = np.where(sp > 0, T / tp, T)  # tokens for norm/residual work (SP shards them over TP)

    # ---- GEMMs of one layer (forward, dgrad, wgrad) --------------------------------------
    if shape.multi_latent_attention:
        d_qk, d_rope, d_v = float(shape.qk_head_dim), float(shape.qk_pos_emb_head_dim), float(shape.v_head_dim)
        r_kv = float(shape.kv_lora_rank)
        attn_lin = []
        if shape.q_lora_rank is None:
            attn_lin.append(_linear_s(T, n_heads * (d_qk + d_rope) / tp, h, rate, bw, sms))
        else:
            r_q = float(shape.q_lora_rank)
            attn_lin.append(_linear_s(T, r_q, h, rate, bw, sms))  # q down-projection, replicated over TP
            attn_lin.append(_linear_s(T, n_heads * (d_qk + d_rope) / tp, r_q, rate, bw, sms))
        attn_lin.append(_linear_s(T, r_kv + d_rope, h, rate, bw, sms))  # kv down, replicated
        attn_lin.append(_linear_s(T, n_heads * (d_qk + d_v) / tp, r_kv, rate, bw, sms))
        proj = _linear_s(T, h, n_heads * d_v / tp, rate, bw, sms)
        qkv_wgrad = attn_lin[0][2]
        qk_dim, v_dim, kv_heads = d_qk + d_rope, d_v, n_heads
        qkv_out_elems = n_heads * (d_qk + d_rope) + n_heads * (d_qk + d_rope + d_v)  # per token, before /tp
    else:
        d = float(shape.kv_channels)
        qkv = _linear_s(T, (n_heads * d + 2 * g * d) / tp, h, rate, bw, sms)
        proj = _linear_s(T, h, n_heads * d / tp, rate, bw, sms)
        attn_lin = [qkv]
        qkv_wgrad = qkv[2]
        qk_dim, v_dim, kv_heads = d, d, g
        qkv_out_elems = n_heads * d + 2 * g * d
    attn_gemm_f = sum(x[0] for x in attn_lin) + proj[0]
    attn_gemm_b = sum(x[1] + x[2] for x in attn_lin) + proj[1] + proj[2]

    f = float(shape.ffn_hidden_size)
    fc1 = _linear_s(T, f * fc1_mult / tp, h, rate, bw, sms)
    fc2 = _linear_s(T, h, f / tp, rate, bw, sms)
    mlp_gemm_f = fc1[0] + fc2[0]
    mlp_gemm_b = fc1[1] + fc1[2] + fc2[1] + fc2[2]
    lw = linear_weights(shape)
    acc_attn_b = _wgrad_accumulation_s(_local_weights(lw["attention"], tp), len(lw["attention"]), impl, bw, bw_ew)

    # ---- core attention --------------------------------------------------------------------
    heads_loc = n_heads / tp
    s_q = s / cp
    if impl.attention in ("fused", "flash"):
        # Causal: the kernel skips masked blocks, so half of QK^T and PV is executed.
        flash = impl.attention == "flash"
        dims = _attention_kernel_dim(qk_dim, flash) + _attention_kernel_dim(v_dim, flash)
        fwd_flops = 2.0 * b * heads_loc * s_q * s * dims * 0.5
        chunk = s / cp  # CP ring steps work on s/cp x s/cp blocks
        r_attn = hw.peak_bf16_tflops * 1e12 * ATTENTION_EFFICIENCY * chunk / (chunk + ATTENTION_HALF_RATE_SEQ)
        if impl.attention == "flash":
            r_attn = r_attn * FLASH2_RELATIVE_RATE
        attn_f = fwd_flops / r_attn + KERNEL_LAUNCH_S
        attn_b = 2.5 * fwd_flops / r_attn + KERNEL_LAUNCH_S
    else:
        # Unfused: batched GEMMs over the full s x s (no masked-block skipping) + softmax bytes.
        elems = b * heads_loc * s_q * s
        gemm_flops = 2.0 * elems * (qk_dim + v_dim)
        per_score = UNFUSED_LOCAL_BYTES_PER_SCORE if impl.attention == "unfused_local" else UNFUSED_TE_BYTES_PER_SCORE
        # Forward share of the bytes: measured fwd/fwd+bwd time 0.0156/0.0388 on H100 (local path).
        attn_f = gemm_flops / rate_bf16 + 0.4 * elems * per_score / bw_st + 4 * KERNEL_LAUNCH_S
        attn_b = 2.0 * gemm_flops / rate_bf16 + 0.6 * elems * per_score / bw_st + 6 * KERNEL_LAUNCH_S

    # ---- elementwise bytes per layer (forward; backward ~2x: read input + grad, write grad) --
    norm_b = 2.0 * h * 2  # read + write h bf16
    resid_b = 3.0 * h * 2  # bias-dropout-add: read 2, write 1
    rope_elems = (n_heads * qk_dim + kv_heads * qk_dim) / tp if shape.position_embedding_type == "rope" else 0.0
    act_b_dense = (3.0 if swiglu else 2.0) * f / tp * 2
    if impl.te:
        ew_f = T_sp * (2 * norm_b + 2 * resid_b) + T * (rope_elems * 4 + act_b_dense)
        # Non-GEMM kernels of a TE layer: forward 2 norms, 2 RoPE, activation, 2 bias-dropout-add,
        # attention layout/aux ~3 (10); backward about twice that plus residual-grad adds (22).
        n_kernels_f, n_kernels_b = 10.0, 22.0
    else:
        # Local spec without Apex/TE fusions: separate bias adds, unfused RoPE (~5 passes).
        bias_b = (2.0 * f / tp * 2 + 2 * 2.0 * h * 2) if bias else 0.0
        ew_f = T_sp * (2 * norm_b + 2 * resid_b) + T * (5 * rope_elems * 4 + act_b_dense + bias_b)
        n_kernels_f, n_kernels_b = 22.0, 45.0
    ew_dense_f = ew_f
    if fp8:
        # TE casts each GEMM input to FP8 with a transposed copy (read 2, write 1 + 1) and each
        # output gradient likewise in backward; current scaling adds an amax pass over each.
        amax = 2.0 if impl.fp8_current_scaling else 0.0
        in_elems = T * (h + n_heads * v_dim / tp + h + f / tp)  # inputs of qkv, proj, fc1, fc2
        out_elems = T * (qkv_out_elems / tp + h + f * fc1_mult / tp + h)
        cast_f = in_elems * (4.0 + amax)
        cast_b = out_elems * (4.0 + amax)
        n_kernels_f, n_kernels_b = n_kernels_f + 5.0, n_kernels_b + 10.0  # cast/transpose + amax/scale updates
    else:
        cast_f = cast_b = 0.0
    ew_f_s = (ew_dense_f + cast_f) / bw_ew + n_kernels_f * KERNEL_LAUNCH_S
    ew_b_s = ((2.0 * ew_dense_f + cast_b) / bw_ew + n_kernels_b * KERNEL_LAUNCH_S
              + acc_attn_b + _wgrad_accumulation_s(_local_weights(lw["mlp"], tp), len(lw["mlp"]), impl, bw, bw_ew))

    # ---- TP / SP collectives of one layer --------------------------------------------------
    tp_bw, tp_lat = _group_link(1.0, tp, gpn, nv, net)
    S_act = T * h * 2.0  # bytes of one full activation [s/cp, b, h] in bf16
    ag = _ring_s(S_act, tp, tp_bw, tp_lat)  # all-gather or reduce-scatter
    ar = _ring_s(S_act, tp, tp_bw, tp_lat, 2.0)

    def hide(comm, behind):
        """Exposed part of a collective overlapped with `behind` compute, plus the slowdown its
        kernels cause to that compute while they share the SMs."""
        return np.maximum(0.0, comm - behind) + OVERLAP_SM_TAX * np.minimum(comm, behind)

    def tp_comm(col_dgrad, col_wgrad, row_dgrad, row_fwd, col_fwd):
        """Exposed TP comm of a (column-parallel -> row-parallel) block, forward and backward."""
        # no SP: fwd all-reduce after the row-parallel GEMM; bwd all-reduce of the input grad,
        # launched async and hidden behind the column-parallel wgrad GEMM (Megatron/TE).
        nosp_f = ar
        nosp_b = hide(ar, col_wgrad)
        # SP: fwd all-gather before the column GEMM + reduce-scatter after the row GEMM; bwd:
        # all-gather of the grad before the row dgrad (exposed), re-gather of the input for wgrad
        # (hidden behind the column dgrad), reduce-scatter of the input grad (behind col wgrad).
        sp_f = 2.0 * ag
        sp_b = ag + hide(ag, col_dgrad) + hide(ag, col_wgrad)
        # TE userbuffers: every one of them split and pipelined with its GEMM.
        ov_f = hide(ag, col_fwd) + hide(ag, row_fwd) + 2.0 * ag / np.maximum(tp, 1.0)
        ov_b = hide(ag, row_dgrad) + hide(ag, col_dgrad) + hide(ag, col_wgrad) + 3.0 * ag / np.maximum(tp, 1.0)
        fwd = np.where(sp > 0, np.where(tp_overlap > 0, ov_f, sp_f), nosp_f)
        bwd = np.where(sp > 0, np.where(tp_overlap > 0, ov_b, sp_b), nosp_b)
        return fwd, bwd

    tpa_f, tpa_b = tp_comm(sum(x[1] for x in attn_lin), qkv_wgrad, proj[1], proj[0], attn_lin[0][0])
    tpm_f, tpm_b = tp_comm(fc1[1], fc1[2], fc2[1], fc2[0], fc1[0])

    # ---- CP ring exchange of K/V, overlapped with each chunk's attention --------------------
    cp_bw, cp_lat = _group_link(tp, cp, gpn, nv, net)
    kv_bytes = b * s_q * (kv_heads / tp) * (qk_dim + v_dim) * 2.0  # K and V of the local chunk
    step_f = kv_bytes / (cp_bw * _ramp(kv_bytes)) + cp_lat + COLLECTIVE_LATENCY_S
    steps = np.maximum(cp - 1.0, 0.0)
    cp_f = steps * hide(step_f, attn_f / np.maximum(cp, 1.0))
    cp_b = steps * hide(2.0 * step_f, attn_b / np.maximum(cp, 1.0))  # K/V and dK/dV

    # ---- dense and MoE layer totals (forward / backward pieces) -----------------------------
    dense = {
        "gemm_f": attn_gemm_f + mlp_gemm_f, "gemm_b": attn_gemm_b + mlp_gemm_b,
        "attn_f": attn_f, "attn_b": attn_b, "ew_f": ew_f_s, "ew_b": ew_b_s,
        "tp_f": tpa_f + tpm_f, "tp_b": tpa_b + tpm_b, "cp_f": cp_f, "cp_b": cp_b, "ep_f": 0.0, "ep_b": 0.0,
        "acc_attn_b": acc_attn_b,
    }
    layers = {"dense": dense}
    if shape.is_moe:
        layers["moe"] = _moe_layer(shape, impl, dense, T, T_sp, tp, ep, etp, rate, bw, bw_ew, sms, gpn, nv, net,
                                   attn_gemm_f, attn_gemm_b, tpa_f, tpa_b, ew_dense_f, act_b_dense)

    # Selective recompute: rerun forward of the chosen modules during backward.
    def sel_extra(parts, is_moe):
        x = 0.0
        if "core_attn" in mods:
            x = x + parts["attn_f"]
        if "layernorm" in mods:
            x = x + T_sp * 2 * norm_b / bw_ew
        if "mlp" in mods and not is_moe:
            x = x + mlp_gemm_f + T * act_b_dense / bw_ew + tpm_f
        if is_moe:
            if "moe" in mods:
                x = x + parts["moe_f"]
            else:
                if "moe_act" in mods:
                    x = x + parts["moe_act_f"]
                if "shared_experts" in mods:
                    x = x + parts["shared_f"]
        if "mla_up_proj" in mods and shape.multi_latent_attention:
            x = x + sum(y[0] for y in attn_lin[1:])
        return x

    def layer_time(p, is_moe):
        fwd = p["gemm_f"] + p["attn_f"] + p["ew_f"] + p["tp_f"] + p["cp_f"] + p["ep_f"]
        bwd = p["gemm_b"] + p["attn_b"] + p["ew_b"] + p["tp_b"] + p["cp_b"] + p["ep_b"]
        rc = sel * sel_extra(p, is_moe) + full_rc * fwd
        return fwd, bwd, rc

    frac_moe = L_moe / L
    comp = {}
    for key in ("gemm", "attn", "ew", "tp", "cp", "ep"):
        comp[key] = (1 - frac_moe) * (dense[key + "_f"] + dense[key + "_b"])
        if shape.is_moe:
            mo = layers["moe"]
            comp[key] = comp[key] + frac_moe * (mo[key + "_f"] + mo[key + "_b"])
    fd, bd, rd = layer_time(dense, False)
    lay_f, lay_b, lay_rc = (1 - frac_moe) * fd, (1 - frac_moe) * bd, (1 - frac_moe) * rd
    if shape.is_moe:
        fm, bm, rm = layer_time(layers["moe"], True)
        lay_f, lay_b, lay_rc = lay_f + frac_moe * fm, lay_b + frac_moe * bm, lay_rc + frac_moe * rm
    t_layer_gpu = lay_f + lay_b + lay_rc
    host_floor = hw.host_floor_s_per_layer * (1.0 + np.where(recompute == 1, HOST_SELECTIVE_EXTRA, 0.0)
                                              + np.where(recompute == 2, recompute_fraction * HOST_FULL_EXTRA, 0.0))
    host_gap = np.maximum(0.0, host_floor - t_layer_gpu)
    t_layer = t_layer_gpu + host_gap

    # ---- embedding (first stage) and output layer + loss (last stage) ----------------------
    V = np.ceil(shape.vocab_size / (shape.make_vocab_size_divisible_by * tp)) * shape.make_vocab_size_divisible_by * tp
    out = _linear_s(T, V / tp, h, rate_bf16, bw, sms)  # Megatron's output layer is not a TE module: bf16 even in FP8 runs
    ce_bytes = CROSS_ENTROPY_FUSED_BYTES_PER_LOGIT if impl.ce_fusion else CROSS_ENTROPY_UNFUSED_BYTES_PER_LOGIT
    out_gemm = out[0] + out[1] + out[2]
    out_ew = (T * V / tp * ce_bytes / bw_st + T_sp * 3 * norm_b / bw_ew + 6 * KERNEL_LAUNCH_S
              + _wgrad_accumulation_s(V / tp * h, 1.0, impl, bw, bw_ew))
    out_tp = np.where(sp > 0, 2.0 * ag, hide(ar, out[2]))  # SP: gather before, reduce-scatter of grad after
    t_out = out_gemm + out_ew + out_tp
    emb_ew = (T * h * 2 * 2 + T * h * 10) / bw_ew + 4 * KERNEL_LAUNCH_S  # lookup; grad scatter-add into fp32
    emb_tp = np.where(sp > 0, ag, ar)
    t_emb = emb_ew + emb_tp

    # ---- pipeline schedule ---------------------------------------------------------------------
    one_stage = pp <= 1
    if stage_layers is None:
        Ls = L_first = L_last = L_mid = np.ceil(L / pp)
    else:
        # Uneven split: the first/last stages (embedding, loss) hold their own counts; the
        # slowest stage sets the pipeline's pace, the most-loaded one its buffers.
        L_first, L_mid, L_last = (np.asarray(x, dtype=np.float64) for x in stage_layers)
        Ls = np.maximum(np.maximum(L_first, L_mid), L_last)
    t_last = L_last * t_layer + t_out + np.where(one_stage, t_emb, 0.0)
    t_first = L_first * t_layer + t_emb
    t_max = np.maximum(np.maximum(t_last, np.where(one_stage, 0.0, t_first)), np.where(one_stage, 0.0, L_mid * t_layer))
    t_sum = L * t_layer + t_out + t_emb
    pp_bw, pp_lat = _group_link(tp * cp * dp, 2.0, gpn, nv, net)
    p2p_bytes = T * h * 2.0 / np.where(sp > 0, tp, 1.0)
    t_p2p = np.where(one_stage, 0.0, 2.0 * (p2p_bytes / (pp_bw * _ramp(p2p_bytes)) + pp_lat + COLLECTIVE_LATENCY_S))
    bubble = np.where(one_stage, 0.0, (t_sum - t_max) / vp)
    # 1F1B: blocking send/recv pairs on the critical path every micro-batch and through fill/drain.
    # Interleaved: Megatron overlaps them with compute (overlap_p2p_comm), vp times as many sends;
    # only fill/drain stays exposed.
    pipe_p2p = np.where(vp > 1, m * vp * OVERLAP_SM_TAX * t_p2p + (pp - 1.0) * t_p2p, (m + pp - 1.0) * t_p2p)
    pipe_p2p = np.where(one_stage, 0.0, pipe_p2p)

    # ---- data-parallel gradient / parameter traffic -----------------------------------------
    P_dense, P_exp = _local_params(shape, tp, pp, ep, etp, V, Ls)
    dpc = dp * cp  # Megatron reduces grads over the dp x cp group and shards the optimizer over it
    edp = np.maximum(1.0, np.floor(tp * pp * dp * cp / (etp * ep * pp)))
    g_bytes = 4.0 if impl.grad_reduce_in_fp32 else 2.0
    p_bytes = 1.0 if impl.fp8_param_gather and fp8 else 2.0
    d_bw, d_lat = _group_link(tp, dpc, gpn, nv, net)
    e_bw, e_lat = _group_link(etp * ep, edp, gpn, nv, net)
    grad_steps = np.where(dist_opt > 0, 1.0, 2.0)  # reduce-scatter vs all-reduce
    has_exp = 1.0 if shape.is_moe else 0.0
    t_grad = _ring_s(P_dense * g_bytes, dpc, d_bw, d_lat, grad_steps) + has_exp * _ring_s(P_exp * g_bytes, edp, e_bw, e_lat, grad_steps)
    t_param = np.where(dist_opt > 0, _ring_s(P_dense * p_bytes, dpc, d_bw, d_lat) + has_exp * _ring_s(P_exp * p_bytes, edp, e_bw, e_lat), 0.0)
    P_total = P_dense + P_exp
    bucket_frac = np.minimum(1.0, np.maximum(_BUCKET_MIN_PARAMS, _BUCKET_PARAMS_PER_DP * dpc) / np.maximum(P_total, 1.0))
    # Overlap window: the backward (forward) of one micro-batch on this stage; the last grad
    # bucket (first param bucket) can never hide.
    win_b = Ls * (lay_b + lay_rc)
    win_f = Ls * lay_f
    grad_exp = np.maximum(bucket_frac * t_grad, t_grad - win_b)
    param_exp = np.maximum(bucket_frac * t_param, t_param - win_f)
    grad_exposed = np.where(overlap_grad > 0, grad_exp + OVERLAP_SM_TAX * (t_grad - grad_exp), t_grad)
    param_exposed = np.where(overlap_param > 0, param_exp + OVERLAP_SM_TAX * (t_param - param_exp), t_param)
    # Tied embeddings across PP: first and last stage all-reduce the embedding grad (finalize_model_grads).
    tied = (not shape.untie_embeddings_and_output_weights)
    emb_sync = np.where(one_stage | (not tied), 0.0, _ring_s(V * h / tp * g_bytes, 2.0, *_group_link(tp * cp * dp, 2.0, gpn, nv, net), 2.0))
    dp_exposed = grad_exposed + param_exposed + emb_sync

    # ---- optimizer -----------------------------------------------------------------------------
    shard = np.where(dist_opt > 0, P_dense / dpc + P_exp / edp, P_total)
    t_opt = (shard * ADAM_BYTES_PER_PARAM + P_total * g_bytes) / bw_st + 20 * KERNEL_LAUNCH_S  # + zeroing the grad buffer

    # ---- assemble ------------------------------------------------------------------------------
    iter_s = m * t_max + bubble + pipe_p2p + dp_exposed + t_opt + ITERATION_OVERHEAD_S
    # Attribute the slowest stage's per-micro-batch work to the breakdown terms.
    k = m * Ls
    stage_extra_out = t_out + np.where(one_stage, t_emb, 0.0)
    gemm_total = k * comp["gemm"] + m * out_gemm
    ew_total = k * comp["ew"] + m * (out_ew + np.where(one_stage, emb_ew, 0.0))
    tp_total = k * comp["tp"] + m * (out_tp + np.where(one_stage, emb_tp, 0.0))
    # the first stage can be the slowest (embedding > output); the residue goes to elementwise
    residue = m * (t_max - (Ls * t_layer + stage_extra_out))
    tokens = gbs * s
    world = tp * pp * dp * cp
    return {
        "iteration_time_s": iter_s,
        "tokens_per_s_per_gpu": tokens / (iter_s * world),
        "num_microbatches": m,
        "gemm_s": gemm_total,
        "attention_s": k * comp["attn"],
        "elementwise_s": ew_total + residue,
        "recompute_s": k * lay_rc,
        "tp_comm_exposed_s": tp_total,
        "cp_comm_exposed_s": k * comp["cp"],
        "ep_comm_s": k * comp["ep"],
        "pp_p2p_s": pipe_p2p,
        "pipeline_bubble_s": bubble,
        "dp_comm_exposed_s": dp_exposed,
        "optimizer_s": t_opt,
        "host_bound_s": k * host_gap,
        "overhead_s": np.zeros_like(iter_s) + ITERATION_OVERHEAD_S,
    }


def _moe_layer(shape, impl, dense, T, T_sp, tp, ep, etp, rate, bw, bw_ew, sms, gpn, nv, net,
               attn_gemm_f, attn_gemm_b, tpa_f, tpa_b, ew_dense_f, act_b_dense):
    """One MoE layer: the attention half of a dense layer + router, dispatch, experts, combine."""
    h = float(shape.hidden_size)
    E = float(shape.num_experts)
    k = float(shape.moe_router_topk)
    fe = float(shape.moe_ffn_hidden_size)
    fsh = float(shape.moe_shared_expert_intermediate_size)
    fc1_mult = 2.0 if shape.swiglu else 1.0
    # Tokens each GPU runs through its local experts (balanced routing): T*k*etp/tp, over E/ep experts.
    local_experts = E / ep
    T_exp = T * k * etp / tp
    M_e = T_exp / local_experts
    groups = local_experts if impl.moe_grouped_gemm else 1.0
    fc1 = _linear_s(M_e, fe * fc1_mult / etp, h, rate, bw, sms, groups)
    fc2 = _linear_s(M_e, h, fe / etp, rate, bw, sms, groups)
    if not impl.moe_grouped_gemm:  # one GEMM per local expert, launched in sequence
        fc1 = tuple(x * local_experts for x in fc1)
        fc2 = tuple(x * local_experts for x in fc2)
    router = _linear_s(T_sp, E, h, rate, bw, sms)
    exp_f = fc1[0] + fc2[0] + router[0]
    exp_b = fc1[1] + fc1[2] + fc2[1] + fc2[2] + router[1] + router[2]
    if fsh > 0:
        sh1 = _linear_s(T, fsh * fc1_mult / tp, h, rate, bw, sms)
        sh2 = _linear_s(T, h, fsh / tp, rate, bw, sms)
        shared_f, shared_b = sh1[0] + sh2[0], sh1[1] + sh1[2] + sh2[1] + sh2[2]
    else:
        shared_f = shared_b = 0.0
    # Elementwise: attention-half of the dense layer's bytes, expert activation, permute/unpermute
    # (read + write T*k*h bf16 each way), router softmax/top-k.
    act_exp = T_exp * (3.0 if shape.swiglu else 2.0) * fe / etp * 2
    permute = 2 * 2 * T_sp * k * h * 2.0
    act_sh = T * (3.0 if shape.swiglu else 2.0) * fsh / tp * 2
    ew_attn_half = ew_dense_f - T * act_b_dense
    ew_f = (ew_attn_half + act_exp + permute + act_sh + T_sp * E * 4 * 4) / bw_ew + 20 * KERNEL_LAUNCH_S
    lw = linear_weights(shape)
    w_exp = local_experts * _local_weights(lw["expert"], etp) + h * E  # routed experts + router
    acc_b = (dense["acc_attn_b"] + _wgrad_accumulation_s(w_exp, len(lw["expert"]) * local_experts + 1.0, impl, bw, bw_ew)
             + _wgrad_accumulation_s(_local_weights(lw["shared_expert"], tp), len(lw["shared_expert"]), impl, bw, bw_ew))
    ew_b = 2.0 * (ew_f - 20 * KERNEL_LAUNCH_S) + 40 * KERNEL_LAUNCH_S + acc_b
    # Dispatch + combine all-to-all over EP (allgather dispatcher: every token to every rank).
    disp = T_sp * k * h * 2.0
    if impl.moe_dispatcher == "allgather":
        disp = T_sp * h * 2.0 * ep
    ep_span = etp * ep
    inside = ep_span <= gpn
    peers_in_node = np.minimum(ep, np.maximum(1.0, np.floor(gpn / etp)))
    frac_in = (peers_in_node - 1.0) / np.maximum(ep, 1.0)
    frac_out = np.where(inside, 0.0, (ep - peers_in_node) / ep)
    net_bytes = disp * frac_out
    if impl.moe_dispatcher == "flex":
        # DeepEP sends each token once per remote node it needs (then forwards over NVLink):
        # with k experts picked among E spread over N nodes, a given remote node is touched with
        # probability 1 - (1 - 1/N)^k (DeepEP internode dispatch; Megatron flex dispatcher).
        nodes = np.maximum(1.0, np.ceil(ep_span / gpn))
        touched = (nodes - 1.0) * (1.0 - (1.0 - 1.0 / nodes) ** k)
        net_bytes = np.where(inside, 0.0, T_sp * h * 2.0 * touched)
    a2a = np.maximum(disp * (frac_in + frac_out) / nv, net_bytes / net) / _ramp(disp) + COLLECTIVE_LATENCY_S + np.where(inside, NVLINK_HOP_LATENCY_S, NETWORK_HOP_LATENCY_S) * np.log2(np.maximum(ep, 2.0))
    a2a = np.where(ep > 1, a2a, 0.0)
    etp_bw, etp_lat = _group_link(1.0, etp, gpn, nv, net)
    etp_c = _ring_s(T_exp * h * 2.0, etp, etp_bw, etp_lat)  # AG of dispatched tokens / RS of outputs
    ep_f = 2 * a2a + 2 * etp_c
    ep_b = 2 * a2a + 2 * etp_c
    # SP: the MoE layer takes T/tp tokens, so no MLP all-gather/reduce-scatter; without SP the
    # attention half keeps its all-reduce.
    return {
        "gemm_f": attn_gemm_f + exp_f + shared_f, "gemm_b": attn_gemm_b + exp_b + shared_b,
        "attn_f": dense["attn_f"], "attn_b": dense["attn_b"], "ew_f": ew_f, "ew_b": ew_b,
        "tp_f": tpa_f, "tp_b": tpa_b, "cp_f": dense["cp_f"], "cp_b": dense["cp_b"],
        "ep_f": ep_f, "ep_b": ep_b,
        "moe_f": exp_f + shared_f + (act_exp + permute + act_sh) / bw_ew + 2 * a2a,
        "moe_act_f": act_exp / bw_ew,
        "shared_f": shared_f + act_sh / bw_ew,
    }


def _local_params(shape: ModelShape, tp, pp, ep, etp, V, Ls):
    """(dense, expert) parameters held by one GPU of the most loaded stage (embedding or output)."""
    h = float(shape.hidden_size)
    L = float(shape.num_layers)
    frac_moe = shape.num_moe_layers / L
    lin, _ = attention_flops_per_token_per_layer(shape, 1)
    attn = lin / 6.0  # 6 FLOPs per weight per token for a linear layer (training.py convention)
    ffn_w = 3.0 if shape.swiglu else 2.0
    fc1_out = (2.0 if shape.swiglu else 1.0)
    mlp_bias = 0.0
    if shape.add_bias_linear:
        d, n, g = shape.kv_channels, shape.num_attention_heads, shape.num_query_groups
        attn += (n * d + 2 * g * d) + h  # QKV and output-projection biases
        mlp_bias = fc1_out * shape.ffn_hidden_size + h
    norms = (2.0 if shape.normalization == "LayerNorm" else 1.0) * 2.0 * h
    dense_layer = (attn + h * shape.ffn_hidden_size * ffn_w + mlp_bias) / tp + norms
    moe_dense_part = (attn + h * shape.moe_shared_expert_intermediate_size * ffn_w) / tp + norms + h * (shape.num_experts or 0)
    moe_expert_part = h * shape.moe_ffn_hidden_size * ffn_w * (shape.num_experts or 0) / (ep * etp)
    P_dense = Ls * ((1 - frac_moe) * dense_layer + frac_moe * moe_dense_part) + V * h / tp
    P_exp = Ls * frac_moe * moe_expert_part
    return P_dense, P_exp


# ---------------------------------------------------------------------------------------------
# Plan-level API
# ---------------------------------------------------------------------------------------------


def _layout_kwargs(plan: Plan, shape: ModelShape) -> dict:
    p, tr, im = plan.parallelism, plan.training, plan.implementation
    dims = parallel_dims(plan)
    rc = _RECOMPUTE_CODES[p.recompute_granularity]
    frac = 1.0
    if p.recompute_granularity == "full":
        per_chunk = max(1, shape.num_layers // (dims.pp * dims.vp))
        frac = recomputed_layer_fraction(per_chunk, p.recompute_method, p.recompute_num_layers)
    return dict(
        tp=dims.tp, pp=dims.pp, dp=dims.dp, cp=dims.cp, ep=dims.ep, etp=dims.etp, vp=dims.vp,
        micro_batch_size=tr.micro_batch_size, sequence_parallel=p.sequence_parallel, recompute=rc,
        recompute_fraction=frac, use_distributed_optimizer=p.use_distributed_optimizer,
        overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=p.overlap_param_gather,
        tp_comm_overlap=p.tp_comm_overlap, precision=tr.precision, fp8_recipe=tr.fp8_recipe,
        fp8_param_gather=tr.fp8_param_gather, transformer_impl=im.transformer_impl,
        attention_backend=im.attention_backend, grad_reduce_in_fp32=im.grad_reduce_in_fp32,
        gradient_accumulation_fusion=im.gradient_accumulation_fusion,
        moe_token_dispatcher_type=im.moe_token_dispatcher_type, moe_grouped_gemm=im.moe_grouped_gemm,
        cross_entropy_loss_fusion=im.cross_entropy_loss_fusion,
        recompute_modules=tuple(p.recompute_modules) if p.recompute_modules is not None else None,
        stage_layers=_uneven_stage_layers(plan, shape),
    )


def _uneven_stage_layers(plan: Plan, shape: ModelShape) -> tuple[int, int, int] | None:
    p = plan.parallelism
    pp = p.pipeline_model_parallel_size
    if pp == 1 or (p.decoder_first_pipeline_num_layers is None and p.decoder_last_pipeline_num_layers is None):
        return None
    try:
        stages = layers_per_stage(shape.num_layers, pp, p.decoder_first_pipeline_num_layers,
                                  p.decoder_last_pipeline_num_layers)
    except ValueError:
        return None  # the validators report the impossible split
    middle = stages[1:-1] or [0]
    return stages[0], max(middle), stages[-1]


def step_time(plan: Plan, shape: ModelShape | None = None) -> PerfEstimate:
    """Predicted iteration time, throughput and MFU/HFU of a plan, with the time breakdown.

    Use it to compare layouts or to explain where a step's time goes; `assumptions` says how
    kernel choices were timed. Layout feasibility is not checked (see validators). Raises
    KeyError for an unknown model or GPU and ValueError for an FP8 plan on a GPU without FP8.
    """
    shape = shape or resolve_model(plan.model)
    hw = hardware_params(plan.cluster)
    tr, p = plan.training, plan.parallelism
    if tr.precision == "fp8" and hw.peak_fp8_tflops is None:
        raise ValueError(f"training.precision: '{plan.cluster.gpu}' has no FP8 tensor cores; use 'bf16' or a Hopper/Blackwell GPU")
    kw = _layout_kwargs(plan, shape)
    r = step_time_arrays(shape, hw, tr.seq_length, tr.global_batch_size, **kw)
    it = _f(r["iteration_time_s"])
    dims = parallel_dims(plan)
    world = dims.tp * dims.pp * dims.dp * dims.cp
    flop_kw = dict(tensor_model_parallel_size=dims.tp)
    mf_c = flops_per_iteration(shape, tr.seq_length, tr.global_batch_size, "causal", **flop_kw)
    mf_f = flops_per_iteration(shape, tr.seq_length, tr.global_batch_size, "full", **flop_kw)
    hw_kw = dict(
        recompute_granularity=p.recompute_granularity, recompute_method=p.recompute_method,
        recompute_num_layers=p.recompute_num_layers, recompute_modules=p.recompute_modules,
        pipeline_model_parallel_size=dims.pp, virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        tensor_model_parallel_size=dims.tp,
    )
    hf_c = hardware_flops_per_iteration(shape, tr.seq_length, tr.global_batch_size, "causal", **hw_kw)
    hf_f = hardware_flops_per_iteration(shape, tr.seq_length, tr.global_batch_size, "full", **hw_kw)

    def tf(x):
        return x / (it * world * 1e12)

    fp8 = tr.precision == "fp8"
    peak, peak8 = hw.peak_bf16_tflops, hw.peak_fp8_tflops
    breakdown = StepTimeBreakdown(**{k: _f(r[k]) for k in StepTimeBreakdown.model_fields})
    tokens = tr.global_batch_size * tr.seq_length
    return PerfEstimate(
        iteration_time_s=it,
        breakdown=breakdown,
        num_microbatches=int(_f(r["num_microbatches"])),
        pipeline_bubble_fraction=breakdown.pipeline_bubble_s / it,
        tokens_per_s=tokens / it,
        tokens_per_s_per_gpu=tokens / (it * world),
        model_tflops_per_gpu_causal=tf(mf_c),
        model_tflops_per_gpu_full=tf(mf_f),
        hardware_tflops_per_gpu_causal=tf(hf_c),
        hardware_tflops_per_gpu_full=tf(hf_f),
        peak_bf16_tflops=peak,
        peak_fp8_tflops=peak8,
        mfu_bf16_causal_pct=100 * tf(mf_c) / peak,
        mfu_bf16_full_pct=100 * tf(mf_f) / peak,
        mfu_fp8_causal_pct=100 * tf(mf_c) / peak8 if fp8 and peak8 else None,
        mfu_fp8_full_pct=100 * tf(mf_f) / peak8 if fp8 and peak8 else None,
        hfu_bf16_causal_pct=100 * tf(hf_c) / peak,
        hfu_bf16_full_pct=100 * tf(hf_f) / peak,
        assumptions=_assumptions(plan, kw),
    )


def _assumptions(plan: Plan, kw: dict) -> list[str]:
    im, p = plan.implementation, plan.parallelism
    out = []
    path = _attention_path(im.transformer_impl, im.attention_backend)
    out.append({
        "fused": "core attention timed as the cuDNN fused causal kernel (TE FusedAttention)",
        "flash": "core attention timed as FlashAttention-2 (0.6x the cuDNN kernel's rate)",
        "unfused_te": "core attention timed unfused with a fused softmax kernel (full s x s scores in HBM)",
        "unfused_local": "core attention timed as Megatron's local unfused path with PyTorch fp32 softmax (full s x s scores in HBM)",
    }[path])
    if plan.training.precision == "fp8":
        out.append("FP8 GEMMs for every transformer linear layer (TE), output layer and attention in bf16; cast/transpose bytes added")
    if p.tp_comm_overlap and not (p.sequence_parallel and p.tensor_model_parallel_size > 1):
        out.append("tp_comm_overlap ignored: it needs sequence_parallel with TP > 1")
    if plan.model.num_experts or resolve_model(plan.model).is_moe:
        out.append("MoE routing assumed perfectly balanced; no all-to-all/compute overlap")
    if im.use_torch_fsdp2:
        out.append("FSDP timed as distributed optimizer + overlapped param all-gather (not modelled in detail)")
    return out


def ring_collective_s(bytes_total: float, num_ranks: int, bus_bandwidth_gbps: float,
                      kind: Literal["all_gather", "reduce_scatter", "all_reduce"] = "all_gather",
                      hop_latency_s: float = NVLINK_HOP_LATENCY_S) -> float:
    """Ring collective time as the model uses it: a tensor of bytes_total (the full, gathered size)
    over n ranks moves (n-1)/n of it through each rank's link (all-reduce = reduce-scatter +
    all-gather: twice), at the achieved bus bandwidth, plus base and per-step latency."""
    steps = 2.0 if kind == "all_reduce" else 1.0
    return _f(_ring_s(float(bytes_total), float(num_ranks), bus_bandwidth_gbps * 1e9, hop_latency_s, steps))


def pipeline_bubble_fraction(pp: int, vp: int, num_microbatches: int) -> float:
    """Narayanan et al. 2021 (Sec. 2.2.2): bubble time / ideal time = (p - 1) / (v * m)."""
    return (pp - 1) / (max(vp, 1) * num_microbatches)


__all__ = [
    "HardwareParams",
    "PerfEstimate",
    "StepTimeBreakdown",
    "hardware_params",
    "pipeline_bubble_fraction",
    "ring_collective_s",
    "step_time",
    "step_time_arrays",
]
