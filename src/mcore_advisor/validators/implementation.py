"""Implementation choices: layer spec, attention kernel, overlap switches, FSDP2, MoE dispatch."""

from __future__ import annotations

import math

from ._core import (
    ATTENTION_BACKEND,
    CAPACITY_FACTOR,
    CP,
    DELAY_WGRAD,
    DISPATCHER,
    DIST_OPT,
    EP,
    EP_OVERLAP,
    ETP,
    EXP_AVG_DTYPE,
    EXP_AVG_SQ_DTYPE,
    FSDP2,
    GIB,
    GRAD_ACC_FUSION,
    GRAD_REDUCE_FP32,
    GROUPED_GEMM,
    MASKED_SOFTMAX_FUSION,
    MBS,
    MEGATRON_FSDP,
    OVERLAP_GRAD_REDUCE,
    OVERLAP_PARAM_GATHER,
    PAD_TO_CAPACITY,
    PP,
    PRECISION_AWARE,
    RECOMPUTE_GRANULARITY,
    RECOMPUTE_METHOD,
    RECOMPUTE_MODULES,
    SEQ,
    SHARDING_STRATEGY,
    SP,
    TP,
    TP_COMM_OVERLAP,
    TRANSFORMER_IMPL,
    Ctx,
    gib,
    rule,
)

AREA = "implementation"


def _local(c: Ctx) -> bool:
    return c.transformer_impl == "local"


@rule(
    "sequence_parallel_needs_te_norm",
    "error",
    AREA,
    "the local spec's torch norm cannot do SP",
    when=lambda c: _local(c) and c.sp_effective,
)
def _local_sp(c: Ctx):
    # The local spec uses Apex FusedLayerNorm when Apex is installed, else WrappedTorchNorm, which
    # asserts "sequence parallel not supported by torch LayerNorm" (transformer/torch_norm.py;
    # reproduced in shared/reference/megatron-core-cpu.md).
    return (
        [SP, TRANSFORMER_IMPL],
        "sequence parallel not supported by torch LayerNorm: transformer_impl local builds WrappedTorchNorm "
        "unless Apex is installed",
        "set implementation.transformer_impl to transformer_engine, or parallelism.sequence_parallel false "
        "(or install Apex for the local spec)",
    )


@rule(
    "local_spec_fusions_need_apex",
    "info",
    AREA,
    "the local spec's fusions come from Apex",
    when=lambda c: _local(c) and (c.gradient_accumulation_fusion or c.masked_softmax_fusion),
)
def _local_apex(c: Ctx):
    # Megatron's own linear layers fuse the wgrad accumulation with Apex's fused_weight_gradient_mlp_cuda and its
    # DotProductAttention takes the masked softmax from Apex's scaled_*masked_softmax_cuda: NVIDIA's PyTorch
    # containers ship Apex, a pip-installed Megatron-LM has neither (render_launch_script turns both off when
    # apex_installed is false). On 4 x H100 (benchmarks/results/gpu_h100x4_N_runs.jsonl) the local-spec plans ran
    # 19-34% slower than predicted with both on, and the dense ones within 6.5% once predicted with both off.
    on = [f for f, v in ((GRAD_ACC_FUSION, c.gradient_accumulation_fusion), (MASKED_SOFTMAX_FUSION, c.masked_softmax_fusion)) if v]
    return (
        [TRANSFORMER_IMPL, *on],
        "transformer_impl local takes " + " and ".join(f.split(".")[1] for f in on) + " from Apex (NVIDIA's PyTorch "
        "containers); without Apex Megatron runs them off and the step is slower than this prediction",
        "where Apex is not installed, set " + " and ".join(f"{f} false" for f in on) + " to predict the run as it "
        "will go (render_launch_script with apex_installed false renders them off)",
    )


