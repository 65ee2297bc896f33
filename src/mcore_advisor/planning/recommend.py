"""recommend_parallelism(request): the fastest layouts that fit, why they win, and what else to know.

The search itself lives in planning/search.py (enumeration, the validators' fast path, one LayoutBatch
through physics.memory.memory_arrays and physics.step_time.step_time_arrays). This module turns a request into search
inputs, re-checks the winners with `evaluate_plan` (so every figure returned is exactly the shared
core's), explains the ranking from the step-time breakdowns, finds the nearest published run,
re-runs a quicker search for 2x the GPUs and a 2x longer sequence, and, when nothing fits, says what
would: the GPU count the model state needs, a sequence that fits, or optimizer CPU offload.

Pure: no clock, no I/O. `recommend_parallelism(..., clock=time.perf_counter)` lets an adapter
(CLI, server) measure the search rate without the core reading the clock itself, and
`cpu_clock=time.thread_time` bounds the searches' CPU time (SEARCH_CPU_BUDGET_S).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import annotated_types
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.megatron_flags import FULL_RECOMPUTE_DEFAULT
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.knowledge.runs import plan_for_run, published_runs
from mcore_advisor.physics.anatomy import count_params
from mcore_advisor.physics.evaluate import Evaluation, evaluate_plan
from mcore_advisor.physics.memory import CUDA_CONTEXT_GIB, model_state_bytes_per_param
from mcore_advisor.physics.step_time import hardware_params, step_time
from mcore_advisor.planning.plan_changes import LOW_HEADROOM_FRACTION
from mcore_advisor.planning.search import (
    RC_BLOCK,
    RC_NONE,
    RC_SELECTIVE,
    RECOMMENDER_RULES,
    Fixed,
    SearchInputs,
    SearchOutcome,
    chunk_layers,
    search,
    space_size,
)
from mcore_advisor.schemas import (
    MAX_GLOBAL_BATCH_SIZE,
    MAX_MICRO_BATCH_SIZE,
    MAX_NUM_LAYERS,
    ClusterSpec,
    Finding,
    ImplementationSpec,
    ModelShape,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
    with_changes,
)
from mcore_advisor.validators import validate

_INPUT = ConfigDict(extra="forbid", frozen=True)
_RESULT = ConfigDict(frozen=True)

MAX_LAYOUTS = 40_000
"""Layouts the main search of one call may enumerate. Each costs 0.05-0.4 ms of CPU (measured on a
2-core host: Qwen3-30B-A3B on 16,384 GPUs enumerates 135,152 and took 16 s; DeepSeek-V3 on 16,384,
38,898 and 4.9 s; GPT-OSS-20B on 256, 19,464 and 3.5 s). Over it the quicker space is searched
instead, and a note says so. 40,000 since the embedding/loss-aware split (planning/search.py
pipeline_splits) gave layer counts that do not divide over PP the VP choices of an even split, doubling
MoE spaces (Moonlight-16B-A3B on 1,024 GPUs: 12,740 -> 24,500 layouts): under the old 20,000 such searches
fell to the quicker space and lost ETP2 (7,361 vs 7,475 tokens/s/GPU); at 40,000 they stay in the full one,
cut at SEARCH_CPU_BUDGET_S with a CPU clock (84 calls of 12 MoE/dense models: at most 4.1 s CPU), uncut up
to 6.4 s a call (DeepSeek-V2-Lite on 4,096 GPUs, 36,638 layouts). Of the published runs the quality benchmark
searches, Qwen3-235B-A22B on 256 GPUs (52,208 layouts) is searched in the quicker space."""
MAX_FOLLOW_UP_LAYOUTS = 20_000
"""Layouts all follow-up quick searches of one call (what-ifs, no-fit suggestions) may enumerate together."""
QUICK_SPACE = "TP within a node, ETP 1 or TP, CP a power of two, SP on, micro-batch <= 8, distributed optimizer on"
SEARCH_CPU_BUDGET_S = 3.5
"""CPU seconds the main search and its follow-up searches of one call may take together when the caller
passes a cpu_clock (issue 19: no call over 5 s; the rest of a call, verification, explanations and the
nearest published run, takes under 1 s cold). The main search checks the likeliest winners first and
stops between layout groups when one more would overrun the budget, and a note says how far it got; a
follow-up search that would not finish at the main search's rate is skipped, with a note. A CPU
clock, not the wall clock, so a loaded host does not change the answers."""


@dataclass
class _Budget:
    """What one call's searches may still spend: layouts for the follow-ups, and CPU time for all of
    them when the caller gave a CPU clock (`clock`; `end` is when the budget runs out)."""

    left: int
    skipped: int = 0
    timed_out: int = 0  # of the skipped: not started or stopped because the CPU budget was spent
    clock: Callable[[], float] | None = None
    end: float = math.inf
    last: float = 0.0  # clock at the start of the running search or at its last deadline check
    s_per_layout: float = 0.0  # the main search's CPU per layout, to foresee a follow-up's

    def start(self) -> Callable[[], bool] | None:
        """The deadline for a search starting now (None without a clock: the search runs in full)."""
        if self.clock is None:
            return None
        self.last = self.clock()
        return self._deadline

    def _deadline(self) -> bool:
        # Asked between layout groups: stop when one more group, costing what the last one did,
        # would end past the budget (so the searches end about at it, not a group later).
        now = self.clock()
        step, self.last = now - self.last, now
        return now + step > self.end

    def affords(self, layouts: int) -> bool:
        return self.clock is None or self.clock() + layouts * self.s_per_layout <= self.end


# Per call (set by recommend_parallelism): the follow-up searches share one budget without every
# helper carrying it.
_follow_ups: ContextVar[_Budget] = ContextVar("follow_up_budget")


def _budget() -> _Budget:
    """This call's follow-up budget; a helper called outside recommend_parallelism gets one of its own."""
    b = _follow_ups.get(None)
    if b is None:
        b = _Budget(left=MAX_FOLLOW_UP_LAYOUTS)
        _follow_ups.set(b)
    return b

# Megatron-Core optimizer CPU offload (megatron/core/optimizer/cpu_offloading/README.md).
CPU_OFFLOAD_FLAGS = "--optimizer-cpu-offload --optimizer-offload-fraction 1.0 --use-precision-aware-optimizer"


# ---------------------------------------------------------------------------------------------
# Request
# ---------------------------------------------------------------------------------------------


def _le(model: type[BaseModel], name: str) -> int:
    """The upper bound a plan field declares, so a pinned value is bounded exactly like the plan's own."""
    return next(m.le for m in model.model_fields[name].metadata if isinstance(m, annotated_types.Le))


_PINNED_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size")


class FixedParallelism(BaseModel):
    """Dimensions to pin; every field left None is searched."""

    model_config = _INPUT

    tensor_model_parallel_size: int | None = Field(None, ge=1, le=_le(ParallelismSpec, "tensor_model_parallel_size"), description="Pin TP.")
    pipeline_model_parallel_size: int | None = Field(None, ge=1, le=_le(ParallelismSpec, "pipeline_model_parallel_size"), description="Pin PP.")
    virtual_pipeline_model_parallel_size: int | None = Field(None, ge=1, le=_le(ParallelismSpec, "virtual_pipeline_model_parallel_size"), description="Pin VP (model chunks per stage); 1 = not interleaved.")
    decoder_first_pipeline_num_layers: int | None = Field(None, ge=1, le=MAX_NUM_LAYERS, description="Pin the first stage's layer count (uneven split).")
    decoder_last_pipeline_num_layers: int | None = Field(None, ge=1, le=MAX_NUM_LAYERS, description="Pin the last stage's layer count (uneven split).")
    context_parallel_size: int | None = Field(None, ge=1, le=_le(ParallelismSpec, "context_parallel_size"), description="Pin CP.")
    expert_model_parallel_size: int | None = Field(None, ge=1, le=_le(ParallelismSpec, "expert_model_parallel_size"), description="Pin EP.")
    expert_tensor_parallel_size: int | None = Field(None, ge=1, le=_le(ParallelismSpec, "expert_tensor_parallel_size"), description="Pin ETP (TP inside experts).")
    data_parallel_size: int | None = Field(None, ge=1, le=_le(ClusterSpec, "num_gpus"), description="Pin DP (= num_gpus / (TP*PP*CP)).")
    micro_batch_size: int | None = Field(None, ge=1, le=MAX_MICRO_BATCH_SIZE, description="Pin the micro-batch size (samples).")
    sequence_parallel: bool | None = Field(None, description="Pin sequence parallelism (only matters with TP > 1).")
    use_distributed_optimizer: bool | None = Field(None, description="Pin the distributed optimizer on or off.")
    recompute_granularity: Literal["none", "selective", "full"] | None = Field(None, description="Pin activation recompute: 'none' = off, 'selective' = Megatron's default modules (core_attn), 'full' = whole layers.")
    recompute_method: Literal["uniform", "block"] | None = Field(None, description="Pin the full-recompute method (implies recompute_granularity 'full').")
    recompute_num_layers: int | None = Field(None, ge=1, le=MAX_NUM_LAYERS, description="Pin recompute_num_layers (group size for uniform, layers per chunk for block).")

    @model_validator(mode="after")
    def _coherent(self) -> FixedParallelism:
        if (self.recompute_method or self.recompute_num_layers) and self.recompute_granularity not in (None, "full"):
            raise ValueError(
                "fixed.recompute_method / fixed.recompute_num_layers apply to full recompute only: set "
                "fixed.recompute_granularity to 'full' or leave them unset"
            )
        return self


