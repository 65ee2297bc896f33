"""Step time of a Megatron-Core training iteration from physics: FLOPs, bytes and links.

Public API
----------
step_time(plan) -> PerfEstimate
    Predicted iteration time with a per-term breakdown, tokens/s/GPU, model TFLOP/s/GPU in both
    FLOP conventions ('causal', 'full'), MFU against the dense BF16 peak (and, for FP8 runs, also
    against the dense FP8 peak), HFU (recomputed forward counted). Never reads published runs.
step_time_arrays(batch, hardware) -> dict[str, ndarray]
    The same model on a physics.layouts.LayoutBatch: one row per candidate layout (TP, PP, DP, CP,
    EP, ETP, VP, micro-batch, SP, precision, recompute, ... as arrays), so one call scores thousands
    of candidate layouts (the layout search). Returns `iteration_time_s`, `tokens_per_s_per_gpu`
    and every breakdown term as arrays. `hardware_params(plan.cluster)` gives the `hardware`
    argument. Divisibility and memory are not checked here (validators.layout_errors and
    physics.memory do).

Model (per GPU of the slowest pipeline stage, per micro-batch, then the 1F1B schedule):
- GEMMs: per-GEMM time on its real (M, N, K) after TP/CP/EP splits: FLOPs at the GPU's sustained
  rate (measured here for H100/H200: `_MEASURED`; else peak x gpu.matmul_efficiency x
  SUSTAINED_GEMM_FRACTION, FP8 peak x FP8_GEMM_EFFICIENCY) divided by the wave-quantization
  efficiency of the output tiles over the SMs, plus the output write the mainloop does not hide
  (GEMM_EPILOGUE_EXPOSED) and KERNEL_LAUNCH_S. Backward = dgrad (M, K, N) + wgrad (K, N, M).
- Core attention: fused (cuDNN = TE 'auto'/'fused') at ATTENTION_EFFICIENCY of the BF16 peak with a
  sequence-length ramp s/(s + ATTENTION_HALF_RATE_SEQ), causal half executed, backward = 2.5x the
  forward work (the kernel recomputes QK^T); 'flash' (FlashAttention-2) at FLASH2_RELATIVE_RATE of
  that; with dropout the kernels' Philox draws (DROPOUT_RNG_OPS_PER_SCORE). Unfused (the local spec's
  Megatron DotProductAttention whatever attention_backend says, or TE 'unfused'): batched GEMMs over
  the full s x s plus the softmax path's bytes per score element (UNFUSED_SOFTMAX_BYTES_PER_SCORE:
  fused masked-softmax kernel, PyTorch bf16 or fp32; attention dropout adds its pass) at streaming
  bandwidth.
- Elementwise (norms, bias/dropout/residual, activation, RoPE, FP8 casts, embedding): bytes over
  the measured elementwise bandwidth, plus KERNEL_LAUNCH_S per kernel; without SP the norm/residual
  work is repeated on every TP rank; the local spec runs more, unfused kernels than TE. Cross
  entropy and the optimizer are streaming passes (bytes per logit / per parameter).
- Collectives: ring cost (bytes x (n-1)/n, x2 for all-reduce) at the achieved bus bandwidth:
  NVLink x NVLINK_EFFICIENCY, or NICs x NETWORK_EFFICIENCY (a group with r ranks per node gets r
  NICs), times the size ramp S/(S + S_half), S_half = the link's rate x COLLECTIVE_HALF_BANDWIDTH_S
  (16 MiB on NVLink), plus latency. TP/SP: exposed
  in forward; the backward ones Megatron/TE launch asynchronously hide behind the paired
  dgrad/wgrad GEMM; tp_comm_overlap runs them as TE's userbuffers do (UB_PIPELINE_SPLITS: ring exchange,
  pipelined and bulk overlap, FP8 all-gather buffers in FP8 runs). CP: ring K/V exchange hidden
  behind each chunk's attention. EP: four all-to-alls per MoE layer (DeepEP sends a token once per
  remote node). DP: reduce-scatter (or all-reduce) of grads and all-gather of params over dp*cp,
  of each pipeline rank's own parameters (physics.memory.rank_params: the count the memory model
  uses, embedding / output layer / MTP where they live; the slowest rank sets the step); overlap
  hides all but the last bucket behind one micro-batch's backward/forward of its layers, and with VP
  each earlier model chunk's traffic behind the pp micro-batches of the later chunks (Megatron syncs a
  chunk at its last / first micro-batch). Hidden
  communication still costs OVERLAP_SM_TAX of its time (NCCL kernels occupy SMs). PP: p2p sends.
- Pipeline: m * t_stage_max + (sum of stage times - t_stage_max) / vp, i.e. the bubble
  (pp-1)/(vp*m) for equal stages (Narayanan et al. 2021, Sec. 2.2.2).
- Recompute: selective reruns the chosen modules' forward (core attention by default); full
  reruns the forward of the recomputed layers (flops.recomputed_layer_fraction).
- Optimizer: Adam over the local shard (of the same per-rank count), bandwidth-bound; plus
  ITERATION_OVERHEAD_S.
- Host (CPU): a layer whose GPU work is shorter than launching its kernels leaves the GPU waiting, and
  so does every host sync (Megatron-LM's loss and gradient NaN checks, an MoE dispatcher's token
  counts); both are timed against the host's speed (GpuSpec.host_floor_ms_per_layer, HOST_FORWARD_SHARE,
  HOST_SYNC_KERNELS) and reported as host_bound_s; a step waiting >= HOST_BOUND_FLAG of its time is
  flagged host-bound.
- Code: `_model` assembles one function per term (GEMMs, core attention, elementwise, TP/CP/EP
  communication, pipeline, data parallel, optimizer, host) on a `_Ctx` of one precision group.

Efficiency parameters (module constants below, each with how it was measured or derived) are few
and global; kernel rates come from micro-benchmarks on this workplace's H100/H200. Three figures
are fitted on the one-GPU rows of Megatron-LM's own loop outside the held-out third
(`benchmarks/throughput_accuracy.py --fit`): the VM hosts' host_floor_ms_per_layer (GPU catalog),
HOST_SYNC_KERNELS and the PyTorch bf16 softmax path's bytes. MoE routing sets the busiest EP rank's
load (physics.moe.busiest_rank_load), capped or padded by a capacity factor; --overlap-moe-expert-parallel-comm
hides the token all-to-alls under the other direction's compute (physics.moe.ep_overlap_saving). Not modelled:
stragglers at scale,
cuBLASLt's heuristic warm-up for new expert GEMM shapes (a short run's first iterations: each GEMM shape met
for the first time costs the host 0.12-0.15 ms median, 0.27-0.30 ms mean, against 0.015 ms once met, on H100:
benchmarks/results/gpu_h100_gemm_shape_probe.json; as-is routing changes every expert's row count each call).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import GpuSpec, default_host_floor_ms, gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.anatomy import linear_weights
from mcore_advisor.physics.flops import (
    flops_per_iteration,
    hardware_flops_per_iteration,
    recomputed_layer_fraction,
)
from mcore_advisor.physics.layouts import RECOMPUTE_FULL, Implementation, LayoutBatch, StageTable
from mcore_advisor.physics.mamba import MambaTiming, hybrid_kinds, mamba_layer_parts
from mcore_advisor.physics.memory import (
    WEIGHT_BYTES_PER_PARAM,
    DpSharding,
    dp_sharding,
    fused_softmax_kernel,
    gradient_bytes_per_param,
    grads_in_fp32,
    stage_table,
)
from mcore_advisor.physics.moe import (
    GRAPHED_LAUNCHES,
    HEURISTIC_QUERY_REF_LAYERS,
    NORM_OP_HOST_KERNELS,
    MoeKit,
    dense_halves,
    dominant_part,
    host_syncs_per_layer,
    load_spread_assumption,
    moe_layer,
)
from mcore_advisor.schemas import ClusterSpec, ModelShape, Plan, parallel_dims

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

GEMM_OPERAND_BW_FRACTION = 1.0
GEMM_ROOFLINE_EXPONENT = 4.0
"""A GEMM also reads its operands and writes its output (elem_bytes * (MK + KN + MN)); where that
takes longer than its FLOPs (few rows against a large weight: an expert that gets 64-512 tokens, a
weight gradient reduced over them) the GEMM runs at HBM speed, reaching this fraction of it. The two
times combine as (t_flops^p + t_bytes^p)^(1/p), which leaves large GEMMs at their FLOP time (+0.1% at
M = 1,024). Fitted with physics.moe.GROUPED_GEMM_RELATIVE_RATE on the TE GroupedLinear cases of
benchmarks/results/gpu_h100_F_kernel_moe.jsonl outside the held-out third (`benchmarks/moe_kernel_accuracy.py
--fit`; the report gives the held-out cases apart)."""

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

UNFUSED_SOFTMAX_BYTES_PER_SCORE = {"fused": 22.0, "bf16": 52.5, "fp32": 74.0}
"""HBM bytes each unfused-attention path moves per score element (b * heads * s_q * s_k) beyond the
QK^T / PV GEMM FLOPs, forward + backward, counted from Megatron's DotProductAttention and
FusedScaleMaskSoftmax (fusions/fused_softmax.py):
- 'fp32' (PyTorch softmax, --attention-softmax-in-fp32): QK^T out 2, .float() 2+4, masked_fill_ 4+4
  (+1 mask), softmax 4+4, .bfloat16() 4+2, PV reads 2 = 33; backward dP 2, dV reads P 2, cast 2+4,
  softmax 4+4+4, masked_fill 4+4 (+1), cast 4+2, dQ/dK read dS 2+2 = 41: 74 B;
- 'bf16' (PyTorch softmax in bf16, Megatron-LM's default): 2 + 2+2+1 + 2+2 + 2 = 13 forward,
  2+2 + 2+2+2 + 2+2+1 + 2+2 = 19 backward: 32 B counted, but it runs as 52.5: fitted on the local-spec rows
  of Megatron-LM's own loop outside the held-out third (H100 and H200, one and two GPUs, s 2048 and
  4096; `benchmarks/throughput_accuracy.py --fit`), the held-out two-GPU ones then within 4%. Its
  kernels over s-long rows of 2-byte elements run further below copy bandwidth than the fp32 path's;
  benchmarks/attention_host_probe.py ('dpa') measures the path on its own;
- 'fused' (the masked-softmax kernel, Megatron's or TE's): 2 + 2+2 + 2 forward, 2+2 + 2+2+2 (in place)
  + 2+2 backward: 22 B."""

UNFUSED_ATTENTION_BW_FACTOR = 1.46
"""Measured bytes-equivalent over counted bytes of the unfused path at streaming (copy) bandwidth:
the 'fp32' path ran 0.0385-0.0391 ns per score fwd+bwd on H100 (104.5 B at 2856 GB/s) and
0.0302-0.0312 on H200 (112 B at 3896 GB/s), 4 shapes each (s 2048/4096, benchmarks/kernel_probe.py),
minus the GEMM time: 108 / 74 counted. Row-wise softmax and masked kernels over s-long rows run below
copy bandwidth; the same factor is applied to the other paths."""

DROPOUT_RNG_OPS_PER_SCORE = 20.0
"""Flash/fused attention with dropout keeps no mask: the kernel draws each score's dropout bit from
Philox4x32-10 (10 rounds of two 32-bit multiplies and xors per 4 values: ~10 integer instructions per
value) in the forward and draws it again in the backward. Timed at the CUDA cores' INT32 rate (64 lanes
per SM on Hopper: the dense BF16 peak / 64) over the causal half of the scores. Derived, not measured
(benchmarks/attention_host_probe.py 'sdpa' measures it)."""

ATTENTION_DROPOUT_BYTES_PER_SCORE = 10.0
"""Dropout on the probabilities of unfused attention (p > 0): forward reads 2, writes 2 and a 1-byte
mask; backward reads the gradient 2 and the mask 1, writes 2."""

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
On other links the ramp is the same start-up time, COLLECTIVE_HALF_BANDWIDTH_S = 16 MiB at the NVLink rate
(55 us): the protocol pipelines its chunks behind a fixed start, so the half-bandwidth size scales with
the link's rate (about 2.3 MiB on one 400 Gb/s NIC, where NCCL's IB collectives reach half their bus
bandwidth at a few MiB)."""
COLLECTIVE_HALF_BANDWIDTH_S = COLLECTIVE_HALF_BANDWIDTH_BYTES / (450e9 * NVLINK_EFFICIENCY)

