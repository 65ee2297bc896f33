"""The time of one MoE layer and micro-batch from its parts (issue 15), for physics.step_time.

One function per part of Megatron-Core's MoELayer (megatron/core/transformer/moe/moe_layer.py): the router
(gating GEMM, top-k, the aux-loss scores, the expert bias), the token permute/unpermute (moe_utils.permute,
fused or not), the routed experts (TEGroupedMLP's grouped GEMM at the real per-expert shape, or
SequentialMLP's loop), the shared experts, the dispatcher's communication (alltoall, allgather, flex/DeepEP;
NVLink inside a node, the NICs across nodes), the load on the busiest EP rank (routing_imbalance), and what the host pays to
launch each part (counted from Megatron-LM's traces; CUDA graphs remove the captured parts' launches) with
the host syncs each dispatcher makes and the GPU's wait for the launches after them. `moe_layer` assembles
them into the part dict step_time's layer model reads, and `moe_part_times` / `dominant_part` say where the
layer's time goes.

step_time imports this module, so this one takes step_time's primitives as a `MoeKit` instead of importing
them (no import cycle).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mcore_advisor.physics.anatomy import linear_weights

GROUPED_GEMM_RELATIVE_RATE = 0.92
"""Grouped expert GEMMs run at this fraction of the rate the GEMM model gives their per-expert shapes
(wave quantization over the output tiles of all local experts; the operands' bytes at HBM speed,
step_time.GEMM_OPERAND_BW_FRACTION, which is what makes an expert with few tokens slow: it reads its whole
weight for them). Fitted with the roofline constants on TE's GroupedLinear (a cuBLAS GEMM per expert, what
Megatron's TEGroupedMLP runs) on one H100: benchmarks/results/gpu_h100_F_kernel_moe.jsonl, 155 cases (eight
expert shapes of catalog models x 1-32 local experts x 64-4,096 tokens each), GPU time from CUDA-graph
replay; 101 fitted cases median |error| 4.2%, 54 held-out 4.1% (was 47% / 42% without the operand bytes:
benchmarks/results/moe_kernel_accuracy.txt). The earlier H200 torch._grouped_mm figure was 0.93."""

ROUTER_BYTES_PER_SCORE = 16.0
"""Router elementwise work per token and expert (fp32 scores): logits cast, softmax/sigmoid, top-k,
the probs scatter and the routing map, forward (backward twice): 4 passes of 4 B. Derived
(moe_utils.topk_routing_with_score_function, unfused)."""

AUX_LOSS_BYTES_PER_SCORE = 12.0
"""--moe-aux-loss-coeff > 0 (aux_loss / seq_aux_loss / global_aux_loss): the router recomputes the scores
for the loss (compute_routing_scores_for_aux_loss: softmax over all experts, read 4 + write 4 B) and sums
them over tokens (read 4 B). Derived."""

# ---- host launches -------------------------------------------------------------------------------
# Counted in step_time's host units (a dense layer launches `kernels_f` forward and `kernels_b` backward
# of them; the reference layer's host time prices them). Source for every count below: rank-0
# torch.profiler traces of Megatron-LM 0.19.2 + TE 2.20.2 on 4 x H100 (session s4, one step each; the
# runs' plans in benchmarks/results/gpu_h100x4_runs.jsonl), per MoE layer and micro-batch (median over
# the step's layers and micro-batches): the host time of each part's ops and the Python between them,
# in units of the same trace's median TE Linear call (forward) / Linear backward node, converted to
# host units with the dense traces (one dense layer = 21.2 Linear calls forward = 16 units and 13.7
# Linear backward nodes = 38 units: i14_7_d13_te_s2k_mbs4 on one H100, dp4_distopt_overlap on 4).
# Counts are chosen on the rows outside the held-out third (crc32(name) % 3 != 0): moe64top8_ep4_alltoall
# and moe64top8_ep4_allgather (16 local experts); moe8top2_ep4_alltoall and moe8top2_ep2_alltoall_fp8delayed
# (2 and 4 local experts, held out) check them.

DENSE_MLP_HOST_SHARE = (0.27, 0.41)
"""Share of a dense layer's host time (forward, backward) in its MLP: fc1 with its fused norm, the
activation, fc2 and their weight-gradient nodes. Dense traces: 0.28 / 0.39 (d13, one H100), 0.26 / 0.43
(dp4, 4 x H100). An MoE layer keeps the rest of the dense layer (attention, residual adds) plus a separate
pre-MLP norm (NORM_OP_HOST_KERNELS); a shared expert makes the same three module calls as the dense
MLP (traces: 4.0 / 11.9 units against 4.3 / 15.6 at this share)."""

NORM_OP_HOST_KERNELS = (1.7, 3.3)
"""A norm issued as a module of its own (TE's fused norm op): the MoE layer's pre-MLP norm (a dense layer
fuses it into fc1's LayerNormLinear) and each of --qk-layernorm's query and key norms (Qwen3; Megatron-Core's
TE spec makes q_layernorm and k_layernorm TENorm modules): forward call and backward node with its
weight-gradient accumulation (traces of the pre-MLP norm: 1.8 / 3.2 and 1.6 / 3.5; s13's H2 trace of a
Qwen3-like rank on one H100, 200 such calls a step with the query and key norms: 1.4 / 5.6 each)."""

ROUTER_HOST_KERNELS = (3.3, 8.0)
AUX_LOSS_HOST_KERNELS = (4.0, 8.0)
EXPERT_BIAS_HOST_KERNELS = (2.0, 0.0)
"""The router (TopKRouter: the gating GEMM's autograd function, then topk, softmax, casts, the two
scatters of the probs and the routing map, moe_utils.topk_routing_with_score_function; backward their
nodes + the gate's weight gradient): traces 3.5 / 7.5 and 3.1 / 8.4 units (each small torch op costs
about a quarter of a TE module call). With an aux loss (not in the traces: counted from router.py /
moe_utils.py) compute_routing_scores_for_aux_loss, get_tokens_per_expert_and_token_count,
switch_load_balancing_loss_func and MoEAuxLossAutoScaler; with --moe-router-enable-expert-bias the bias
add and the tokens-per-expert accumulation. benchmarks/results/gpu_h200x2_kernel_moe.jsonl ('moe_router',
H200 host): forward + backward 0.7-0.9 ms without the aux loss, 1.2-1.4 ms with it, at any size."""

PERMUTE_HOST_KERNELS = {False: (5.0, 6.0), True: (2.0, 4.0)}
"""Token permute + unpermute (moe_utils.permute: argsort, remainder, index_select; unpermute: zeros +
scatter_add; the allgather path's masked_select of the local probs): allgather trace 4.8 / 5.5 units.
Fused (--moe-permute-fusion, TE's kernels; not traced): one call per direction."""

DISPATCHER_HOST_KERNELS = {"alltoall": ((5.1, 12.9), (8.9, 9.1)), "allgather": ((3.4, 2.0), (3.3, 7.3)),
                           "flex": ((3.4, 2.0), (3.3, 7.3))}
"""(always, only with EP or ETP peers) host launches of each token dispatcher beyond the permute,
token_dispatcher.py. alltoall (MoEAlltoAllTokenDispatcher), trace 14.0 / 22.0 units in all: always the
tokens-per-expert count and its device-to-host copy on the side stream, sort_chunks_by_idxs over the
(EP x local experts) chunks before and after the experts; with peers the counts' all-gather and the
tokens', probs' and combine's all-to-alls (their autograd functions: 6.3 / 9.1 units in the trace) and
the split bookkeeping (input/output splits, their three more copies to the host: about 60% of the
preprocess' ops, 2.6 forward units). allgather, trace 6.7 / 9.3: always the local map/probs slices and
tokens-per-expert; with peers the routing map, probs and tokens all-gathered over TP x EP and the
combine's reduce-scatter (3.3 / 7.3). Without peers Megatron skips these calls or they return their
input (mappings.all_to_all, MoEAllGatherTokenDispatcher.token_dispatch). flex (DeepEP / HybridEP: one
fused dispatch and one fused combine call, setup_metadata's topk, indices-to-multihot): no trace yet;
taken as the allgather's."""

GROUPED_EXPERTS_HOST_KERNELS = (9.3, 23.5)
PER_EXPERT_HOST_KERNELS = {True: (0.21, 3.89), False: (4.7, 12.4)}
"""Routed experts. TEGroupedMLP (moe_grouped_gemm): two calls of TE's GroupedLinear + the weighted
activation (fixed: traces 10.0 and 14.5 Linear calls forward, 5.4 and 11.5 backward nodes beyond the
per-expert share) and per local expert: TE's general_grouped_gemm issues one cuBLAS GEMM per expert and
per GEMM input (2 launches backward, dgrad + wgrad) plus the two expert weights' gradient-accumulation
nodes (every expert's weight is its own parameter). Per expert and micro-batch (s11, rank-0 trace of
T_qwen30like_e128k8_s4k_mbs4_forced: 128 local experts on one H200, forced routing, so 0.2% of the expert GEMMs
missed the heuristics cache, host-bound, so op durations are host time; benchmarks/results/gpu_h200x2_T_runs.jsonl):
_GroupedLinear 3.1 ms a call (128 GEMMs issued ~23 us apart, two calls) = 56 us forward; _GroupedLinearBackward
7.2 ms a call (256 GEMMs) and the two weights' AccumulateGrad nodes 40 us each (mean) = 198 us backward, which the
row's host probe (5.85 ms per reference layer) prices at 0.22 forward and 4.13 backward units; less the
profiler's own stretch of that step (1.107 s traced against 1.043 s untraced: x 0.94), 0.21 and 3.89. The
held-out GPT-OSS rank of the same lease (64 experts, hidden 2,880) issues its GEMMs 28-30 us apart. The s9
figures (0.14 / 2.94, C_qwen30like_e128k8_s4k) had subtracted that row's heuristic-cache misses at the isolated
query's cost from the same per-call times, which this miss-free trace shows were not in them; the s4 traces'
0.9 / 4.6 came from routing as is, their heuristic queries included. Checked on one H100 against Megatron-Core's own
TEGroupedMLP (benchmarks/gpu/moe_host_probe.py, s13, 2-128 local experts: benchmarks/results/moe_host_accuracy.txt):
0.27 / 2.77 units per expert without DDP, 0.24 / 3.79 inside Megatron's DDP (its per-weight gradient hook). SequentialMLP runs each expert's MLP
module in a Python loop: fc1,
the weighted SwiGLU (a torch.compile'd function: a Dynamo cache lookup per call), fc2, and backward two
Linear nodes, the activation's and two gradient-accumulation nodes per expert: 6.27 Linear calls forward
and 4.46 Linear backward nodes per expert (the period between successive experts' fc1 calls, median, rank-0
trace of F_qwen30like_e128k8_s4k_sequential: 128 local experts on one H100, session s7, benchmarks/results/
gpu_h100_F_runs.jsonl). Calibration: the only SequentialMLP trace; that row went from -47% to the figure in
throughput_accuracy.txt section 5."""

FP8_PER_EXPERT_HOST_KERNELS = (0.28, 1.7)
FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS = (0.62, 0.27)
"""Per local expert and micro-batch, what FP8 adds to TEGroupedMLP's host launches beyond bf16's: with any recipe
each expert's GEMM inputs are cast by their own quantizer into a tensor object of their own, forward and, for the
gradients, backward (FP8_PER_EXPERT_HOST_KERNELS); current scaling (--fp8-recipe tensorwise) first takes each
input's amax and scale on its own, about four more kernel launches and four allocations per expert and GEMM input
(FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS, on top). Every recipe: Megatron-Core's own TEGroupedMLP on one H100 VM
(benchmarks/gpu/moe_host_probe.py, session s13: 2-128 local experts, two leases, with and without Megatron's DDP;
benchmarks/results/gpu_h100_H_moe_host_probe.jsonl), the slope over the local experts less bf16's in the units the
same run's host probe prices, cases outside the held-out third: delayed 0.22 / 2.09 (plain) and 0.34 / 1.38 (DDP),
the means taken; the delayed row of Megatron-LM's own loop agrees (0.20 / 2.04, below). Current scaling: the rank-0
trace of H_q30rank_ep1_forced_fp8cs (32 local experts, one H100, Megatron-LM's loop, s13 second H call, outside
the held-out third; benchmarks/gpu/grouped_linear_trace.py -> benchmarks/results/gpu_h100_H2_grouped_linear_trace.json:
_GroupedLinear 5.98 ms a call against bf16's 1.66 and delayed's 2.91, its backward 5.12 against 2.84 and 5.22) puts
the current-scaling total at 0.90 / 1.97 units per expert, whose forward the module probe's tight loop reads at
0.44-0.62: the loop's figure is taken. bf16's own module slope, 0.27 / 2.77 and 0.24 / 3.79, is
PER_EXPERT_HOST_KERNELS[True]'s (benchmarks/results/moe_host_accuracy.txt compares every probe case)."""

FP8_EXPERT_PADDING_HOST_KERNELS = (1.3, 6.6)
"""Per MoE layer and micro-batch, dropless FP8 with grouped experts: TEGroupedMLP pads every expert's rows to the
FP8 GEMM's alignment and back (experts.py: two Fp8Padding calls on the tokens and probs, one Fp8Unpadding, each with
its backward; skipped where the dispatcher pads to capacity). From the rank-0 trace of E_q30rank_ep2_forced_fp8cs
(s12/17, host probe 4.85 ms): 0.27 ms forward, 0.26 ms backward a layer."""

MOE_HOST_SYNCS = {"alltoall": 1.0, "allgather": 2.0, "flex": 1.0}
"""Host syncs per MoE layer and micro-batch (forward; the backward has none: no cudaStreamSynchronize,
cudaEventSynchronize or blocking copy on the autograd thread of any trace). alltoall: the token counts
copied to the host on the side stream and `d2h_event.synchronize()` before the first all-to-all
(_maybe_dtoh_and_synchronize; traces: 47 cudaEventSynchronize per step = 12 layers x 4 micro-batches less
one outside the window). allgather: `local_map.sum(dim=0).long().cpu()` for tokens_per_expert and the
`masked_select` of the local probs, whose output size is read back (dispatch_postprocess; trace: 100
cudaStreamSynchronize per step, 96 of them in the MoE layers). flex: DeepEP's dispatch waits on the host
for the received token counts (fused_a2a.fused_dispatch returns them as a host list). A layer captured
whole in a CUDA graph (cuda_graph_modules 'moe', which needs drop-and-pad) syncs nowhere."""

POST_SYNC_HOST_SHARE = 0.5
"""Share of the dispatcher's always-made work and the permute the host issues after the sync; all of the
collectives and the experts come after it. Call order in token_dispatcher.py (alltoall): the counts and
their copies and permute 1 come before the sync, both sort_chunks_by_idxs and the unpermute after it:
(3.3 of the dispatcher's 5.1 forward units + about 0.3 of the permute's 5, by op count) / 10.1 = 0.48."""

COMBINED_1F1B_HOST_KERNELS = 25.0
"""Host launches the combined 1F1B schedule (--overlap-moe-expert-parallel-comm) adds per MoE layer and micro-batch
(forward units): each layer's forward and backward split into schedule-plan nodes (pre-dispatch, dispatch, mlp,
combine) run from Python on two streams, every node's tensors detached and re-attached, its backward an
autograd call of its own, events recorded and waited between the streams. Chosen on the two E rows outside the
held-out third (2 x H200, s12: E_q30rank_ep2_overlap_fp8cs and _overlap_bf16_mbs2, -21.9% / -20.5% without it,
-4% / +3% at 25); the held-out E_q30rank_ep2_overlap_bf16 (two leases' calls) checks it. Its rank-0 trace puts
the GPU's host-late idle 290 ms a step (4.5 ms a layer, ~17 units) above its dropless twin's, whose all-to-alls
the overlap hides: on this VM host the schedule is no faster than the plain one (1.84-1.98 s against 1.80-1.89 s)."""

GRAPHED_LAUNCHES = 1.0
"""A captured part replays as one graph launch (torch.cuda.CUDAGraph.replay)."""

UNTRAINED_EXPERT_LOAD_CV = 0.21
"""Spread of the tokens each expert receives (std / mean over the experts of one MoE layer call) with an
untrained router on Megatron's mock data: its random gating weights favour some experts for every token
alike. Measured by the profile job's routing record (launcher/entry/moe_routing.py, result
moe_routing.expert_load_cv_mean) on 2 x H100, Megatron-LM 0.19.2 + TE 2.20.2, hidden 2048, EP2, 16,384
tokens per rank and micro-batch (benchmarks/results/gpu_h100x2_R_runs.jsonl): 0.184 with 8 experts top-2,
0.234 with 64 experts top-8 (the two rows outside the held-out third; the held-out twins read 0.186 and
0.234); with --moe-router-force-load-balancing 0.009 / 0.015, the sampling noise alone."""

UNTRAINED_LOAD_CV_RANGE = {True: (0.12, 0.85), False: (0.84, 2.82)}
"""Expert-load spreads the profile job's routing record measured on as-routed runs (untrained routers, Megatron's mock
data), by whether the model has a shared expert: with one 0.12-0.45 (0.81-0.85 at hidden 1,024 and 64 experts), without
one 0.84 (Mixtral's layers) to 2.82 (a 128-expert rank). UNTRAINED_EXPERT_LOAD_CV under-states it there: the O set's
as-routed one-GPU steps ran 14-30% over the prediction made with it and within 15% with the measured spread
(benchmarks/results/gpu_h100_O_summary.md). No mechanism predicts the spread yet: Megatron's own model at initialisation
(benchmarks/untrained_router_spread.py) shows it growing layer by layer on OLMoE's layers but not on Mixtral's, whose
measured spread comes after the job's first optimizer steps. Stated with a prediction, never used in one."""


LOAD_SPREAD_FIX = ("set implementation.moe_expert_load_cv from a profile job's routing record (get_job fills it in), or "
                   "force the balance (moe_router_force_load_balancing) for a benchmark")


def untrained_spread_statement(has_shared: bool) -> str:
    """What an as-routed prediction assumes of the router's spread, and how far measured runs were from it."""
    lo, hi = UNTRAINED_LOAD_CV_RANGE[has_shared]
    return (f"an untrained router's expert-load spread {UNTRAINED_EXPERT_LOAD_CV:g} (std / mean of tokens per expert) "
            f"assumed; as-routed runs {'with' if has_shared else 'without'} a shared expert measured {lo:g}-{hi:g}"
            + ("" if has_shared else ", and one-GPU steps ran 14-30% over this assumption's prediction"))


def load_spread_assumption(cv: float | None, forced: bool, has_shared: bool) -> str:
    """How a prediction spreads the tokens over the experts (expert_load_cv's inputs), and how sure that is."""
    if cv is not None:
        return f"expert-load spread {cv:g} (implementation.moe_expert_load_cv: measured, a profile job's routing record)"
    if forced:
        return "expert loads balanced (--moe-router-force-load-balancing): sampling noise only"
    return f"{untrained_spread_statement(has_shared)}: {LOAD_SPREAD_FIX}"


CUBLASLT_HEURISTICS_CACHE_KEYS = 8192
"""cuBLASLt's heuristics cache: the algorithm chosen for each GEMM problem (its shape among the key) is kept for
this many problems (NVIDIA cuBLAS documentation, heuristics cache: default capacity 8192, environment variable
CUBLASLT_HEURISTICS_CACHE_CAPACITY; 0 turns it off). Transformer Engine's GEMMs (the grouped experts' one per
expert, Linear's) and torch's go through it."""

CUBLASLT_CACHE_FIX = 65536
"""The cache size offered for uneven expert row counts (plan_changes, evaluate_plan's warning): 8x the default,
what took 64 experts top-8 on 4 x H200 from 0.735 to 0.656 s per step (benchmarks/results/gpu_h200x4_C_runs.jsonl)."""

EXPERT_GEMM_SHAPES = 6
"""cuBLASLt problems per expert row count: fc1 and fc2 forward, each one's dgrad and wgrad (the row count is M
of four and K of the two wgrads; the other dimensions are the layer's, alike for every expert and layer)."""

QUERIED_EXPERT_GEMMS = (2.0, 2.0)
"""Of an expert's GEMMs, those (forward, backward) whose new row count costs a heuristic query: fc1 and fc2 forward
and their dgrads, where the row count is M. The two wgrads meet it as the reduction dimension K and cost about what
a problem met before costs: on one H100, a new row count read 0.12-0.21 ms (forward, dgrad) against 0.024-0.039
ms (wgrad, 0.016-0.029 met before), cuBLASLt and cuBLAS alike, alone and four processes at once, at four expert
shapes (benchmarks/gpu/gemm_shape_probe.py, session s10, 4 x H100: benchmarks/results/gpu_h100x4_gemm_shape_probe_s10.jsonl).
The wgrads' problems still take cache keys (EXPERT_GEMM_SHAPES). Inside Megatron-LM's loop (128 experts routed as is on
one GPU, every expert GEMM a miss with the cache off): the cache off added 1.66 and 1.85 s a step to the 8x cache's
1.80 s on one H100 (s15, benchmarks/results/gpu_h100_Y_runs.jsonl, Y_qwen30like_cache0 against _cachebig), which
this count predicts at 1.79 s on that machine's host probes (4.77 ms) where 2 + 4 predicted 2.69 s; 1.27 s on one H200
(s9, C_qwen30like_e128k8_s4k_cache0 against the default cache: 1.65 s here, 2.48 s at 2 + 4). Both cache-off rows
are in the held-out third of throughput_accuracy.txt: they decided between 2 + 2 and 2 + 4 here, so their errors there
no longer check this count; Megatron-Core's own TEGroupedMLP, outside every table, does (module probe, s15: the
backward pays 1.04-1.66x the forward's for new counts; benchmarks/results/gpu_h100_Y_summary.md)."""

HEURISTIC_QUERY_REF_LAYERS = 0.0245
"""Host time of one GEMM whose problem misses the heuristics cache (cublasLtMatmulAlgoGetHeuristic, then the
launch), in reference layers (the host floor's unit): 0.135 ms, the median over 300 row counts met for the
first time of a bf16 GEMM on one H100 VM (medians 0.12-0.15 ms, cuBLASLt and cuBLAS alike; 0.015 ms once
met: benchmarks/gpu/gemm_shape_probe.py -> benchmarks/results/gpu_h100_gemm_shape_probe.json), over that VM's
host_floor_ms_per_layer 5.5. The median, not the mean (0.27-0.30 ms): the few queries that take milliseconds
are a new kernel's first load (once per kernel, early in a run). In a run (s9, 4 x H200, host probe 4.8 ms):
the cache turned off added 1.27 s per step to ~15,000 expert GEMMs of a one-GPU 128-expert model
(C_qwen30like_e128k8_s4k and _cache0; 85 us each, against 0.118 ms from this constant at that probe)."""

HEURISTIC_QUERY_TORCH_REF_LAYERS = 0.0565
"""The same miss where torch issues the expert GEMM (the local spec: SequentialMLP of Megatron's own linear layers,
aten::mm through cuBLAS) rather than Transformer Engine: 0.31 ms, the median time from an expert aten::mm's start
to its kernel launch over the forward's expert GEMMs of a traced step (rank 0, N_moe64top8_ep4_alltoall, 4 x H100,
Megatron-LM 0.19.2 without TE, session s10: 0.28-0.37 ms each, the attention's fixed-shape mm 0.05-0.09 ms in
the same step; benchmarks/results/gpu_h100x4_N_runs.jsonl), over the catalog's host_floor_ms_per_layer 5.5 the
row was predicted with (no TE host probe there). The held-out N_moe8top2_ep2_alltoall trace reads 0.29 ms. The same
lease's isolated probe (benchmarks/gpu/gemm_shape_probe.py, benchmarks/results/gpu_h100x4_gemm_shape_probe_s10.jsonl)
reads 0.12-0.20 ms for a new row count of the forward and dgrad GEMMs, alone or four processes at once, and 0.025 ms
for the wgrad (the row count as the reduction dimension): a training step pays about twice the isolated query, so
the in-run figure is the one used, for the GEMMs QUERIED_EXPERT_GEMMS counts."""


#: bins of the row-count law in the cache model: each bin's counts are taken as equally likely (the law is smooth
#: over a few hundredths of its width), which keeps a layout search's many calls cheap
ROW_COUNT_BINS = 2000


def _row_count_bins(mean: float, cv: float) -> tuple[np.ndarray, float]:
    """(probability of one row count in each bin, counts per bin) of an expert GEMM's row count m >= 1: a gamma
    law of the expert's mean load `mean` and spread cv across experts, layers and micro-batches plus the
    routing's Poisson noise (cv^2 + 1/mean); experts with no token run no GEMM."""
    k = 1.0 / (cv * cv + 1.0 / mean)
    theta = mean / k
    top = mean + 12.0 * mean / math.sqrt(k) + 50.0
    width = max(1.0, top / ROW_COUNT_BINS)
    m = np.arange(1.0, top, width) + 0.5 * (width - 1.0)
    p = np.exp((k - 1.0) * np.log(m) - m / theta - math.lgamma(k) - k * math.log(theta))
    return p / (p.sum() * width), width


@functools.lru_cache(maxsize=4096)
def _lru_miss_share(mean: int, cv_milli: int, capacity: int) -> float:
    """Share of row counts drawn from _row_count_bins that miss an LRU cache of `capacity` row counts, in steady
    state (Che's approximation: a count of probability p is cached while it recurs within the cache's
    characteristic time T, sum over counts of 1 - exp(-p T) = capacity). 0 where the counts fit."""
    if capacity <= 0:
        return 1.0
    p, width = _row_count_bins(float(max(mean, 1)), cv_milli / 1000.0)
    return che_miss_share(p, width, capacity)


def che_miss_share(p: np.ndarray, width: float, capacity: int) -> float:
    """Steady-state miss share of an LRU cache of `capacity` items under independent draws, each of the `width`
    items of bin i drawn with probability p[i] (Che's approximation); 0 where the items fit."""
    if width * np.count_nonzero(p > 1e-9) <= capacity:
        return 0.0
    lo, hi = 1.0, 1e15
    for _ in range(60):
        t = math.sqrt(lo * hi)
        lo, hi = (lo, t) if width * np.sum(-np.expm1(-p * t)) > capacity else (t, hi)
    return float(width * np.sum(p * np.exp(-p * lo)))


def _quantized(mean: np.ndarray) -> np.ndarray:
    """The mean loads on a 2% log grid above 64 rows (the miss share is smooth in them): a search's thousands of
    layouts share a few cache entries."""
    grid = np.rint(np.exp(np.rint(np.log(np.maximum(mean, 1.0)) / 0.02) * 0.02))
    return np.where(mean <= 64, np.rint(mean), grid).astype(np.int64)


def cache_row_counts(capacity_keys: int | None) -> int:
    """Row counts cuBLASLt's heuristics cache holds: its problems (None: the default) over EXPERT_GEMM_SHAPES."""
    return int((CUBLASLT_HEURISTICS_CACHE_KEYS if capacity_keys is None else capacity_keys) // EXPERT_GEMM_SHAPES)


def heuristic_miss_share(mean_rows, cv: float, capacity_keys: int | None = None) -> np.ndarray:
    """Share of expert GEMMs whose problem is not in cuBLASLt's heuristics cache, per layout (`mean_rows`: the
    rows each local expert runs per call, array). An EP rank's process meets one row count per expert and call;
    while the counts it meets recur within the cache's reach they hit; fine-grained experts routed unevenly
    meet thousands, each EXPERT_GEMM_SHAPES problems, and thrash it (profile job, session s9, 4 x H200:
    64 experts top-8 as routed 0.733 s per step with the cache off, 0.735 with the default, 0.656 with
    CUBLASLT_HEURISTICS_CACHE_CAPACITY=65536, 0.646 routed evenly: benchmarks/results/gpu_h200x4_C_runs.jsonl).
    Steady state: the counts met for the first time in a run's early iterations, misses too, vanish over a long
    run; a profile job records its own iterations' share (launcher/entry/moe_routing.py heuristic_misses)."""
    cap = cache_row_counts(capacity_keys)
    flat = np.atleast_1d(np.asarray(mean_rows, dtype=np.float64))
    keys, where = np.unique(_quantized(flat), return_inverse=True)
    shares = np.array([_lru_miss_share(int(k), int(round(1000 * cv)), cap) for k in keys])
    return shares[where].reshape(np.shape(mean_rows))


def _expected_max_normal(n) -> np.ndarray:
    """E[max of n independent standard normals] (Blom's approximation, within 1% for n <= 4,096); 0 for n = 1."""
    from statistics import NormalDist

    n = np.asarray(n, dtype=np.float64)
    inv = np.vectorize(lambda q: NormalDist().inv_cdf(q))
    return np.where(n > 1, inv((np.maximum(n, 2.0) - 0.375) / (np.maximum(n, 2.0) + 0.25)), 0.0)


def expert_load_cv(force_balanced: bool, measured: float | None) -> float:
    """The router's expert-load spread beyond sampling noise: measured (a job's routing record) wins; 0 with
    --moe-router-force-load-balancing; else an untrained router's (UNTRAINED_EXPERT_LOAD_CV)."""
    if measured is not None:
        return float(measured)
    return 0.0 if force_balanced else UNTRAINED_EXPERT_LOAD_CV


def busiest_rank_load(shape, ep, cv: float, slots=None) -> np.ndarray:
    """Tokens the busiest EP rank receives over the mean, per MoE layer call. Each rank sums E/EP experts'
    loads: spread `cv` over sqrt(E/EP) experts (with the finite-population correction: the EP ranks share
    a fixed total) plus, given `slots` (token choices routed over the EP group per call), their sampling
    noise; the busiest of EP ranks lies E[max of EP normals] spreads above the mean, never above EP."""
    ep = np.asarray(ep, dtype=np.float64)
    E = float(shape.num_experts)
    per_rank = E / np.maximum(ep, 1.0)
    spread2 = (cv / np.sqrt(per_rank)) ** 2 * np.maximum(E - per_rank, 0.0) / max(E - 1.0, 1.0)
    if slots is not None:
        spread2 = spread2 + np.maximum(1.0 - 1.0 / ep, 0.0) * ep / np.maximum(slots, 1.0)
    return np.where(ep > 1, np.minimum(ep, 1.0 + _expected_max_normal(ep) * np.sqrt(spread2)), 1.0)


def busiest_rank_misses(local, share, ep) -> np.ndarray:
    """Expert row counts per MoE layer call that miss the heuristics cache on the EP rank that misses most: each
    of a rank's `local` experts misses with probability `share` on its own, and every rank waits for the slowest
    at the layer's next all-to-all, so the layer pays the most-missing rank's queries (the expected largest of EP
    binomial counts, as a normal's; the mean alone on one rank), never more than all EP ranks' misses together
    (which bounds the normal's tail where misses are rare)."""
    local, share = np.asarray(local, dtype=np.float64), np.asarray(share, dtype=np.float64)
    ep = np.asarray(ep, dtype=np.float64)
    mean = local * share
    spread = np.sqrt(np.maximum(local * share * (1.0 - share), 0.0))
    return np.minimum(local, np.minimum(mean + _expected_max_normal(ep) * spread, np.maximum(ep, 1.0) * mean))


def routing_imbalance(c) -> np.ndarray:
    """The busiest EP rank's load over the mean for the time model: every all-to-all waits for that rank,
    so its experts set the layer's time. A measured figure (implementation.moe_routing_imbalance) wins;
    else busiest_rank_load with the T_sp*k*EP token choices of one call."""
    ep = np.asarray(c.ep, dtype=np.float64)
    if c.impl.moe_imbalance is not None:
        return np.where(ep > 1, float(c.impl.moe_imbalance), 1.0)
    cv = expert_load_cv(c.impl.moe_force_balanced, c.impl.moe_expert_cv)
    return busiest_rank_load(c.shape, ep, cv, slots=c.T_sp * float(c.shape.moe_router_topk) * ep)


@dataclass(frozen=True)
class MoeKit:
    """step_time's primitives and constants the MoE parts use."""

    ring_s: Callable[..., Any]  # ring collective seconds (bytes, n, bw, hop latency, steps)
    ramp: Callable[[Any], Any]  # NCCL size ramp
    wgrad_s: Callable[..., Any]  # weight-gradient accumulation seconds
    local_weights: Callable[..., Any]
    linears: Callable[..., Any]  # GEMM seconds of an anatomy block's linear layers (tokens, TP or ETP, groups, rate)
    kernel_s: float  # KERNEL_LAUNCH_S
    latency_s: float  # COLLECTIVE_LATENCY_S
    nvlink_hop_s: float
    network_hop_s: float
    ref_units: tuple[float, float]  # host units (forward, backward) that cost one reference layer's host time
    overlap_tax: float  # OVERLAP_SM_TAX: compute slowdown per second of communication hidden behind it


def _aux_loss_on(shape) -> bool:
    kind = shape.moe_router_load_balancing_type or "aux_loss"
    return bool(shape.moe_aux_loss_coeff) and kind in ("aux_loss", "seq_aux_loss", "global_aux_loss")


def router(c, kit: MoeKit) -> dict:
    """Router (TopKRouter): gating GEMM [T_sp, h] x [h, E] + score function and top-k; with an aux loss
    the scores for the switch loss; with the expert bias its update. Seconds and host launches."""
    shape = c.shape
    E, h = float(shape.num_experts), float(shape.hidden_size)
    gemm = c.linear(c.T_sp, E, h)
    per_score = ROUTER_BYTES_PER_SCORE + (AUX_LOSS_BYTES_PER_SCORE if _aux_loss_on(shape) else 0.0)
    kf, kb = ROUTER_HOST_KERNELS
    if _aux_loss_on(shape):
        kf, kb = kf + AUX_LOSS_HOST_KERNELS[0], kb + AUX_LOSS_HOST_KERNELS[1]
    if shape.moe_router_enable_expert_bias:
        kf, kb = kf + EXPERT_BIAS_HOST_KERNELS[0], kb + EXPERT_BIAS_HOST_KERNELS[1]
    ew = c.T_sp * E * per_score / c.bw_ew
    return {"gemm_f": gemm[0], "gemm_b": gemm[1] + gemm[2], "ew_f": ew, "ew_b": 2.0 * ew, "kernels": (kf, kb)}


INDEX_ADD_BYTES_PER_S = 225e9
"""bf16 rows per second (bytes of the source rows) that the permute's backward, index_select's gradient
(torch index_add_ with atomics: indexFuncLargeIndex), adds back into the token order on H100. Rank-0
traces of iteration 3, 2 x H100 (gpu_h100x2_R, forced-balance rows): 64 experts top-8, 131,072 rows of
2,048 per layer and micro-batch, 2.34 ms per call = 229 GB/s (not held out); 8 experts top-2, 32,768 rows,
0.61 ms = 220 GB/s (held out: a check). Plain copies run at the elementwise rate (14x faster)."""


FUSED_PERMUTE_PASSES = (1.0, 1.0)
"""TE's fused permute and unpermute (--moe-permute-fusion) move each token's k routed copies once and the
token itself once per kernel, forward and backward alike (the backward of one is the other), plus one read
of the routed rows for the probabilities' gradient. From the bytes, not fitted; checked on H100 by
benchmarks/kernel_probe.py moe (gpu_h100_F_kernel_moe.jsonl, kind moe_permute, fused): at 16,384 tokens of
hidden 4,096-7,168 the forward + backward round trip is predicted +5% to +11% (the unfused byte count the
fused kernels had before was 2.3x over); smaller cases (0.3-1.1 GB of rows) take a fixed 1-2 ms of the
probe's wall time, the host's launches (PERMUTE_HOST_KERNELS) and the routing map's index kernels."""


def permute(c, kit: MoeKit) -> dict:
    """Token permute before the experts and unpermute after them (moe_utils.permute / unpermute): each
    reads and writes T_sp * k rows of h bf16 values forward; backward the unpermute's gradient gathers
    (read + write) and the permute's adds back with index_add_ (INDEX_ADD_BYTES_PER_S). The alltoall
    dispatcher with several local experts also sorts the received rows by expert before the experts and
    back after them (sort_chunks_by_idxs: split + cat, read + write each, forward and backward). With
    --moe-permute-fusion (TE's kernels) every pass, the backward's too, is a plain read + write and each
    direction one launch (PERMUTE_HOST_KERNELS): the permute reads each token once and writes its k copies,
    the unpermute reads the k copies and writes the token (FUSED_PERMUTE_PASSES)."""
    fused = bool(c.impl.moe_permute_fused)
    k, h = float(c.shape.moe_router_topk), float(c.shape.hidden_size)
    rows = c.T_sp * k * h * 2.0  # one pass over the routed rows
    T_exp, _, local = tokens_per_expert(c)
    sort = (2 * 2 * T_exp * h * 2.0 * np.where(local > 1, 1.0, 0.0)) if c.impl.moe_dispatcher == "alltoall" else 0.0
    if fused:
        f, b = FUSED_PERMUTE_PASSES
        one_way = 2.0 * (1.0 + 1.0 / k) * rows  # permute + unpermute: k copies of each token, read or written once
        return {"ew_f": (f * one_way + sort) / c.bw_ew, "ew_b": (b * one_way + rows + sort) / c.bw_ew,
                "kernels": PERMUTE_HOST_KERNELS[fused]}
    bytes_f = 2 * 2 * rows
    ew_b = (bytes_f + 2 * rows + sort) / c.bw_ew + rows / INDEX_ADD_BYTES_PER_S
    return {"ew_f": (bytes_f + sort) / c.bw_ew, "ew_b": ew_b, "kernels": PERMUTE_HOST_KERNELS[fused]}


def load_factor(c) -> Any:
    """The busiest EP rank's load over the balanced share as the experts compute it: routing_imbalance
    dropless; capped at the capacity factor where experts drop (--moe-expert-capacity-factor: no expert takes
    more than capacity = tokens x k / E x factor of a rank's tokens); exactly the factor padded
    (--moe-pad-expert-input-to-capacity: every expert receives its capacity from every rank, padding included;
    token_dispatcher.MoEAlltoAllTokenDispatcher.preprocess)."""
    return capacity_capped(routing_imbalance(c), c.impl.moe_capacity_factor, c.impl.moe_pad_to_capacity)


def capacity_capped(load, capacity_factor: float | None, pad: bool):
    """An expert load (over the balanced share) as the capacity factor leaves it: unchanged dropless, capped
    at the factor where experts drop, the factor itself where they are padded to capacity."""
    if capacity_factor is None:
        return load
    if pad:
        return np.full_like(np.asarray(load, dtype=np.float64), float(capacity_factor))
    return np.minimum(load, float(capacity_factor))


def tokens_per_expert(c):
    """(tokens through the busiest EP rank's local experts, per local expert, local experts): balanced
    routing T*k*etp/tp over E/ep experts, times load_factor."""
    shape = c.shape
    local = float(shape.num_experts) / c.ep
    T_exp = c.T * float(shape.moe_router_topk) * c.etp / c.tp * load_factor(c)
    return T_exp, T_exp / local, local


def experts(c, kit: MoeKit) -> dict:
    """Routed experts at their real per-expert shape: one grouped GEMM over the local experts (wave
    quantization over all of them, GROUPED_GEMM_RELATIVE_RATE) or SequentialMLP's GEMMs one expert after
    another; the activation; the weight-gradient accumulation."""
    shape, impl = c.shape, c.impl
    h, fe = float(shape.hidden_size), float(shape.moe_ffn_hidden_size)
    T_exp, M_e, local = tokens_per_expert(c)
    grouped = impl.moe_grouped_gemm
    rate = c.rate * (GROUPED_GEMM_RELATIVE_RATE if grouped else 1.0)
    groups = local if grouped else 1.0
    lw = linear_weights(shape)["expert"]
    fc1, fc2 = kit.linears(c, lw, M_e, c.etp, groups, rate)
    n = 1.0 if grouped else local  # SequentialMLP: one GEMM per local expert, launched in sequence
    act = T_exp * (3.0 if shape.swiglu else 2.0) * fe / c.etp * 2 / c.bw_ew
    w_exp = local * kit.local_weights(lw, c.etp) + h * float(shape.num_experts)  # routed experts + router
    acc = kit.wgrad_s(w_exp, len(lw) * local + 1.0, impl, c.bw, c.bw_ew)
    per_f, per_b = PER_EXPERT_HOST_KERNELS[bool(grouped)]
    if grouped and c.fp8:  # every recipe casts each expert's inputs; current scaling first takes their amax
        cs_f, cs_b = FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS if impl.fp8_current_scaling else (0.0, 0.0)
        per_f, per_b = per_f + FP8_PER_EXPERT_HOST_KERNELS[0] + cs_f, per_b + FP8_PER_EXPERT_HOST_KERNELS[1] + cs_b
    fix_f, fix_b = GROUPED_EXPERTS_HOST_KERNELS if grouped else (0.0, 0.0)
    if grouped and c.fp8 and not impl.moe_pad_to_capacity:
        fix_f, fix_b = fix_f + FP8_EXPERT_PADDING_HOST_KERNELS[0], fix_b + FP8_EXPERT_PADDING_HOST_KERNELS[1]
    share = (impl.moe_miss_share if impl.moe_miss_share is not None
             else 0.0 if impl.moe_pad_to_capacity  # one row count: its six problems stay cached
             else heuristic_miss_share(M_e, expert_load_cv(impl.moe_force_balanced, impl.moe_expert_cv), impl.cublaslt_cache))
    miss = busiest_rank_misses(local, share, c.ep)
    per_query = HEURISTIC_QUERY_REF_LAYERS if impl.te else HEURISTIC_QUERY_TORCH_REF_LAYERS
    query_f, query_b = (per_query * q for q in kit.ref_units)  # one query in host units
    # a miss costs per_query of the host's reference layer (TE's or torch's path) per QUERIED_EXPERT_GEMMS
    # forward: each expert's GEMM waits for its own heuristic query (asked right before its launch, after the
    # dispatcher's sync): the GPU idles where a query outlasts the previous expert's GEMM, whatever the layer's
    # host total (trace, s9 C_moe64top8_ep4_alltoall step 3: 179 of the 279 ms the GPU idled fell inside the
    # forward _GroupedLinear; none inside its backward, whose host runs ahead of the GPU)
    query_s = query_f * c.host_f
    per_gemm_f = (fc1[0] + fc2[0]) / (2.0 * groups)  # one expert's fc1 or fc2, forward
    miss_wait_f = QUERIED_EXPERT_GEMMS[0] * miss * np.maximum(0.0, query_s - per_gemm_f)
    return {"gemm_f": n * (fc1[0] + fc2[0]), "gemm_b": n * (fc1[1] + fc1[2] + fc2[1] + fc2[2]),
            "wgrad_b": n * (fc1[2] + fc2[2]), "ew_f": act, "ew_b": 2.0 * act, "acc_b": acc, "T_exp": T_exp, "miss_share": share, "miss_wait_f": miss_wait_f,
            "kernels": (fix_f + per_f * local + QUERIED_EXPERT_GEMMS[0] * miss * query_f,
                        fix_b + per_b * local + QUERIED_EXPERT_GEMMS[1] * miss * query_b)}


def shared_experts(c, kit: MoeKit) -> dict:
    """The shared expert(s): a dense MLP of moe_shared_expert_intermediate_size over every token, split by TP."""
    shape = c.shape
    fsh = float(shape.moe_shared_expert_intermediate_size)
    if fsh <= 0:
        return {"gemm_f": 0.0, "gemm_b": 0.0, "ew_f": 0.0, "ew_b": 0.0, "acc_b": 0.0, "mlp_calls": 0.0}
    lw = linear_weights(shape)["shared_expert"]
    sh1, sh2 = kit.linears(c, lw)
    act = c.T * (3.0 if shape.swiglu else 2.0) * fsh / c.tp * 2 / c.bw_ew
    acc = kit.wgrad_s(kit.local_weights(lw, c.tp), len(lw), c.impl, c.bw, c.bw_ew)
    return {"gemm_f": sh1[0] + sh2[0], "gemm_b": sh1[1] + sh1[2] + sh2[1] + sh2[2], "ew_f": act, "ew_b": 2.0 * act,
            "acc_b": acc, "mlp_calls": 1.0}  # host launches: a dense MLP's (DENSE_MLP_HOST_SHARE, host_kernels)


def dispatch_s(c, kit: MoeKit) -> Any:
    """One dispatch (or combine) over EP: alltoall sends T_sp*k token rows (the busiest rank's share),
    allgather every token to every EP rank, flex (DeepEP) each token once per remote node it needs. The
    part inside the node crosses NVLink, the rest the rank's NIC; both run at once (the slower sets it)."""
    shape, ep, gpn = c.shape, c.ep, float(c.hw.gpus_per_node)
    h, k = float(shape.hidden_size), float(shape.moe_router_topk)
    disp = c.T_sp * k * h * 2.0 * load_factor(c)
    if c.impl.moe_dispatcher == "allgather":
        disp = c.T_sp * h * 2.0 * ep
    ep_span = c.etp * ep
    inside = ep_span <= gpn
    peers_in_node = np.minimum(ep, np.maximum(1.0, np.floor(gpn / c.etp)))
    frac_in = (peers_in_node - 1.0) / np.maximum(ep, 1.0)
    frac_out = np.where(inside, 0.0, (ep - peers_in_node) / ep)
    net_bytes = disp * frac_out
    if c.impl.moe_dispatcher == "flex":
        # with k experts among E spread over N nodes, a given remote node is touched with probability
        # 1 - (1 - 1/N)^k (DeepEP internode dispatch; Megatron's flex dispatcher)
        nodes = np.maximum(1.0, np.ceil(ep_span / gpn))
        touched = (nodes - 1.0) * (1.0 - (1.0 - 1.0 / nodes) ** k)
        net_bytes = np.where(inside, 0.0, c.T_sp * h * 2.0 * touched)
    hop = np.where(inside, kit.nvlink_hop_s, kit.network_hop_s)
    a2a = (np.maximum(disp * (frac_in + frac_out) / c.nv, net_bytes / c.net) / kit.ramp(disp) + kit.latency_s
           + hop * np.log2(np.maximum(ep, 2.0)))
    return np.where(ep > 1, a2a, 0.0)


def dispatcher_kernels(c) -> tuple:
    """(always, with peers) host launches of the token dispatcher beyond the permute, each (forward,
    backward): DISPATCHER_HOST_KERNELS, the second only where EP x ETP has peers."""
    local, coll = DISPATCHER_HOST_KERNELS[c.impl.moe_dispatcher]
    peers = np.where(c.ep * c.etp > 1, 1.0, 0.0)
    return local, (coll[0] * peers, coll[1] * peers)


def dense_halves(d: dict) -> dict:
    """{'attn': (forward, backward), 'mlp': (forward, backward)} launches of a dense layer's halves: the MLP its
    DENSE_MLP_HOST_SHARE of a layer without query and key norms, the attention the rest (those norms included)."""
    halves = {"attn": [], "mlp": []}
    for i, key in enumerate(("kernels_f", "kernels_b")):
        qk = d[("qk_norm_kernels_f", "qk_norm_kernels_b")[i]]
        mlp = DENSE_MLP_HOST_SHARE[i] * (d[key] - qk)
        halves["attn"].append(d[key] - mlp)
        halves["mlp"].append(mlp)
    return {name: tuple(v) for name, v in halves.items()}


def attention_part_kernels(L) -> tuple:
    """(forward, backward) launches of an MoE layer outside its MoE block: a dense layer's attention half
    (dense_halves) plus the separate pre-MLP norm (NORM_OP_HOST_KERNELS)."""
    (a_f, a_b), (norm_f, norm_b) = dense_halves(L.dense)["attn"], NORM_OP_HOST_KERNELS
    return a_f + norm_f, a_b + norm_b


def host_pieces(c, L, parts: dict) -> list:
    """[(captured by, (forward, backward) launches)] of one MoE layer and micro-batch: the attention
    part ('attn'), router + shared experts ('moe_router'), permute + the dispatcher's local work
    ('moe_preprocess'), the dispatcher's collectives + routed experts ('moe' only)."""
    r, ex = parts["router"]["kernels"], parts["experts"]["kernels"]
    mlp = parts["shared"]["mlp_calls"]
    sh_f, sh_b = (mlp * k for k in dense_halves(L.dense)["mlp"])
    pm = parts["permute"]["kernels"]
    local, coll = dispatcher_kernels(c)
    return [(("attn",), attention_part_kernels(L)),
            (("moe", "moe_router"), (r[0] + sh_f, r[1] + sh_b)),
            (("moe", "moe_preprocess"), (pm[0] + local[0], pm[1] + local[1])),
            (("moe",), (coll[0] + ex[0], coll[1] + ex[1]))]


def host_kernels(c, L, parts: dict) -> tuple:
    """(forward, backward) launches of one MoE layer and micro-batch as the host pays for them
    (host_pieces), each piece a CUDA graph captures replaced by one launch (GRAPHED_LAUNCHES), plus the
    combined 1F1B schedule's own (COMBINED_1F1B_HOST_KERNELS)."""
    mods = c.impl.graphed
    kf = COMBINED_1F1B_HOST_KERNELS if c.impl.moe_ep_overlap else 0.0
    kb = 0.0
    for names, (f, b) in host_pieces(c, L, parts):
        captured = bool(mods & set(names))
        kf, kb = kf + (GRAPHED_LAUNCHES if captured else f), kb + (GRAPHED_LAUNCHES if captured else b)
    return kf, kb


def host_syncs_per_layer(impl) -> float:
    """Host syncs per MoE layer and micro-batch (MOE_HOST_SYNCS; none in a layer captured whole, none where the
    alltoall dispatcher pads every expert to its capacity: every split is known on the host,
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize returns at once)."""
    if "moe" in impl.graphed or (impl.moe_pad_to_capacity and impl.moe_dispatcher == "alltoall"):
        return 0.0
    return MOE_HOST_SYNCS[impl.moe_dispatcher]


def post_sync_kernels_f(c, parts: dict) -> Any:
    """Forward launches the host issues after the dispatcher's sync (POST_SYNC_HOST_SHARE): the GPU queue
    is empty at the sync, so these cannot hide behind earlier work; 0 where the sync is gone."""
    if host_syncs_per_layer(c.impl) == 0:
        return 0.0
    local, coll = dispatcher_kernels(c)
    # a capacity factor without padding moves the sync before permutation 1 (the dropped routing map's size):
    # the whole permute and the dispatcher's local work come after it
    share = 1.0 if c.impl.moe_capacity_factor is not None else POST_SYNC_HOST_SHARE
    before = share * (local[0] + parts["permute"]["kernels"][0])
    return before + coll[0] + parts["experts"]["kernels"][0]


def combined_1f1b_share(c) -> Any:
    """Share of a rank's layer forwards (and backwards) that Megatron's combined 1F1B schedule
    (--overlap-moe-expert-parallel-comm) runs beside the other direction: all but the warm-up forwards and
    the cool-down backwards. PP = 1: the first forward and the last backward of the M micro-batches
    (schedules.combined_1f1b_schedule_for_no_pipelining); interleaved PP: the first rank's warm-up,
    2 (PP - 1) + (VP - 1) PP model chunks of its M x VP (schedules.get_pp_rank_microbatches)."""
    chunks = np.maximum(c.m * c.vp, 1.0)
    warm = np.where(c.pp > 1, 2.0 * (c.pp - 1.0) + (c.vp - 1.0) * c.pp, 1.0)
    return np.clip((chunks - np.minimum(warm, chunks)) / chunks, 0.0, 1.0)


def ep_overlap_saving(p: dict, a: Any, delay_wgrad: bool, tax: float = 0.0) -> Any:
    """Seconds the combined 1F1B schedule saves on one layer's forward (one micro-batch) and backward (the
    previous one) run together, each token all-to-all (`a`: dispatch or combine, one direction) on the
    communication stream under the other direction's compute
    (models/common/model_chunk_schedule_plan.TransformerLayerSchedulePlan.run):
        comm:    combine_bwd      | dispatch_fwd -> dispatch_bwd          | combine_fwd
        compute: pre_dispatch_fwd | mlp_bwd -> mlp_bwd_dw -> mlp_fwd      | pre_dispatch_bwd
    mlp_fwd waits for dispatch_fwd, dispatch_bwd for mlp_bwd; with --delay-wgrad-compute mlp_bwd is the
    experts' data gradients only and their weight gradients (mlp_bwd_dw) run under dispatch_bwd, without it
    dispatch_bwd waits for both. `p`: the compute pieces (pre_f, pre_b, mlp_f, mlp_b data gradients, mlp_w
    weight gradients), seconds; `tax`: what each second of hidden communication slows the compute beside it
    (step_time.OVERLAP_SM_TAX: the all-to-all kernels hold SMs)."""
    g_b = p["mlp_b"] if delay_wgrad else p["mlp_b"] + p["mlp_w"]
    w = p["mlp_w"] if delay_wgrad else 0.0
    phase2 = np.maximum(np.maximum(g_b + w, a) + p["mlp_f"], np.maximum(a, g_b) + a)
    together = np.maximum(a, p["pre_f"]) + phase2 + np.maximum(a, p["pre_b"])
    alone = p["pre_f"] + p["pre_b"] + p["mlp_f"] + p["mlp_b"] + p["mlp_w"] + 4.0 * a
    return (1.0 - tax) * np.maximum(0.0, alone - together)


def _overlap_pieces(L, parts: dict, ew_attn_half: Any) -> dict:
    """The compute pieces of ep_overlap_saving: the attention part with the router and half the permute
    (pre-dispatch), the experts with the shared experts and the other half (mlp)."""
    r, pm, ex, sh = parts["router"], parts["permute"], parts["experts"], parts["shared"]
    pre_f = (L.attn.gemm_f + L.dense["attn_f"] + L.tpa[0] + L.dense["cp_f"] + ew_attn_half
             + r["gemm_f"] + r["ew_f"] + 0.5 * pm["ew_f"])
    pre_b = (L.attn.gemm_b + L.dense["attn_b"] + L.tpa[1] + L.dense["cp_b"] + 2.0 * ew_attn_half + L.dense["acc_attn_b"]
             + r["gemm_b"] + r["ew_b"] + 0.5 * pm["ew_b"])
    mlp_f = ex["gemm_f"] + ex["ew_f"] + sh["gemm_f"] + sh["ew_f"] + 0.5 * pm["ew_f"]
    mlp_b = ex["gemm_b"] - ex["wgrad_b"] + ex["ew_b"] + sh["gemm_b"] + sh["ew_b"] + sh["acc_b"] + 0.5 * pm["ew_b"]
    return {"pre_f": pre_f, "pre_b": pre_b, "mlp_f": mlp_f, "mlp_b": mlp_b, "mlp_w": ex["wgrad_b"] + ex["acc_b"]}


def moe_parts(c, kit: MoeKit) -> dict:
    """Every part of the MoE block (router, permute, experts, shared, dispatch + ETP collectives)."""
    a2a = dispatch_s(c, kit)
    ex = experts(c, kit)
    etp_bw, etp_lat = c.link(1.0, c.etp)
    etp_c = kit.ring_s(ex["T_exp"] * float(c.shape.hidden_size) * 2.0, c.etp, etp_bw, etp_lat)  # AG / RS of dispatched tokens
    comm = 2 * a2a + 2 * etp_c
    return {"router": router(c, kit), "permute": permute(c, kit), "experts": ex, "shared": shared_experts(c, kit),
            "dispatch": {"f": comm, "b": comm}, "a2a": a2a}


def moe_part_times(parts: dict) -> dict:
    """Seconds per layer and micro-batch (forward + backward, GPU work) of each named part."""
    def fb(p):
        return p.get("gemm_f", 0.0) + p.get("gemm_b", 0.0) + p.get("ew_f", 0.0) + p.get("ew_b", 0.0) + p.get("acc_b", 0.0)
    return {"router": fb(parts["router"]), "permute": fb(parts["permute"]), "experts": fb(parts["experts"]),
            "shared_experts": fb(parts["shared"]), "dispatch": parts["dispatch"]["f"] + parts["dispatch"]["b"]}


def moe_layer(c, L, kit: MoeKit) -> dict:
    """One MoE layer: the attention half of the dense layer `L` + router, dispatch, experts, combine.
    Returns the part dict step_time's layer model reads (gemm/attn/ew/tp/cp/ep x f/b, host kernels,
    the recompute pieces) plus 'moe_parts': moe_part_times and 'host_wait', the GPU's wait for the host's
    launches beyond the layer's GPU work (attention half included) or, where longer, after the
    dispatcher's sync ('sync_wait_f': post_sync_kernels_f against the GPU work they launch)."""
    parts = moe_parts(c, kit)
    r, pm, ex, sh = parts["router"], parts["permute"], parts["experts"], parts["shared"]
    # the attention half of a dense layer's elementwise bytes (norm, residual, RoPE; not the MLP activation)
    ew_attn_half = (L.ew.ew_dense_f - c.T * L.ew.act_b_dense) / c.bw_ew
    launches = 20 * kit.kernel_s
    ew_f = ew_attn_half + r["ew_f"] + pm["ew_f"] + ex["ew_f"] + sh["ew_f"] + launches
    acc_b = L.dense["acc_attn_b"] + ex["acc_b"] + sh["acc_b"]
    ew_b = 2.0 * ew_attn_half + r["ew_b"] + pm["ew_b"] + ex["ew_b"] + sh["ew_b"] + 2 * launches + acc_b
    kf, kb = host_kernels(c, L, parts)
    comm = parts["dispatch"]["f"]
    times = moe_part_times(parts)
    if c.impl.moe_ep_overlap:
        saved = combined_1f1b_share(c) * ep_overlap_saving(_overlap_pieces(L, parts, ew_attn_half), 0.5 * comm,
                                                           c.impl.moe_delay_wgrad, kit.overlap_tax)
        times["dispatch"] = 2.0 * comm - saved
    else:
        saved = 0.0
    ep_exposed = comm - 0.5 * saved  # per direction: the all-to-alls less what runs under the other direction
    gpu = (L.attn.gemm_f + L.attn.gemm_b + L.dense["attn_f"] + L.dense["attn_b"] + L.tpa[0] + L.tpa[1]
           + L.dense["cp_f"] + L.dense["cp_b"] + ew_attn_half * 3.0 + sum(times.values()))
    # the GPU waits for the host where launching the layer takes longer than running it, and at least
    # where the launches after the dispatcher's sync take longer than the work they launch
    gpu_post = ex["gemm_f"] + ex["ew_f"] + pm["ew_f"] + comm
    sync_wait = np.maximum(0.0, c.host_f * post_sync_kernels_f(c, parts) - gpu_post)
    times["host_wait"] = np.maximum(np.maximum(0.0, c.host_f * kf + c.host_b * kb - gpu), sync_wait)
    return {
        "kernels_f": kf, "kernels_b": kb,
        "gemm_f": L.attn.gemm_f + ex["gemm_f"] + sh["gemm_f"] + r["gemm_f"],
        "gemm_b": L.attn.gemm_b + ex["gemm_b"] + sh["gemm_b"] + r["gemm_b"],
        "attn_f": L.dense["attn_f"], "attn_b": L.dense["attn_b"], "ew_f": ew_f, "ew_b": ew_b,
        # SP: the MoE layer takes T/tp tokens, so no MLP all-gather/reduce-scatter; without SP the
        # attention half keeps its all-reduce.
        "tp_f": L.tpa[0], "tp_b": L.tpa[1], "cp_f": L.dense["cp_f"], "cp_b": L.dense["cp_b"],
        "ep_f": ep_exposed, "ep_b": ep_exposed,
        "moe_f": r["gemm_f"] + ex["gemm_f"] + sh["gemm_f"] + ex["ew_f"] + pm["ew_f"] + sh["ew_f"] + 2 * parts["a2a"],
        "moe_act_f": ex["ew_f"],
        "shared_f": sh["gemm_f"] + sh["ew_f"],
        "moe_parts": times,
        # GPU idle per micro-batch after the dispatcher's host sync (forward), not hidden by queued work
        "sync_wait_f": sync_wait,
        "miss_wait_f": ex["miss_wait_f"],
        "miss_share": ex["miss_share"],
    }


def dominant_part(times: dict) -> tuple[str, float]:
    """(name, share) of the largest part of one MoE layer's time (moe_parts of `moe_layer`, one row)."""
    vals = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in times.items()}
    total = sum(vals.values())
    name = max(vals, key=vals.get)
    return name, (vals[name] / total if total > 0 else 0.0)


__all__ = ["MoeKit", "cache_row_counts", "che_miss_share", "heuristic_miss_share", "attention_part_kernels", "dispatch_s", "dispatcher_kernels", "dominant_part", "experts",
           "host_kernels", "host_pieces", "host_syncs_per_layer", "moe_layer", "moe_part_times", "moe_parts", "permute",
           "post_sync_kernels_f", "router", "busiest_rank_load", "capacity_capped", "combined_1f1b_share", "ep_overlap_saving", "expert_load_cv", "load_factor", "routing_imbalance",
           "shared_experts", "tokens_per_expert"]
