"""Cross-field feasibility of a Plan: every rule Megatron-LM / Megatron-Core enforces, plus warnings.

Public API
----------
validate(plan) -> list[Finding]
    All findings at once (errors, warnings, info), in registry order. Pure. Never raises for an
    infeasible plan; raises KeyError/ValueError only for unresolvable input (unknown model or GPU,
    a model missing required shape fields), from `knowledge.models.resolve_model` / `knowledge.hardware.gpu`.
errors(findings) -> list[Finding]
    The findings with severity 'error' (a plan is runnable when this is empty).
rule_names(severity=None, area=None) -> list[str]
    Registered codes, in the order `validate` and `layout_errors` report them; RULES holds the
    `Rule` objects (code, severity, area, summary) for per-rule rejection counts.
layout_errors(ctx) -> list[str]
    Fast path for search loops: the codes of the error rules a plan with these values would
    violate, computed on a `Ctx` of plain values without building pydantic objects. Build one
    `Ctx(shape, gpu, num_gpus=..., seq_length=..., gbs=..., ...)` per search (a resolved ModelShape
    and GpuSpec; fields left out take the Plan's defaults) and `ctx.with_layout(tp=..., pp=..., ...)`
    per layout. It returns exactly `[f.code for f in errors(validate(plan))]` for the
    equivalent plan (same order); a test checks this on a grid of layouts. Cost: about 10 us per
    call (vs ~20 us for validate on a built Plan).
"""

from __future__ import annotations

from collections.abc import Iterable

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import catalog_model, resolve_model
from mcore_advisor.schemas import Finding, Plan, Severity

from . import batch, cuda_graphs, hardware, implementation, layout, model, recompute  # noqa: F401  (registers rules)
from ._core import RULES as _REGISTERED
from ._core import Ctx, Rule

__all__ = ["validate", "errors", "rule_names", "layout_errors", "Ctx", "RULES", "Rule", "AREAS"]

AREAS = ("layout", "model", "batch", "hardware", "recompute", "implementation")

# Report order: by area as listed (layout first: a bad world size explains much that follows),
# then registration order within each module.
RULES: tuple[Rule, ...] = tuple(sorted(_REGISTERED, key=lambda r: AREAS.index(r.area)))

_ERROR_RULES = tuple(r for r in RULES if r.severity == "error")


def _ctx_from_plan(plan: Plan) -> Ctx:
    spec = plan.model
    shape = resolve_model(spec)
    g = gpu(plan.cluster.gpu)
    seq_max = spec.seq_length_max
    kv_given = spec.kv_channels is not None
    if spec.name:
        cat = catalog_model(spec.name).spec
        seq_max = seq_max if seq_max is not None else cat.seq_length_max
        kv_given = kv_given or cat.kv_channels is not None
    cl, tr, p, im = plan.cluster, plan.training, plan.parallelism, plan.implementation
    return Ctx(
        shape=shape, gpu=g, num_gpus=cl.num_gpus, gpus_per_node=cl.gpus_per_node,
        nvlink_gbps=cl.nvlink_bandwidth_gbps, scaleout_gbps=cl.scaleout_bandwidth_gbps, hbm_gib=cl.gpu_memory_gib,
        seq_length=tr.seq_length, seq_length_max=seq_max, kv_channels_given=kv_given, gbs=tr.global_batch_size,
        mbs=tr.micro_batch_size, precision=tr.precision, fp8_recipe=tr.fp8_recipe, fp8_format=tr.fp8_format,
        fp8_param_gather=tr.fp8_param_gather, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
        vp_raw=p.virtual_pipeline_model_parallel_size, cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
        etp_raw=p.expert_tensor_parallel_size, sp=p.sequence_parallel, use_distributed_optimizer=p.use_distributed_optimizer,
        recompute_granularity=p.recompute_granularity, recompute_method=p.recompute_method,
        recompute_num_layers=p.recompute_num_layers, recompute_modules=p.recompute_modules,
        overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=p.overlap_param_gather,
        tp_comm_overlap=p.tp_comm_overlap, transformer_impl=im.transformer_impl, attention_backend=im.attention_backend,
        moe_token_dispatcher_type=im.moe_token_dispatcher_type, moe_grouped_gemm=im.moe_grouped_gemm,
        use_torch_fsdp2=im.use_torch_fsdp2, use_megatron_fsdp=im.use_megatron_fsdp,
        data_parallel_sharding_strategy=im.data_parallel_sharding_strategy,
        use_precision_aware_optimizer=im.use_precision_aware_optimizer, exp_avg_dtype=im.exp_avg_dtype,
        exp_avg_sq_dtype=im.exp_avg_sq_dtype, grad_reduce_in_fp32=im.grad_reduce_in_fp32,
        decoder_first_pipeline_num_layers=p.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=p.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        cross_entropy_fusion_impl=im.cross_entropy_fusion_impl, cross_entropy_loss_fusion=im.cross_entropy_loss_fusion,
        gradient_accumulation_fusion=im.gradient_accumulation_fusion, masked_softmax_fusion=im.masked_softmax_fusion,
        moe_expert_capacity_factor=im.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=im.moe_pad_expert_input_to_capacity,
        overlap_moe_expert_parallel_comm=im.overlap_moe_expert_parallel_comm, delay_wgrad_compute=im.delay_wgrad_compute,
        cuda_graph_impl=im.cuda_graph_impl, cuda_graph_modules=tuple(im.cuda_graph_modules or ()),
        check_for_nan_in_loss_and_grad=im.check_for_nan_in_loss_and_grad,
        attention_dropout=tr.attention_dropout, hidden_dropout=tr.hidden_dropout,
    )


def validate(plan: Plan) -> list[Finding]:
    """Every finding for the plan: errors block it, warnings and info explain it."""
    c = _ctx_from_plan(plan)
    return [r.finding(c) for r in RULES if r.applies(c)]


def errors(findings: Iterable[Finding]) -> list[Finding]:
    """Only the blocking findings."""
    return [f for f in findings if f.severity == "error"]


def rule_names(severity: Severity | None = None, area: str | None = None) -> list[str]:
    """Registered rule codes in report order, optionally one severity or area."""
    return [
        r.code
        for r in RULES
        if (severity is None or r.severity == severity) and (area is None or r.area == area)
    ]


def layout_errors(c: Ctx) -> list[str]:
    """Codes of the error rules these plain values violate (see the module docstring)."""
    return [r.code for r in _ERROR_RULES if r.applies(c)]