NETWORK_EFFICIENCY = 0.85
"""Achieved fraction of a 400 Gb/s NIC's 50 GB/s per direction in NCCL collectives (~42-45 GB/s
bus bandwidth per NIC on InfiniBand NDR). Literature value, not measured here."""

OVERLAP_SM_TAX = 0.15
"""Compute slowdown per second of communication hidden behind it: NCCL's kernels hold one SM per
channel while they run (16-32 channels on NVLink, fewer on InfiniBand, of 132 SMs on H100 =
12-24%) and share HBM bandwidth, so an overlapped collective is not free. Midpoint of that range;
an estimate from NCCL's channel counts, not fitted."""

UB_PIPELINE_SPLITS = 4
"""tp_comm_overlap as Megatron's --tp-comm-overlap sets it up without a --tp-comm-overlap-cfg file: Transformer
Engine's initialize_ub defaults (transformer_engine/pytorch/module/base.py): 'ring_exchange' (peer-to-peer
sends on copy engines, one 1/tp chunk per step while the GEMM of the chunk in hand runs) for qkv_fprop,
fc1_fprop, proj_dgrad and fc2_dgrad; 'pipeline' (num_splits 4, num_sm 16) for the reduce-scatters after
proj_fprop and fc2_fprop; 'bulk' (num_sm 16) for the input re-gather beside qkv/fc1 dgrad and the dgrad
reduce-scatter beside qkv/fc1 wgrad. UB_FP8_ALL_GATHER: with an FP8 recipe the all-gather buffers (qkv_fprop,
qkv_dgrad, proj_dgrad, fc1_fprop, fc1_dgrad, fc2_dgrad) hold FP8 (1 B per element), the reduce-scatters bf16
(fp8_buf in the same function)."""

UB_GEMM_STRETCH = 1.24
"""GEMM time beside userbuffers' overlap over the same GEMMs without it. The overlapped GEMMs are split
(ring exchange: tp chunks; pipeline: UB_PIPELINE_SPLITS) and share the SMs with the pipelined/bulk
communication kernels, which hold their SMs for the GEMM's whole length: measured on 4 x H100 (s5,
benchmarks/results/gpu_h100x4_L_summary.md): rank-0 GEMM kernel time 578 ms with --tp-comm-overlap against
482 ms without (L_tp4_sp_tpoverlap vs L_tp4_sp, Llama-3-8B layers, TP4 SP, micro-batch 8), +19.8% of all
GEMM time, of which the overlapped GEMMs (every TP GEMM but the row-parallel wgrads; not the output
layer) are 82%: 1 + 0.198 / 0.82. One pair of rows, bf16, TP4; not fitted on any held-out row."""

COLLECTIVE_LATENCY_S = 10e-6
NVLINK_HOP_LATENCY_S = 1e-6
NETWORK_HOP_LATENCY_S = 5e-6
"""Per-collective base latency and per-ring-step latency (n-1 steps for all-gather/reduce-scatter,
2(n-1) for all-reduce), on top of the bandwidth ramp above: launch + a few us per InfiniBand hop.
They matter only for small models and long rings."""

HOST_FORWARD_SHARE = 4.2 / 6.1
"""Host (CPU) time: the GPU waits whenever the host launches work slower than the GPU runs it.
The host's speed is one figure per machine, the time to launch one reference layer's forward +
backward for one micro-batch (GpuSpec.host_floor_ms_per_layer, ClusterSpec override; the reference
layer is GPT-3 1.3B's, TE, bf16, no recompute: `host_reference_kernels`). Every other host cost is
that figure scaled by what is launched: a layer's forward kernels (recomputed ones included) over the
reference forward's, its backward kernels over the reference backward's. The forward carries
HOST_FORWARD_SHARE of the reference layer's host time (Python modules and autograd graph building;
the backward runs in autograd's C++ engine): full recompute, which reruns every forward, added 4.2 ms
to the 6.1 ms layer on the H200 VM (benchmarks/results/gpu_recommend_sweep.jsonl)."""

HOST_SYNC_KERNELS = 2.0
"""GPU idle after a host sync (a `.item()`/D2H read the host waits on: the loss NaN/Inf checks of
every micro-batch and each gradient bucket's once per step, --check-for-nan-in-loss-and-grad;
an MoE dispatcher's tokens-per-expert read in every MoE layer's forward): the queue is empty, so
the GPU waits while the host returns and launches the next work, about this many reference-forward
kernel launches. Fitted together with the H100/H200 host_floor_ms_per_layer (5.5) on the one-GPU rows
of Megatron-LM's own loop outside the held-out third (`benchmarks/throughput_accuracy.py --fit`:
grid over floor 2-7 ms, 0-8 launches and a per-step host term of 0-400 launches, which came out 0,
so the per-step cost stays ITERATION_OVERHEAD_S)."""


HOST_BOUND_FLAG = 0.10
"""Share of the step the GPU waits for the host above which a prediction is called host-bound."""

HOST_PROBE_TO_LAYER = 1.0
"""Host time of the reference layer inside Megatron-LM's training loop over the profile job's host probe
(launcher/entry/host_probe.py: TE's TransformerLayer at the reference layer's sizes on 128 tokens, every
local rank at once, after training). Taken as 1: Megatron's TE layer issues the same TE modules, and
its extra Python (bias-dropout-add, RoPE, DDP hooks) was not separable on the lease that introduced the
probe (s5, 4 x H100 VM: probes 5.0-16.2 ms per rank-slowest, median 8.4, against the 7.3-11.9 ms per
reference layer that s4's host-bound dense rows on the same kind of VM imply). With each row's own
probe the s5 rows' step-time error is 2.9% median held-out / 6.4% fitted; with the catalog's one-GPU
VM figure (5.5) instead, 4.5% / 18.3% (benchmarks/results/gpu_h100x4_L_summary.md)."""


HOST_PROBE_GEMMS = 12
"""GEMM problems of the host probe's layer per forward + backward: TE's TransformerLayer issues QKV, the
projection, fc1 and fc2 forward and each one's dgrad and wgrad backward. With cuBLASLt's heuristics cache off
(CUBLASLT_HEURISTICS_CACHE_CAPACITY=0 for the whole job) each of them asks the heuristic every time, so the probe
times the host plus these queries: the s9 H200 lease's probes read 7.7-8.1 ms with the cache off against 4.5-6.2 with
it on (benchmarks/results/gpu_h200x4_C_runs.jsonl)."""


def host_floor_from_probe(probe_ms_per_layer: float, heuristics_cache_off: bool = False) -> float:
    """host_floor_ms_per_layer for a machine whose host probe measured `probe_ms_per_layer`; a probe run with
    cuBLASLt's heuristics cache off also timed HOST_PROBE_GEMMS queries of HEURISTIC_QUERY_REF_LAYERS floors each."""
    queries = HOST_PROBE_GEMMS * HEURISTIC_QUERY_REF_LAYERS if heuristics_cache_off else 0.0
    return HOST_PROBE_TO_LAYER * probe_ms_per_layer / (1.0 + queries)

DATALOADER_MASK_S_PER_GIB = 0.104
"""Step time per GiB of attention mask that Megatron-LM's default data loader hands one loading rank
(--create-attention-mask-in-dataloader, on unless --no-create-attention-mask-in-dataloader): each
sample's seq x seq bool mask (core/datasets/gpt_dataset.py _get_ltor_masks_and_position_ids: 256 MiB
at 16k tokens) is collated into shared memory by a worker, pinned by the loader's thread, copied to
the GPU (traces: 5-7 ms per 256 MiB on the compute stream) and broadcast over TP, every micro-batch;
causal attention never reads it. The host work stalls the training process 40-75 ms per 256 MiB
(traces: no CUDA call, no op), and ranks that exchange data every layer (CP's K/V ring, EP's
all-to-alls) wait for each other's stalls, so they add up. Fitted on four pairs of the same plan with
and without the mask on one 4 x H100 VM lease (session s8, M_* rows of
benchmarks/results/gpu_h100x4_M_runs.jsonl: 60-129 ms per GiB, median 104); the two held-out pairs'
differences (CP2 at 32k: 252 ms, TP4 selective recompute at 8k: 57 ms) are predicted at 208 and 52 ms.
A VM's host figure, like the catalog's host floor; Megatron-Bridge and NeMo recipes skip the mask."""

ITERATION_OVERHEAD_S = 0.005
"""Per-iteration fixed cost outside the schedule on a host fast enough to add no host term: loss
reduction and logging, grad-norm all-reduce, optimizer launches, data loader. An estimate; it
matters only for very short steps."""

# Streaming multiprocessors per GPU (wave quantization). NVIDIA architecture whitepapers; H100 SXM
# 132 confirmed by torch.cuda.get_device_properties on this workplace's H100 and H200.
_SM_COUNT = {"h100-sxm": 132, "h100-pcie": 114, "h200": 132, "a100-80gb": 108, "a100-40gb": 108, "b200": 148, "gb200": 152}
_SM_BY_ARCH = {"ampere": 108, "hopper": 132, "blackwell": 148}

# Megatron-Core DDP default bucket: max(40M, 1M * dp) elements (distributed/distributed_data_parallel.py).
_BUCKET_MIN_PARAMS = 40_000_000
_BUCKET_PARAMS_PER_DP = 1_000_000


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
                                       else default_host_floor_ms(g, cluster.num_gpus, cluster.gpus_per_node)),
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
    ssm_scan_s: float = Field(0.0, description="Mamba-2 convolution and SSD chunked scan of a hybrid model, forward + backward (physics.mamba).")
    elementwise_s: float = Field(description="Norms, activations, bias/dropout/residual, RoPE, FP8 casts, cross-entropy, embedding, MoE permutes.")
    recompute_s: float = Field(description="Forward work rerun in backward by activation recomputation.")
    tp_comm_exposed_s: float = Field(description="Tensor/sequence-parallel collectives not hidden behind GEMMs.")
    cp_comm_exposed_s: float = Field(description="Context-parallel K/V ring exchange not hidden behind attention.")
    ep_comm_s: float = Field(description="MoE token all-to-all (dispatch + combine, forward + backward).")
    pp_p2p_s: float = Field(description="Pipeline send/receive of activations and gradients on the critical path.")
    pipeline_bubble_s: float = Field(description="Pipeline fill and drain: (sum of stage times - slowest stage) / VP; (pp-1)/(vp*m) of the schedule for equal stages.")
    dp_comm_exposed_s: float = Field(description="Data-parallel gradient reduce-scatter/all-reduce and parameter all-gather not overlapped.")
    optimizer_s: float = Field(description="Adam step over the local parameter shard (HBM-bound).")
    host_bound_s: float = Field(description="GPU idle waiting for the host: layers whose GPU work takes less than launching their kernels, the waits after host syncs (loss and gradient NaN checks, MoE token counts) and the step's own host work (optimizer launches, logging); from the host's speed (GpuSpec.host_floor_ms_per_layer, ClusterSpec override).")
    dataloader_mask_s: float = Field(0.0, description="Megatron-LM's default data loader building, pinning, copying and broadcasting each sample's seq x seq attention mask (--no-create-attention-mask-in-dataloader removes it; causal attention never reads it): DATALOADER_MASK_S_PER_GIB per GiB on each loading rank, summed over the CP and EP ranks that wait for each other every layer.")
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
    host_bound: bool = Field(False, description=f"True when the GPU is predicted to wait for the host (breakdown.host_bound_s) for at least {HOST_BOUND_FLAG:.0%} of the step: the step then follows the host's speed (more variable from one step to the next) more than the GPU's.")
    moe_layer_parts_s: dict[str, float] | None = Field(None, description="MoE models: seconds of each part of one MoE layer and micro-batch on the slowest GPU (physics.moe: router, permute, experts, shared_experts, dispatch = EP/ETP communication, host_wait = the GPU's wait for the host to launch the layer's kernels beyond the layer's GPU work), forward + backward.")
    moe_dominant_part: str | None = Field(None, description="MoE models: the largest of moe_layer_parts_s.")
    moe_expert_gemm_miss_share: float | None = Field(None, description="MoE models: share of the routed experts' GEMMs whose shape (the expert's token count) misses cuBLASLt's heuristics cache and pays a heuristic query on the host (physics.moe.heuristic_miss_share: measured, or the steady state of the routing's spread).")
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
    mg = gradient_bytes_per_param(impl.grad_reduce_in_fp32)
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