class RecommendRequest(BaseModel):
    """What to train where, and the constraints the plan must honour."""

    model_config = _INPUT

    model: ModelSpec = Field(description="Model: a catalog name (e.g. 'llama3-70b') and/or explicit shape fields.")
    cluster: ClusterSpec = Field(description="GPU type and count (num_gpus is the world size the plan must use).")
    seq_length: int = Field(ge=1, le=4_194_304, description="Tokens per sample.")
    global_batch_size: int | None = Field(None, ge=1, le=MAX_GLOBAL_BATCH_SIZE, description="Samples per optimizer step; None = about 4M tokens per step (a power of two) but at least one sample per 8 GPUs.")
    precision: Literal["bf16", "fp8"] = Field("bf16", description="Training precision; 'fp8' = Transformer Engine FP8 GEMMs (Hopper or newer).")
    allow_fp8: bool = Field(False, description="With precision 'bf16', also consider FP8 and recommend it when faster (needs a GPU with FP8 and Transformer Engine).")
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = Field("delayed", description="FP8 scaling recipe for FP8 candidates (--fp8-recipe).")
    fp8_param_gather: bool = Field(False, description="FP8 candidates keep their weights in FP8 and all-gather them in FP8 (--fp8-param-gather, as Megatron-Bridge's FP8 current-scaling recipe does; needs the distributed optimizer).")
    fixed: FixedParallelism = Field(default_factory=FixedParallelism, description="Dimensions to pin (partial ParallelismSpec names, plus data_parallel_size and micro_batch_size).")
    max_tensor_model_parallel_size: int | None = Field(None, ge=1, le=_le(ParallelismSpec, "tensor_model_parallel_size"), description="Upper bound on TP (and on ETP); None = no bound beyond the model's divisibility.")
    min_headroom_gib: float = Field(0.0, ge=0, description="Memory that must stay free on the most-loaded GPU, GiB, on top of the memory model's fragmentation and CUDA-context allowances.")
    min_headroom_fraction: float = Field(LOW_HEADROOM_FRACTION, ge=0, le=0.5, description="The same as a fraction of GPU capacity (default: the 5% below which estimate_memory suggests changes, for routing imbalance and data-dependent peaks); the larger of the two applies.")
    allow_recompute: bool = Field(True, description="Allow activation recomputation (selective or full); False = none.")
    allow_tp_comm_overlap: bool = Field(True, description="Consider TP communication overlap (--tp-comm-overlap: Transformer Engine userbuffers): every plan where it can run (Transformer Engine, sequence parallel, TP > 1 within one node) is timed with and without it; False = TP/SP collectives run exposed, as without the flag.")
    transformer_impl: Literal["transformer_engine", "local"] | None = Field(None, description="Layer spec; None = implementation.transformer_impl (Transformer Engine by default).")
    implementation: ImplementationSpec = Field(default_factory=ImplementationSpec, description="Kernel and buffer choices held fixed during the search (with use_torch_fsdp2 the search covers FSDP2 layouts: no PP, EP or distributed optimizer).")
    top_k: int = Field(5, ge=1, le=20, description="How many plans (distinct TP/PP/CP/EP/ETP/precision layouts) to return.")
    what_if: bool = Field(True, description="Also answer 'what if 2x the GPUs' and 'what if a 2x longer sequence' with a quicker search.")

    @model_validator(mode="after")
    def _coherent(self) -> RecommendRequest:
        mt, fx = self.max_tensor_model_parallel_size, self.fixed
        for name in _PINNED_SIZES:
            v = getattr(fx, name)
            if v is not None and v > self.cluster.num_gpus:
                raise ValueError(f"fixed.{name}: {v} is more than cluster.num_gpus ({self.cluster.num_gpus}); "
                                 "a parallel size cannot exceed the world size: pin a smaller one or add GPUs")
        for name in ("tensor_model_parallel_size", "expert_tensor_parallel_size"):
            v = getattr(fx, name)
            if mt is not None and v is not None and v > mt:
                raise ValueError(f"fixed.{name} ({v}) exceeds max_tensor_model_parallel_size ({mt}); change one of them")
        if self.fp8_param_gather and self.precision == "bf16" and not self.allow_fp8:
            raise ValueError("fp8_param_gather applies to FP8 plans: set precision 'fp8' (or allow_fp8 true), or fp8_param_gather false")
        if self.fp8_param_gather and fx.use_distributed_optimizer is False:
            raise ValueError("fp8_param_gather needs the distributed optimizer (Megatron-LM validate_args): unpin "
                             "fixed.use_distributed_optimizer, or set fp8_param_gather false")
        if not self.allow_recompute and self.fixed.recompute_granularity not in (None, "none"):
            raise ValueError("allow_recompute is false but fixed.recompute_granularity asks for recompute; change one of them")
        return self


def default_global_batch_size(seq_length: int, num_gpus: int) -> int:
    """About 4M tokens per step (Llama-3 and GPT-3 recipes use 2-16M), as a power of two, and at
    least one sample per 8 GPUs so data parallelism has samples to spread."""
    tokens = 2**22
    gbs = 2 ** max(0, round(math.log2(max(1, tokens / seq_length))))
    floor = 2 ** math.ceil(math.log2(max(1, num_gpus / 8)))
    return max(gbs, floor)


_FIXED_ALIASES = {
    "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
    "vp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size", "dp": "data_parallel_size",
    "mbs": "micro_batch_size", "sp": "sequence_parallel", "recompute": "recompute_granularity",
}


def request_from_options(
    *,
    model: str,
    num_gpus: int,
    gpu: str = "h100-sxm",
    seq_length: int = 4096,
    global_batch_size: int | None = None,
    precision: Literal["bf16", "fp8"] = "bf16",
    **options,
) -> RecommendRequest:
    """Build a request from CLI-style flags, e.g. `mcore-advisor recommend --model llama3-70b
    --gpus 64 --gpu h100-sxm --seq-length 8192 --global-batch-size 128`.

    `model` is a catalog key or alias. Extra options: any RecommendRequest field
    (max_tensor_model_parallel_size, min_headroom_gib, allow_fp8, allow_recompute,
    transformer_impl, what_if, top_k, ...), gpus_per_node (the cluster's), or a pinned dimension by
    its FixedParallelism name or short alias (tp, pp, vp, cp, ep, etp, dp, mbs, sp, recompute); None
    values are ignored.
    Raises KeyError for an unknown model or GPU, ValueError for an unknown option.
    """
    resolve_model(ModelSpec(name=model))  # KeyError with close matches, before anything else
    gpus_per_node = options.pop("gpus_per_node", None)
    fixed: dict = {}
    top: dict = {}
    for key, value in options.items():
        if value is None:
            continue
        name = _FIXED_ALIASES.get(key, key)
        if name in FixedParallelism.model_fields:
            fixed[name] = value
        elif key in RecommendRequest.model_fields:
            top[key] = value
        else:
            known = sorted(set(_FIXED_ALIASES) | set(FixedParallelism.model_fields) | set(RecommendRequest.model_fields))
            raise ValueError(f"unknown recommend option {key!r}; known: {', '.join(known)}")
    return RecommendRequest(
        model=ModelSpec(name=model),
        cluster=ClusterSpec(gpu=gpu, num_gpus=num_gpus, gpus_per_node=gpus_per_node),
        seq_length=seq_length,
        global_batch_size=global_batch_size,
        precision=precision,
        fixed=FixedParallelism(**fixed),
        **top,
    )


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


class RecommendedPlan(BaseModel):
    """One recommended plan with the shared core's predictions for it."""

    model_config = _RESULT

    rank: int = Field(description="1 = fastest.")
    plan: Plan = Field(description="Complete plan, accepted by every other tool (evaluate_plan, estimate_memory, render_launch_script, run_profile_job).")
    layout: str = Field(description="Short layout summary, e.g. 'TP8 PP4 VP5 CP1 DP2 mbs1 SP, selective recompute'.")
    iteration_time_s: float = Field(description="Predicted step time.")
    tokens_per_s_per_gpu: float
    tokens_per_s: float = Field(description="Whole job.")
    model_tflops_per_gpu_causal: float = Field(description="Model TFLOP/s/GPU, causal-half attention (Megatron since 2025-03).")
    model_tflops_per_gpu_full: float = Field(description="Model TFLOP/s/GPU, full s^2 attention (pre-2025-03 Megatron, NeMo 24.x).")
    mfu_bf16_causal_pct: float = Field(description="Model FLOPs (causal) / dense BF16 peak, %.")
    mfu_bf16_full_pct: float = Field(description="Model FLOPs (full) / dense BF16 peak, %.")
    mfu_fp8_causal_pct: float | None = Field(description="FP8 plans: model FLOPs (causal) / dense FP8 peak, %.")
    memory_total_gib: float = Field(description="Predicted per-GPU memory on the most-loaded rank (reserved + CUDA context + NCCL).")
    capacity_gib: float
    headroom_gib: float = Field(description="capacity - memory_total.")
    data_parallel_size: int
    num_microbatches: int
    pipeline_bubble_fraction: float
    relative_throughput: float = Field(description="tokens/s of this plan / tokens/s of the best plan.")
    why_slower: str | None = Field(description="For runners-up: the step-time terms that make it slower than the best, quantified.")
    evaluation: Evaluation = Field(description="evaluate_plan's full result: findings (warnings/info), memory breakdown, step-time breakdown.")