@rule(
    "grouped_gemm_ignored_by_local_spec",
    "info",
    AREA,
    "the local spec always builds SequentialMLP",
    when=lambda c: _local(c) and c.is_moe and c.moe_grouped_gemm and c.num_experts // max(c.ep, 1) > 1,
)
def _local_grouped(c: Ctx):
    # megatron-core 0.19: LocalSpecProvider.grouped_mlp_modules returns SequentialMLP whatever moe_grouped_gemm says
    return (
        [GROUPED_GEMM, TRANSFORMER_IMPL],
        f"transformer_impl local builds SequentialMLP whatever moe_grouped_gemm says: the {c.num_experts // c.ep} "
        "local experts run one after another, each its own GEMMs and launches (the prediction counts them so)",
        "set implementation.transformer_impl transformer_engine for the grouped GEMM, or moe_grouped_gemm false "
        "to say what runs",
    )


@rule(
    "context_parallel_needs_te_attention",
    "error",
    AREA,
    "CP runs in Transformer Engine's attention",
    when=lambda c: c.cp > 1 and (_local(c) or c.attention_backend == "local"),
)
def _cp_te(c: Ctx):
    # Megatron-Core DotProductAttention (local spec / attention_backend local) asserts
    # "Context parallelism is only supported by TEDotProductAttention!".
    return (
        [CP, TRANSFORMER_IMPL, ATTENTION_BACKEND],
        "Context parallelism is only supported by TEDotProductAttention! "
        f"(context_parallel_size {c.cp} with transformer_impl {c.transformer_impl}, attention_backend "
        f"{c.attention_backend})",
        "set implementation.transformer_impl transformer_engine and attention_backend auto/flash/fused, or "
        "parallelism.context_parallel_size 1",
    )


@rule(
    "context_parallel_with_unfused_attention",
    "error",
    AREA,
    "TE's unfused attention has no CP",
    when=lambda c: c.cp > 1 and not _local(c) and c.attention_backend == "unfused",
)
def _cp_unfused(c: Ctx):
    # Transformer Engine get_attention_backend disables UnfusedDotProductAttention under context
    # parallelism; with NVTE_UNFUSED_ATTN the only backend allowed, none is left.
    return (
        [CP, ATTENTION_BACKEND],
        f"context_parallel_size {c.cp} needs Transformer Engine's flash or fused (cuDNN) attention; "
        "its unfused attention does not support context parallelism",
        "set implementation.attention_backend to auto, flash or fused",
    )


@rule(
    "attention_backend_local_needs_local_spec",
    "error",
    AREA,
    "attention_backend local is the local spec's attention",
    when=lambda c: c.attention_backend == "local" and not _local(c),
)
def _backend_local(c: Ctx):
    # Megatron-LM validate_args: "--attention-backend local is only supported with --spec local".
    return (
        [ATTENTION_BACKEND, TRANSFORMER_IMPL],
        "--attention-backend local is only supported with the local spec (transformer_impl local)",
        "set implementation.attention_backend to auto (or unfused for TE's unfused kernel), or "
        "transformer_impl local",
    )


@rule(
    "attention_backend_ignored_by_local_spec",
    "warning",
    AREA,
    "TE attention backends do nothing in the local spec",
    when=lambda c: _local(c) and c.attention_backend in ("flash", "fused", "unfused"),
)
def _backend_ignored(c: Ctx):
    # attention_backend selects Transformer Engine's kernel (NVTE_*_ATTN); the local spec's core
    # attention is always Megatron-Core's DotProductAttention.
    return (
        [ATTENTION_BACKEND, TRANSFORMER_IMPL],
        f"attention_backend {c.attention_backend} is ignored with transformer_impl local: the local spec always "
        "runs Megatron-Core's unfused DotProductAttention",
        "set implementation.transformer_impl to transformer_engine to get flash/fused attention",
    )


def _scores_bytes_per_layer(c: Ctx) -> float:
    # Korthikanti et al. 2022 sec. 4.1: unfused attention keeps the softmax output (2 B), the
    # dropout mask (1 B) and the dropout output (2 B) per score: 5*a*s^2*b bytes per layer, heads
    # split over TP. A measured local-spec run on H200 (shared/data/device-measurements-h200.jsonl,
    # GPT 1.3B, s 2048) used about 6 B per score, so this is a floor.
    heads = c.shape.num_attention_heads / c.tp
    return 5 * c.mbs * heads * c.seq_length**2