def _gemm_s(m, n, k, rate_flops, bw_bytes, sms, groups=1.0, elem_bytes=2.0):
    """One (grouped) GEMM: the FLOPs at the sustained rate over the wave efficiency and the operands'
    bytes at HBM speed, combined as a soft maximum (GEMM_ROOFLINE_EXPONENT), + exposed epilogue + one
    kernel per group (TE's GroupedLinear issues a cuBLAS GEMM per expert)."""
    m = np.maximum(m, 1.0)
    flops = 2.0 * m * n * k * groups
    t_flops = flops / (rate_flops * _wave_efficiency(m, n, groups, sms))
    t_bytes = elem_bytes * (m * k + k * n + m * n) * groups / (bw_bytes * GEMM_OPERAND_BW_FRACTION)
    p = GEMM_ROOFLINE_EXPONENT
    return ((t_flops ** p + t_bytes ** p) ** (1.0 / p) + GEMM_EPILOGUE_EXPOSED * 2.0 * m * n * groups / bw_bytes
            + KERNEL_LAUNCH_S * groups)


def _linear_s(m, n, k, rate_flops, bw_bytes, sms, groups=1.0, elem_bytes=2.0):
    """(forward, dgrad, wgrad) of y[m,n] = x[m,k] @ w[k,n]."""
    return (
        _gemm_s(m, n, k, rate_flops, bw_bytes, sms, groups, elem_bytes),
        _gemm_s(m, k, n, rate_flops, bw_bytes, sms, groups, elem_bytes),
        _gemm_s(k, n, m, rate_flops, bw_bytes, sms, groups, elem_bytes),
    )


def _ramp(bytes_total, bw_bytes=None):
    """Bus-bandwidth fraction reached by a collective of this full size (NCCL protocol ramp) on a link of
    bw_bytes B/s (None: NVLink's, COLLECTIVE_HALF_BANDWIDTH_BYTES)."""
    half = COLLECTIVE_HALF_BANDWIDTH_BYTES if bw_bytes is None else COLLECTIVE_HALF_BANDWIDTH_S * bw_bytes
    return bytes_total / (bytes_total + half)


def _ring_s(bytes_total, n, bw_bytes, hop_latency, steps_per_rank=1.0):
    """Ring all-gather/reduce-scatter (steps_per_rank=1) or all-reduce (2) of a bytes_total tensor over n ranks."""
    n = np.maximum(n, 1.0)
    active = (n > 1) & (bytes_total > 0)
    eff_bw = bw_bytes * _ramp(np.maximum(bytes_total, 1.0), bw_bytes)
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
# The model: one precision group of a LayoutBatch, term by term
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Impl:
    """Plan choices that change kernels, not layout (scalars)."""

    fp8: bool = False
    fp8_current_scaling: bool = False
    fp8_param_gather: bool = False
    te: bool = True
    attention: Literal["fused", "flash", "unfused_te", "unfused_local"] = "fused"
    masked_softmax_fusion: bool = True
    softmax_fp32: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    rope_fused: bool = True
    bias_activation_fused: bool = True
    bias_dropout_fused: bool = True
    nan_checks: bool = True
    grad_reduce_in_fp32: bool = True
    grad_acc_fusion: bool = True
    moe_dispatcher: str = "alltoall"
    moe_grouped_gemm: bool = True
    moe_force_balanced: bool = False  # --moe-router-force-load-balancing
    moe_permute_fused: bool = False  # --moe-permute-fusion (Transformer Engine's kernels)
    dataloader_mask: bool = True  # --create-attention-mask-in-dataloader (Megatron-LM's default)
    moe_imbalance: float | None = None  # measured busiest-EP-rank load over the mean (physics.moe.routing_imbalance)
    moe_expert_cv: float | None = None  # measured expert-load spread (physics.moe.expert_load_cv)
    moe_miss_share: float | None = None  # measured expert GEMMs missing cuBLASLt's heuristics cache
    cublaslt_cache: int | None = None  # CUBLASLT_HEURISTICS_CACHE_CAPACITY (None: cuBLASLt's default)
    moe_capacity_factor: float | None = None  # --moe-expert-capacity-factor (None: dropless)
    moe_pad_to_capacity: bool = False  # --moe-pad-expert-input-to-capacity (with a capacity factor)
    moe_ep_overlap: bool = False  # --overlap-moe-expert-parallel-comm (combined 1F1B schedule)
    moe_delay_wgrad: bool = False  # --delay-wgrad-compute
    ce_fusion: bool = True
    recompute_modules: tuple[str, ...] = ("core_attn",)
    graphed: frozenset[str] = frozenset()  # the layer parts CUDA graphs capture (layouts.Implementation.graphed)
    dp_sharding: DpSharding = DpSharding(False, False, None)  # what DP shards: physics.memory.dp_sharding


def _kernel_choices(im: Implementation, fp8: bool) -> _Impl:
    return _Impl(
        fp8=fp8,
        fp8_current_scaling=im.fp8_recipe in ("tensorwise",),
        fp8_param_gather=bool(im.fp8_param_gather),
        te=im.transformer_impl == "transformer_engine",
        attention=_attention_path(im.transformer_impl, im.attention_backend),
        masked_softmax_fusion=im.masked_softmax_fusion,
        softmax_fp32=im.attention_softmax_in_fp32,
        attention_dropout=im.attention_dropout,
        hidden_dropout=im.hidden_dropout,
        # TE's fused RoPE kernel; the local spec cannot use it (TransformerConfig raises without TE).
        rope_fused=im.apply_rope_fusion and im.transformer_impl == "transformer_engine",
        bias_activation_fused=im.bias_activation_fusion,
        bias_dropout_fused=im.bias_dropout_fusion,
        nan_checks=im.check_for_nan_in_loss_and_grad,
        grad_reduce_in_fp32=grads_in_fp32(im),
        grad_acc_fusion=bool(im.gradient_accumulation_fusion),
        moe_dispatcher=im.moe_token_dispatcher_type,
        # the local spec's experts are always SequentialMLP (LocalSpecProvider.grouped_mlp_modules)
        moe_grouped_gemm=im.moe_grouped_gemm and im.transformer_impl == "transformer_engine",
        moe_force_balanced=im.moe_router_force_load_balancing,
        moe_permute_fused=im.moe_permute_fusion and im.transformer_impl == "transformer_engine",
        dataloader_mask=im.create_attention_mask_in_dataloader,
        moe_imbalance=im.moe_routing_imbalance,
        moe_expert_cv=im.moe_expert_load_cv,
        moe_miss_share=im.moe_heuristic_miss_share,
        cublaslt_cache=im.cublaslt_heuristics_cache_capacity,
        moe_capacity_factor=im.moe_expert_capacity_factor,
        moe_pad_to_capacity=im.pads_to_capacity,
        moe_ep_overlap=im.overlap_moe_expert_parallel_comm,
        moe_delay_wgrad=im.delay_wgrad_compute and im.overlap_moe_expert_parallel_comm,
        ce_fusion=im.cross_entropy_loss_fusion,
        recompute_modules=im.recompute_modules if im.recompute_modules is not None else ("core_attn",),
        graphed=im.graphed,
        dp_sharding=dp_sharding(im),
    )


def step_time_arrays(batch: LayoutBatch, hardware: HardwareParams) -> dict[str, np.ndarray]:
    """Vectorised step time of every row of `batch` on `hardware` (see the module docstring).

    Returns arrays: iteration_time_s, tokens_per_s_per_gpu, num_microbatches, and the
    StepTimeBreakdown terms (`gemm_s`, ..., `overhead_s`).
    """
    out: dict[str, np.ndarray] = {}
    for fp8 in (False, True):
        rows = batch.fp8 == fp8
        if not rows.any():
            continue
        part = _model(_context(batch if rows.all() else batch.select(rows), hardware, fp8))
        if rows.all():
            return part
        for k, v in part.items():
            out.setdefault(k, np.zeros(len(batch)))[rows] = v
    return out


def _attention_path(transformer_impl: str, attention_backend: str) -> Literal["fused", "flash", "unfused_te", "unfused_local"]:
    # Megatron-LM: the local spec's core attention is always Megatron's DotProductAttention
    # (gpt_layer_specs LocalSpecProvider.core_attention), whatever --attention-backend says. With TE,
    # 'unfused' is TE's UnfusedDotProductAttention (fused softmax kernel), 'local' Megatron's
    # DotProductAttention, 'flash' FlashAttention-2, 'fused' and 'auto' cuDNN FusedAttention (TE's
    # choice on Hopper).
    if transformer_impl == "local":
        return "unfused_local"
    return {"flash": "flash", "unfused": "unfused_te", "local": "unfused_local"}.get(attention_backend, "fused")


def _softmax_path(impl: _Impl, heads_per_rank, s: float):
    """Per row: the unfused attention's softmax path ('fused', 'bf16', 'fp32'), the kernel choice the
    memory model makes (physics.memory.fused_softmax_kernel)."""
    dpa = impl.attention == "unfused_local"
    fused = fused_softmax_kernel(dpa, impl.masked_softmax_fusion, heads_per_rank, int(s))
    torch_path = "fp32" if (impl.softmax_fp32 or not dpa) else "bf16"
    return np.where(fused, "fused", torch_path)


@dataclass(frozen=True)
class _Ctx:
    """One precision group of a batch resolved for the time model: layout arrays (float64), the
    tokens one GPU works on per micro-batch, and the hardware's achieved rates."""

    shape: ModelShape
    hw: HardwareParams
    impl: _Impl
    stages: StageTable
    s: float
    gbs: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    vp: np.ndarray
    b: np.ndarray
    edp: np.ndarray  # expert data-parallel size
    sp: np.ndarray  # 1 where SP runs (TP > 1)
    tp_overlap: np.ndarray  # TE userbuffers overlap needs SP
    recompute: np.ndarray
    recompute_fraction: np.ndarray
    dist_opt: np.ndarray
    overlap_grad: np.ndarray
    overlap_param: np.ndarray
    m: np.ndarray  # micro-batches per step
    T: np.ndarray  # tokens per GPU per micro-batch (sequence split by CP)
    T_sp: np.ndarray  # tokens for norm/residual work (SP shards them over TP)
    fp8: bool  # FP8 GEMMs run (the group's precision on a GPU with FP8)
    rate: float  # GEMM FLOP/s at the group's precision
    rate_bf16: float
    bw: float  # HBM bytes/s
    bw_ew: float  # elementwise kernels' achieved bytes/s
    bw_st: float  # streaming passes' achieved bytes/s
    nv: float  # NVLink bus bytes/s achieved
    net: float  # NIC bus bytes/s achieved
    host_f: float = 0.0  # host seconds per forward kernel launched (HOST_FORWARD_SHARE)
    host_b: float = 0.0  # host seconds per backward kernel

    def linear(self, m, n, k, groups=1.0, rate=None):
        """(forward, dgrad, wgrad) of y[m,n] = x[m,k] @ w[k,n] on this GPU; FP8 operands are 1 byte (a rate
        other than the bf16 one is the FP8 GEMMs')."""
        rate = self.rate if rate is None else rate
        elem = 1.0 if self.fp8 and rate != self.rate_bf16 else 2.0
        return _linear_s(m, n, k, rate, self.bw, float(self.hw.num_sms), groups, elem)

    def link(self, stride, size):
        return _group_link(stride, size, float(self.hw.gpus_per_node), self.nv, self.net)


