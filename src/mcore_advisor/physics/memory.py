"""Per-GPU memory of a Megatron-Core training plan, term by term, on its most-loaded rank.

What is modelled, and the definition each figure follows:

- `peak_allocated`: what `torch.cuda.max_memory_allocated()` reports in steady state (after the
  first optimizer step has created the Adam state): model state (weights, gradient buffer,
  optimizer state) + the activations saved by the in-flight microbatches + the largest transient
  live at that moment (logits and loss on the last stage, a layer's backward working set, the
  recompute working set) + persistent Megatron buffers. The optimizer step is a second candidate
  peak (model state + the optimizer's temporaries); the larger one is reported.
- `peak_reserved`: peak_allocated + the caching allocator's fragmentation margin (an empirical
  allowance, see `fragmentation_fraction`).
- `total`: peak_reserved + memory outside PyTorch's allocator (CUDA context, NCCL buffers), which
  max_memory_allocated never includes. `fits` compares total with the GPU's capacity.

Activations are derived from what each forward op saves for backward, block by block from the
layer anatomy (physics.activations: the per-layer bytes, which reduce to Korthikanti et al. 2022
Table 2 for GPT-3 shapes), not from a fitted constant. This module adds what lies outside the layers:
- Loss: the last stage holds 6 B per logit (unfused), 10 B (Megatron's torch.compile'd 'native'
  fused cross entropy: Inductor materialises in-place updates out of place) or 2 B (TE's).
- the embedding's token ids, the final norm and output-layer inputs, the MTP layers, and the
  checkpointed layer inputs of full recompute.

Pipeline schedule (Megatron `pipeline_parallel/schedules.py`): 1F1B rank r holds
min(PP - r, M) microbatches at its peak (PP - r - 1 warmup forwards, +1 in steady state); the
interleaved schedule holds min(2*(PP - r - 1) + (VP - 1)*PP + 1, M*VP) model chunks on rank r
(warmup = (PP - r - 1)*2 + (VP - 1)*microbatch_group_size_per_vp_stage, group size = PP by
default). On rank 0 that is L*(1 + (PP - 1)/(PP*VP)) layer-microbatches, Megatron's
"interleaved schedule memory penalty".

Buffers that add nothing: the distributed optimizer all-gathers parameters in place into DDP's
param buffer (the bf16 weights already counted) and reduce-scatters in place in the grad buffer;
gradient clipping works tensor by tensor. Not modelled: CUDA-graph pools, TE userbuffers for
tp_comm_overlap, CPU offloading, MoE capacity-factor padding beyond `moe_token_imbalance`.

One model, any number of layouts: `memory_arrays(batch)` evaluates a physics.layouts.LayoutBatch
(the layout search's thousands of candidates) rank by rank; `memory_breakdown(plan)` is its
one-row view. Per-layout facts (each evaluated rank's layers and parameters, `stage_table`; the
per-layer activation bytes, `activation_table`) are computed once per distinct layout; the bytes
per parameter are written once (`WEIGHT_BYTES_PER_PARAM`, `gradient_bytes_per_param`,
`OPTIMIZER_BYTES_PER_PARAM`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.activations import (  # noqa: F401 (the per-layer names: re-exported)
    ActivationOptions,
    activation_options,
    fused_softmax_kernel,
    layer_activation_terms,
    layer_backward_working_bytes,
    layer_backward_working_pieces,
    layer_kinds,
    megatron_dot_product_attention,
    softmax_bytes_per_score,
)
from mcore_advisor.physics.anatomy import RankParams, anatomy, linear_weights, rank_params  # noqa: F401 (RankParams: re-exported)
from mcore_advisor.physics.layouts import (
    NUM_SLOTS,
    RECOMPUTE_FULL,
    RECOMPUTE_SELECTIVE,
    ActivationTable,
    Implementation,
    LayoutBatch,
    StageTable,
    stage_split,
)
from mcore_advisor.physics.moe import busiest_rank_load, capacity_capped, expert_load_cv
from mcore_advisor.schemas import ModelShape, Plan, layers_per_stage

GIB = 1024**3

# ---------------------------------------------------------------------------------------------
# Named assumptions (not fitted to any measurement; each states where it comes from)
# ---------------------------------------------------------------------------------------------

# CUDA context of a torch process on Hopper with lazy module loading (CUDA >= 11.7 default),
# incl. cuBLAS/cuDNN handles: typically 0.5-0.6 GiB as nvidia-smi minus torch's reserved shows.
# Not measured in this project; outside max_memory_allocated/max_memory_reserved.
CUDA_CONTEXT_GIB = 0.55
# NCCL buffers per communicator the rank belongs to with >= 2 ranks: NCCL_BUFFSIZE 4 MiB x
# channels (up to 32 on NVLink) x send/recv, plus proxy state. Order-of-magnitude allowance.
NCCL_PER_COMMUNICATOR_GIB = 0.25
# cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG default on Hopper 32 MiB per handle; torch allocates
# it through the caching allocator, so it is inside max_memory_allocated) and small misc tensors.
MISC_ALLOCATED_BYTES = 64 * 2**20


def cross_entropy_peak_bytes_per_logit(fused: bool, impl: Literal["native", "te"] = "native") -> float:
    """Bytes per logit (per token x local vocab entry) live at the loss's peak on the last stage.

    - Unfused (`tensor_parallel/cross_entropy.py` vocab_parallel_cross_entropy): `.float()` makes
      an fp32 copy while the bf16 logits are still referenced by the model's forward; subtract and
      exp then run in place on the copy, which is saved as the softmax and turned into the
      gradient in place: 2 + 4 = 6 B.
    - Fused 'native' (`fusions/fused_cross_entropy.py`): the same steps inside torch.compile'd
      graphs (`jit_fuser`). Inductor keeps an input mutation in place only when pointwise ops
      alone consume it; calculate_predicted_logits also reduces over the mutated logits (max
      subtraction, exp, sum) and calculate_gradients scatters into the softmax, so each graph
      writes the new value into a fresh fp32 [s, b, v] buffer and copies it back (the NOTE in
      later versions of that file, which split the graphs to avoid it): 2 + 4 + 4 = 10 B.
      megatron-core 0.19.2 as our profile job runs it shows exactly that: +4 B/logit on every
      fused row against the unfused probe rows (e.g. 2.00 GiB at 16384 tokens x 32768 vocab).
    - Fused 'te' (Transformer Engine's parallel_cross_entropy): writes the gradient into the bf16
      logits in place: 2 B (TE builds around the 2026 numerics fix may hold more; not measured).
    """
    if not fused:
        return 6.0
    return 2.0 if impl == "te" else 10.0


def fragmentation_fraction(*, expandable_segments: bool, pipelined_or_full_recompute: bool) -> float:
    """Reserved-minus-allocated margin as a fraction of peak allocated.

    Grounding: the H200 probe rows (shared/data/device-measurements-h200.jsonl, PP=1, no
    expandable segments) show reserved/allocated - 1 of 0.3-4.0% without recompute (median 1.6%)
    and 18.9% with full recompute; Megatron-Bridge's memory-tuning skill reports a Llama3-70B
    PP4 VP5 run at 58.8 GB allocated that OOMs on an 80 GB H100 from fragmentation alone and fits
    with expandable_segments. With expandable segments the allocator maps pages on demand and the
    margin is near zero.
    Our H200 sweep (benchmarks/results/gpu_*.jsonl, 31 rows) agrees without changing the
    numbers: no/selective recompute 0.3-8.9% (median 2.1%; reserved predicted within 4.6%, +1.2%
    on average), full recompute or PP2 1.7-12.0% (median 4.3%; reserved over-predicted by 4.2% on
    average, max 8.3% on the one PP2 row). The spread within each group is wider than the gap
    between the groups' medians and the probe's 18.9% full-recompute row exceeds 10%, so these
    stay an upper-side planning margin rather than a fit (benchmarks/results/memory_accuracy.txt).
    """
    if expandable_segments:
        return 0.01
    return 0.10 if pipelined_or_full_recompute else 0.04


# ---------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------


class StageMemory(BaseModel):
    """One pipeline rank's memory (bytes), as `MemoryBreakdown` reports it for the whole plan."""

    model_config = ConfigDict(frozen=True)

    pipeline_rank: int
    role: Literal["only", "first", "middle", "last"]
    num_layers: int = Field(description="Decoder layers on this rank (all its model chunks).")
    in_flight_microbatches: float = Field(description="Microbatches whose activations are held at the peak (model chunks / VP when interleaved).")
    num_params: int = Field(description="Parameters held by this rank after TP/PP/EP sharding.")
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float = Field(description="Saved activations of all in-flight microbatches.")
    transient_bytes: float = Field(description="Largest temporary live at the forward/backward peak (logits/loss, layer working set, recompute).")
    buffers_bytes: float = Field(description="Persistent Megatron buffers (global memory buffer) and cuBLAS workspace.")
    optimizer_step_transient_bytes: float = Field(description="Temporaries of the optimizer step (a separate candidate peak).")
    peak_allocated_bytes: float

    @property
    def peak_allocated_gib(self) -> float:
        return self.peak_allocated_bytes / GIB


class MemoryBreakdown(BaseModel):
    """Per-GPU memory of a plan on its most-loaded rank (bytes and GiB = 2^30 B)."""

    model_config = ConfigDict(frozen=True)

    most_loaded_pipeline_rank: int
    most_loaded_role: Literal["only", "first", "middle", "last"]
    weights_gib: float = Field(description="bf16 parameters (+ FP8 copies/transposes TE keeps) on the most-loaded rank.")
    gradients_gib: float = Field(description="DDP gradient buffer: 4 B/param with grad_reduce_in_fp32 else 2.")
    optimizer_gib: float = Field(description="fp32 main params + Adam m, v: 12 B/param, sharded over DP*CP (experts over expert-DP) with the distributed optimizer.")
    activations_gib: float = Field(description="Activations saved by all in-flight microbatches at the peak.")
    transient_gib: float = Field(description="Largest temporary at the peak: logits/cross-entropy, backward working set, recompute working set.")
    buffers_gib: float = Field(description="Persistent buffers inside PyTorch's allocator (Megatron global memory buffer, cuBLAS workspace).")
    optimizer_step_transient_gib: float = Field(description="Optimizer-step temporaries (torch Adam foreach, fp32 grad copies).")
    peak_phase: Literal["forward_backward", "optimizer_step"]
    peak_allocated_gib: float = Field(description="Predicted torch.cuda.max_memory_allocated() on the most-loaded rank.")
    fragmentation_gib: float = Field(description="Allocator margin: reserved - allocated (empirical allowance).")
    peak_reserved_gib: float = Field(description="Predicted torch.cuda.max_memory_reserved().")
    non_pytorch_gib: float = Field(description="CUDA context + NCCL buffers, outside PyTorch's allocator statistics.")
    total_gib: float = Field(description="peak_reserved + non_pytorch: what must fit in the GPU.")
    capacity_gib: float = Field(description="Usable GPU memory (cluster.gpu_memory_gib or the catalog's total capacity).")
    fits: bool
    headroom_gib: float = Field(description="capacity - total; negative when it does not fit.")
    stages: list[StageMemory] = Field(description="The distinct pipeline ranks evaluated: first, rank 1 (most-loaded middle), rank PP-2 (least-loaded middle), last.")
    assumptions: list[str] = Field(description="Choices the plan does not pin down, stated so a user can check them.")

    @property
    def least_loaded_peak_gib(self) -> float:
        return min(s.peak_allocated_bytes for s in self.stages) / GIB


# ---------------------------------------------------------------------------------------------
# Parameters per pipeline rank (the count itself: physics.anatomy.rank_params)
# ---------------------------------------------------------------------------------------------


def _stage_layers(num_layers: int, pp: int, vp: int, rank: int,
                  first: int | None = None, last: int | None = None) -> list[int]:
    """Global layer indices on a pipeline rank (interleaved chunks: chunk v of rank r is model chunk v*pp + r).

    Even split unless decoder_first/last_pipeline_num_layers are set (schemas.layers_per_stage);
    each stage's layers divide evenly over its vp chunks. With a remainder (a split the
    validators reject) the extra layers go to the first chunks.
    """
    chunks = pp * vp
    try:
        per_stage = layers_per_stage(num_layers, pp, first, last) if pp > 1 else [num_layers]
    except ValueError:
        per_stage = None
    if per_stage is not None and (first is not None or last is not None):
        sizes = [0] * chunks
        for r, n in enumerate(per_stage):
            base, rem = divmod(n, vp)
            for v in range(vp):
                sizes[v * pp + r] = base + (1 if v < rem else 0)
    else:
        base, rem = divmod(num_layers, chunks)
        sizes = [base + (1 if c < rem else 0) for c in range(chunks)]
    starts = [0]
    for sz in sizes[:-1]:
        starts.append(starts[-1] + sz)
    out: list[int] = []
    for v in range(vp):
        c = v * pp + rank
        out.extend(range(starts[c], starts[c] + sizes[c]))
    return out


# ---------------------------------------------------------------------------------------------
# Per-layout tables (memoised: a search's many configurations share them)
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)  # the search asks for it per layout; a handful of distinct (shape, TP, ETP) values
def te_dummy_wgrad_bytes(shape: ModelShape, tp: int, etp: int, *, has_dense: bool, has_moe: bool,
                         output_vocab: int | None = None) -> float:
    """With gradient-accumulation fusion TE returns a cached bf16 dummy weight gradient per distinct
    local weight shape (get_dummy_wgrad); Megatron's output layer (fused with Apex) takes one too,
    [output_vocab / tp, h], when the rank holds it. Measured on H200: +96 MiB on GPT 1.3B (qkv, proj,
    fc1, fc2 at TP1) and +75 MiB on GPT 2.7B at TP2, exactly."""
    lw = linear_weights(shape)
    blocks = [(lw["attention"], tp)]
    if has_dense:
        blocks.append((lw["mlp"], tp))
    if has_moe:
        blocks += [(lw["expert"], etp), (lw["shared_expert"], tp)]
    blocks.append((lw["mamba"], tp))  # empty without Mamba layers
    shapes = {(r // t if split == 0 else r, c // t if split == 1 else c) for weights, t in blocks for r, c, split in weights}
    if output_vocab:
        shapes.add((output_vocab // tp, shape.hidden_size))
    return 2.0 * sum(r * c for r, c in shapes)


def evaluated_ranks(pp: int) -> list[int]:
    """The pipeline ranks the breakdown evaluates: first; rank 1, the middle rank holding the most
    in flight (the most-loaded middle); rank PP-2, holding the fewest (the least-loaded middle, for
    the imbalance); last. Padded to NUM_SLOTS by repeating the last."""
    ranks = sorted({0, min(1, pp - 1), max(0, pp - 2), pp - 1})
    return ranks + [ranks[-1]] * (NUM_SLOTS - len(ranks))


@lru_cache(maxsize=65536)
def _slot_layers(num_layers: int, pp: int, vp: int, first: int, last: int) -> tuple[tuple[int, ...], ...]:
    f, la = stage_split(first, last)
    return tuple(tuple(_stage_layers(num_layers, pp, vp, r, f, la)) for r in evaluated_ranks(pp))


@lru_cache(maxsize=65536)
def _stage_params_row(shape: ModelShape, seq: int, key: tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
    """(rank, layers, dense, expert, FP8-eligible, first, last) of each evaluated rank (rank_params)
    of one layout, key = the _STAGE_KEYS values."""
    tp, pp, vp, ep, etp, first, last = key
    out = []
    for r, layers in zip(evaluated_ranks(pp), _slot_layers(shape.num_layers, pp, vp, first, last), strict=True):
        rp = rank_params(shape, list(layers), first=r == 0, last=r == pp - 1, tp=tp, ep=ep, etp=etp, seq_length=seq)
        out.append((r, len(layers), rp.dense, rp.expert, rp.fp8_eligible, r == 0, r == pp - 1))
    return tuple(out)


def _per_layout(batch: LayoutBatch, names: tuple[str, ...], fn) -> tuple[list, np.ndarray]:
    """fn(*values) once per distinct combination of the batch's `names` columns; (results, row -> result)."""
    if len(batch) == 1:
        return [fn(*(int(getattr(batch, n)[0]) for n in names))], np.zeros(1, dtype=np.int64)
    keys = np.ascontiguousarray(np.stack([getattr(batch, n) for n in names], axis=1), dtype=np.int64)
    rows = keys.view(np.dtype((np.void, keys.itemsize * keys.shape[1]))).ravel()  # one sortable key per row
    _, first, inv = np.unique(rows, return_index=True, return_inverse=True)
    return [fn(*(int(x) for x in keys[i])) for i in first], inv.reshape(-1)


_STAGE_KEYS = ("tp", "pp", "vp", "ep", "etp", "first_stage_layers", "last_stage_layers")


def stage_table(batch: LayoutBatch) -> StageTable:
    """Parameters and layers of the evaluated pipeline ranks of every row: the one parameter count
    (rank_params, with the embedding, output layer and MTP where they are) that memory and step
    time both use. The batch's own table when it carries one."""
    if batch.stages is not None:
        return batch.stages
    shape, seq = batch.shape, batch.seq_length
    rows, inv = _per_layout(batch, _STAGE_KEYS, lambda *k: _stage_params_row(shape, seq, k))
    cols = np.asarray(rows, dtype=np.float64).transpose(2, 1, 0)[..., inv]  # (field, slot, row)
    vocabs, vinv = _per_layout(batch, ("tp",), shape.padded_vocab_size)
    vocab = np.asarray(vocabs, dtype=np.float64)[vinv]
    return StageTable(rank=cols[0], layers=cols[1], dense_params=cols[2], expert_params=cols[3], fp8_params=cols[4],
                      first=cols[5] > 0, last=cols[6] > 0, padded_vocab=vocab)


_MAX_PIECES = 6  # dense (2, + Mamba) and MoE (2) working-set pieces


@lru_cache(maxsize=65536)
def _stage_activations(shape: ModelShape, seq: int, o: ActivationOptions, layers: tuple[int, ...]) -> tuple:
    """(saved bytes per sample, working pieces (const), (slope)) of one rank's decoder layers."""
    kinds = layer_kinds(shape, seq, o)
    n_moe = sum(shape.moe_layer_pattern[i] for i in layers) if shape.is_moe else 0
    n_dense = len(layers) - n_moe
    if shape.is_hybrid:
        blocks = anatomy(shape).layers
        saved = sum(kinds[blocks[i]][0] for i in layers)
    else:
        saved = n_dense * kinds["dense"][0] + n_moe * kinds.get("moe", kinds["dense"])[0]
    used = ([kinds["dense"]] if n_dense else []) + ([kinds["moe"]] if n_moe else [])
    const = [c for k in used for c in k[1]]
    slope = [c for k in used for c in k[2]]
    pad = _MAX_PIECES - len(const)
    return saved, tuple(const) + (0.0,) * pad, tuple(slope) + (0.0,) * pad


def moe_token_imbalance(shape: ModelShape, impl: Implementation, ep: int) -> float:
    """Expert tokens of the busiest EP rank over the mean (physics.moe.busiest_rank_load; a measured
    moe_routing_imbalance wins). Each rank's peak comes from its heaviest micro-batch, and over a run's
    many micro-batches every rank is the busiest one in some: every rank's expert activations are sized
    for it (2 x H100 EP2 runs: the router as is peaks 0.6-0.8 GiB above its forced-balance twin)."""
    if impl.moe_routing_imbalance is not None:
        load = float(impl.moe_routing_imbalance)
    else:
        load = float(busiest_rank_load(shape, ep, expert_load_cv(impl.moe_router_force_load_balancing,
                                                                  impl.moe_expert_load_cv)))
    return float(capacity_capped(load, impl.moe_expert_capacity_factor, impl.pads_to_capacity))


@lru_cache(maxsize=65536)
def _activation_row(shape: ModelShape, seq: int, impl: Implementation, selective: bool, key: tuple[int, ...]) -> tuple:
    tp, pp, vp, cp, ep, etp, sp, fp8, first, last = key
    o = activation_options(impl, tp, cp, sp, fp8, ep, etp, selective)
    if shape.is_moe and ep > 1:
        o = replace(o, moe_token_imbalance=moe_token_imbalance(shape, impl, ep))
    kinds = layer_kinds(shape, seq, o)
    mtp_kind = kinds["moe"] if shape.is_moe and shape.moe_layer_pattern[-1] else kinds["dense"]
    out_fused = _out_fused(impl)
    saved, const, slope, mtp, dummies = [], [], [], [], []
    for r, layers in zip(evaluated_ranks(pp), _slot_layers(shape.num_layers, pp, vp, first, last), strict=True):
        a = _stage_activations(shape, seq, o, layers)
        saved.append(a[0])
        const.append(a[1])
        slope.append(a[2])
        n_moe = sum(shape.moe_layer_pattern[i] for i in layers) if shape.is_moe else 0
        is_last = r == pp - 1
        mtp.append(shape.mtp_num_layers * mtp_kind[0] if is_last else 0.0)
        dummies.append(te_dummy_wgrad_bytes(shape, tp, etp, has_dense=len(layers) > n_moe, has_moe=n_moe > 0,
                                            output_vocab=shape.padded_vocab_size(tp) if is_last and out_fused else None))
    return saved, const, slope, mtp, dummies


_ACTIVATION_KEYS = ("tp", "pp", "vp", "cp", "ep", "etp", "sequence_parallel", "fp8", "first_stage_layers",
                    "last_stage_layers")


def activation_table(batch: LayoutBatch, selective: bool) -> ActivationTable:
    """Saved activations and backward working sets of the evaluated ranks of every row, for no
    recompute / full recompute (selective False) or the batch's selective modules."""
    own = batch.activations_selective if selective else batch.activations
    if own is not None:
        return own
    shape, seq, impl = batch.shape, batch.seq_length, batch.impl
    rows, inv = _per_layout(batch, _ACTIVATION_KEYS, lambda *k: _activation_row(shape, seq, impl, selective, k))
    saved, const, slope, mtp, dummies = (np.asarray([r[i] for r in rows], dtype=np.float64) for i in range(5))
    pieces = max(1, int(np.flatnonzero(np.any((const != 0) | (slope != 0), axis=(0, 1))).max(initial=0)) + 1)
    const, slope = const[..., :pieces], slope[..., :pieces]  # the padding no row uses
    return ActivationTable(saved=saved.T[:, inv], work_const=const.transpose(2, 1, 0)[..., inv],
                           work_slope=slope.transpose(2, 1, 0)[..., inv], mtp=mtp.T[:, inv], te_dummy_wgrad=dummies.T[:, inv])


# ---------------------------------------------------------------------------------------------
# The vectorised breakdown: every evaluated rank of every row of a LayoutBatch
# ---------------------------------------------------------------------------------------------

WEIGHT_BYTES_PER_PARAM = 2.0
"""bf16 model weights (Megatron's Float16Module; DDP's param buffer holds the same tensors)."""
OPTIMIZER_BYTES_PER_PARAM = 12.0
"""fp32 main parameters + Adam m and v (Megatron's mixed-precision and distributed optimizers)."""
FP8_CACHE_BYTES_PER_PARAM = 2.0
"""TE's FP8 copy of a weight and its transpose (1 B each), cached for all micro-batches of a step."""


def gradient_bytes_per_param(grad_reduce_in_fp32: bool) -> float:
    """DDP's gradient buffer (main_grad): fp32 with --grad-reduce-in-fp32 (Megatron's default), else bf16."""
    return 4.0 if grad_reduce_in_fp32 else 2.0


def grads_in_fp32(impl: Implementation) -> bool:
    """Whether the gradient buffer (and its reduction) is fp32. Megatron-FSDP ignores --grad-reduce-in-bf16:
    its buffer takes --megatron-fsdp-main-grads-dtype, whose default 'auto' is the bf16 parameter dtype
    (megatron_fsdp/param_and_grad_buffer.py _resolve_group_grad_dtype)."""
    return impl.grad_reduce_in_fp32 and not impl.use_megatron_fsdp


def model_state_bytes_per_param(grad_reduce_in_fp32: bool) -> float:
    """Weights + gradient buffer + optimizer state of one parameter held unsharded."""
    return WEIGHT_BYTES_PER_PARAM + gradient_bytes_per_param(grad_reduce_in_fp32) + OPTIMIZER_BYTES_PER_PARAM


_STATE_DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0}


def optimizer_bytes_per_param(impl: Implementation, fp8):
    """Optimizer state per parameter (numbers or arrays of `fp8`): fp32 main weight + Adam m, v, or with
    --use-precision-aware-optimizer the moments at --exp-avg(-sq)-dtype and the main weight as 16-bit
    remainders of the bf16 weight wherever TE's FusedAdam holds it (no FP8 or delayed scaling; Megatron's
    OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and store_param_remainders, default true;
    distrib_optimizer.py allocates the master_param state as int16). Other FP8 recipes keep MCore's fp32 one."""
    if not impl.use_precision_aware_optimizer:
        return OPTIMIZER_BYTES_PER_PARAM + 0.0 * np.asarray(fp8, dtype=np.float64)
    te_master = ~np.asarray(fp8, dtype=bool) | (impl.fp8_recipe == "delayed")
    moments = _STATE_DTYPE_BYTES[impl.exp_avg_dtype] + _STATE_DTYPE_BYTES[impl.exp_avg_sq_dtype]
    return np.where(te_master, 2.0, 4.0) + moments


def _decoupled_grads(impl: Implementation, fp8) -> np.ndarray:
    """Where the optimizer reads the bf16 gradient shard itself (precision-aware optimizer with TE's master
    weights: `decoupled_grad`, distrib_optimizer._copy_model_grads_to_main_grads) instead of an fp32 copy."""
    return impl.use_precision_aware_optimizer & (~np.asarray(fp8, dtype=bool) | (impl.fp8_recipe == "delayed"))


@dataclass(frozen=True)
class DpSharding:
    """What the data-parallel group (DP x CP; routed experts: expert-DP) shards of each rank's model state.

    DDP: nothing but, with the distributed optimizer, the optimizer state (ZeRO-1). torch FSDP2 (Megatron's
    fully_shard with reshard_after_forward): everything. Megatron-FSDP: --data-parallel-sharding-strategy
    (megatron_fsdp/param_and_grad_buffer.py _init_each_parameter_group_buffers: 'optim' distributes the
    main-weight buffer, 'optim_grads' also the gradient buffer, 'optim_grads_params' also the bf16 weights);
    the optimizer state follows the main weights. `optimizer` None = the row's use_distributed_optimizer.
    `prefetch`: the implementation overlaps its gathers and reduce-scatters itself (torch FSDP2's forward and
    backward prefetch); Megatron-FSDP does so only with --overlap-param-gather / --overlap-grad-reduce.
    """

    params: bool
    grads: bool
    optimizer: bool | None
    prefetch: bool = False


_MEGATRON_FSDP_SHARDING = {
    "no_shard": DpSharding(False, False, False),
    "optim": DpSharding(False, False, True),
    "optim_grads": DpSharding(False, True, True),
    "optim_grads_params": DpSharding(True, True, True),
}


def dp_sharding(impl: Implementation) -> DpSharding:
    """The model state the plan's data-parallel implementation shards (one mechanism for FSDP2 and
    Megatron-FSDP; physics.step_time times the collectives the same table implies)."""
    if impl.use_megatron_fsdp:
        return _MEGATRON_FSDP_SHARDING[impl.data_parallel_sharding_strategy]
    if impl.use_torch_fsdp2:
        return DpSharding(True, True, True, prefetch=True)
    return DpSharding(False, False, None)


def _out_fused(impl: Implementation) -> bool:
    """Whether the output layer's weight gradient is fused too (a cached dummy instead of a bf16 tensor)."""
    return _fused_dummies(impl) and impl.output_layer_wgrad_fusion is not False


def _fused_dummies(impl: Implementation) -> bool:
    return impl.gradient_accumulation_fusion and impl.transformer_impl == "transformer_engine" and not impl.use_torch_fsdp2


@dataclass(frozen=True)
class _ModelState:
    weights: np.ndarray
    gradients: np.ndarray
    optimizer: np.ndarray
    step_transient: np.ndarray  # temporaries of the optimizer step


def _model_state(b: LayoutBatch, st: StageTable) -> _ModelState:
    """Weights, gradient buffer and optimizer state of each evaluated rank, and the step's temporaries.

    A sharded buffer holds its dense part over DP x CP and its expert part over expert-DP (`DpSharding`);
    sharded weights and gradients add the layers being gathered or reduced at the peak: the current and
    the prefetched one (coarse: the FSDP unit is a transformer layer in both FSDP implementations)."""
    im, shard = b.impl, dp_sharding(b.impl)
    n_params = st.dense_params + st.expert_params
    dp_opt, edp = b.dp * b.cp, b.expert_dp
    fp32_grads = grads_in_fp32(im)
    grad_b = gradient_bytes_per_param(fp32_grads)
    mx = 1 / 16 if im.fp8_recipe == "mxfp8" else 0.0
    weights = WEIGHT_BYTES_PER_PARAM * n_params
    # TE caches the FP8 weight and its transpose for all microbatches of a step (with
    # --fp8-param-gather the FP8 param (1 B) and its transpose (1 B) replace the bf16 copy).
    weights = weights + np.where(b.fp8 & (not im.fp8_param_gather), FP8_CACHE_BYTES_PER_PARAM * st.fp8_params * (1.0 + mx), 0.0)
    grads = grad_b * n_params
    sharded = st.dense_params / dp_opt + st.expert_params / edp
    share = sharded / np.maximum(n_params, 1.0)  # the fraction of the rank's parameters one DP rank keeps
    in_flight = 2 * n_params / np.maximum(1.0, st.layers)  # two layers unsharded
    if shard.params:
        weights = weights * share + WEIGHT_BYTES_PER_PARAM * in_flight
    if shard.grads:
        grads = grads * share + grad_b * in_flight
    opt_sharded = b.use_distributed_optimizer if shard.optimizer is None else np.full(len(b), shard.optimizer)
    held = np.where(opt_sharded, sharded, n_params)
    optim = optimizer_bytes_per_param(im, b.fp8) * held
    # torch _multi_tensor_adam's sqrt(v) temporary per param group (local spec); fp32 copies of bf16
    # grads for the main params (bf16 gradient buffer) unless the optimizer reads them directly.
    fp32_copy = np.where(_decoupled_grads(im, b.fp8) | fp32_grads, 0.0, 4.0)
    step = (4.0 * held if im.transformer_impl == "local" else 0.0) + fp32_copy * held
    return _ModelState(weights, grads, optim, step + np.zeros_like(weights))


def in_flight_microbatches(pp, vp, rank, num_microbatches):
    """Microbatches of activations a rank holds at its peak, in units of its whole layer set
    (numbers or numpy arrays).

    1F1B: min(PP - rank, M). Interleaved: min(2*(PP - rank - 1) + (VP - 1)*PP + 1, M*VP) model
    chunks, i.e. that many / VP microbatches of the rank's layers (Megatron
    `forward_backward_pipelining_with_interleaving`, microbatch_group_size_per_vp_stage = PP).
    """
    interleaved = np.minimum(2 * (pp - rank - 1) + (vp - 1) * pp + 1, num_microbatches * vp) / np.maximum(vp, 1)
    out = np.where(pp <= 1, 1.0, np.where(vp > 1, interleaved, np.minimum(pp - rank, num_microbatches)))
    return float(out) if np.ndim(out) == 0 else out.astype(np.float64)


@dataclass(frozen=True)
class _Activations:
    activations: np.ndarray
    transient: np.ndarray
    in_flight: np.ndarray
    block_slope: np.ndarray  # bytes one more block-recomputed layer per chunk saves at the peak
    per_chunk: np.ndarray


def _last_stage_transient(b: LayoutBatch, st: StageTable, tok: np.ndarray) -> np.ndarray:
    """Largest temporary at the loss: logits + the cross-entropy buffers (per output head), or the
    output layer's backward (logits, its bf16 weight gradient unless fused, the input gradient)."""
    im, h, V, tp = b.impl, b.shape.hidden_size, st.padded_vocab, b.tp
    logits = 2.0 * V * tok / tp
    te_ce = im.cross_entropy_loss_fusion and im.cross_entropy_fusion_impl == "te"
    ce_peak = cross_entropy_peak_bytes_per_logit(im.cross_entropy_loss_fusion, im.cross_entropy_fusion_impl) / 2.0 * logits
    # bf16 output-layer weight gradient before main_grad.add_ (a cached dummy when fused)
    out_wgrad = 0.0 if _out_fused(im) else 2.0 * V * h / tp
    bwd_peak = logits + out_wgrad + 2.0 * h * tok
    heads = b.shape.mtp_num_layers * (logits if te_ce else 2.0 * logits)
    return np.maximum(ce_peak * 1.0 + heads, bwd_peak)


def _activations(b: LayoutBatch, st: StageTable, act: ActivationTable, R: np.ndarray) -> _Activations:
    """Saved activations of the in-flight micro-batches and the largest temporary of each evaluated
    rank. Full recompute keeps a checkpointed input per layer group (uniform) or per recomputed
    layer (block, R = layers per chunk) and adds the recompute working set."""
    h, s, mbs = b.shape.hidden_size, b.seq_length, b.micro_batch_size
    tok = s / b.cp * mbs
    sp_div = np.where(b.sp, b.tp, 1)
    full, block = b.recompute == RECOMPUTE_FULL, b.recompute_block
    saved = act.saved * mbs
    work = np.max(act.work_const + act.work_slope * mbs, axis=0)
    per_layer = saved / np.maximum(1.0, st.layers)
    per_chunk = np.maximum(1.0, st.layers // b.vp)
    ckpt = 2.0 * h * tok / sp_div  # a checkpointed layer input
    per_mb = saved
    if full.any():
        rec = np.minimum(R, per_chunk)
        saved_block = b.vp * (rec * ckpt + (per_chunk - rec) * per_layer)
        saved_uniform = b.vp * np.ceil(per_chunk / np.maximum(R, 1.0)) * ckpt
        work_full = np.where(block, per_layer, per_layer * np.minimum(R, per_chunk)) + work
        per_mb = np.where(full, np.where(block, saved_block, saved_uniform), saved)
        work = np.where(full, work_full, work)
    per_mb = per_mb + np.where(st.first, 16.0 * tok, 0.0)  # token and position ids kept for the embedding backward
    infl = in_flight_microbatches(b.pp, b.vp, st.rank, b.num_microbatches)
    acts = infl * per_mb
    if b.impl.overlap_moe_expert_parallel_comm and b.shape.is_moe:
        # the combined 1F1B schedule runs layer j's forward (next micro-batch) beside layer n-1-j's backward:
        # one layer more than the n a micro-batch keeps is alive at the backward's peak
        # (models/common/model_chunk_schedule_plan.py; E_q30rank_ep2_overlap rows: +0.55-1.0 GiB over their twins)
        acts = acts + per_layer
    # final norm input + output-layer input; labels, mask; the MTP layers' activations
    acts = acts + np.where(st.last, 2.0 * h * tok / sp_div * 2 + 12.0 * tok, 0.0)
    acts = acts + np.where(st.last, act.mtp * mbs, 0.0)
    transient = np.where(st.last, np.maximum(work, _last_stage_transient(b, st, tok)), work)
    return _Activations(acts, transient, infl, infl * b.vp * (per_layer - ckpt), per_chunk)


def _buffers(b: LayoutBatch, act: ActivationTable) -> np.ndarray:
    """Persistent buffers inside PyTorch's allocator: cuBLAS workspace and small tensors, TE's dummy
    weight gradients, and the local spec's global memory buffer: the unfused attention's baddbmm
    input [b*n/t, s, s] bf16 and the SP all-gather buffer share one name, sized by the larger."""
    im, s, h = b.impl, b.seq_length, b.shape.hidden_size
    buffers = float(MISC_ALLOCATED_BYTES) + (act.te_dummy_wgrad if _fused_dummies(im) else 0.0)
    if im.transformer_impl == "local":
        tok = s / b.cp * b.micro_batch_size
        gbuf = 2.0 * (b.shape.num_attention_heads / b.tp) * b.micro_batch_size * (s / b.cp) * s if im.unfused_attention else 0.0
        buffers = buffers + np.where(b.sp, np.maximum(gbuf, 2.0 * h * tok), gbuf)
    return buffers + np.zeros_like(act.saved)


def _dataloader_mask(b: LayoutBatch, st: StageTable) -> np.ndarray:
    """The micro-batch's attention mask Megatron-LM's default data loader hands the first and last stages
    (--create-attention-mask-in-dataloader): b x s x s bool copied to the GPU, this CP rank's s/cp query rows
    kept (get_batch_on_this_cp_rank). Measured on 4 x H100 (s8 M_* pairs): +64 MiB at CP4 16k, +128 MiB
    at CP2 16k and TP4 8k with 2 samples, +512 MiB at CP2 32k over the same plans without it."""
    if not b.impl.create_attention_mask_in_dataloader:
        return np.zeros_like(st.layers, dtype=float)
    mask = b.micro_batch_size * (b.seq_length / b.cp) * float(b.seq_length)
    return np.where(st.first | st.last, mask, 0.0)


@dataclass(frozen=True)
class MemoryArrays:
    """Memory of every row of a LayoutBatch: bytes per evaluated rank (arrays (NUM_SLOTS, n), slot
    order of `evaluated_ranks`) and per row on its most-loaded rank (arrays (n,))."""

    stages: StageTable
    in_flight: np.ndarray
    weights: np.ndarray
    gradients: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    transient: np.ndarray
    buffers: np.ndarray
    step_transient: np.ndarray
    peak_allocated: np.ndarray
    most_loaded: np.ndarray  # slot index of the most-loaded rank (the first of equals)
    peak_allocated_bytes: np.ndarray
    fragmentation_bytes: np.ndarray
    non_pytorch_gib: np.ndarray
    total_gib: np.ndarray


def _recompute_layers(b: LayoutBatch) -> np.ndarray:
    """Layers per uniform group or per chunk in block recompute; Megatron's default 1 when unset."""
    return np.where(b.recompute_num_layers > 0, b.recompute_num_layers, 1).astype(np.float64)


def _tables(b: LayoutBatch) -> tuple[StageTable, ActivationTable]:
    st = stage_table(b)
    sel = b.recompute == RECOMPUTE_SELECTIVE
    if not sel.any():
        return st, activation_table(b, False)
    if sel.all():
        return st, activation_table(b, True)
    none, chosen = activation_table(b, False), activation_table(b, True)
    return st, ActivationTable(**{f: np.where(sel, getattr(chosen, f), getattr(none, f))
                                  for f in ("saved", "work_const", "work_slope", "mtp", "te_dummy_wgrad")})


def non_pytorch_gib(b: LayoutBatch) -> np.ndarray:
    """CUDA context + NCCL buffers of every communicator the rank belongs to with >= 2 ranks (and the
    embedding group of the first and last stage with PP > 1): outside PyTorch's allocator."""
    comms = ((b.tp > 1).astype(np.int64) + (b.pp > 1) + (b.cp > 1) + (b.dp > 1) + (b.ep > 1)
             + ((b.etp > 1) if b.shape.is_moe else 0) + (b.pp > 1))
    return CUDA_CONTEXT_GIB + NCCL_PER_COMMUNICATOR_GIB * comms


def _fragmentation(b: LayoutBatch) -> np.ndarray:
    pipelined = (b.pp > 1) | (b.recompute == RECOMPUTE_FULL)
    es = b.impl.expandable_segments
    return np.where(pipelined, fragmentation_fraction(expandable_segments=es, pipelined_or_full_recompute=True),
                    fragmentation_fraction(expandable_segments=es, pipelined_or_full_recompute=False))


def memory_arrays(b: LayoutBatch) -> MemoryArrays:
    """The memory model on a batch of layouts (memory_breakdown is its one-row view)."""
    st, act = _tables(b)
    ms = _model_state(b, st)
    a = _activations(b, st, act, _recompute_layers(b))
    buffers = _buffers(b, act) + _dataloader_mask(b, st)
    static = ms.weights + ms.gradients + ms.optimizer + buffers
    peak = np.maximum(static + a.activations + a.transient, static + ms.step_transient)
    top = np.argmax(peak, axis=0)
    peak_row = peak[top, np.arange(len(b))]
    frag = _fragmentation(b) * peak_row
    non_pt = non_pytorch_gib(b)
    return MemoryArrays(
        stages=st, in_flight=a.in_flight, weights=ms.weights, gradients=ms.gradients, optimizer=ms.optimizer,
        activations=a.activations, transient=a.transient, buffers=buffers, step_transient=ms.step_transient,
        peak_allocated=peak, most_loaded=top, peak_allocated_bytes=peak_row, fragmentation_bytes=frag,
        non_pytorch_gib=non_pt, total_gib=(peak_row + frag) / GIB + non_pt,
    )


def block_recompute_layers_to_fit(b: LayoutBatch, budget_gib: float) -> np.ndarray:
    """The fewest layers per chunk that full 'block' recompute must rerun for each row to fit in
    `budget_gib` (inf where no count does). On every rank the forward/backward peak falls linearly
    with that count (each recomputed layer keeps only its checkpointed input): peak(k) = C - k*D."""
    st, act = _tables(b)
    ms = _model_state(b, st)
    a = _activations(b, st, act, np.zeros(len(b)))
    buffers = _buffers(b, act)
    static = ms.weights + ms.gradients + ms.optimizer + buffers
    peak_max = (budget_gib - non_pytorch_gib(b)) * GIB / (1.0 + _fragmentation(b))
    C, D = static + a.activations + a.transient, a.block_slope
    need = np.where(D > 0, np.ceil((C - peak_max) / np.where(D > 0, D, 1.0)), np.where(C <= peak_max, 0.0, np.inf))
    need = np.maximum(need, 1.0)
    ok = (need <= a.per_chunk) & (static + ms.step_transient <= peak_max)
    return np.where(ok.all(axis=0), need.max(axis=0), np.inf)


def model_state_gib(b: LayoutBatch) -> np.ndarray:
    """Weights, gradient buffer and optimizer state of each row's most-loaded evaluated rank, with the
    allocator's fragmentation margin (GiB): a lower bound of what the row needs (no activations)."""
    ms = _model_state(b, stage_table(b))
    return (ms.weights + ms.gradients + ms.optimizer).max(axis=0) * (1.0 + _fragmentation(b)) / GIB


# ---------------------------------------------------------------------------------------------
# The breakdown of one plan
# ---------------------------------------------------------------------------------------------


def memory_breakdown(plan: Plan, *, cross_entropy_fusion_impl: Literal["native", "te"] | None = None,
                     output_layer_wgrad_fusion: bool | None = None) -> MemoryBreakdown:
    """Per-GPU memory on the most-loaded rank of `plan` (see the module docstring for definitions).

    `output_layer_wgrad_fusion` None follows the plan's gradient_accumulation_fusion, as Megatron-LM
    does (its own output layer then needs Apex); False = only the TE layers fuse (this project's profile
    job on a machine without Apex).

    `cross_entropy_fusion_impl` overrides the plan's implementation.cross_entropy_fusion_impl
    (Megatron's --cross-entropy-fusion-impl); it matters only with cross_entropy_loss_fusion. See
    `cross_entropy_peak_bytes_per_logit` for what each implementation holds at the loss.
    Raises KeyError/ValueError (naming the plan field) for an unknown model or GPU.
    A one-row view of `memory_arrays`, the function the layout search runs on thousands of rows.
    """
    shape = resolve_model(plan.model)
    g = gpu(plan.cluster.gpu)
    capacity = plan.cluster.gpu_memory_gib or g.hbm_capacity_gib
    overrides: dict = {"output_layer_wgrad_fusion": output_layer_wgrad_fusion}
    if cross_entropy_fusion_impl is not None:
        overrides["cross_entropy_fusion_impl"] = cross_entropy_fusion_impl
    batch = LayoutBatch.from_plan(plan, shape, **overrides)
    m = memory_arrays(batch)
    stages = _stage_memories(m, int(batch.pp[0]))
    top = stages[int(m.most_loaded[0])]
    peak = float(m.peak_allocated_bytes[0])
    at_step = top.weights_bytes + top.gradients_bytes + top.optimizer_bytes + top.buffers_bytes + top.optimizer_step_transient_bytes
    reserved_gib = (peak + float(m.fragmentation_bytes[0])) / GIB
    non_pt = float(m.non_pytorch_gib[0])
    total = reserved_gib + non_pt
    return MemoryBreakdown(
        most_loaded_pipeline_rank=top.pipeline_rank, most_loaded_role=top.role,
        weights_gib=top.weights_bytes / GIB, gradients_gib=top.gradients_bytes / GIB, optimizer_gib=top.optimizer_bytes / GIB,
        activations_gib=top.activations_bytes / GIB, transient_gib=top.transient_bytes / GIB, buffers_gib=top.buffers_bytes / GIB,
        optimizer_step_transient_gib=top.optimizer_step_transient_bytes / GIB,
        peak_phase="optimizer_step" if at_step >= peak else "forward_backward",
        peak_allocated_gib=peak / GIB, fragmentation_gib=float(m.fragmentation_bytes[0]) / GIB,
        peak_reserved_gib=reserved_gib, non_pytorch_gib=non_pt, total_gib=total, capacity_gib=capacity,
        fits=total <= capacity, headroom_gib=capacity - total, stages=stages,
        assumptions=_assumptions(batch.impl),
    )


def _stage_memories(m: MemoryArrays, pp: int) -> list[StageMemory]:
    """One StageMemory per distinct evaluated rank of a one-row MemoryArrays."""
    out = []
    st = m.stages
    for i in range(len(set(evaluated_ranks(pp)))):
        r = int(st.rank[i, 0])
        n_params = float(st.dense_params[i, 0] + st.expert_params[i, 0])
        out.append(StageMemory(
            pipeline_rank=r,
            role="only" if pp == 1 else ("first" if r == 0 else ("last" if r == pp - 1 else "middle")),
            num_layers=int(st.layers[i, 0]),
            in_flight_microbatches=float(m.in_flight[i, 0]),
            num_params=int(round(n_params)),
            weights_bytes=float(m.weights[i, 0]), gradients_bytes=float(m.gradients[i, 0]),
            optimizer_bytes=float(m.optimizer[i, 0]), activations_bytes=float(m.activations[i, 0]),
            transient_bytes=float(m.transient[i, 0]), buffers_bytes=float(m.buffers[i, 0]),
            optimizer_step_transient_bytes=float(m.step_transient[i, 0]),
            peak_allocated_bytes=float(m.peak_allocated[i, 0]),
        ))
    return out


def _assumptions(im: Implementation) -> list[str]:
    ce = im.cross_entropy_fusion_impl
    out = [
        (f"dropout: attention {im.attention_dropout:g}, hidden {im.hidden_dropout:g}"
         + (" (masks and dropped outputs kept for backward)" if im.attention_dropout or im.hidden_dropout else "")),
        ("fused bias-activation (Megatron-LM default)" if im.bias_activation_fusion else "unfused bias-activation")
        + "; local spec: torch AdamW (foreach); TE spec: TE FusedAdam",
        ("gradient-accumulation fusion (Megatron's default; Apex for the output layer): TE keeps one bf16 dummy "
         "weight gradient per distinct weight shape" if im.gradient_accumulation_fusion and im.transformer_impl == "transformer_engine"
         else "no gradient-accumulation fusion: each bf16 weight gradient is a transient before main_grad.add_"),
        "cross entropy: "
        + (f"fused, {ce} implementation" if im.cross_entropy_loss_fusion else "unfused (vocab_parallel_cross_entropy)")
        + f" ({cross_entropy_peak_bytes_per_logit(im.cross_entropy_loss_fusion, ce):g} B/logit at the loss)",
    ]
    if im.unfused_attention:
        kind = ("Megatron's DotProductAttention (the local spec's core attention whatever attention_backend says)"
                if im.transformer_impl == "local" or im.attention_backend == "local" else "TE's unfused attention")
        out.append(f"{kind}: s x s scores saved; masked_softmax_fusion {im.masked_softmax_fusion} (kernel for 17-4096 "
                   f"tokens), attention_softmax_in_fp32 {im.attention_softmax_in_fp32} (Megatron-LM's default off: 2 B "
                   "per score, 6 B with fp32 softmax)")
    shard = dp_sharding(im)
    if shard.params or shard.grads:
        kind = (f"Megatron-FSDP {im.data_parallel_sharding_strategy}" if im.use_megatron_fsdp else "torch FSDP2")
        out.append(f"{kind}: {'weights, ' if shard.params else ''}gradients and optimizer state sharded over DP*CP "
                   "(experts over expert-DP); 2 layers unsharded in flight (coarse)")
    if im.use_megatron_fsdp:
        out.append("Megatron-FSDP keeps bf16 gradients (--megatron-fsdp-main-grads-dtype auto), whatever grad_reduce_in_fp32 says")
    return out