def _unfused(c: Ctx) -> bool:
    return _local(c) or c.attention_backend in ("unfused", "local")


@rule(
    "unfused_attention_memory",
    "warning",
    AREA,
    "unfused attention stores s x s scores",
    when=_unfused,
)
def _scores(c: Ctx):
    per_layer = _scores_bytes_per_layer(c)
    layers = c.layers_per_stage or math.ceil(c.shape.num_layers / c.pp)
    stage = per_layer * layers
    share = stage / (c.hbm_gib * GIB)
    severity = "warning" if share >= 0.10 else "info"
    return (
        [ATTENTION_BACKEND, TRANSFORMER_IMPL, SEQ, MBS],
        f"unfused attention materialises the s x s score matrix: at seq_length {c.seq_length}, micro_batch_size "
        f"{c.mbs} and {c.shape.num_attention_heads / c.tp:g} heads per GPU that is >= {gib(per_layer)} per "
        f"layer, {gib(stage)} for the {layers} layers of a stage per micro-batch ({share:.0%} of "
        f"{c.hbm_gib:g} GiB), growing with s^2 (Korthikanti et al. 2022: 5*a*s^2*b bytes)",
        "set implementation.transformer_impl transformer_engine with attention_backend auto/flash/fused "
        "(memory linear in s)",
        severity,
    )


@rule(
    "tp_comm_overlap_needs_sequence_parallel",
    "error",
    AREA,
    "TP comm overlap needs SP",
    when=lambda c: c.tp_comm_overlap and not c.sp_effective,
)
def _tpo_sp(c: Ctx):
    # Megatron-LM validate_args asserts this (SP is also forced off when TP == 1).
    return (
        [TP_COMM_OVERLAP, SP, TP],
        "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is enabled"
        + (" (and sequence parallelism needs tensor_model_parallel_size > 1)" if c.tp == 1 else ""),
        "set parallelism.sequence_parallel true with tensor_model_parallel_size > 1, or tp_comm_overlap false",
    )


@rule(
    "tp_comm_overlap_needs_te",
    "error",
    AREA,
    "TP comm overlap is Transformer Engine userbuffers",
    when=lambda c: c.tp_comm_overlap and _local(c),
)
def _tpo_te(c: Ctx):
    return (
        [TP_COMM_OVERLAP, TRANSFORMER_IMPL],
        "tp_comm_overlap uses Transformer Engine userbuffers, which the local spec does not have",
        "set implementation.transformer_impl transformer_engine, or parallelism.tp_comm_overlap false",
    )


@rule(
    "overlap_param_gather_needs_distributed_optimizer",
    "info",
    AREA,
    "param all-gather overlap is a distributed-optimizer feature",
    when=lambda c: c.overlap_param_gather and not c.use_distributed_optimizer and not c.use_megatron_fsdp,
)
def _opg_distopt(c: Ctx):
    # Megatron-LM validate_args asserts "--overlap-param-gather only supported with distributed
    # optimizer or megatron fsdp" when the flag is passed; overlap_param_gather defaults to true in
    # the plan, so a plan without the distributed optimizer simply has nothing to overlap and the
    # renderer leaves the flag out.
    return (
        [OVERLAP_PARAM_GATHER, DIST_OPT],
        "overlap_param_gather is ignored without the distributed optimizer (there is no parameter "
        "all-gather); the launch script omits --overlap-param-gather, which Megatron-LM would reject "
        "('--overlap-param-gather only supported with distributed optimizer or megatron fsdp')",
        "set parallelism.overlap_param_gather false, or use_distributed_optimizer true",
    )