def _context(batch: LayoutBatch, hw: HardwareParams, fp8_rows: bool) -> _Ctx:
    im = batch.impl
    f64 = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    tp, cp, b, dp = f64(batch.tp), f64(batch.cp), f64(batch.micro_batch_size), f64(batch.dp)
    sp = np.where(tp > 1, f64(batch.sequence_parallel), 0.0)
    recompute = f64(batch.recompute)
    per_chunk = np.maximum(1, batch.shape.num_layers // (batch.pp * batch.vp))
    frac = np.where(batch.recompute == RECOMPUTE_FULL,
                    recomputed_layer_fraction(per_chunk, batch.recompute_block, batch.recompute_num_layers), 1.0)
    gbs = f64(batch.global_batch_size)
    T = b * float(batch.seq_length) / cp
    fp8 = fp8_rows and hw.peak_fp8_tflops is not None
    rate_bf16 = hw.peak_bf16_tflops * 1e12 * hw.gemm_bf16_fraction
    bw = hw.hbm_bandwidth_gbps * 1e9
    return _Ctx(
        shape=batch.shape, hw=hw, impl=_kernel_choices(im, fp8_rows), stages=stage_table(batch),
        s=float(batch.seq_length), gbs=gbs, tp=tp, pp=f64(batch.pp), dp=dp, cp=cp, ep=f64(batch.ep), etp=f64(batch.etp),
        vp=f64(batch.vp), b=b, edp=f64(batch.expert_dp), sp=sp, tp_overlap=f64(batch.tp_comm_overlap) * sp,
        recompute=recompute, recompute_fraction=frac, dist_opt=f64(batch.use_distributed_optimizer),
        overlap_grad=f64(batch.overlap_grad_reduce), overlap_param=f64(batch.overlap_param_gather),
        m=np.maximum(1.0, np.floor(gbs / np.maximum(b * dp, 1.0))), T=T, T_sp=np.where(sp > 0, T / tp, T), fp8=fp8,
        rate=hw.peak_fp8_tflops * 1e12 * hw.gemm_fp8_fraction if fp8 else rate_bf16, rate_bf16=rate_bf16,
        bw=bw, bw_ew=bw * hw.elementwise_fraction, bw_st=bw * hw.stream_fraction,
        nv=hw.nvlink_bandwidth_gbps * 1e9 * NVLINK_EFFICIENCY, net=hw.scaleout_bandwidth_gbps * 1e9 * NETWORK_EFFICIENCY,
        **_host_rates(hw),
    )


def host_unit_s(floor_s_per_layer: float) -> tuple[float, float]:
    """Host seconds of one forward and one backward host unit on a host of this speed: the reference layer's
    host time split by HOST_FORWARD_SHARE over its forward and backward kernels (host_reference_kernels)."""
    k_f, k_b = host_reference_kernels()
    return floor_s_per_layer * HOST_FORWARD_SHARE / k_f, floor_s_per_layer * (1.0 - HOST_FORWARD_SHARE) / k_b


def _host_rates(hw: HardwareParams) -> dict:
    """Host seconds per forward and per backward kernel launch (HOST_FORWARD_SHARE)."""
    if hw.host_floor_s_per_layer <= 0:
        return {}
    host_f, host_b = host_unit_s(hw.host_floor_s_per_layer)
    return {"host_f": host_f, "host_b": host_b}


def _hide(comm, behind, tax=OVERLAP_SM_TAX):
    """Exposed part of a collective overlapped with `behind` compute, plus the slowdown its
    kernels cause to that compute while they share the SMs (`tax` of the overlapped time)."""
    return np.maximum(0.0, comm - behind) + tax * np.minimum(comm, behind)


# ---- GEMMs of one layer (forward, dgrad, wgrad) ----------------------------------------------


@dataclass(frozen=True)
class _AttentionGemms:
    lin: list  # (fwd, dgrad, wgrad) of each input-side linear (QKV, or MLA's down/up projections)
    proj: tuple  # the output projection
    qk_dim: float
    v_dim: float
    kv_heads: float
    qkv_out_elems: float  # QKV output elements per token, before /tp
    gather_width: float  # width of what the column-parallel side gathers with SP (h, or MLA's latents)

    @property
    def gemm_f(self):
        return sum(x[0] for x in self.lin) + self.proj[0]

    @property
    def gemm_b(self):
        return sum(x[1] + x[2] for x in self.lin) + self.proj[1] + self.proj[2]


def _linears(c: _Ctx, weights: tuple, tokens=None, tp=None, groups=1.0, rate=None) -> list:
    """(forward, dgrad, wgrad) seconds of each linear layer of an anatomy block (physics/anatomy.py
    linear_weights: out x in and the dimension TP splits) on one rank: column-parallel layers split
    their outputs over `tp` (the rank's TP, or expert TP for routed experts), row-parallel ones their
    inputs, over `tokens` (the micro-batch's T by default); a replicated one (MLA's down-projections)
    runs whole on the rank's sequence shard (T_sp tokens with SP)."""
    tokens, tp = (c.T if tokens is None else tokens), (c.tp if tp is None else tp)
    out = []
    for n, k, tp_dim in weights:
        if tp_dim is None:
            out.append(c.linear(c.T_sp, float(n), float(k), groups, rate))
        else:
            out.append(c.linear(tokens, n / tp if tp_dim == 0 else float(n), k / tp if tp_dim == 1 else float(k), groups, rate))
    return out


def _attention_gemms(c: _Ctx) -> _AttentionGemms:
    """The attention block's GEMMs from the layer anatomy (its last linear is the output projection)
    and the widths the attention, elementwise and TP terms need."""
    shape = c.shape
    h, n_heads = float(shape.hidden_size), float(shape.num_attention_heads)
    *lin, proj = _linears(c, linear_weights(shape)["attention"])
    if not shape.multi_latent_attention:
        d, g = float(shape.kv_channels), float(shape.num_query_groups)
        return _AttentionGemms(lin, proj, d, d, g, n_heads * d + 2 * g * d, h)
    d_qk, d_rope, d_v = float(shape.qk_head_dim), float(shape.qk_pos_emb_head_dim), float(shape.v_head_dim)
    # Megatron MLASelfAttention: the column-parallel up-projections gather their narrow inputs
    # (q_compressed, kv_compressed) and the RoPE part of the key instead of the hidden state.
    r_kv = float(shape.kv_lora_rank)
    gather_width = (h if shape.q_lora_rank is None else float(shape.q_lora_rank)) + r_kv + d_rope
    qkv_out = n_heads * (d_qk + d_rope) + n_heads * (d_qk + d_rope + d_v)  # per token, before /tp
    return _AttentionGemms(lin, proj, d_qk + d_rope, d_v, n_heads, qkv_out, gather_width)


ATTENTION_HOST_KERNELS = (2.0, 4.0)
"""(forward, backward) kernels the host is charged for core attention: TE's fused kernel with its layout
and softmax-statistics work; Megatron's DotProductAttention issues its handful of plain PyTorch ops
(baddbmm, masked_fill_, softmax, bmm, permute) at about the host cost of one TE attention call."""


CP_ATTENTION_HOST_KERNELS_PER_STEP = (4.7, 10.3)
"""(forward, backward) host units of Transformer Engine's context-parallel attention per ring step (with
CP > 1 they replace ATTENTION_HOST_KERNELS: AttnFuncWithCPAndKVP2P loops over the CP ranks in Python, each
step a K/V send/receive, an attention call on its chunk and the softmax-statistics correction).
Rank-0 traces, 2 x H100, CP2 (session s6: cp2_s16k of gpu_h100x2_S, R_cp2_s16k of gpu_h100x2_R; no
held-out row): AttnFuncWithCPAndKVP2P 3.95 / 2.24 ms per call forward = 14.0 / 11.0 TE Linear calls of the
same trace, its backward 7.9 / 7.0 Linear backward nodes; at 0.755 units per Linear call and 2.77 per
backward node (the dense traces' conversion, physics.moe) and 2 steps per call: 4.7 / 10.3. Non-CP fused
attention in the same lease: 1.8 Linear calls / 1.1 nodes, what ATTENTION_HOST_KERNELS charges."""


def _attention_host_kernels(c: _Ctx) -> tuple:
    """(forward, backward) host units of one layer's core attention (CP_ATTENTION_HOST_KERNELS_PER_STEP
    x CP with context parallelism)."""
    (f, b), (sf, sb) = ATTENTION_HOST_KERNELS, CP_ATTENTION_HOST_KERNELS_PER_STEP
    return np.where(c.cp > 1, c.cp * sf, f), np.where(c.cp > 1, c.cp * sb, b)


def _core_attention(c: _Ctx, a: _AttentionGemms) -> tuple:
    """(forward, backward) seconds of QK^T, softmax and PV on one GPU."""
    b, s, impl = c.b, c.s, c.impl
    heads_loc = float(c.shape.num_attention_heads) / c.tp
    s_q = s / c.cp
    if impl.attention in ("fused", "flash"):
        # Causal: the kernel skips masked blocks, so half of QK^T and PV is executed.
        flash = impl.attention == "flash"
        dims = _attention_kernel_dim(a.qk_dim, flash) + _attention_kernel_dim(a.v_dim, flash)
        fwd_flops = 2.0 * b * heads_loc * s_q * s * dims * 0.5
        chunk = s / c.cp  # CP ring steps work on s/cp x s/cp blocks
        r_attn = c.hw.peak_bf16_tflops * 1e12 * ATTENTION_EFFICIENCY * chunk / (chunk + ATTENTION_HALF_RATE_SEQ)
        if impl.attention == "flash":
            r_attn = r_attn * FLASH2_RELATIVE_RATE
        rng = 0.0
        if impl.attention_dropout > 0:
            rng = 0.5 * DROPOUT_RNG_OPS_PER_SCORE * 0.5 * b * heads_loc * s_q * s / (c.hw.peak_bf16_tflops * 1e12 / 64.0)
        return fwd_flops / r_attn + rng + KERNEL_LAUNCH_S, 2.5 * fwd_flops / r_attn + rng + KERNEL_LAUNCH_S
    # Unfused: batched GEMMs over the full s x s (no masked-block skipping) + softmax bytes.
    elems = b * heads_loc * s_q * s
    gemm_flops = 2.0 * elems * (a.qk_dim + a.v_dim)
    path = _softmax_path(impl, np.floor(heads_loc), s)
    counted = np.select([path == "fused", path == "bf16"], [UNFUSED_SOFTMAX_BYTES_PER_SCORE["fused"],
                        UNFUSED_SOFTMAX_BYTES_PER_SCORE["bf16"]], UNFUSED_SOFTMAX_BYTES_PER_SCORE["fp32"])
    if impl.attention_dropout > 0:
        counted = counted + ATTENTION_DROPOUT_BYTES_PER_SCORE
    per_score = UNFUSED_ATTENTION_BW_FACTOR * counted
    n_kernels = np.where(path == "fused", 3.0, 5.0) + (1.0 if impl.attention_dropout > 0 else 0.0)
    # Forward share of the bytes: measured fwd/fwd+bwd time 0.0156/0.0388 on H100 (fp32 path).
    attn_f = gemm_flops / c.rate_bf16 + 0.4 * elems * per_score / c.bw_st + n_kernels * KERNEL_LAUNCH_S
    attn_b = 2.0 * gemm_flops / c.rate_bf16 + 0.6 * elems * per_score / c.bw_st + 1.5 * n_kernels * KERNEL_LAUNCH_S
    return attn_f, attn_b


# ---- elementwise bytes per layer (forward; backward ~2x: read input + grad, write grad) ------


@dataclass(frozen=True)
class _Elementwise:
    norm_b: float  # bytes per token of one norm (read + write h bf16)
    resid_b: float  # bytes per token of one bias-dropout-add
    rope_elems: Any
    act_b_dense: Any  # bytes per token of the dense MLP's activation
    ew_dense_f: Any  # forward elementwise bytes of a dense layer
    ew_f_s: Any  # forward elementwise seconds (with FP8 casts and launches)
    ew_b_s: Any  # backward elementwise seconds (with weight-gradient accumulation)
    acc_attn_b: Any
    acc_mlp_b: Any
    kernels_f: float  # non-GEMM, non-attention kernels of a dense layer's forward, as the host pays for them
    kernels_b: float  # ... and backward (weight-gradient adds included)
    qk_norm_kernels: tuple = (0.0, 0.0)  # of those, the query and key norms' (--qk-layernorm)


def _elementwise(c: _Ctx, a: _AttentionGemms) -> _Elementwise:
    shape, impl, T, T_sp, tp = c.shape, c.impl, c.T, c.T_sp, c.tp
    h, f = float(shape.hidden_size), float(shape.ffn_hidden_size)
    fc1_mult = 2.0 if shape.swiglu else 1.0
    norm_b = 2.0 * h * 2  # read + write h bf16
    resid_b = 3.0 * h * 2  # bias-dropout-add: read 2, write 1
    n_heads = float(shape.num_attention_heads)
    rope_elems = (n_heads * a.qk_dim + a.kv_heads * a.qk_dim) / tp if shape.position_embedding_type == "rope" else 0.0
    act_b_dense = (3.0 if shape.swiglu else 2.0) * f / tp * 2
    # RoPE: TE's fused kernel (one pass per tensor) or Megatron's unfused torch path (~5 passes).
    rope_passes = 1.0 if impl.rope_fused else 5.0
    # Non-GEMM kernels of a TE layer: forward 2 norms, 2 RoPE, activation, 2 bias-dropout-add,
    # attention layout/aux ~3 (10); backward about twice that plus residual-grad adds (22). The host
    # is charged these for the local spec too: its extra kernels come from plain PyTorch ops, each far
    # cheaper to issue than a TE module call, in the same module structure.
    host_f, host_b = 10.0, 22.0
    if impl.te:
        ew_f = T_sp * (2 * norm_b + 2 * resid_b) + T * (rope_passes * rope_elems * 4 + act_b_dense)
        n_kernels_f, n_kernels_b = host_f, host_b
    else:
        # Local spec without Apex/TE fusions: separate bias adds, unfused RoPE (~5 passes).
        bias_b = (2.0 * f / tp * 2 + 2 * 2.0 * h * 2) if shape.add_bias_linear else 0.0
        ew_f = T_sp * (2 * norm_b + 2 * resid_b) + T * (rope_passes * rope_elems * 4 + act_b_dense + bias_b)
        n_kernels_f, n_kernels_b = 22.0, 45.0
    more_f = more_b = 0.0
    if not impl.rope_fused and shape.position_embedding_type == "rope" and impl.te:
        more_f, more_b = 8.0, 8.0  # q and k: 4 more kernels each way
    if not impl.bias_activation_fused:
        # bias add, activation (and the SwiGLU product) as separate kernels: one more pass each way
        ew_f = ew_f + T * act_b_dense
        more_f, more_b = more_f + 2.0, more_b + 3.0
    if impl.hidden_dropout > 0:
        # two bias-dropout-adds per layer: a 1-byte mask per element written forward and read backward
        # (fused; unfused, dropout and the residual add are separate passes over the bf16 tensor)
        extra = 1.0 if impl.bias_dropout_fused else 1.0 + 2.0 * 2
        ew_f = ew_f + 2 * T_sp * h * extra
        more_f, more_b = more_f + (0.0 if impl.bias_dropout_fused else 2.0), more_b + 2.0
    qk = (0.0, 0.0)
    if shape.qk_layernorm:
        # the query and key norms: a pass over each head's q and k (read + write bf16), two modules of their own
        ew_f = ew_f + T * (n_heads + a.kv_heads) * a.qk_dim / tp * 4
        qk = (2 * NORM_OP_HOST_KERNELS[0], 2 * NORM_OP_HOST_KERNELS[1])
        more_f, more_b = more_f + qk[0], more_b + qk[1]
    n_kernels_f, n_kernels_b = n_kernels_f + more_f, n_kernels_b + more_b
    host_f, host_b = host_f + more_f, host_b + more_b
    if c.fp8:
        # TE casts each GEMM input to FP8 with a transposed copy (read 2, write 1 + 1) and each
        # output gradient likewise in backward; current scaling adds an amax pass over each.
        amax = 2.0 if impl.fp8_current_scaling else 0.0
        in_elems = T * (h + n_heads * a.v_dim / tp + h + f / tp)  # inputs of qkv, proj, fc1, fc2
        out_elems = T * (a.qkv_out_elems / tp + h + f * fc1_mult / tp + h)
        cast_f = in_elems * (4.0 + amax)
        cast_b = out_elems * (4.0 + amax)
        n_kernels_f, n_kernels_b = n_kernels_f + 5.0, n_kernels_b + 10.0  # cast/transpose + amax/scale updates
        host_f, host_b = host_f + 5.0, host_b + 10.0
    else:
        cast_f = cast_b = 0.0
    lw = linear_weights(shape)
    acc_attn_b = _wgrad_accumulation_s(_local_weights(lw["attention"], tp), len(lw["attention"]), impl, c.bw, c.bw_ew)
    acc_mlp_b = _wgrad_accumulation_s(_local_weights(lw["mlp"], tp), len(lw["mlp"]), impl, c.bw, c.bw_ew)
    ew_f_s = (ew_f + cast_f) / c.bw_ew + n_kernels_f * KERNEL_LAUNCH_S
    ew_b_s = (2.0 * ew_f + cast_b) / c.bw_ew + n_kernels_b * KERNEL_LAUNCH_S + acc_attn_b + acc_mlp_b
    adds = 0.0 if impl.grad_acc_fusion else float(len(lw["attention"]) + len(lw["mlp"]))
    return _Elementwise(norm_b, resid_b, rope_elems, act_b_dense, ew_f, ew_f_s, ew_b_s, acc_attn_b, acc_mlp_b,
                        host_f, host_b + adds, qk)


# ---- TP / SP collectives of one layer --------------------------------------------------------


class _TpComm:
    """Exposed TP communication of a (column-parallel -> row-parallel) block, forward and backward."""

    def __init__(self, c: _Ctx) -> None:
        self.c = c
        tp_bw, tp_lat = c.link(1.0, c.tp)
        S_act = c.T * float(c.shape.hidden_size) * 2.0  # bytes of one full activation [s/cp, b, h] in bf16
        self.ag = _ring_s(S_act, c.tp, tp_bw, tp_lat)  # all-gather or reduce-scatter
        self.ar = _ring_s(S_act, c.tp, tp_bw, tp_lat, 2.0)
        # Userbuffers' all-gather buffers hold the FP8 GEMM inputs in FP8 runs (UB_FP8_ALL_GATHER).
        self.ag_ub = _ring_s(S_act * (0.5 if c.fp8 else 1.0), c.tp, tp_bw, tp_lat)

    def __call__(self, col_dgrad, col_wgrad, row_dgrad, row_fwd, col_fwd, in_width=None):
        """`in_width` is the width of what the column side gathers (h, or MLA's latents)."""
        c, ag, ar = self.c, self.ag, self.ar
        h = float(c.shape.hidden_size)
        ag_in = ag * ((in_width or h) / h)
        ar_in = ar * ((in_width or h) / h)
        # no SP: fwd all-reduce after the row-parallel GEMM; bwd all-reduce of the input grad,
        # launched async and hidden behind the column-parallel wgrad GEMM (Megatron/TE).
        nosp_f = ar
        nosp_b = _hide(ar_in, col_wgrad)
        # SP: fwd all-gather before the column GEMM + reduce-scatter after the row GEMM; bwd:
        # all-gather of the grad before the row dgrad (exposed), re-gather of the input for wgrad
        # (hidden behind the column dgrad), reduce-scatter of the input grad (behind col wgrad).
        sp_f = ag_in + ag
        sp_b = ag + _hide(ag_in, col_dgrad) + _hide(ag_in, col_wgrad)
        ov_f, ov_b = self.userbuffers(col_fwd, row_fwd, row_dgrad, col_dgrad, col_wgrad, (in_width or h) / h)
        fwd = np.where(c.sp > 0, np.where(c.tp_overlap > 0, ov_f, sp_f), nosp_f)
        bwd = np.where(c.sp > 0, np.where(c.tp_overlap > 0, ov_b, sp_b), nosp_b)
        return fwd, bwd

    def userbuffers(self, col_fwd, row_fwd, row_dgrad, col_dgrad, col_wgrad, in_share):
        """tp_comm_overlap: each collective split and run beside its GEMM as TE's initialize_ub sets them up
        (UB_PIPELINE_SPLITS): ring exchange for the gathers before the column GEMM (forward) and the row dgrad,
        nothing exposed while each peer send is shorter than the GEMM of the chunk in hand (copy engines: no
        SMs taken); the reduce-scatter after the row GEMM pipelined in UB_PIPELINE_SPLITS, its last split
        exposed; bulk overlap of the input re-gather with the column dgrad and of the dgrad reduce-scatter with
        the column wgrad. The overlapped GEMMs stretch by UB_GEMM_STRETCH (their split and the SMs the
        pipelined and bulk kernels hold: 16 of them in TE's defaults)."""
        ag, ag_ub = self.ag, self.ag_ub
        tail = 1.0 / UB_PIPELINE_SPLITS
        # the GEMMs beside userbuffers kernels run UB_GEMM_STRETCH longer (split, SMs shared): booked here
        stretch = UB_GEMM_STRETCH - 1.0
        rs_f = tail * ag + _hide((1.0 - tail) * ag, (1.0 - tail) * row_fwd, 0.0)
        fwd = _hide(in_share * ag_ub, col_fwd, 0.0) + rs_f + stretch * (col_fwd + row_fwd)
        bwd = (_hide(ag_ub, row_dgrad, 0.0) + _hide(in_share * ag_ub, col_dgrad, 0.0)
               + _hide(in_share * ag, col_wgrad, 0.0) + stretch * (row_dgrad + col_dgrad + col_wgrad))
        return fwd, bwd


def _cp_ring(c: _Ctx, a: _AttentionGemms, attn_f, attn_b) -> tuple:
    """CP ring exchange of K/V, overlapped with each chunk's attention: (forward, backward)."""
    cp_bw, cp_lat = c.link(c.tp, c.cp)
    kv_bytes = c.b * (c.s / c.cp) * (a.kv_heads / c.tp) * (a.qk_dim + a.v_dim) * 2.0  # K and V of the local chunk
    step_f = kv_bytes / (cp_bw * _ramp(kv_bytes, cp_bw)) + cp_lat + COLLECTIVE_LATENCY_S
    steps = np.maximum(c.cp - 1.0, 0.0)
    cp_f = steps * _hide(step_f, attn_f / np.maximum(c.cp, 1.0))
    cp_b = steps * _hide(2.0 * step_f, attn_b / np.maximum(c.cp, 1.0))  # K/V and dK/dV
    return cp_f, cp_b


# ---- layers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layers:
    """The per-micro-batch pieces of one dense layer (and what MoE, hybrid and recompute reuse)."""

    attn: _AttentionGemms
    fc1: tuple
    fc2: tuple
    ew: _Elementwise
    tp_comm: _TpComm
    tpa: tuple  # attention block TP comm (forward, backward)
    tpm: tuple  # MLP block TP comm
    dense: dict  # part -> seconds (gemm_f, gemm_b, attn_f, ..., ep_b)

    @property
    def mlp_gemm_f(self):
        return self.fc1[0] + self.fc2[0]

    @property
    def mlp_gemm_b(self):
        return self.fc1[1] + self.fc1[2] + self.fc2[1] + self.fc2[2]


def _dense_layer(c: _Ctx) -> _Layers:
    shape = c.shape
    a = _attention_gemms(c)
    # the dense MLP's fc1 and fc2 (a zero-width pair where the model has no dense MLP)
    fc1, fc2 = _linears(c, linear_weights(shape)["mlp"] or ((0, shape.hidden_size, 0), (shape.hidden_size, 0, 1)))
    attn_f, attn_b = _core_attention(c, a)
    ew = _elementwise(c, a)
    tp_comm = _TpComm(c)
    tpa = tp_comm(sum(x[1] for x in a.lin), a.lin[0][2], a.proj[1], a.proj[0], a.lin[0][0], a.gather_width)
    tpm = tp_comm(fc1[1], fc1[2], fc2[1], fc2[0], fc1[0])
    cp_f, cp_b = _cp_ring(c, a, attn_f, attn_b)
    attn_k = _attention_host_kernels(c)
    gemms = float(len(a.lin) + 1 + 2)
    dense = {
        "gemm_f": a.gemm_f + (fc1[0] + fc2[0]), "gemm_b": a.gemm_b + (fc1[1] + fc1[2] + fc2[1] + fc2[2]),
        "attn_f": attn_f, "attn_b": attn_b, "ew_f": ew.ew_f_s, "ew_b": ew.ew_b_s,
        "tp_f": tpa[0] + tpm[0], "tp_b": tpa[1] + tpm[1], "cp_f": cp_f, "cp_b": cp_b, "ep_f": 0.0, "ep_b": 0.0,
        "acc_attn_b": ew.acc_attn_b,
        # kernels the host launches for one layer and micro-batch (TP collectives: one per exchange)
        "kernels_f": gemms + attn_k[0] + ew.kernels_f + np.where(c.tp > 1, 4.0, 0.0),
        "kernels_b": 2 * gemms + attn_k[1] + ew.kernels_b + np.where(c.tp > 1, 6.0, 0.0),
        "attn_kernels_f": attn_k[0],
        "qk_norm_kernels_f": ew.qk_norm_kernels[0], "qk_norm_kernels_b": ew.qk_norm_kernels[1],
    }
    return _Layers(a, fc1, fc2, ew, tp_comm, tpa, tpm, dense)


def _moe_kit() -> MoeKit:
    """This module's primitives for physics.moe (which cannot import them: this module imports it)."""
    return MoeKit(ring_s=_ring_s, ramp=_ramp, wgrad_s=_wgrad_accumulation_s, local_weights=_local_weights, linears=_linears,
                  kernel_s=KERNEL_LAUNCH_S, latency_s=COLLECTIVE_LATENCY_S, nvlink_hop_s=NVLINK_HOP_LATENCY_S,
                  network_hop_s=NETWORK_HOP_LATENCY_S, ref_units=_ref_units(), overlap_tax=OVERLAP_SM_TAX)


@lru_cache(maxsize=1)
def _ref_units() -> tuple[float, float]:
    """(forward, backward) host units whose host time is one reference layer's (HOST_FORWARD_SHARE of it
    forward over its forward kernels, the rest over its backward kernels): prices host work given in
    reference layers in the units host_f / host_b charge."""
    k_f, k_b = host_reference_kernels()
    return k_f / HOST_FORWARD_SHARE, k_b / (1.0 - HOST_FORWARD_SHARE)


def _moe_layer(c: _Ctx, L: _Layers) -> dict:
    """One MoE layer from its parts (physics.moe.moe_layer)."""
    return moe_layer(c, L, _moe_kit())


def _hybrid_kinds(c: _Ctx, L: _Layers, moe: dict | None) -> list:
    """One block per layer: the attention and MLP halves of the dense layer (the elementwise work
    split by bytes: one norm + residual each, RoPE to attention, the activation to the MLP), the
    MoE layer without its attention half, and the Mamba mixer (physics.mamba)."""
    shape, T, T_sp, ew, d = c.shape, c.T, c.T_sp, L.ew, L.dense
    ew_attn = T_sp * (ew.norm_b + ew.resid_b) + T * ew.rope_elems * 4
    share = ew_attn / (ew_attn + T_sp * (ew.norm_b + ew.resid_b) + T * ew.act_b_dense)
    ew_b_rest = ew.ew_b_s - ew.acc_attn_b - ew.acc_mlp_b
    # Kernels: each half of a dense layer launches about half its kernels (a Mamba mixer as many as a
    # whole dense layer: conv, scan chunks, gating, norm).
    half_k = {"kernels_f": 0.5 * d["kernels_f"], "kernels_b": 0.5 * d["kernels_b"]}
    zero = {"attn_f": 0.0, "attn_b": 0.0, "cp_f": 0.0, "cp_b": 0.0, "ep_f": 0.0, "ep_b": 0.0, "norms": 1.0, **half_k}
    attn_half = {**zero, "gemm_f": L.attn.gemm_f, "gemm_b": L.attn.gemm_b, "attn_f": d["attn_f"], "attn_b": d["attn_b"],
                 "ew_f": share * ew.ew_f_s, "ew_b": share * ew_b_rest + ew.acc_attn_b, "tp_f": L.tpa[0], "tp_b": L.tpa[1],
                 "cp_f": d["cp_f"], "cp_b": d["cp_b"], "mlp_rc_f": 0.0}
    mlp_half = {**zero, "gemm_f": L.mlp_gemm_f, "gemm_b": L.mlp_gemm_b, "ew_f": (1 - share) * ew.ew_f_s,
                "ew_b": (1 - share) * ew_b_rest + ew.acc_mlp_b, "tp_f": L.tpm[0], "tp_b": L.tpm[1]}
    moe_only = None
    if moe is not None:
        moe_only = {**moe, "norms": 1.0, **{k: np.maximum(0.0, moe[k] - attn_half[k]) for k in (
            "gemm_f", "gemm_b", "attn_f", "attn_b", "ew_f", "ew_b", "tp_f", "tp_b", "cp_f", "cp_b", "kernels_f", "kernels_b")}}
    mamba_part = None
    if shape.num_mamba_layers:
        cp_bw, cp_lat = c.link(c.tp, c.cp)
        mamba_part = mamba_layer_parts(shape, MambaTiming(
            T=T, T_sp=T_sp, tp=c.tp, linear_s=lambda m_, n_, k_: c.linear(m_, n_, k_),
            tp_comm=L.tp_comm, cp_a2a=lambda x: np.where(c.cp > 1, _ring_s(x, c.cp, cp_bw, cp_lat), 0.0),
            bw_ew=c.bw_ew, rate=c.rate, kernel_s=KERNEL_LAUNCH_S, norm_resid_bytes=ew.norm_b + ew.resid_b))
        mamba_part = {"kernels_f": d["kernels_f"], "kernels_b": d["kernels_b"], **mamba_part}
    return hybrid_kinds(shape, attn_half, mlp_half, moe_only, mamba_part)


def _selective_extra(c: _Ctx, L: _Layers, parts: dict, is_moe: bool):
    """Selective recompute: the forward of the chosen modules rerun during backward."""
    mods, ew = c.impl.recompute_modules, L.ew
    x = 0.0
    if "core_attn" in mods:
        x = x + parts["attn_f"]
    if "layernorm" in mods:
        x = x + c.T_sp * parts.get("norms", 2.0) * ew.norm_b / c.bw_ew
    if "mlp" in mods and not is_moe:
        x = x + parts.get("mlp_rc_f", L.mlp_gemm_f + c.T * ew.act_b_dense / c.bw_ew + L.tpm[0])
    if is_moe:
        if "moe" in mods:
            x = x + parts["moe_f"]
        else:
            if "moe_act" in mods:
                x = x + parts["moe_act_f"]
            if "shared_experts" in mods:
                x = x + parts["shared_f"]
    if "mla_up_proj" in mods and c.shape.multi_latent_attention:
        x = x + sum(y[0] for y in L.attn.lin[1:])
    return x


def _layer_time(c: _Ctx, L: _Layers, p: dict, is_moe: bool) -> tuple:
    """(forward, backward, recompute) seconds of one layer and micro-batch."""
    fwd = p["gemm_f"] + p["attn_f"] + p["ew_f"] + p["tp_f"] + p["cp_f"] + p["ep_f"] + p.get("ssm_f", 0.0)
    bwd = p["gemm_b"] + p["attn_b"] + p["ew_b"] + p["tp_b"] + p["cp_b"] + p["ep_b"] + p.get("ssm_b", 0.0)
    sel = np.where(c.recompute == 1, 1.0, 0.0)
    full_rc = np.where(c.recompute == 2, 1.0, 0.0) * c.recompute_fraction
    rc = sel * _selective_extra(c, L, p, is_moe) + full_rc * fwd
    return fwd, bwd, rc


@dataclass(frozen=True)
class _LayerAverage:
    comp: dict  # term -> seconds per layer (weighted over the layer kinds), fwd + bwd
    fwd: Any
    bwd: Any
    rc: Any
    host_gap: Any  # GPU idle per layer waiting for the host
    t_layer: Any  # seconds per layer and micro-batch on the critical path
    kernels: Any  # kernels the host launches per layer and micro-batch (forward, backward, recompute)


def _average_layer(c: _Ctx, L: _Layers, moe: dict | None) -> _LayerAverage:
    """One layer and micro-batch averaged over the model's layer kinds, held to the host floor."""
    shape = c.shape
    frac_moe = float(shape.num_moe_layers) / float(shape.num_layers)
    # (parts, share of the layers, is MoE) per layer kind: a GPT model's dense and MoE layers, or
    # a hybrid pattern's one-block layers (physics.mamba).
    kinds = [(_graphed_dense(c, L.dense), 1 - frac_moe, False)] + ([(moe, frac_moe, True)] if shape.is_moe else [])
    if shape.is_hybrid:
        kinds = _hybrid_kinds(c, L, moe)
    comp = {}
    for key in ("gemm", "attn", "ew", "tp", "cp", "ep", "ssm"):
        comp[key] = sum(w * (p.get(key + "_f", 0.0) + p.get(key + "_b", 0.0)) for p, w, _ in kinds)
    lay_f = lay_b = lay_rc = 0.0
    for p, w, is_moe in kinds:
        f_, b_, r_ = _layer_time(c, L, p, is_moe)
        lay_f, lay_b, lay_rc = lay_f + w * f_, lay_b + w * b_, lay_rc + w * r_
    t_layer_gpu = lay_f + lay_b + lay_rc
    launches = [(w, _layer_kernels(c, p)) for p, w, _ in kinds]
    k_f, k_b, k_rc = (sum(w * ks[i] for w, ks in launches) for i in range(3))
    # The host launches a layer's kernels one by one (Python, Megatron-Core, TE, the CUDA launch); a
    # layer whose GPU work takes less than that leaves the GPU waiting (HOST_FORWARD_SHARE).
    host_f, host_b = c.host_f * k_f, c.host_f * k_rc + c.host_b * k_b
    host_gap = np.maximum(0.0, host_f + host_b - t_layer_gpu)
    if shape.is_moe and host_syncs_per_layer(c.impl) > 0 and not c.impl.moe_ep_overlap:
        # the dispatcher's sync in every MoE layer's forward keeps the host within a layer of the GPU, so
        # a forward the host cannot issue as fast as the GPU runs it leaves the GPU idle however much
        # backward work follows, and the other way round (rank-0 traces of E_q30rank_ep2_forced_bf16,
        # 2 x H200: forward layers host-bound at 14.5 ms a layer, backward GPU-bound at 12.0; the sync's own
        # wait after it: sync_wait_f). The combined 1F1B schedule interleaves the two on one host thread.
        sync_wait = sum(w * p.get("sync_wait_f", 0.0) for p, w, _ in kinds)
        host_gap = (np.maximum(np.maximum(0.0, host_f - lay_f), sync_wait)
                    + np.maximum(0.0, host_b - lay_b - lay_rc))
    # an MoE layer's forward heuristic-cache misses stall the GPU even where the layer's host total hides
    miss_wait = sum(w * p.get("miss_wait_f", 0.0) for p, w, _ in kinds)
    host_gap = np.maximum(host_gap, miss_wait)
    return _LayerAverage(comp, lay_f, lay_b, lay_rc, host_gap, t_layer_gpu + host_gap, k_f + k_rc + k_b)


def _graphed_dense(c: _Ctx, d: dict) -> dict:
    """The dense layer with the launches the host pays under CUDA graphs: each captured half (moe.dense_halves) one
    replay (GRAPHED_LAUNCHES) instead of its launches."""
    captured = c.impl.graphed & {"attn", "mlp"}
    if not captured:
        return d
    halves = dense_halves(d)
    return {**d, **{key: d[key] - sum(halves[name][i] - GRAPHED_LAUNCHES for name in captured)
                    for i, key in enumerate(("kernels_f", "kernels_b"))}}


def _layer_kernels(c: _Ctx, p: dict) -> tuple:
    """(forward, backward, recomputed) kernels one layer launches per micro-batch; recompute reruns core
    attention (selective), half the forward for the 'mlp'/'moe' modules, or the forward (full)."""
    fwd, bwd = p.get("kernels_f", 0.0), p.get("kernels_b", 0.0)
    mods = c.impl.recompute_modules
    sel = p.get("attn_kernels_f", 0.0) if "core_attn" in mods else 0.0
    sel = sel + (0.5 * fwd if ({"mlp", "moe"} & set(mods)) else 0.0)
    rc = np.where(c.recompute == 1, sel, 0.0) + np.where(c.recompute == 2, c.recompute_fraction * fwd, 0.0)
    return fwd, bwd, rc


@lru_cache(maxsize=1)
def host_reference_kernels() -> tuple[float, float]:
    """(forward, backward) kernels of the host floor's reference layer: GPT-3 1.3B, Transformer Engine,
    bf16, micro-batch 1 of 2,048 tokens, no recompute, weight gradients added to main_grad by separate
    kernels (the pretrain_gpt.py runs the figure was measured with: --no-gradient-accumulation-fusion)."""
    plan = Plan(model={"name": "gpt3-1.3b"}, cluster={"gpu": "h100-sxm", "num_gpus": 1, "host_floor_ms_per_layer": 0},
                training={"seq_length": 2048, "global_batch_size": 1, "micro_batch_size": 1},
                implementation={"gradient_accumulation_fusion": False})
    shape = resolve_model(plan.model)
    c = _context(LayoutBatch.from_plan(plan, shape), hardware_params(plan.cluster), False)
    d = _dense_layer(c).dense
    return _f(d["kernels_f"]), _f(d["kernels_b"])


# ---- embedding (first stage), output layer + loss and MTP (last stage) ------------------------


@dataclass(frozen=True)
class _Ends:
    out_gemm: Any
    out_ew: Any
    out_tp: Any
    t_out: Any
    emb_ew: Any
    emb_tp: Any
    t_emb: Any
    t_mtp: Any
    mtp: dict  # breakdown term -> seconds of the MTP layers per micro-batch ('gemm', 'attn', 'ew', 'tp', 'cp', 'ep', 'rc')


def _embedding_and_output(c: _Ctx, L: _Layers, moe: dict | None) -> _Ends:
    shape, T, T_sp, impl, tp = c.shape, c.T, c.T_sp, c.impl, c.tp
    h = float(shape.hidden_size)
    V = c.stages.padded_vocab
    out = c.linear(T, V / tp, h, rate=c.rate_bf16)  # Megatron's output layer is not a TE module: bf16 even in FP8 runs
    ce_bytes = CROSS_ENTROPY_FUSED_BYTES_PER_LOGIT if impl.ce_fusion else CROSS_ENTROPY_UNFUSED_BYTES_PER_LOGIT
    out_gemm = out[0] + out[1] + out[2]
    out_ew = (T * V / tp * ce_bytes / c.bw_st + T_sp * 3 * L.ew.norm_b / c.bw_ew + 6 * KERNEL_LAUNCH_S
              + _wgrad_accumulation_s(V / tp * h, 1.0, impl, c.bw, c.bw_ew))
    ag, ar = L.tp_comm.ag, L.tp_comm.ar
    out_tp = np.where(c.sp > 0, 2.0 * ag, _hide(ar, out[2]))  # SP: gather before, reduce-scatter of grad after
    t_out = out_gemm + out_ew + out_tp
    emb_ew = (T * h * 2 * 2 + T * h * 10) / c.bw_ew + 4 * KERNEL_LAUNCH_S  # lookup; grad scatter-add into fp32
    emb_tp = np.where(c.sp > 0, ag, ar)
    # MTP (MultiTokenPredictionBlock, last stage): per depth one layer of the last decoder layer's
    # type, its eh_proj (2h -> h, column-parallel) and its own output layer and loss.
    t_mtp, mtp = 0.0, {}
    if shape.mtp_num_layers:
        last_moe = shape.is_moe and shape.moe_layer_pattern[-1] == 1
        p_mtp = moe if last_moe else L.dense
        eh = c.linear(T, h / tp, 2.0 * h)
        f_, b_, r_ = _layer_time(c, L, p_mtp, last_moe)
        n = float(shape.mtp_num_layers)
        # the MTP layers' time by breakdown term (they sum to t_mtp), booked where the last stage is slowest
        mtp = {"gemm": n * (p_mtp["gemm_f"] + p_mtp["gemm_b"] + sum(eh) + out_gemm),
               "attn": n * (p_mtp["attn_f"] + p_mtp["attn_b"]), "ew": n * (p_mtp["ew_f"] + p_mtp["ew_b"] + out_ew),
               "tp": n * (p_mtp["tp_f"] + p_mtp["tp_b"] + out_tp), "cp": n * (p_mtp["cp_f"] + p_mtp["cp_b"]),
               "ep": n * (p_mtp["ep_f"] + p_mtp["ep_b"]), "rc": n * r_}
        t_mtp = n * (f_ + b_ + r_ + sum(eh) + t_out)
    return _Ends(out_gemm, out_ew, out_tp, t_out, emb_ew, emb_tp, emb_ew + emb_tp, t_mtp, mtp)


# ---- pipeline schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pipeline:
    t_max: Any  # per-micro-batch time of the slowest stage
    layers: Any  # that stage's decoder layers
    with_output: Any  # whether it is the last stage (output layer, loss, MTP)
    with_embedding: Any  # whether it holds the embedding (the first stage, or the only one)
    bubble: Any
    p2p: Any


def _pipeline(c: _Ctx, t_layer, e: _Ends) -> _Pipeline:
    """1F1B / interleaved schedule: the slowest stage sets the pace, fill and drain add the bubble
    (sum of stage times - slowest) / VP, and the stage-to-stage sends."""
    pp, vp, m = c.pp, c.vp, c.m
    one_stage = pp <= 1
    st = c.stages
    # The first/last stages (embedding, loss) hold their own layer counts; the largest middle one.
    L_first, L_mid, L_last = st.layers[0], np.maximum(st.layers[1], st.layers[2]), st.layers[3]
    t_last = L_last * t_layer + e.t_out + e.t_mtp + np.where(one_stage, e.t_emb, 0.0)
    t_first = np.where(one_stage, 0.0, L_first * t_layer + e.t_emb)
    t_mid = np.where(one_stage, 0.0, L_mid * t_layer)
    t_max = np.maximum(np.maximum(t_last, t_first), t_mid)
    last_slowest = t_last >= np.maximum(t_first, t_mid)
    first_slowest = ~last_slowest & (t_first >= t_mid)
    layers = np.where(last_slowest, L_last, np.where(first_slowest, L_first, L_mid))
    t_sum = float(c.shape.num_layers) * t_layer + e.t_out + e.t_emb + e.t_mtp
    pp_bw, pp_lat = c.link(c.tp * c.cp * c.dp, 2.0)
    p2p_bytes = c.T * float(c.shape.hidden_size) * 2.0 / np.where(c.sp > 0, c.tp, 1.0)
    t_p2p = np.where(one_stage, 0.0, 2.0 * (p2p_bytes / (pp_bw * _ramp(p2p_bytes, pp_bw)) + pp_lat + COLLECTIVE_LATENCY_S))
    bubble = np.where(one_stage, 0.0, (t_sum - t_max) / vp)
    # 1F1B: blocking send/recv pairs on the critical path every micro-batch and through fill/drain.
    # Interleaved: Megatron overlaps them with compute (overlap_p2p_comm), vp times as many sends;
    # only fill/drain stays exposed.
    pipe_p2p = np.where(vp > 1, m * vp * OVERLAP_SM_TAX * t_p2p + (pp - 1.0) * t_p2p, (m + pp - 1.0) * t_p2p)
    return _Pipeline(t_max, layers, last_slowest, first_slowest | one_stage, bubble, np.where(one_stage, 0.0, pipe_p2p))


# ---- data-parallel gradient / parameter traffic and the optimizer ------------------------------


def _data_parallel(c: _Ctx, lay: _LayerAverage) -> tuple:
    """(exposed DP communication, optimizer step) seconds of the rank that needs the most for both.

    Every evaluated rank reduces the gradients of its own parameters (physics.memory.rank_params,
    embedding and output layer where they are) over DP x CP (experts over expert-DP) and, with the
    optimizer state sharded, all-gathers them; overlap hides all but the last bucket behind one
    micro-batch's backward (forward) of the rank's own layers. Sharded gradients (FSDP, Megatron-FSDP
    optim_grads*) are reduce-scattered every micro-batch and sharded weights (FSDP2, optim_grads_params)
    all-gathered for every micro-batch's forward and again for its backward (`_fsdp_exposed`). Tied
    embeddings with PP > 1: the first and last stage also all-reduce the embedding gradient.
    """
    st, impl, shape, sh = c.stages, c.impl, c.shape, c.impl.dp_sharding
    P_dense, P_exp = st.dense_params, st.expert_params
    dpc = c.dp * c.cp  # Megatron reduces grads over the dp x cp group and shards the optimizer over it
    g_bytes = gradient_bytes_per_param(impl.grad_reduce_in_fp32)
    p_bytes = 1.0 if impl.fp8_param_gather and c.fp8 else WEIGHT_BYTES_PER_PARAM
    d_bw, d_lat = c.link(c.tp, dpc)
    e_bw, e_lat = c.link(c.etp * c.ep, c.edp)
    opt_shard = c.dist_opt > 0 if sh.optimizer is None else np.full(np.shape(c.dist_opt), sh.optimizer)
    grad_steps = np.where(opt_shard, 1.0, 2.0)  # reduce-scatter vs all-reduce
    has_exp = 1.0 if shape.is_moe else 0.0
    t_grad = _ring_s(P_dense * g_bytes, dpc, d_bw, d_lat, grad_steps) + has_exp * _ring_s(P_exp * g_bytes, c.edp, e_bw, e_lat, grad_steps)
    t_param = np.where(opt_shard, _ring_s(P_dense * p_bytes, dpc, d_bw, d_lat) + has_exp * _ring_s(P_exp * p_bytes, c.edp, e_bw, e_lat), 0.0)
    P_total = P_dense + P_exp
    bucket_frac = np.minimum(1.0, np.maximum(_BUCKET_MIN_PARAMS, _BUCKET_PARAMS_PER_DP * dpc) / np.maximum(P_total, 1.0))
    # Overlap windows (wall-clock: a host-bound layer's launch gaps stretch them too). Megatron syncs each
    # model chunk's grads once its last micro-batch's backward is done and gathers its params at its first
    # forward (schedules.py: is_last/first_microbatch_for_model_chunk): the rank's last chunk reduces behind
    # its own backward only, the earlier ones behind the pp micro-batches of each later chunk that follow
    # (microbatch_group_size_per_vp_stage = pp); the params likewise in forward. Non-interleaved: one
    # micro-batch's backward (forward) of the rank's layers. The last grad (first param) bucket never hides.
    stretch = lay.t_layer / np.maximum(lay.fwd + lay.bwd + lay.rc, 1e-30)
    chunk = st.layers / c.vp * stretch
    chunks_window = 1.0 + (c.vp - 1.0) * c.pp

    def exposed(t, per_layer):
        return np.maximum(np.maximum(bucket_frac * t, t / c.vp - chunk * per_layer), t - chunks_window * chunk * per_layer)

    grad_exp, param_exp = exposed(t_grad, lay.bwd + lay.rc), exposed(t_param, lay.fwd)
    grad_exposed = np.where(c.overlap_grad > 0, grad_exp + OVERLAP_SM_TAX * (t_grad - grad_exp), t_grad)
    param_exposed = np.where(c.overlap_param > 0, param_exp + OVERLAP_SM_TAX * (t_param - param_exp), t_param)
    if sh.grads or sh.params:
        grad_exposed, param_exposed = _fsdp_exposed(c, lay, st.layers * stretch, (t_grad, t_param),
                                                    (grad_exposed, param_exposed))
    syncs = (c.pp > 1) & (st.first | st.last) & (not shape.untie_embeddings_and_output_weights)
    emb_sync = np.where(syncs, _ring_s(st.padded_vocab * float(shape.hidden_size) / c.tp * g_bytes, 2.0,
                                       *c.link(c.tp * c.cp * c.dp, 2.0), 2.0), 0.0)
    dp_exposed = grad_exposed + param_exposed + emb_sync
    shard = np.where(opt_shard, P_dense / dpc + P_exp / c.edp, P_total)
    t_opt = (shard * ADAM_BYTES_PER_PARAM + P_total * g_bytes) / c.bw_st + 20 * KERNEL_LAUNCH_S  # + zeroing the grad buffer
    slot = np.argmax(dp_exposed + t_opt, axis=0)[None, :]
    return np.take_along_axis(dp_exposed, slot, axis=0)[0], np.take_along_axis(t_opt, slot, axis=0)[0]


def _fsdp_exposed(c: _Ctx, lay: _LayerAverage, layers, times: tuple, step_end: tuple) -> tuple:
    """(grad, param) exposed seconds per step when DP shards gradients and/or weights (physics.memory.dp_sharding).

    Sharded gradients: each FSDP unit's gradient is reduce-scattered into its shard as its backward ends,
    every micro-batch (no unsharded buffer to accumulate in). Sharded weights: each unit is all-gathered
    before its forward and again before its backward (resharded after forward), every micro-batch, with the
    next unit prefetched behind the current one's compute, so per micro-batch and direction one unit's
    share never hides and the rest hides behind the rank's layers (`layers`: wall-clock layer units).
    The end-of-step collectives of what stays unsharded keep their `step_end` exposure."""
    sh = c.impl.dp_sharding
    t_grad, t_param = times
    units = np.maximum(c.stages.layers, 1.0)

    def per_microbatch(t, compute, on):
        hidden = np.maximum(t / units, t - compute)
        return c.m * np.where((on > 0) | sh.prefetch, hidden + OVERLAP_SM_TAX * (t - hidden), t)

    grad_exposed = per_microbatch(t_grad, layers * (lay.bwd + lay.rc), c.overlap_grad) if sh.grads else step_end[0]
    if not sh.params:
        return grad_exposed, step_end[1]
    # t_param is one all-gather of the rank's parameters (it is 0 where the optimizer is unsharded; FSDP shards it)
    param_exposed = (per_microbatch(t_param, layers * lay.fwd, c.overlap_param)
                     + per_microbatch(t_param, layers * (lay.bwd + lay.rc), c.overlap_param))
    return grad_exposed, param_exposed


# ---- host syncs and per-step host work ---------------------------------------------------------


def host_syncs_per_step(c: _Ctx, pipe: _Pipeline):
    """Host syncs per step on the slowest stage: with --check-for-nan-in-loss-and-grad, two loss checks
    per micro-batch (pretrain_gpt's loss_func: validate_result for NaN and Inf, each reading the loss
    back) and two per gradient bucket once per step (DDP start_grad_sync -> check_grads; buckets of
    max(40M, 1M x DP) parameters with overlap_grad_reduce, else one per buffer); and the token dispatcher's
    per MoE layer and micro-batch (tokens-per-expert read back: physics.moe.host_syncs_per_layer)."""
    st = c.stages
    nan = 2.0 if c.impl.nan_checks else 0.0
    bucket = np.maximum(_BUCKET_MIN_PARAMS, _BUCKET_PARAMS_PER_DP * c.dp * c.cp)
    slot = np.where(pipe.with_output, 3, 0)[None, :]

    def at(x):
        return np.take_along_axis(x, slot, axis=0)[0]

    dense, expert = at(st.dense_params), at(st.expert_params)
    buckets = np.where(c.overlap_grad > 0, np.ceil(dense / bucket) + np.ceil(expert / bucket),
                       1.0 + (expert > 0))
    moe_syncs = pipe.layers * float(c.shape.num_moe_layers) / float(c.shape.num_layers) * host_syncs_per_layer(c.impl)
    loss = np.where(pipe.with_output, nan, 0.0)
    return c.m * (loss + moe_syncs) + nan * buckets


def _host_waits(c: _Ctx, pipe: _Pipeline):
    """GPU idle on the host per step beyond the layers' own launch gaps: after every sync
    (HOST_SYNC_KERNELS); 0 on a host fast enough that no host floor is given."""
    return c.host_f * HOST_SYNC_KERNELS * host_syncs_per_step(c, pipe)


def _dataloader_mask(c: _Ctx):
    """The data loader's attention masks on the step (DATALOADER_MASK_S_PER_GIB): every micro-batch's
    b x s x s bytes on each loading rank (TP rank 0; every CP rank loads the whole sequence), summed over
    the loading ranks one layer's exchanges tie together: the CP group, and the EP group's distinct
    data-parallel ranks (EP x ETP / TP of them). DP and PP ranks take their stalls apart."""
    if not c.impl.dataloader_mask:
        return np.zeros_like(c.m)
    loaders = c.cp * np.clip(c.ep * c.etp / c.tp, 1.0, c.dp)
    # a rank no peer waits for every layer (one GPU, DP, PP) absorbs its stalls while its host is ahead
    tied = (loaders > 1) | (c.tp > 1)
    gib = c.m * c.b * c.s * c.s / 2**30
    return np.where(tied, DATALOADER_MASK_S_PER_GIB * gib * loaders, 0.0)


# ---- assemble ----------------------------------------------------------------------------------


def _model(c: _Ctx) -> dict[str, np.ndarray]:
    L = _dense_layer(c)
    moe = _moe_layer(c, L) if c.shape.is_moe else None
    lay = _average_layer(c, L, moe)
    e = _embedding_and_output(c, L, moe)
    pipe = _pipeline(c, lay.t_layer, e)
    dp_exposed, t_opt = _data_parallel(c, lay)
    m = c.m
    host_waits = _host_waits(c, pipe)
    loader = _dataloader_mask(c)
    iter_s = (m * pipe.t_max + pipe.bubble + pipe.p2p + dp_exposed + t_opt + ITERATION_OVERHEAD_S + host_waits
              + loader)
    # Attribute the slowest stage's per-micro-batch work to the breakdown terms: its layers, and the
    # output layer, loss and MTP layers (last stage) or the embedding (first stage) where it holds them.
    k = m * pipe.layers
    out, emb = pipe.with_output, pipe.with_embedding
    stage_extra = np.where(out, e.t_out + e.t_mtp, 0.0) + np.where(emb, e.t_emb, 0.0)
    residue = m * (pipe.t_max - (pipe.layers * lay.t_layer + stage_extra))  # 0: the slowest stage is one of them

    def mtp(term):
        return m * np.where(out, e.mtp.get(term, 0.0), 0.0)

    tokens = c.gbs * c.s
    world = c.tp * c.pp * c.dp * c.cp
    return {
        "iteration_time_s": iter_s,
        "tokens_per_s_per_gpu": tokens / (iter_s * world),
        "num_microbatches": m,
        "gemm_s": k * lay.comp["gemm"] + m * np.where(out, e.out_gemm, 0.0) + mtp("gemm"),
        "attention_s": k * lay.comp["attn"] + mtp("attn"),
        "ssm_scan_s": k * lay.comp["ssm"],
        "elementwise_s": k * lay.comp["ew"] + m * (np.where(out, e.out_ew, 0.0) + np.where(emb, e.emb_ew, 0.0)) + residue + mtp("ew"),
        "recompute_s": k * lay.rc + mtp("rc"),
        "tp_comm_exposed_s": k * lay.comp["tp"] + m * (np.where(out, e.out_tp, 0.0) + np.where(emb, e.emb_tp, 0.0)) + mtp("tp"),
        "cp_comm_exposed_s": k * lay.comp["cp"] + mtp("cp"),
        "ep_comm_s": k * lay.comp["ep"] + mtp("ep"),
        "pp_p2p_s": pipe.p2p,
        "pipeline_bubble_s": pipe.bubble,
        "dp_comm_exposed_s": dp_exposed,
        "optimizer_s": t_opt,
        "host_bound_s": k * lay.host_gap + host_waits,
        "dataloader_mask_s": loader,
        "overhead_s": np.zeros_like(iter_s) + ITERATION_OVERHEAD_S,
    }


# ---------------------------------------------------------------------------------------------
# Plan-level API
# ---------------------------------------------------------------------------------------------


def step_time(plan: Plan, shape: ModelShape | None = None) -> PerfEstimate:
    """Predicted iteration time, throughput and MFU/HFU of a plan, with the time breakdown.

    Use it to compare layouts or to explain where a step's time goes; `assumptions` says how
    kernel choices were timed. Layout feasibility is not checked (see validators). Raises
    KeyError for an unknown model or GPU and ValueError for an FP8 plan on a GPU without FP8.
    A one-row view of `step_time_arrays`, the function the layout search runs on thousands of rows.
    """
    shape = shape or resolve_model(plan.model)
    hw = hardware_params(plan.cluster)
    tr, p = plan.training, plan.parallelism
    if tr.precision == "fp8" and hw.peak_fp8_tflops is None:
        raise ValueError(f"training.precision: '{plan.cluster.gpu}' has no FP8 tensor cores; use 'bf16' or a Hopper/Blackwell GPU")
    r = step_time_arrays(LayoutBatch.from_plan(plan, shape), hw)
    it = _f(r["iteration_time_s"])
    dims = parallel_dims(plan)
    world = dims.tp * dims.pp * dims.dp * dims.cp
    mf_c, mf_f = (flops_per_iteration(shape, tr.seq_length, tr.global_batch_size, conv, tensor_model_parallel_size=dims.tp)
                  for conv in ("causal", "full"))
    hf_c, hf_f = (hardware_flops_per_iteration(shape, tr.seq_length, tr.global_batch_size, conv, p) for conv in ("causal", "full"))

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
        host_bound=breakdown.host_bound_s >= HOST_BOUND_FLAG * it,
        moe_layer_parts_s=(moe_parts := (moe_view := _moe_summary(plan, shape, hw))[0]),
        moe_dominant_part=dominant_part(moe_parts)[0] if moe_parts else None,
        moe_expert_gemm_miss_share=moe_view[1],
        assumptions=_assumptions(plan, hw) + _moe_assumptions(moe_parts),
    )