class NearestRun(BaseModel):
    """The published measured run closest to the request (model size, GPU, sequence, GPU count)."""

    model_config = _RESULT

    row: int = Field(description="Row of knowledge.runs.published_runs().")
    source: str
    citation: str
    model: str
    params_b: float | None
    gpu: str | None
    num_gpus: int | None
    seq_length: int | None
    global_batch_size: int | None
    precision: str | None
    layout: str = Field(description="Published TP/PP/VP/CP/EP/DP and micro-batch.")
    measured_tokens_per_s_per_gpu: float | None
    measured_tflops_per_gpu: float | None
    flop_convention: str = Field(description="Convention of measured_tflops_per_gpu ('full', 'full+recompute' = counts recompute, 'causal').")
    measured_mfu_pct: float | None
    predicted_tokens_per_s_per_gpu: float | None = Field(description="This tool's prediction for that published plan (a calibration hint).")
    distance: float = Field(description="Within the best-matching tier (same precision, then same GPU, then same model family, in that order): |ln params ratio| + GPU mismatch (0.5 same architecture, 1 other) + 0.5|log2 seq ratio| + 0.25|log2 GPU-count ratio| + 0.5 dense/MoE mismatch + 0.75 BF16/FP8 mismatch with the recommended plan.")
    differences: list[str] = Field(default_factory=list, description="How the published run differs from the plan it is compared with (precision, GPU, model family, size, sequence, GPU count); empty = a like-for-like run.")


class WhatIf(BaseModel):
    """The best plan of a quicker search for a changed request."""

    model_config = _RESULT

    scenario: Literal["2x_gpus", "2x_seq_length"]
    num_gpus: int
    seq_length: int
    global_batch_size: int
    feasible: bool
    layout: str | None
    tokens_per_s_per_gpu: float | None
    tokens_per_s: float | None = Field(description="Whole job.")
    change_tokens_per_s_per_gpu_pct: float | None = Field(description="vs the recommended plan.")
    change_tokens_per_s_pct: float | None = Field(description="Whole-job throughput vs the recommended plan.")
    note: str


class SearchStatistics(BaseModel):
    """What the search looked at. Layouts and candidates each add up:
    layouts_enumerated = layouts_pruned_by_model_state + sum(layouts_rejected_by_rule) + layouts_searched;
    candidates_enumerated = sum(candidates_rejected_by_rule) + candidates_over_memory + candidates_dominated + candidates_timed."""

    model_config = _RESULT

    layouts_enumerated: int = Field(description="(TP, PP, split, VP, CP, EP, ETP, SP, precision) combinations with TP*PP*CP dividing num_gpus.")
    layouts_pruned_by_model_state: int = Field(description="Skipped because weights + gradients + optimizer state alone exceed the usable memory.")
    layouts_rejected_by_rule: dict[str, int] = Field(description="First failing validator error rule (or recommender rule) -> layouts.")
    layouts_searched: int
    candidates_enumerated: int = Field(description="Searched layouts x micro-batch sizes x distributed optimizer on/off x recompute options.")
    candidates_rejected_by_rule: dict[str, int]
    candidates_over_memory: int = Field(description="Exceed capacity minus the required headroom.")
    candidates_dominated: int = Field(description="Not timed: a variant of the same layout and micro-batch that recomputes less (or shards the optimizer) fits.")
    candidates_timed: int = Field(description="Scored with physics.step_time.step_time_arrays.")
    candidates_evaluated: int = Field(description="Memory-checked (enumerated - rejected by rule).")
    plans_verified: int = Field(description="Top candidates re-checked with evaluate_plan.")
    plans_rejected_at_verification: int
    elapsed_s: float | None = Field(description="Wall time of the main search; None unless the caller passed a clock.")
    candidates_per_s: float | None = Field(description="candidates_evaluated / elapsed_s.")


class Recommendation(BaseModel):
    """What recommend_parallelism returns."""

    model_config = _RESULT

    feasible: bool = Field(description="At least one plan fits with the requested headroom under the constraints.")
    global_batch_size: int
    plans: list[RecommendedPlan] = Field(description="Best first; distinct (TP, PP, CP, EP, ETP, precision) layouts, each with its best VP, micro-batch, SP and recompute.")
    explanation: list[str] = Field(description="Why the best plan wins (dominant costs that differ from the runners-up, quantified) and where its time goes.")
    nearest_published_run: NearestRun | None
    what_if: list[WhatIf]
    suggestions: list[str] = Field(description="When nothing fits: what would (GPU count, sequence length, optimizer CPU offload, relaxed constraints).")
    min_gpus_for_model_state: int = Field(description="GPUs needed just to hold bf16 weights + gradients + fp32 Adam state (18 B/param with fp32 gradients), spread perfectly.")
    notes: list[str] = Field(description="Assumptions and search choices.")
    stats: SearchStatistics


# ---------------------------------------------------------------------------------------------
# The tool
# ---------------------------------------------------------------------------------------------


def recommend_parallelism(request: RecommendRequest, *, clock: Callable[[], float] | None = None,
                          cpu_clock: Callable[[], float] | None = None) -> Recommendation:
    """Ranked parallel layouts that fit, fastest first, with predictions and explanations.

    Searches every valid TP, PP (even, or uneven when the layers do not divide), VP, CP, EP, ETP,
    DP (derived), micro-batch, sequence parallel, distributed optimizer and recompute choice, checks
    each with the validators, scores memory and step time with the shared core, and re-checks the
    winners with evaluate_plan. Use it first when someone asks how to train a model on N GPUs.
    Nothing fitting is a normal result (feasible=False) with suggestions. Raises KeyError for an
    unknown model or GPU and ValueError for contradictory constraints. `cpu_clock` (the calling
    thread's CPU time) bounds the searches to SEARCH_CPU_BUDGET_S; a note says when that cut one short.
    """
    t0 = clock() if clock else None
    shape = resolve_model(request.model)
    g = gpu(request.cluster.gpu)
    gbs = request.global_batch_size or default_global_batch_size(request.seq_length, request.cluster.num_gpus)
    notes: list[str] = []
    if request.global_batch_size is None:
        notes.append(f"global_batch_size not given: {gbs} ({gbs * request.seq_length / 1e6:.1f}M tokens per step) used")
    inp = _inputs(request, shape, gbs)
    size = space_size(inp)
    if size > MAX_LAYOUTS:
        inp = _inputs(request, shape, gbs, quick=True)
        notes.append(f"the full search space has {size:,} layouts, more than the {MAX_LAYOUTS:,} one answer may take: "
                     f"searched the quicker space instead ({QUICK_SPACE}; {space_size(inp):,} layouts); pin dimensions "
                     "(fixed tp, pp, ep, ...) to search the rest in full")
    budget = _Budget(left=MAX_FOLLOW_UP_LAYOUTS, clock=cpu_clock)
    if cpu_clock is not None:
        budget.end = cpu_clock() + SEARCH_CPU_BUDGET_S
    token = _follow_ups.set(budget)
    try:
        return _recommend(request, shape, g, gbs, inp, notes, clock, t0)
    finally:
        _follow_ups.reset(token)