@rule(
    "overlap_param_gather_needs_overlap_grad_reduce",
    "warning",
    AREA,
    "param gather overlap rides on grad reduce overlap",
    when=lambda c: c.overlap_param_gather and not c.overlap_grad_reduce,
)
def _opg_ogr(c: Ctx):
    # Megatron-LM validate_args asserts "Must use --overlap-param-gather with --overlap-grad-reduce";
    # the renderer drops --overlap-param-gather in that case, so the overlap is lost, not the run.
    return (
        [OVERLAP_PARAM_GATHER, OVERLAP_GRAD_REDUCE],
        "overlap_param_gather needs overlap_grad_reduce (Megatron-LM: 'Must use --overlap-param-gather "
        "with --overlap-grad-reduce'); the launch script omits --overlap-param-gather, so the parameter "
        "all-gather will not be overlapped",
        "set parallelism.overlap_grad_reduce true, or overlap_param_gather false",
    )


@rule(
    "fsdp2_with_distributed_optimizer",
    "error",
    AREA,
    "FSDP2 replaces the distributed optimizer",
    when=lambda c: c.use_torch_fsdp2 and c.use_distributed_optimizer,
)
def _fsdp_distopt(c: Ctx):
    # Megatron-LM validate_args asserts this message.
    return (
        [FSDP2, DIST_OPT],
        "--use-torch-fsdp2 is not supported with MCore's distributed optimizer",
        "set parallelism.use_distributed_optimizer false (FSDP2 shards parameters, gradients and optimizer "
        "state itself) and overlap_param_gather false",
    )


@rule(
    "fsdp2_with_pipeline_parallel",
    "error",
    AREA,
    "FSDP2 without PP",
    when=lambda c: c.use_torch_fsdp2 and c.pp > 1,
)
def _fsdp_pp(c: Ctx):
    # Megatron-LM validate_args asserts this message.
    return (
        [FSDP2, PP],
        "--use-torch-fsdp2 is not supported with pipeline parallelism",
        "set parallelism.pipeline_model_parallel_size 1, or implementation.use_torch_fsdp2 false",
    )


@rule(
    "fsdp2_with_expert_parallel",
    "error",
    AREA,
    "FSDP2 without EP",
    when=lambda c: c.use_torch_fsdp2 and c.ep > 1,
)
def _fsdp_ep(c: Ctx):
    # Megatron-LM validate_args asserts this message.
    return (
        [FSDP2, EP],
        "--use-torch-fsdp2 is not supported with expert parallelism",
        "set parallelism.expert_model_parallel_size 1, or implementation.use_torch_fsdp2 false",
    )


@rule(
    "fsdp2_needs_untied_embeddings",
    "error",
    AREA,
    "FSDP2 with untied embeddings only",
    when=lambda c: c.use_torch_fsdp2 and not c.shape.untie_embeddings_and_output_weights,
)
def _fsdp_tied(c: Ctx):
    # Megatron-LM validate_args asserts this message.
    return (
        [FSDP2, "model.untie_embeddings_and_output_weights"],
        "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights",
        "set implementation.use_torch_fsdp2 false (this model ties its embeddings)",
    )


@rule(
    "megatron_fsdp_with_torch_fsdp2",
    "error",
    AREA,
    "one FSDP implementation at a time",
    when=lambda c: c.use_megatron_fsdp and c.use_torch_fsdp2,
)
def _two_fsdps(c: Ctx):
    # megatron/training/models/dist_utils.py _ddp_wrap raises this ValueError.
    return (
        [MEGATRON_FSDP, FSDP2],
        "Using use_megatron_fsdp and use_torch_fsdp2 at the same time is not supported.",
        "set implementation.use_torch_fsdp2 false (Megatron-FSDP also shards parameters: "
        "data_parallel_sharding_strategy optim_grads_params), or use_megatron_fsdp false",
    )


@rule(
    "megatron_fsdp_turns_on_distributed_optimizer",
    "warning",
    AREA,
    "Megatron-FSDP runs with the distributed optimizer",
    when=lambda c: c.use_megatron_fsdp and not c.use_distributed_optimizer,
)
def _mfsdp_distopt(c: Ctx):
    # validate_args warns and sets args.use_distributed_optimizer = True under --use-megatron-fsdp.
    return (
        [MEGATRON_FSDP, DIST_OPT],
        "Megatron-FSDP is only compatible with --use-distributed-optimizer: Megatron-LM turns it on itself "
        "(use_distributed_optimizer false is not what runs)",
        "set parallelism.use_distributed_optimizer true",
    )