def _moe_summary(plan: Plan, shape: ModelShape, hw: HardwareParams) -> tuple[dict[str, float] | None, float | None]:
    """(the parts of one MoE layer and micro-batch (physics.moe.moe_part_times), its expert GEMMs' heuristic-cache
    miss share), one row; (None, None) without MoE."""
    if not shape.is_moe:
        return None, None
    c = _context(LayoutBatch.from_plan(plan, shape), hw, plan.training.precision == "fp8")
    layer = _moe_layer(c, _dense_layer(c))
    return {k: _f(v) for k, v in layer["moe_parts"].items()}, _f(layer["miss_share"])


def _moe_assumption(im) -> str:
    """How the plan's MoE choices were timed: routing load, permute, token drop, the all-to-all overlap."""
    cf = im.moe_expert_capacity_factor
    drop = ("dropless" if cf is None else f"capacity factor {cf:g}, " + ("padded to capacity: fixed expert rows, no "
            "dispatcher sync" if im.moe_pad_expert_input_to_capacity else "dropped tokens, the sync before the permute"))
    overlap = ("the combined 1F1B schedule hides each all-to-all under the other micro-batch's compute less "
               "OVERLAP_SM_TAX, at its own host launches (physics.moe.ep_overlap_saving)"
               if im.overlap_moe_expert_parallel_comm else "all-to-alls not overlapped with compute")
    return (f"MoE routing: the busiest EP rank's load from physics.moe.routing_imbalance (measured when "
            f"implementation.moe_routing_imbalance is set); {drop}; token permute "
            f"{'fused (TE)' if im.moe_permute_fusion else 'unfused'}; {overlap}")