def _recommend(request: RecommendRequest, shape: ModelShape, g, gbs: int, inp: SearchInputs, notes: list[str],
               clock: Callable[[], float] | None, t0: float | None) -> Recommendation:
    budget = _budget()
    deadline, c0 = budget.start(), budget.last
    out = search(inp, deadline)
    if deadline is not None:
        st = out.stats
        budget.s_per_layout = (budget.clock() - c0) / max(1, st.layouts_enumerated - st.layouts_not_reached)
    t_search = clock() if clock else None
    plans, verified, rejected = _top_plans(request, inp, out, request.top_k)

    capacity = inp.capacity_gib
    min_gpus = _min_gpus_for_model_state(shape, request, inp)
    explanation: list[str] = []
    suggestions: list[str] = []
    what_if: list[WhatIf] = []
    if plans:
        explanation = _explain(plans)
        if request.what_if:
            what_if = _what_ifs(request, shape, gbs, plans[0])
    else:
        suggestions = _no_fit(request, shape, inp, out, min_gpus, gbs)
    if inp.precisions == ("bf16",) and request.allow_fp8:
        notes.append(f"allow_fp8 ignored: {g.key} has no FP8 tensor cores" if g.fp8_dense_tflops is None
                     else "allow_fp8 ignored: FP8 needs transformer_impl 'transformer_engine'")
    notes.append(
        "dominated variants are not timed: a configuration that fits without recompute beats every recompute "
        "option of it, and the distributed optimizer is never slower or larger in this model"
    )
    notes.append(f"memory must leave {inp.required_headroom_gib:.1f} GiB of {capacity:.1f} GiB free on the most-loaded GPU")
    notes.extend(_budget_notes(out))
    notes.extend(_split_notes(plans))
    elapsed = (t_search - t0) if clock else None
    s = out.stats
    evaluated = s.configurations_enumerated - sum(s.configurations_rejected_by_rule.values())
    stats = SearchStatistics(
        layouts_enumerated=s.layouts_enumerated,
        layouts_pruned_by_model_state=s.layouts_pruned_by_model_state,
        layouts_rejected_by_rule=dict(s.layouts_rejected_by_rule),
        layouts_searched=s.layouts_searched,
        candidates_enumerated=s.configurations_enumerated,
        candidates_rejected_by_rule=dict(s.configurations_rejected_by_rule),
        candidates_over_memory=s.configurations_over_memory,
        candidates_dominated=s.configurations_dominated,
        candidates_timed=s.configurations_timed,
        candidates_evaluated=evaluated,
        plans_verified=verified,
        plans_rejected_at_verification=rejected,
        elapsed_s=elapsed,
        candidates_per_s=(evaluated / elapsed) if elapsed else None,
    )
    return Recommendation(
        feasible=bool(plans),
        global_batch_size=gbs,
        plans=plans,
        explanation=explanation,
        nearest_published_run=nearest_published_run(shape, request.cluster, request.seq_length,
                                                     plans[0].plan.training.precision if plans else request.precision),
        what_if=what_if,
        suggestions=suggestions,
        min_gpus_for_model_state=min_gpus,
        notes=notes,
        stats=stats,
    )


def _split_notes(plans: list[RecommendedPlan]) -> list[str]:
    """What the plans' stage splits and TP overlap assume."""
    pars = [p.plan.parallelism for p in plans]
    notes = []
    if any(p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers for p in pars):
        notes.append(
            "uneven pipeline split: decoder_first/last_pipeline_num_layers put fewer layers on the first/last stage "
            "(embedding, loss); memory and step time are computed for each stage's own layer count"
        )
    if any(p.pipeline_model_parallel_size > 1 and (p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split)
           for p in pars):
        notes.append(
            "embedding/loss-aware pipeline split (--account-for-embedding-in-pipeline-split, "
            "--account-for-loss-in-pipeline-split): the embedding and the output layer + loss count as one layer "
            "each, so the first/last stage builds one layer fewer, in its first/last model chunk; this lets "
            "layer counts that do not divide over PP x VP interleave (Megatron's get_num_layers_to_build)"
        )
    if any(p.tp_comm_overlap for p in pars):
        notes.append(
            "TP communication overlap (--tp-comm-overlap, 'SP+overlap') is timed with and without wherever it can "
            "run: Transformer Engine userbuffers with sequence parallelism, the TP group inside one node, Transformer "
            "Engine's default userbuffers settings (no --tp-comm-overlap-cfg); it hides the TP collectives but "
            "stretches the GEMMs beside it; their buffers are not in the memory estimate"
        )
    return notes


# ---------------------------------------------------------------------------------------------
# Request -> search inputs
# ---------------------------------------------------------------------------------------------


def _budget_notes(out: SearchOutcome) -> list[str]:
    """What the layout and time budgets left out of this answer."""
    s, b, notes = out.stats, _budget(), []
    if s.layouts_not_reached:
        left = s.layouts_enumerated - s.layouts_pruned_by_model_state
        notes.append(f"search stopped at its {SEARCH_CPU_BUDGET_S:g} s CPU limit: {left - s.layouts_not_reached:,} of the "
                     f"{left:,} layouts that pass the model-state bound checked, {s.layouts_not_reached:,} not reached; "
                     "the plans are the best of those checked; pin dimensions (fixed tp, pp, ep, ...) to search the rest")
    over = b.skipped - b.timed_out
    if over:
        notes.append(f"{over} follow-up search(es) (what-ifs, suggestions) skipped: together they would "
                     f"enumerate more than {MAX_FOLLOW_UP_LAYOUTS:,} layouts")
    if b.timed_out:
        notes.append(f"{b.timed_out} follow-up search(es) (what-ifs, suggestions) skipped: past the "
                     f"{SEARCH_CPU_BUDGET_S:g} s CPU limit of this call's searches")
    return notes


def _implementation(request: RecommendRequest) -> ImplementationSpec:
    im = request.implementation
    if "create_attention_mask_in_dataloader" not in im.model_fields_set:
        # Megatron-LM's default data-loader mask costs the step and nothing reads it (physics.step_time)
        im = im.model_copy(update={"create_attention_mask_in_dataloader": False})
    if request.transformer_impl and request.transformer_impl != im.transformer_impl:
        im = im.model_copy(update={"transformer_impl": request.transformer_impl})
    return im


def _inputs(request: RecommendRequest, shape: ModelShape, gbs: int, *, quick: bool = False, cluster: ClusterSpec | None = None, seq_length: int | None = None) -> SearchInputs:
    cluster = cluster or request.cluster
    g = gpu(cluster.gpu)
    im = _implementation(request)
    capacity = cluster.gpu_memory_gib or g.hbm_capacity_gib
    fx = request.fixed
    if request.precision == "fp8":
        precisions: tuple[str, ...] = ("fp8",)
    elif request.allow_fp8 and g.fp8_dense_tflops is not None and im.transformer_impl == "transformer_engine":
        precisions = ("bf16", "fp8")
    else:
        precisions = ("bf16",)
    rec = fx.recompute_granularity
    if rec is None and (fx.recompute_method or fx.recompute_num_layers):
        rec = "full"
    return SearchInputs(
        shape=shape, gpu=g, hardware=hardware_params(cluster), cluster=cluster,
        seq_length=seq_length or request.seq_length, global_batch_size=gbs, precisions=precisions,
        implementation=im, fp8_recipe=request.fp8_recipe, fp8_param_gather=request.fp8_param_gather, capacity_gib=capacity,
        required_headroom_gib=max(request.min_headroom_gib, request.min_headroom_fraction * capacity),
        fixed=Fixed(
            tp=fx.tensor_model_parallel_size, pp=fx.pipeline_model_parallel_size,
            vp=fx.virtual_pipeline_model_parallel_size, first=fx.decoder_first_pipeline_num_layers,
            last=fx.decoder_last_pipeline_num_layers, cp=fx.context_parallel_size, ep=fx.expert_model_parallel_size,
            etp=fx.expert_tensor_parallel_size, dp=fx.data_parallel_size, mbs=fx.micro_batch_size,
            sp=fx.sequence_parallel, dist_opt=fx.use_distributed_optimizer, recompute=rec,
            recompute_method=fx.recompute_method, recompute_num_layers=fx.recompute_num_layers,
        ),
        max_tp=request.max_tensor_model_parallel_size,
        allow_recompute=request.allow_recompute,
        tp_comm_overlap=request.allow_tp_comm_overlap,
        quick=quick,
    )


# ---------------------------------------------------------------------------------------------
# Candidates -> verified plans
# ---------------------------------------------------------------------------------------------


def _candidate_plan(request: RecommendRequest, inp: SearchInputs, out: SearchOutcome, i: int) -> Plan:
    lo = out.layouts[int(out.layout[i])]
    rc = int(out.recompute[i])
    k = int(out.recompute_num_layers[i]) if rc >= RC_BLOCK else None
    dist = bool(out.dist_opt[i])
    granularity = None if rc == RC_NONE else ("selective" if rc == RC_SELECTIVE else "full")
    method = None if rc < RC_BLOCK else ("block" if rc == RC_BLOCK else "uniform")
    if method == "block" and k >= max(chunk_layers(inp.shape.num_layers, lo.pp, lo.vp, lo.split)):
        # Block over every layer of every chunk is the conventional uniform-1 full recompute.
        method, k = FULL_RECOMPUTE_DEFAULT
    moe = inp.shape.is_moe
    par = ParallelismSpec(
        tensor_model_parallel_size=lo.tp,
        pipeline_model_parallel_size=lo.pp,
        virtual_pipeline_model_parallel_size=lo.vp if lo.vp > 1 else None,
        decoder_first_pipeline_num_layers=lo.split.first,
        decoder_last_pipeline_num_layers=lo.split.last,
        account_for_embedding_in_pipeline_split=lo.split.embedding,
        account_for_loss_in_pipeline_split=lo.split.loss,
        context_parallel_size=lo.cp,
        expert_model_parallel_size=lo.ep,
        expert_tensor_parallel_size=lo.etp if (moe and lo.etp != lo.tp) else None,
        sequence_parallel=lo.sp,
        use_distributed_optimizer=dist,
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=k,
        overlap_grad_reduce=True,
        overlap_param_gather=dist,
        tp_comm_overlap=lo.tp_overlap,
    )
    return Plan(
        model=request.model,
        cluster=inp.cluster,
        training=TrainingSpec(
            seq_length=inp.seq_length, global_batch_size=inp.global_batch_size, micro_batch_size=int(out.mbs[i]),
            precision=lo.precision, fp8_recipe=request.fp8_recipe if lo.precision == "fp8" else "delayed",
            fp8_param_gather=request.fp8_param_gather and lo.precision == "fp8",
        ),
        parallelism=par,
        implementation=inp.implementation,
    )