@rule(
    "sharding_strategy_without_megatron_fsdp",
    "warning",
    AREA,
    "the sharding strategy is Megatron-FSDP's",
    when=lambda c: not c.use_megatron_fsdp and c.data_parallel_sharding_strategy != "optim_grads_params",
)
def _strategy_unused(c: Ctx):
    # Only Megatron-FSDP's buffers read --data-parallel-sharding-strategy; DDP and FSDP2 ignore it.
    return (
        [SHARDING_STRATEGY, MEGATRON_FSDP],
        f"data_parallel_sharding_strategy {c.data_parallel_sharding_strategy!r} is ignored without Megatron-FSDP "
        "(DDP shards only the optimizer state, with use_distributed_optimizer)",
        "set implementation.use_megatron_fsdp true, or leave data_parallel_sharding_strategy at its default",
    )


@rule(
    "megatron_fsdp_gradients_in_bf16",
    "info",
    AREA,
    "Megatron-FSDP's gradient buffer dtype",
    when=lambda c: c.use_megatron_fsdp and c.grad_reduce_in_fp32,
)
def _mfsdp_grads(c: Ctx):
    # Megatron-FSDP's gradient buffer takes --megatron-fsdp-main-grads-dtype ('auto' = the bf16 parameter
    # dtype: param_and_grad_buffer._resolve_group_grad_dtype); accumulate_allreduce_grads_in_fp32 is DDP's.
    return (
        [GRAD_REDUCE_FP32, MEGATRON_FSDP],
        "grad_reduce_in_fp32 does not reach Megatron-FSDP: its gradients are accumulated and reduced in bf16 "
        "(--megatron-fsdp-main-grads-dtype auto); the estimates use 2 B per gradient",
        "set implementation.grad_reduce_in_fp32 false to say what runs",
    )


@rule(
    "precision_aware_optimizer_needs_distributed_optimizer",
    "error",
    AREA,
    "the precision-aware optimizer is a distributed-optimizer feature",
    when=lambda c: c.use_precision_aware_optimizer and not c.use_distributed_optimizer and not c.use_megatron_fsdp,
)
def _pao_distopt(c: Ctx):
    # megatron/core/optimizer/optimizer_config.py OptimizerConfig.__post_init__ asserts this message.
    return (
        [PRECISION_AWARE, DIST_OPT],
        "--use-precision-aware-optimizer only supported with distributed optimizer",
        "set parallelism.use_distributed_optimizer true, or implementation.use_precision_aware_optimizer false",
    )


@rule(
    "optimizer_state_dtype_ignored",
    "warning",
    AREA,
    "optimizer-state dtypes need the precision-aware optimizer",
    when=lambda c: not c.use_precision_aware_optimizer and (c.exp_avg_dtype != "fp32" or c.exp_avg_sq_dtype != "fp32"),
)
def _state_dtype(c: Ctx):
    # megatron/core/optimizer/__init__.py passes exp_avg(_sq)_dtype to TE's FusedAdam only with the
    # precision-aware optimizer; otherwise Adam keeps fp32 moments.
    return (
        [EXP_AVG_DTYPE, EXP_AVG_SQ_DTYPE, PRECISION_AWARE],
        f"exp_avg_dtype {c.exp_avg_dtype} / exp_avg_sq_dtype {c.exp_avg_sq_dtype} are ignored without "
        "--use-precision-aware-optimizer: Adam keeps fp32 moments",
        "set implementation.use_precision_aware_optimizer true, or the dtypes back to fp32",
    )