def _moe_assumptions(parts: dict[str, float] | None) -> list[str]:
    if not parts:
        return []
    name, share = dominant_part(parts)
    listed = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    return [f"MoE layer per micro-batch (ms, forward + backward): {listed}; {name} dominates ({100 * share:.0f}%)"]


def _assumptions(plan: Plan, hw: HardwareParams) -> list[str]:
    im, p = plan.implementation, plan.parallelism
    out = []
    if hw.host_floor_s_per_layer > 0:
        out.append(f"host speed {1e3 * hw.host_floor_s_per_layer:g} ms per reference layer (cluster.host_floor_ms_per_layer, "
                   "else the GPU catalog's VM figure inside one node and a bare-metal DGX/HGX host's over several): "
                   "layers' kernel launches and the waits after host syncs"
                   + (" (loss and gradient NaN checks on)" if im.check_for_nan_in_loss_and_grad else "")
                   + " are timed against it")
    else:
        out.append("host assumed never binding (host floor 0): no launch gaps or sync waits")
    path = _attention_path(im.transformer_impl, im.attention_backend)
    out.append({
        "fused": "core attention timed as the cuDNN fused causal kernel (TE FusedAttention)",
        "flash": "core attention timed as FlashAttention-2 (0.6x the cuDNN kernel's rate)",
        "unfused_te": "core attention timed unfused with a fused softmax kernel (full s x s scores in HBM)",
        "unfused_local": "core attention timed as Megatron's DotProductAttention (the local spec's, whatever attention_backend "
                         "says): full s x s scores in HBM, softmax by the fused kernel (masked_softmax_fusion, up to 4,096 "
                         "tokens) or PyTorch (bf16, fp32 with attention_softmax_in_fp32)",
    }[path])
    if plan.training.precision == "fp8":
        out.append("FP8 GEMMs for every transformer linear layer (TE), output layer and attention in bf16; cast/transpose bytes added")
    if p.tp_comm_overlap and not (p.sequence_parallel and p.tensor_model_parallel_size > 1):
        out.append("tp_comm_overlap ignored: it needs sequence_parallel with TP > 1")
    shape = resolve_model(plan.model)
    if shape.is_moe:
        out.append(_moe_assumption(im))
        out.append(load_spread_assumption(im.moe_expert_load_cv, im.moe_router_force_load_balancing,
                                          bool(shape.moe_shared_expert_intermediate_size)))
    if im.use_torch_fsdp2 or im.use_megatron_fsdp:
        kind = f"Megatron-FSDP {im.data_parallel_sharding_strategy}" if im.use_megatron_fsdp else "torch FSDP2"
        out.append(f"{kind}: sharded gradients reduce-scattered and sharded weights all-gathered (forward and "
                   "backward) every micro-batch, one layer's share exposed per micro-batch and direction")
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