def layout_summary(plan: Plan) -> str:
    """'TP8 PP4 VP5 CP2 EP8 DP4 mbs1 SP, full recompute (block 3), fp8' style one-liner."""
    p, t = plan.parallelism, plan.training
    dp = plan.cluster.num_gpus // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)
    parts = [f"TP{p.tensor_model_parallel_size}", f"PP{p.pipeline_model_parallel_size}"]
    if p.virtual_pipeline_model_parallel_size:
        parts.append(f"VP{p.virtual_pipeline_model_parallel_size}")
    if p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers:
        parts.append(f"(first {p.decoder_first_pipeline_num_layers or '-'} / last {p.decoder_last_pipeline_num_layers or '-'} layers)")
    elif p.pipeline_model_parallel_size > 1 and (p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split):
        counted = "+".join(x for x, on in (("embedding", p.account_for_embedding_in_pipeline_split),
                                           ("loss", p.account_for_loss_in_pipeline_split)) if on)
        parts.append(f"({counted} as layers)")
    parts.append(f"CP{p.context_parallel_size}")
    if p.expert_model_parallel_size > 1 or (resolve_model(plan.model).is_moe):
        parts.append(f"EP{p.expert_model_parallel_size}")
        if p.expert_tensor_parallel_size is not None:
            parts.append(f"ETP{p.expert_tensor_parallel_size}")
    parts.append(f"DP{dp}")
    parts.append(f"mbs{t.micro_batch_size}")
    if p.sequence_parallel and p.tensor_model_parallel_size > 1:
        parts.append("SP+overlap" if p.tp_comm_overlap else "SP")
    s = " ".join(parts)
    if p.recompute_granularity == "selective":
        s += ", selective recompute"
    elif p.recompute_granularity == "full":
        s += f", full recompute ({p.recompute_method} {p.recompute_num_layers})"
    if not p.use_distributed_optimizer:
        s += ", no distributed optimizer"
    if t.precision == "fp8":
        s += ", fp8"
    return s


def _layout_key(lo) -> tuple:
    # Runners-up are distinct (TP, PP, CP, EP, ETP, precision) layouts; VP, the stage split, SP,
    # micro-batch, recompute and the optimizer sharding are that layout's tuning (its best is shown).
    return (lo.tp, lo.pp, lo.cp, lo.ep, lo.etp, lo.precision)


def _order(out: SearchOutcome) -> np.ndarray:
    # Fastest first; among equals, less memory.
    return np.lexsort((out.memory_total_gib, -np.round(out.tokens_per_s_per_gpu, 6)))


def _accept(ev: Evaluation, inp: SearchInputs) -> bool:
    if any(f.severity == "error" for f in ev.findings) or ev.memory is None or ev.performance is None:
        return False
    return ev.memory.total_gib <= inp.capacity_gib - inp.required_headroom_gib + 1e-9


def _top_plans(request: RecommendRequest, inp: SearchInputs, out: SearchOutcome, k: int,
               max_checks: int | None = None) -> tuple[list[RecommendedPlan], int, int]:
    if not len(out.tokens_per_s_per_gpu):
        return [], 0, 0
    max_checks = max_checks or (10 * k + 40)
    taken: set[tuple] = set()
    chosen: list[tuple[Plan, Evaluation]] = []
    verified = rejected = 0
    for i in _order(out):
        lo = out.layouts[int(out.layout[i])]
        key = _layout_key(lo)
        if key in taken:
            continue
        if verified >= max_checks:
            break
        plan = _candidate_plan(request, inp, out, int(i))
        ev = evaluate_plan(plan)
        verified += 1
        if not _accept(ev, inp):
            rejected += 1
            continue
        taken.add(key)
        chosen.append((plan, ev))
        if len(chosen) >= k:
            break
    chosen.sort(key=lambda pe: -pe[1].performance.tokens_per_s_per_gpu)
    best_tps = chosen[0][1].performance.tokens_per_s_per_gpu if chosen else 0.0
    plans = []
    best_ev = chosen[0][1] if chosen else None
    for rank, (plan, ev) in enumerate(chosen, 1):
        perf, mem = ev.performance, ev.memory
        plans.append(RecommendedPlan(
            rank=rank, plan=plan, layout=layout_summary(plan),
            iteration_time_s=perf.iteration_time_s, tokens_per_s_per_gpu=perf.tokens_per_s_per_gpu,
            tokens_per_s=perf.tokens_per_s, model_tflops_per_gpu_causal=perf.model_tflops_per_gpu_causal,
            model_tflops_per_gpu_full=perf.model_tflops_per_gpu_full, mfu_bf16_causal_pct=perf.mfu_bf16_causal_pct,
            mfu_bf16_full_pct=perf.mfu_bf16_full_pct, mfu_fp8_causal_pct=perf.mfu_fp8_causal_pct,
            memory_total_gib=mem.total_gib, capacity_gib=mem.capacity_gib, headroom_gib=mem.headroom_gib,
            data_parallel_size=ev.parallel.data_parallel_size, num_microbatches=ev.parallel.num_microbatches,
            pipeline_bubble_fraction=perf.pipeline_bubble_fraction,
            relative_throughput=perf.tokens_per_s_per_gpu / best_tps,
            why_slower=None if rank == 1 else _why_slower(best_ev, ev, chosen[0][0], plan),
            evaluation=ev,
        ))
    return plans, verified, rejected


# ---------------------------------------------------------------------------------------------
# Explanations
# ---------------------------------------------------------------------------------------------

_TERMS = {
    "gemm_s": "GEMM time",
    "attention_s": "core attention",
    "ssm_scan_s": "Mamba-2 convolution and SSD scan",
    "elementwise_s": "elementwise/memory-bound ops",
    "recompute_s": "activation recompute",
    "tp_comm_exposed_s": "exposed TP/SP communication",
    "cp_comm_exposed_s": "exposed CP ring exchange",
    "ep_comm_s": "MoE all-to-all",
    "pp_p2p_s": "pipeline send/receive",
    "pipeline_bubble_s": "pipeline bubble",
    "dp_comm_exposed_s": "exposed data-parallel communication",
    "optimizer_s": "optimizer step",
    "host_bound_s": "host-bound kernel launches (layers too small for the GPU)",
    "dataloader_mask_s": "the data loader's attention masks",
    "overhead_s": "fixed overhead",
}


def _dims(plan: Plan, ev: Evaluation) -> dict[str, str]:
    p, t = plan.parallelism, plan.training
    rc = p.recompute_granularity or "no"
    if p.recompute_granularity == "full":
        rc = f"full ({p.recompute_method} {p.recompute_num_layers})"
    return {
        "tp": f"TP{p.tensor_model_parallel_size}" + ((" SP+overlap" if p.tp_comm_overlap else " SP")
                                                     if p.sequence_parallel and p.tensor_model_parallel_size > 1 else ""),
        "pp": f"PP{p.pipeline_model_parallel_size}" + (f" VP{p.virtual_pipeline_model_parallel_size}" if p.virtual_pipeline_model_parallel_size else ""),
        "m": f"{ev.parallel.num_microbatches} micro-batches of {t.micro_batch_size}",
        "cp": f"CP{p.context_parallel_size}",
        "ep": f"EP{p.expert_model_parallel_size}" + (f" ETP{p.expert_tensor_parallel_size}" if p.expert_tensor_parallel_size else ""),
        "dp": f"DP{ev.parallel.data_parallel_size}",
        "rc": f"{rc} recompute",
        "prec": t.precision,
    }


# Which layout dimensions drive each step-time term.
_CAUSES = {
    "pipeline_bubble_s": ("pp", "m"),
    "pp_p2p_s": ("pp",),
    "tp_comm_exposed_s": ("tp", "cp", "m"),  # volume per GPU scales with its tokens (s/CP x micro-batch)
    "cp_comm_exposed_s": ("cp",),
    "ep_comm_s": ("ep",),
    "dp_comm_exposed_s": ("dp",),
    "optimizer_s": ("dp",),
    "recompute_s": ("rc",),
    "gemm_s": ("tp", "cp", "m", "prec"),
    "attention_s": ("tp", "cp"),
    "ssm_scan_s": ("tp", "cp"),
    "elementwise_s": ("tp", "cp", "prec"),
}


def _cause(term: str, a: dict[str, str], b: dict[str, str]) -> str:
    diff = [d for d in _CAUSES.get(term, ()) if a[d] != b[d]]
    if not diff:
        return ""
    return ", ".join(f"{b[d]} vs {a[d]}" for d in diff)