@rule(
    "flex_dispatcher_needs_tp_ep",
    "error",
    AREA,
    "the flex dispatcher needs an expert group",
    when=lambda c: c.is_moe and c.moe_token_dispatcher_type == "flex" and c.etp * c.ep == 1,
)
def _flex_1(c: Ctx):
    # MoEFlexTokenDispatcher.__init__ asserts "Flex token dispatcher requires TPxEP > 1" (TP here is
    # the expert tensor-parallel size).
    return (
        [DISPATCHER, EP, ETP],
        "Flex token dispatcher requires TPxEP > 1 (expert_tensor_parallel_size x expert_model_parallel_size = 1)",
        "set implementation.moe_token_dispatcher_type alltoall, or expert_model_parallel_size > 1",
    )


@rule(
    "flex_dispatcher_backend",
    "info",
    AREA,
    "the flex dispatcher needs DeepEP or HybridEP",
    when=lambda c: c.is_moe and c.moe_token_dispatcher_type == "flex" and c.etp * c.ep > 1,
)
def _flex_backend(c: Ctx):
    return (
        [DISPATCHER],
        "moe_token_dispatcher_type flex runs through DeepEP or HybridEP (--moe-flex-dispatcher-backend); "
        "that library must be installed in the training image",
        None,
    )


@rule(
    "allgather_dispatcher_with_ep",
    "info",
    AREA,
    "allgather dispatch gathers every token on every EP rank",
    when=lambda c: c.is_moe and c.moe_token_dispatcher_type == "allgather" and c.ep > 1,
)
def _allgather(c: Ctx):
    return (
        [DISPATCHER, EP],
        f"the allgather dispatcher gathers all tokens of the {c.ep * c.etp} expert-parallel ranks onto each rank, "
        "so its traffic and buffers grow with EP; alltoall sends each token only where it is routed",
        "set implementation.moe_token_dispatcher_type alltoall",
    )


@rule(
    "grouped_gemm_off",
    "info",
    AREA,
    "per-expert GEMMs launched one by one",
    when=lambda c: c.is_moe and not c.moe_grouped_gemm and c.num_experts // c.ep > 1,
)
def _grouped(c: Ctx):
    return (
        [GROUPED_GEMM],
        f"without moe_grouped_gemm the {c.num_experts // c.ep} local experts run as separate small GEMMs, "
        "one launch each",
        "set implementation.moe_grouped_gemm true",
    )


@rule(
    "te_cross_entropy_fusion_refused_by_megatron",
    "error",
    AREA,
    "Megatron-LM refuses TE's fused cross entropy",
    when=lambda c: c.cross_entropy_loss_fusion and c.cross_entropy_fusion_impl == "te",
)
def _te_ce_refused(c: Ctx):
    # megatron/training/arguments.py validate_args (core_r0.19): asserts not (cross_entropy_loss_fusion
    # and cross_entropy_fusion_impl == 'te'), "disabled due to stability issues".
    return (
        ["implementation.cross_entropy_fusion_impl", "implementation.cross_entropy_loss_fusion"],
        "Megatron-LM 0.19 refuses --cross-entropy-loss-fusion with --cross-entropy-fusion-impl te "
        "(TE's fused cross entropy is disabled for stability)",
        "set implementation.cross_entropy_fusion_impl native, or cross_entropy_loss_fusion false",
    )


@rule(
    "te_cross_entropy_needs_transformer_engine",
    "error",
    AREA,
    "TE's cross entropy needs the TE layer spec",
    when=lambda c: c.cross_entropy_fusion_impl == "te" and c.transformer_impl != "transformer_engine",
)
def _te_ce(c: Ctx):
    return (
        ["implementation.cross_entropy_fusion_impl", TRANSFORMER_IMPL],
        "cross_entropy_fusion_impl 'te' is Transformer Engine's kernel, which the local spec does not load",
        "set implementation.cross_entropy_fusion_impl native, or transformer_impl transformer_engine",
    )


# ---- MoE token drop and the combined 1F1B schedule (TransformerConfig.__post_init__, token_dispatcher.py) ----