def _term_deltas(best: Evaluation, other: Evaluation) -> list[tuple[float, str]]:
    T = best.performance.iteration_time_s
    bb, ob = best.performance.breakdown, other.performance.breakdown
    return [((getattr(ob, k) - getattr(bb, k)) / T, k) for k in _TERMS]


def _why_slower(best: Evaluation, other: Evaluation, best_plan: Plan, other_plan: Plan) -> str:
    """'PP8 VP.. adds a 9.1% pipeline bubble ...; it saves 2.4% exposed TP/SP communication ...'."""
    a, b = _dims(best_plan, best), _dims(other_plan, other)
    loss = 100 * (1 - other.performance.tokens_per_s_per_gpu / best.performance.tokens_per_s_per_gpu)
    deltas = _term_deltas(best, other)
    worse = sorted((d for d in deltas if d[0] > 0.002), reverse=True)[:2]
    better = sorted(d for d in deltas if d[0] < -0.002)[:1]
    parts = []
    for d, k in worse:
        c = _cause(k, a, b)
        parts.append(f"{_TERMS[k]} +{100 * d:.1f}% of the best plan's step" + (f" ({c})" if c else ""))
    s = f"{loss:.1f}% fewer tokens/s than #1: " + ("; ".join(parts) if parts else "small differences spread over many terms")
    for d, k in better:
        c = _cause(k, a, b)
        s += f"; it saves {100 * -d:.1f}% on {_TERMS[k]}" + (f" ({c})" if c else "")
    return s


def _overlap_line(best: RecommendedPlan) -> str:
    """The explanation's statement that the plan assumes TP communication overlap, and what it is worth."""
    perf = best.evaluation.performance
    off = step_time(with_changes(best.plan, "parallelism", tp_comm_overlap=False))
    return (f"assumes TP communication overlap (--tp-comm-overlap: Transformer Engine userbuffers run the TP/SP "
            f"all-gathers and reduce-scatters beside their GEMMs, as the NeMo/Megatron-Bridge recipes do): exposed "
            f"TP/SP communication {100 * perf.breakdown.tp_comm_exposed_s / perf.iteration_time_s:.1f}% of the step; "
            f"without the flag the step is {100 * (off.iteration_time_s / perf.iteration_time_s - 1):.1f}% longer "
            f"({off.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)")


def largest_term_gap(fast_plan: Plan, fast: Evaluation, slow_plan: Plan, slow: Evaluation) -> str:
    """The mechanism that makes `fast` faster than `slow`: the step-time term where `slow` spends the most more
    (share of fast's step) and the layout dimensions behind it, e.g. 'pipeline bubble +9.1% (PP8 VP4 vs PP4 VP20)'."""
    d, k = max(_term_deltas(fast, slow))
    c = _cause(k, _dims(fast_plan, fast), _dims(slow_plan, slow))
    return f"{_TERMS[k]} +{100 * d:.1f}%" + (f" ({c})" if c else "")


def _explain(plans: list[RecommendedPlan]) -> list[str]:
    best = plans[0]
    ev = best.evaluation
    perf = ev.performance
    out = [
        f"best: {best.layout}: {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {best.model_tflops_per_gpu_causal:.0f} TFLOP/s/GPU "
        f"causal ({best.model_tflops_per_gpu_full:.0f} full), MFU {best.mfu_bf16_causal_pct:.1f}% (causal, of dense BF16 peak), "
        f"{best.memory_total_gib:.1f} of {best.capacity_gib:.1f} GiB"
    ]
    T = perf.iteration_time_s
    terms = sorted(((v, k) for k, v in perf.breakdown.model_dump().items() if v > 0), reverse=True)[:4]
    out.append("its step: " + ", ".join(f"{_TERMS[k]} {100 * v / T:.0f}%" for v, k in terms))
    if best.plan.parallelism.tp_comm_overlap:
        out.append(_overlap_line(best))
    if len(plans) > 1:
        ru = plans[1]
        a, b = _dims(best.plan, ev), _dims(ru.plan, ru.evaluation)
        deltas = _term_deltas(ev, ru.evaluation)
        worse = max(deltas)
        better = min(deltas)
        line = f"vs #2 ({ru.layout}, {100 * (1 - ru.relative_throughput):.1f}% slower): "
        if worse[0] > 0.002:
            c = _cause(worse[1], a, b)
            line += f"{(c.split(' vs ')[0] if c else '#2')} adds {100 * worse[0]:.1f}% {_TERMS[worse[1]]} that {(c.split(' vs ')[1].split(',')[0] if c else '#1')} avoids"
        else:
            line += "the terms differ by less than 0.2% each"
        if better[0] < -0.002:
            c = _cause(better[1], a, b)
            who = c.split(" vs ")[1].split(",")[0] if c else "#1"
            line += f"; {who} costs {100 * -better[0]:.1f}% {_TERMS[better[1]]} more"
        out.append(line)
    for p in plans[2:]:
        out.append(f"#{p.rank} ({p.layout}): {p.why_slower}")
    for line in ev.explanation:
        if line.startswith(("pipeline bubble", "communication not hidden", "recompute adds")):
            out.append(line)
    return out


# ---------------------------------------------------------------------------------------------
# Nearest published run
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _run_table() -> tuple[tuple, ...]:
    rows = []
    for run in published_runs():
        rp = plan_for_run(run)
        params = run.params_b * 1e9 if run.params_b else None
        moe = None
        pred = None
        if rp is not None:
            shape = resolve_model(rp.plan.model)
            moe = shape.is_moe
            if params is None:
                params = float(count_params(shape, run.seq_length))
            try:
                pred = step_time(rp.plan, shape).tokens_per_s_per_gpu
            except (ValueError, ArithmeticError):
                pred = None
        rows.append((run, params, moe, pred))
    return tuple(rows)


def _precision_family(text: str | None) -> str | None:
    if not text:
        return None
    t = text.lower()
    return "fp8" if "fp8" in t else ("bf16" if "bf16" in t or "fp16" in t else None)


_FAMILIES = ("llama", "mixtral", "qwen", "deepseek", "nemotron", "gpt")


def row_is_moe(run) -> bool:
    """A published row is an MoE run when it uses expert parallelism or its name has the -A<active>B suffix
    ('Qwen3-235B-A22B'): rows without a reconstructable plan say no more."""
    return (run.expert_model_parallel_size or 1) > 1 or re.search(r"-A\d+(?:\.\d+)?B\b", run.model) is not None


def _family(name: str | None, moe: bool | None) -> tuple[bool | None, str | None]:
    """(MoE?, name family): what 'the same kind of model' means for a comparison."""
    n = (name or "").lower()
    return moe, next((f for f in _FAMILIES if f in n), None)


@dataclass(frozen=True, slots=True)
class _ThisPlan:
    """What a published run is set beside: this plan's parameters, GPU, (is MoE, family), precision
    family, sequence length and GPU count."""

    params: float
    gpu_key: str
    fam: tuple
    precision: str | None
    seq_length: int
    num_gpus: int


def _run_differences(run, p_run: float, run_fam: tuple, plan: _ThisPlan) -> list[str]:
    out = []
    rp = _precision_family(run.precision)
    if plan.precision is not None and rp is not None and rp != plan.precision:
        out.append(f"precision {rp.upper()} (this plan: {plan.precision.upper()})")
    if run.gpu != plan.gpu_key:
        out.append(f"GPU {run.gpu} (this plan: {plan.gpu_key})")
    if run_fam[0] is not None and run_fam[0] != plan.fam[0]:
        out.append(f"{'MoE' if run_fam[0] else 'dense'} model (this plan: {'MoE' if plan.fam[0] else 'dense'})")
    if run_fam[1] != plan.fam[1]:
        out.append(f"model {run.model}, another family than this plan's {plan.fam[1] or 'custom model'}")
    if abs(math.log(p_run / plan.params)) > math.log(1.1):
        out.append(f"{p_run / 1e9:,.1f}B parameters (this plan: {plan.params / 1e9:,.1f}B)")
    if run.seq_length != plan.seq_length:
        out.append(f"sequence {run.seq_length} (this plan: {plan.seq_length})")
    if run.num_gpus != plan.num_gpus:
        out.append(f"{run.num_gpus} GPUs (this plan: {plan.num_gpus})")
    return out


def nearest_published_run(shape: ModelShape, cluster: ClusterSpec, seq_length: int,
                          precision: str | None = None) -> NearestRun | None:
    """The published run that matches the plan's precision, GPU and model family first (an FP8 run is no
    yardstick for a BF16 plan, nor an A100 run for an H100 one), then is closest in size, sequence length
    and GPU count (NearestRun.distance); it lists what still differs."""
    params = float(count_params(shape, seq_length))
    g = gpu(cluster.gpu)
    fam = _family(shape.name, shape.is_moe)
    best = None
    for run, p_run, moe, pred in _run_table():
        if p_run is None or run.num_gpus is None or run.seq_length is None:
            continue
        if run.measured_tokens_per_sec_per_gpu is None and run.measured_tflops_per_gpu is None:
            continue
        moe = row_is_moe(run) if moe is None else moe
        run_fam = _family(run.model, moe)
        rp = _precision_family(run.precision)
        same_arch = bool(run.gpu) and gpu(run.gpu).architecture == g.architecture
        tier = (int(precision is not None and rp is not None and rp != precision),
                0 if run.gpu == g.key else (1 if same_arch else 2),
                int(moe is not None and moe != shape.is_moe) + int(run_fam[1] != fam[1]))
        d = abs(math.log(params / p_run))
        if run.gpu != g.key:
            d += 0.5 if same_arch else 1.0
        d += 0.5 * abs(math.log2(seq_length / run.seq_length)) + 0.25 * abs(math.log2(cluster.num_gpus / run.num_gpus))
        if moe is not None and moe != shape.is_moe:
            d += 0.5
        if tier[0]:
            d += 0.75
        if best is None or (tier, d) < best[0]:
            best = ((tier, d), run, p_run, pred, run_fam)
    if best is None:
        return None
    (_, d), run, p_run, pred, run_fam = best
    lay = f"TP{run.tensor_model_parallel_size} PP{run.pipeline_model_parallel_size}"
    for name, v in (("VP", run.virtual_pipeline_model_parallel_size), ("CP", run.context_parallel_size),
                    ("EP", run.expert_model_parallel_size), ("DP", run.data_parallel_size), ("mbs", run.micro_batch_size)):
        if v:
            lay += f" {name}{v}"
    if run.recompute:
        lay += f", recompute {run.recompute}"
    src = [s for s in _sources() if s[0] == run.source]
    return NearestRun(
        row=run.row, source=run.source, citation=src[0][1] if src else run.source, model=run.model,
        params_b=round(p_run / 1e9, 2), gpu=run.gpu, num_gpus=run.num_gpus, seq_length=run.seq_length,
        global_batch_size=run.global_batch_size, precision=run.precision, layout=lay,
        measured_tokens_per_s_per_gpu=run.measured_tokens_per_sec_per_gpu,
        measured_tflops_per_gpu=run.measured_tflops_per_gpu, flop_convention=run.flop_convention,
        measured_mfu_pct=run.measured_mfu_pct, predicted_tokens_per_s_per_gpu=pred, distance=round(d, 3),
        differences=_run_differences(run, p_run, run_fam,
                                     _ThisPlan(params, g.key, fam, precision, seq_length, cluster.num_gpus)),
    )


@lru_cache(maxsize=1)
def _sources() -> tuple[tuple[str, str], ...]:
    from mcore_advisor.knowledge.runs import sources

    return tuple((k, v.citation) for k, v in sources().items())


# ---------------------------------------------------------------------------------------------
# What-if and no-fit
# ---------------------------------------------------------------------------------------------


def _quick_best(request: RecommendRequest, shape: ModelShape, gbs: int, *, cluster: ClusterSpec | None = None,
                seq_length: int | None = None) -> RecommendedPlan | None:
    inp = _inputs(request, shape, gbs, quick=True, cluster=cluster, seq_length=seq_length)
    budget, size = _budget(), space_size(inp)
    if size > budget.left:
        budget.skipped += 1
        return None
    if not budget.affords(size):  # it would not finish within the CPU budget at the main search's rate
        budget.skipped += 1
        budget.timed_out += 1
        return None
    budget.left -= size
    out = search(inp, budget.start())
    if out.stats.layouts_not_reached:  # a partial answer to a what-if would mislead: none instead
        budget.skipped += 1
        budget.timed_out += 1
        return None
    plans, _, _ = _top_plans(request, inp, out, 1, max_checks=5)
    return plans[0] if plans else None


def _what_ifs(request: RecommendRequest, shape: ModelShape, gbs: int, best: RecommendedPlan) -> list[WhatIf]:
    res = []
    n, s = request.cluster.num_gpus, request.seq_length
    for scenario, cluster, seq in (
        ("2x_gpus", request.cluster.model_copy(update={"num_gpus": 2 * n}), s),
        ("2x_seq_length", request.cluster, 2 * s),
    ):
        if seq > 4_194_304:
            continue
        skipped = _budget().skipped
        top = _quick_best(request, shape, gbs, cluster=cluster, seq_length=seq)
        if _budget().skipped > skipped:
            continue  # not searched (over the budget): a note says so, no "nothing fits"
        same = f"same global batch of {gbs} samples"
        if top is None:
            res.append(WhatIf(scenario=scenario, num_gpus=cluster.num_gpus, seq_length=seq, global_batch_size=gbs,
                              feasible=False, layout=None, tokens_per_s_per_gpu=None, tokens_per_s=None,
                              change_tokens_per_s_per_gpu_pct=None, change_tokens_per_s_pct=None,
                              note=f"nothing fits ({same})"))
            continue
        d_gpu = 100 * (top.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu - 1)
        d_job = 100 * (top.tokens_per_s / best.tokens_per_s - 1)
        if scenario == "2x_gpus":
            note = (f"{same} on twice the GPUs, so each data-parallel replica runs fewer micro-batches; "
                    f"per-GPU throughput {d_gpu:+.0f}%, job throughput {d_job:+.0f}%")
            if d_job > 100 + SUPERLINEAR_TOLERANCE_PCT:
                why = _superlinear_mechanism(request, best, top, n)
                if why is None:
                    # No named mechanism: the gain would be the search's, not the GPUs'. Report linear scaling.
                    top = top.model_copy(update={"tokens_per_s_per_gpu": best.tokens_per_s_per_gpu,
                                                 "tokens_per_s": 2 * best.tokens_per_s})
                    note = (f"{same} on twice the GPUs: capped at linear scaling (+100% job throughput); the quicker "
                            f"search's {d_job:+.0f}% is explained by no change the 2x GPUs make possible")
                    d_gpu, d_job = 0.0, 100.0
                else:
                    note += f"; above linear scaling because {why}"
        else:
            note = (f"{same} (2x tokens per step): attention grows with s^2 and activations with s; "
                    f"per-GPU throughput {d_gpu:+.0f}%")
        res.append(WhatIf(scenario=scenario, num_gpus=cluster.num_gpus, seq_length=seq, global_batch_size=gbs,
                          feasible=True, layout=top.layout, tokens_per_s_per_gpu=top.tokens_per_s_per_gpu,
                          tokens_per_s=top.tokens_per_s, change_tokens_per_s_per_gpu_pct=d_gpu,
                          change_tokens_per_s_pct=d_job, note=note + f" (quicker search: {QUICK_SPACE})"))
    return res


SUPERLINEAR_TOLERANCE_PCT = 0.5
"""A 2x-GPU what-if may exceed +100% job throughput by this much (rounding) before it needs a mechanism."""


def _superlinear_mechanism(request: RecommendRequest, best: RecommendedPlan, top: RecommendedPlan, n: int) -> str | None:
    """Why twice the GPUs do better than twice the throughput, or None when nothing the extra GPUs make
    possible explains it. Each step-time term is compared per token per GPU (same global batch and sequence,
    so GPU-seconds per step: term x GPUs); the terms that shrink are the mechanism, and the what-if layout
    must not fit on the original GPUs (else the original search would have taken it)."""
    b, t = best.evaluation.performance.breakdown, top.evaluation.performance.breakdown
    saved = sorted(((getattr(b, k) * n - getattr(t, k) * 2 * n) / (getattr(b, k) * n) if getattr(b, k) else 0.0, k)
                   for k in _TERMS if getattr(b, k) * n > getattr(t, k) * 2 * n)
    saved = [(f, k) for f, k in reversed(saved) if f > 0.01]
    if not saved:
        return None
    terms = ", ".join(f"{_TERMS[k]} {-100 * f:.0f}% per token" for f, k in saved[:2])
    change = f"{top.layout} instead of {best.layout}"
    if top.layout.replace(f"DP{top.data_parallel_size}", "") == best.layout.replace(f"DP{best.data_parallel_size}", ""):
        return None  # the same layout with twice the data parallelism: per-GPU work per token cannot shrink
    on_n = evaluate_plan(with_changes(top.plan, "cluster", num_gpus=n))
    capacity = on_n.memory.capacity_gib if on_n.memory else None
    headroom = max(request.min_headroom_gib, request.min_headroom_fraction * capacity) if capacity else 0.0
    if on_n.valid and on_n.memory is not None and on_n.memory.total_gib <= capacity - headroom:
        return None  # the layout fitted on n GPUs too: the 2x GPUs do not explain the gain
    reason = (f"needs {on_n.memory.total_gib:.1f} GiB of {capacity:.1f} on {n} GPUs" if on_n.valid and on_n.memory
              else f"is not a valid layout on {n} GPUs")
    return (f"{change}: {terms}; that layout {reason}, and fits on {2 * n} because the distributed optimizer's "
            f"state (fp32 main weights, Adam moments) shards over twice the data-parallel ranks")


def _model_state_bytes_per_param(request: RecommendRequest) -> float:
    return model_state_bytes_per_param(_implementation(request).grad_reduce_in_fp32)