@rule(
    "pad_needs_capacity_factor",
    "error",
    AREA,
    "padding to capacity needs a capacity factor",
    when=lambda c: c.is_moe and c.moe_pad_expert_input_to_capacity and c.moe_expert_capacity_factor is None,
)
def _pad_cf(c: Ctx):
    # MoEAlltoAllTokenDispatcher.__init__: assert config.moe_expert_capacity_factor is not None
    return (
        [PAD_TO_CAPACITY, CAPACITY_FACTOR],
        "moe_pad_expert_input_to_capacity pads each expert to its capacity, which only a capacity factor defines",
        "set implementation.moe_expert_capacity_factor (1.0 is Megatron-Bridge's token-drop setting), or "
        "moe_pad_expert_input_to_capacity false",
    )


@rule(
    "ep_overlap_needs_ep",
    "error",
    AREA,
    "the all-to-all overlap needs expert parallelism and the alltoall or flex dispatcher",
    when=lambda c: c.is_moe and c.overlap_moe_expert_parallel_comm
    and (c.ep == 1 or c.moe_token_dispatcher_type not in ("alltoall", "flex")),
)
def _ep_overlap_ep(c: Ctx):
    return (
        [EP_OVERLAP, EP, DISPATCHER],
        f"overlap_moe_expert_parallel_comm is only supported with expert_model_parallel_size > 1 and the alltoall or "
        f"flex dispatcher (EP {c.ep}, dispatcher {c.moe_token_dispatcher_type})",
        "set expert_model_parallel_size > 1 and implementation.moe_token_dispatcher_type alltoall, or "
        "overlap_moe_expert_parallel_comm false",
    )


@rule(
    "ep_overlap_recompute",
    "error",
    AREA,
    "the all-to-all overlap cannot recompute whole layers or the MoE block",
    when=lambda c: c.is_moe and c.overlap_moe_expert_parallel_comm
    and (c.recompute_granularity == "full" or c.recompute_method is not None or "moe" in (c.recompute_modules or ())),
)
def _ep_overlap_rc(c: Ctx):
    return (
        [EP_OVERLAP, RECOMPUTE_GRANULARITY, RECOMPUTE_METHOD, RECOMPUTE_MODULES],
        "overlap_moe_expert_parallel_comm needs no full recompute, no recompute_method and no 'moe' in "
        "recompute_modules (TransformerConfig asserts each)",
        "use selective recompute of other modules (e.g. moe_act, layernorm), or overlap_moe_expert_parallel_comm false",
    )


@rule(
    "ep_overlap_needs_vp",
    "error",
    AREA,
    "the all-to-all overlap with pipeline parallelism needs the interleaved schedule",
    when=lambda c: c.is_moe and c.overlap_moe_expert_parallel_comm and c.pp > 1 and not c.interleaved,
)
def _ep_overlap_vp(c: Ctx):
    return (
        [EP_OVERLAP, PP, "parallelism.virtual_pipeline_model_parallel_size"],
        "with pipeline_model_parallel_size > 1, overlap_moe_expert_parallel_comm needs "
        "virtual_pipeline_model_parallel_size (the combined 1F1B schedule is the interleaved one's)",
        "set virtual_pipeline_model_parallel_size to 2 or more, or overlap_moe_expert_parallel_comm false",
    )


@rule(
    "delay_wgrad_needs_overlap",
    "error",
    AREA,
    "delay_wgrad_compute needs the all-to-all overlap and Transformer Engine",
    when=lambda c: c.delay_wgrad_compute and (not c.overlap_moe_expert_parallel_comm or c.transformer_impl != "transformer_engine"),
)
def _delay_wgrad(c: Ctx):
    return (
        [DELAY_WGRAD, EP_OVERLAP, TRANSFORMER_IMPL],
        "delay_wgrad_compute needs overlap_moe_expert_parallel_comm and the Transformer Engine layers "
        "(TransformerConfig and validate_args assert both)",
        "set implementation.overlap_moe_expert_parallel_comm true with transformer_impl transformer_engine, or "
        "delay_wgrad_compute false",
    )