def _min_gpus_for_model_state(shape: ModelShape, request: RecommendRequest, inp: SearchInputs) -> int:
    usable = inp.capacity_gib - inp.required_headroom_gib - CUDA_CONTEXT_GIB
    total = count_params(shape, request.seq_length) * _model_state_bytes_per_param(request) / 2**30
    return max(1, math.ceil(total / max(usable, 1e-9)))


def _no_fit(request: RecommendRequest, shape: ModelShape, inp: SearchInputs, out: SearchOutcome, min_gpus: int,
            gbs: int) -> list[str]:
    s = out.stats
    n = request.cluster.num_gpus
    gpn = inp.hardware.gpus_per_node
    usable = inp.capacity_gib - inp.required_headroom_gib
    bpp = _model_state_bytes_per_param(request)
    out_lines: list[str] = []
    passed_state = s.layouts_enumerated - s.layouts_pruned_by_model_state
    if s.layouts_enumerated == 0:
        out_lines.append("no layout can be built under the pinned dimensions and max TP: relax `fixed` or max_tensor_model_parallel_size")
    elif passed_state == 0:
        out_lines.append(
            f"model state alone does not fit: the best layout needs {out.min_model_state_gib:.1f} GiB per GPU for bf16 "
            f"weights + gradients + Adam state vs {usable:.1f} GiB usable"
        )
    elif s.layouts_searched == 0:
        code, cnt = max(s.layouts_rejected_by_rule.items(), key=lambda kv: kv[1])
        out_lines.append(f"every layout breaks a Megatron rule; most often {code} ({cnt} layouts)" + _rule_hint(request, shape, code, inp))
    elif s.configurations_timed == 0:
        out_lines.append(
            f"every configuration exceeds memory: the smallest needs {out.best_unconstrained_total_gib:.1f} GiB vs "
            f"{usable:.1f} GiB usable ({inp.capacity_gib:.1f} capacity - {inp.required_headroom_gib:.1f} headroom)"
        )
    else:
        out_lines.append("no candidate passed the final evaluate_plan check")
    n_params_b = count_params(shape, request.seq_length) / 1e9
    if min_gpus > n or (s.layouts_enumerated and passed_state == 0):
        found = _smallest_cluster(request, shape, gbs, max(min_gpus, n + 1), gpn)
        msg = (f"holding {bpp:.0f} B/param of model state ({n_params_b:.1f}B parameters) needs at least {min_gpus} GPUs "
               "even if spread perfectly")
        if found:
            msg += f"; the smallest cluster tried that fits with activations is {found[0]} GPUs: {found[1]}"
        out_lines.append(msg)
    elif s.layouts_searched > 0:
        found = _longest_sequence(request, shape, gbs)
        if found:
            out_lines.append(f"a shorter sequence fits on these {n} GPUs: seq_length {found[0]} ({found[1]})")
        bigger = _smallest_cluster(request, shape, gbs, n + 1, gpn)
        if bigger:
            out_lines.append(f"or more GPUs: {bigger[0]} GPUs fit with {bigger[1]}")
    if request.fixed != FixedParallelism() or request.max_tensor_model_parallel_size or not request.allow_recompute:
        out_lines.append("relax the constraints (fixed dimensions, max_tensor_model_parallel_size, allow_recompute) to widen the search")
    out_lines.append(
        "Megatron-Core can move the fp32 main weights and Adam state (12 B/param) to host memory with optimizer CPU "
        f"offload ({CPU_OFFLOAD_FLAGS}; megatron/core/optimizer/cpu_offloading), at a step-time cost; "
        "this tool does not model it"
    )
    return out_lines


def _rule_hint(request: RecommendRequest, shape: ModelShape, code: str, inp: SearchInputs) -> str:
    if code in RECOMMENDER_RULES:
        return f": {RECOMMENDER_RULES[code]}"
    # Build the plan the pins describe and let the validators say it with a fix.
    fx = request.fixed
    try:
        plan = Plan(
            model=request.model, cluster=request.cluster,
            training=TrainingSpec(seq_length=request.seq_length, global_batch_size=inp.global_batch_size,
                                  micro_batch_size=fx.micro_batch_size or 1, precision=inp.precisions[0]),
            parallelism=ParallelismSpec(
                tensor_model_parallel_size=fx.tensor_model_parallel_size or 1,
                pipeline_model_parallel_size=fx.pipeline_model_parallel_size or 1,
                context_parallel_size=fx.context_parallel_size or 1,
                expert_model_parallel_size=fx.expert_model_parallel_size or 1,
            ),
            implementation=inp.implementation,
        )
        hit: list[Finding] = [f for f in validate(plan) if f.code == code]
    except (ValueError, KeyError):
        hit = []
    if hit:
        return f": {hit[0].message}" + (f" (fix: {hit[0].fix})" if hit[0].fix else "")
    return ""


def _smallest_cluster(request: RecommendRequest, shape: ModelShape, gbs: int, at_least: int, gpn: int) -> tuple[int, str] | None:
    """The smallest of a few cluster sizes >= at_least (powers of two, whole nodes) where something fits."""
    pow2 = [2**i for i in range(0, 21) if 2**i >= at_least][:4]
    nodes = [gpn * k for k in range(max(1, -(-at_least // gpn)), max(1, -(-at_least // gpn)) + 3)]
    tries = sorted({n for n in pow2 + nodes if n >= at_least and (n <= gpn or n % gpn == 0)})[:6]
    for n in tries:
        cl = request.cluster.model_copy(update={"num_gpus": n})
        top = _quick_best(request, shape, gbs, cluster=cl)
        if top is not None:
            return n, top.layout
    return None


def _longest_sequence(request: RecommendRequest, shape: ModelShape, gbs: int) -> tuple[int, str] | None:
    s = request.seq_length // 2
    while s >= 128:
        top = _quick_best(request, shape, gbs, seq_length=s)
        if top is not None:
            return s, top.layout
        s //= 2
    return None


def format_recommendation(rec: Recommendation) -> str:
    """Plain-text report of a Recommendation for a terminal (the CLI's non-JSON output)."""
    lines: list[str] = []
    if rec.plans:
        p0 = rec.plans[0].plan
        lines.append(f"{p0.model.name or 'model'} on {p0.cluster.num_gpus} x {p0.cluster.gpu}, seq {p0.training.seq_length}, "
                     f"global batch {rec.global_batch_size}")
        for p in rec.plans:
            lines.append(
                f"#{p.rank} {p.layout}\n     step {p.iteration_time_s:.3f} s, {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                f"{p.model_tflops_per_gpu_causal:.0f} TFLOP/s/GPU causal ({p.model_tflops_per_gpu_full:.0f} full), "
                f"MFU {p.mfu_bf16_causal_pct:.1f}% causal, memory {p.memory_total_gib:.1f}/{p.capacity_gib:.1f} GiB"
            )
        lines.append("why:")
        lines.extend(f"  - {x}" for x in rec.explanation)
    else:
        lines.append("no plan fits:")
        lines.extend(f"  - {x}" for x in rec.suggestions)
    for w in rec.what_if:
        lines.append(f"what if {w.scenario.replace('_', ' ')} ({w.num_gpus} GPUs, seq {w.seq_length}): "
                     + (f"{w.layout}, {w.tokens_per_s_per_gpu:,.0f} tokens/s/GPU; {w.note}" if w.feasible else w.note))
    r = rec.nearest_published_run
    if r:
        meas = (f"{r.measured_tokens_per_s_per_gpu:,.0f} tokens/s/GPU" if r.measured_tokens_per_s_per_gpu
                else f"{r.measured_tflops_per_gpu} TFLOP/s/GPU ({r.flop_convention})")
        pred = f", this tool predicts {r.predicted_tokens_per_s_per_gpu:,.0f}" if r.predicted_tokens_per_s_per_gpu else ""
        prec = f", {_precision_family(r.precision).upper()}" if _precision_family(r.precision) else ""
        lines.append(f"nearest published run: {r.model} on {r.num_gpus} x {r.gpu}, seq {r.seq_length}{prec}, {r.layout}: "
                     f"measured {meas}{pred} [{r.source}]"
                     + (f"; differs in: {'; '.join(r.differences)}" if r.differences else "; like for like"))
    s = rec.stats
    rate = f" in {s.elapsed_s * 1000:.0f} ms ({s.candidates_per_s:,.0f}/s)" if s.elapsed_s else ""
    lines.append(f"searched {s.layouts_enumerated:,} layouts and {s.candidates_evaluated:,} configurations{rate}; "
                 f"{s.candidates_timed:,} timed")
    lines.extend(f"note: {x}" for x in rec.notes)
    return "\n".join(lines)


__all__ = [
    "CPU_OFFLOAD_FLAGS",
    "FixedParallelism",
    "NearestRun",
    "RecommendRequest",
    "Recommendation",
    "RecommendedPlan",
    "SearchStatistics",
    "WhatIf",
    "default_global_batch_size",
    "format_recommendation",
    "largest_term_gap",
    "layout_summary",
    "nearest_published_run",
    "recommend_parallelism",
    "row_is_moe",
    "request_from_options",
]
