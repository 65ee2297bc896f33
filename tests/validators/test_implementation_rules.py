"""Implementation rules: layer spec, attention kernel, overlap switches, FSDP2, MoE dispatch."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

from mcore_advisor.validators import validate

IMPL = "implementation.transformer_impl"
BACKEND = "implementation.attention_backend"


def _moe(kit, ep=8, **impl):
    return kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 8},
        parallelism={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": ep,
        },
        implementation=impl,
    )


def test_local_spec_with_sequence_parallel_is_an_error(kit):
    f = kit.one(kit.plan(implementation={"transformer_impl": "local"}), "sequence_parallel_needs_te_norm")
    assert f.severity == "error"
    assert f.fields == ["parallelism.sequence_parallel", IMPL]
    assert f.message.startswith("sequence parallel not supported by torch LayerNorm")
    assert "transformer_engine" in f.fix and "sequence_parallel false" in f.fix


def test_context_parallel_with_the_local_spec_is_an_error(kit):
    p = kit.plan(
        implementation={"transformer_impl": "local"},
        parallelism={
            "sequence_parallel": False,
            "pipeline_model_parallel_size": 1,
            "context_parallel_size": 2,
        },
    )
    f = kit.one(p, "context_parallel_needs_te_attention")
    assert f.severity == "error" and f.fields[0] == "parallelism.context_parallel_size"
    assert f.message.startswith("Context parallelism is only supported by TEDotProductAttention!")


def test_context_parallel_with_te_unfused_attention_is_an_error(kit):
    p = kit.plan(
        implementation={"attention_backend": "unfused"},
        parallelism={"pipeline_model_parallel_size": 1, "context_parallel_size": 2},
    )
    f = kit.one(p, "context_parallel_with_unfused_attention")
    assert f.severity == "error" and f.fields == ["parallelism.context_parallel_size", BACKEND]
    assert "auto, flash or fused" in f.fix


def test_attention_backend_local_needs_the_local_spec(kit):
    f = kit.one(
        kit.plan(implementation={"attention_backend": "local"}), "attention_backend_local_needs_local_spec"
    )
    assert f.severity == "error" and f.fields == [BACKEND, IMPL]
    assert "--attention-backend local is only supported" in f.message


def test_te_backends_are_ignored_by_the_local_spec(kit):
    p = kit.plan(
        implementation={"transformer_impl": "local", "attention_backend": "flash"},
        parallelism={"sequence_parallel": False},
    )
    f = kit.one(p, "attention_backend_ignored_by_local_spec")
    assert f.severity == "warning" and "flash" in f.message


def test_unfused_attention_memory_is_quantified_and_bounded_by_a_measurement(kit):
    # GPT 1.3B, local spec, s 2048, mbs 4 on one H200: the shape of shared/data/device-measurements-h200.jsonl.
    p = kit.plan(
        model={"name": "gpt3-1.3b"},
        cluster={"gpu": "h200", "num_gpus": 1},
        training={"seq_length": 2048, "global_batch_size": 32, "micro_batch_size": 4},
        parallelism={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": False,
        },
        implementation={"transformer_impl": "local"},
    )
    f = kit.one(p, "unfused_attention_memory")
    assert f.severity == "warning"
    # Korthikanti 2022: 5 bytes per score, 4 * 16 heads * 2048^2 scores per layer, 24 layers.
    per_layer_gib = 5 * 4 * 16 * 2048**2 / 2**30
    stage_gib = per_layer_gib * 24
    assert f"{per_layer_gib:.1f} GiB per layer" in f.message and f"{stage_gib:.1f} GiB" in f.message
    # Measured on H200 (megatron-core 0.19.2): peak allocated 74.84 GiB with unfused attention vs 37.70 GiB
    # with SDPA at the same shape. The s^2 estimate is a floor that explains most of that gap.
    measured_gap = 74.84 - 37.70
    estimate = float(re.search(r"([\d.]+) GiB for the", f.message).group(1))
    assert 0.7 * measured_gap <= estimate <= measured_gap


def test_unfused_attention_on_short_sequences_is_only_info(kit):
    p = kit.plan(
        training={"seq_length": 1024},
        parallelism={"sequence_parallel": False},
        implementation={"transformer_impl": "local"},
    )
    assert kit.one(p, "unfused_attention_memory").severity == "info"


def test_tp_comm_overlap_needs_sequence_parallel(kit):
    p = kit.plan(parallelism={"sequence_parallel": False, "tp_comm_overlap": True})
    f = kit.one(p, "tp_comm_overlap_needs_sequence_parallel")
    assert f.severity == "error" and f.fields[0] == "parallelism.tp_comm_overlap"
    assert f.message.startswith(
        "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism"
    )


def test_tp_comm_overlap_needs_transformer_engine(kit):
    p = kit.plan(parallelism={"tp_comm_overlap": True}, implementation={"transformer_impl": "local"})
    f = kit.one(p, "tp_comm_overlap_needs_te")
    assert f.severity == "error" and f.fields == ["parallelism.tp_comm_overlap", IMPL]


def test_overlap_param_gather_needs_the_distributed_optimizer(kit):
    p = kit.plan(parallelism={"use_distributed_optimizer": False})
    f = kit.one(p, "overlap_param_gather_needs_distributed_optimizer")
    # the plan default (true) must not block a plan without the distributed optimizer
    assert f.severity == "info"
    assert "ignored without the distributed optimizer" in f.message
    assert "--overlap-param-gather only supported with distributed optimizer or megatron fsdp" in f.message


def test_overlap_param_gather_needs_overlap_grad_reduce(kit):
    p = kit.plan(parallelism={"overlap_grad_reduce": False})
    f = kit.one(p, "overlap_param_gather_needs_overlap_grad_reduce")
    assert f.severity == "warning"
    assert "Must use --overlap-param-gather with --overlap-grad-reduce" in f.message


def test_fsdp2_with_the_distributed_optimizer_is_an_error(kit):
    p = kit.plan(implementation={"use_torch_fsdp2": True}, parallelism={"pipeline_model_parallel_size": 1})
    f = kit.one(p, "fsdp2_with_distributed_optimizer")
    assert f.severity == "error"
    assert f.message == "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"


def test_fsdp2_with_pipeline_parallel_is_an_error(kit):
    p = kit.plan(
        implementation={"use_torch_fsdp2": True},
        parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False},
    )
    f = kit.one(p, "fsdp2_with_pipeline_parallel")
    assert f.severity == "error" and f.fields[1] == "parallelism.pipeline_model_parallel_size"


def test_fsdp2_with_expert_parallel_is_an_error(kit):
    f = kit.one(_moe(kit, use_torch_fsdp2=True), "fsdp2_with_expert_parallel")
    assert f.severity == "error" and "expert parallelism" in f.message


def test_fsdp2_needs_untied_embeddings(kit):
    p = kit.plan(
        model={"name": "llama3-70b", "untie_embeddings_and_output_weights": False},
        implementation={"use_torch_fsdp2": True},
    )
    f = kit.one(p, "fsdp2_needs_untied_embeddings")
    assert f.severity == "error"
    assert f.message == "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"


def test_flex_dispatcher_needs_an_expert_group(kit):
    f = kit.one(_moe(kit, ep=1, moe_token_dispatcher_type="flex"), "flex_dispatcher_needs_tp_ep")
    assert f.severity == "error" and f.fields[0] == "implementation.moe_token_dispatcher_type"
    assert f.message.startswith("Flex token dispatcher requires TPxEP > 1")


def test_flex_dispatcher_points_at_its_backend(kit):
    f = kit.one(_moe(kit, moe_token_dispatcher_type="flex"), "flex_dispatcher_backend")
    assert f.severity == "info" and "DeepEP" in f.message


def test_allgather_dispatcher_with_expert_parallel_is_info(kit):
    f = kit.one(_moe(kit, moe_token_dispatcher_type="allgather"), "allgather_dispatcher_with_ep")
    assert f.severity == "info" and "alltoall" in f.fix


def test_grouped_gemm_off_with_several_local_experts_is_info(kit):
    f = kit.one(_moe(kit, ep=1, moe_grouped_gemm=False), "grouped_gemm_off")
    assert f.severity == "info" and "the 8 local experts" in f.message


def test_te_cross_entropy_needs_the_transformer_engine_spec(kit):
    p = kit.plan(implementation={"cross_entropy_fusion_impl": "te", "transformer_impl": "local"})
    f = kit.one(p, "te_cross_entropy_needs_transformer_engine")
    assert f.severity == "error" and "implementation.cross_entropy_fusion_impl" in f.fields
    ok = kit.plan(implementation={"cross_entropy_fusion_impl": "te"})
    assert "te_cross_entropy_needs_transformer_engine" not in [x.code for x in validate(ok)]


def test_fused_te_cross_entropy_is_refused_as_megatron_lm_refuses_it(kit):
    # megatron/training/arguments.py (core_r0.19) asserts against this pair before any training.
    bad = kit.plan(implementation={"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"})
    f = [x for x in validate(bad) if x.code == "te_cross_entropy_fusion_refused_by_megatron"]
    assert f and f[0].severity == "error" and "native" in f[0].fix
    ok = kit.plan(implementation={"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"})
    assert "te_cross_entropy_fusion_refused_by_megatron" not in {x.code for x in validate(ok)}


# ---- Megatron-FSDP and the precision-aware optimizer ------------------------------------------


def _megatron_source(relpath: str) -> str:
    """A Megatron-LM source file's text (read, not imported), or the test skips without megatron-core."""
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed (the job extra)")
    return (pathlib.Path(next(iter(spec.submodule_search_locations))) / relpath).read_text()


def test_megatron_fsdp_with_torch_fsdp2_is_an_error_with_megatrons_message(kit):
    p = kit.plan(implementation={"use_torch_fsdp2": True, "use_megatron_fsdp": True},
                 parallelism={"pipeline_model_parallel_size": 1})
    f = kit.one(p, "megatron_fsdp_with_torch_fsdp2")
    assert f.severity == "error" and f.fields == ["implementation.use_megatron_fsdp", "implementation.use_torch_fsdp2"]
    # the ValueError megatron/training/models/dist_utils.py _ddp_wrap raises, word for word
    assert f.message in _megatron_source("training/models/dist_utils.py")


def test_megatron_fsdp_accepts_expert_parallel_and_the_distributed_optimizer(kit):
    # The layout MoE-ModelZoo's Qwen3-235B ran (EP 8, Megatron-FSDP): none of torch FSDP2's refusals apply.
    codes = kit.codes(_moe(kit, use_megatron_fsdp=True))
    assert not [c for c in codes if c.startswith("fsdp2_")]
    assert "megatron_fsdp_turns_on_distributed_optimizer" not in codes


def test_megatron_fsdp_without_the_distributed_optimizer_warns_that_megatron_turns_it_on(kit):
    p = kit.plan(implementation={"use_megatron_fsdp": True},
                 parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False})
    f = kit.one(p, "megatron_fsdp_turns_on_distributed_optimizer")
    assert f.severity == "warning" and "use_distributed_optimizer true" in f.fix
    # validate_args sets it itself: the run goes ahead, so no error may block it
    assert not [g for g in kit.findings(p) if g.severity == "error"]
    assert "args.use_distributed_optimizer = True" in _megatron_source("training/arguments.py")


def test_fp8_param_gather_is_accepted_under_megatron_fsdp(kit):
    p = kit.plan(training={"precision": "fp8", "fp8_param_gather": True},
                 implementation={"use_megatron_fsdp": True},
                 parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False})
    assert "fp8_param_gather_needs_distributed_optimizer" not in kit.codes(p)
    p2 = kit.plan(training={"precision": "fp8", "fp8_param_gather": True},
                  parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False})
    assert "fp8_param_gather_needs_distributed_optimizer" in kit.codes(p2)


def test_a_sharding_strategy_without_megatron_fsdp_is_ignored_with_a_warning(kit):
    f = kit.one(kit.plan(implementation={"data_parallel_sharding_strategy": "optim"}),
                "sharding_strategy_without_megatron_fsdp")
    assert f.severity == "warning" and "'optim'" in f.message
    # Megatron's own default strategy says nothing
    assert "sharding_strategy_without_megatron_fsdp" not in kit.codes(kit.plan())


def test_megatron_fsdp_notes_that_its_gradients_are_bf16(kit):
    f = kit.one(kit.plan(implementation={"use_megatron_fsdp": True}), "megatron_fsdp_gradients_in_bf16")
    assert f.severity == "info" and "bf16" in f.message
    p = kit.plan(implementation={"use_megatron_fsdp": True, "grad_reduce_in_fp32": False})
    assert "megatron_fsdp_gradients_in_bf16" not in kit.codes(p)


def test_precision_aware_optimizer_needs_the_distributed_optimizer(kit):
    p = kit.plan(implementation={"use_precision_aware_optimizer": True},
                 parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False})
    f = kit.one(p, "precision_aware_optimizer_needs_distributed_optimizer")
    assert f.severity == "error"
    # OptimizerConfig.__post_init__'s assertion message
    assert f.message in _megatron_source("core/optimizer/optimizer_config.py")
    ok = kit.plan(implementation={"use_precision_aware_optimizer": True, "use_megatron_fsdp": True},
                  parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False})
    assert "precision_aware_optimizer_needs_distributed_optimizer" not in kit.codes(ok)


def test_optimizer_state_dtypes_without_the_precision_aware_optimizer_are_ignored(kit):
    f = kit.one(kit.plan(implementation={"exp_avg_dtype": "bf16"}), "optimizer_state_dtype_ignored")
    assert f.severity == "warning" and "fp32 moments" in f.message
    p = kit.plan(implementation={"exp_avg_dtype": "bf16", "use_precision_aware_optimizer": True})
    assert "optimizer_state_dtype_ignored" not in kit.codes(p)


def test_local_spec_with_apex_fusions_on_says_which_to_turn_off_without_apex(kit):
    f = kit.one(kit.plan(implementation={"transformer_impl": "local"}), "local_spec_fusions_need_apex")
    assert f.severity == "info"
    assert f.fields == [IMPL, "implementation.gradient_accumulation_fusion", "implementation.masked_softmax_fusion"]
    assert "Apex" in f.message and "gradient_accumulation_fusion false" in f.fix and "masked_softmax_fusion false" in f.fix
    only_softmax = kit.one(kit.plan(implementation={"transformer_impl": "local", "gradient_accumulation_fusion": False}),
                           "local_spec_fusions_need_apex")
    assert only_softmax.fields == [IMPL, "implementation.masked_softmax_fusion"]
    off = {"transformer_impl": "local", "gradient_accumulation_fusion": False, "masked_softmax_fusion": False}
    assert "local_spec_fusions_need_apex" not in [x.code for x in validate(kit.plan(implementation=off))]
    # Transformer Engine's layers fuse the accumulation themselves
    assert "local_spec_fusions_need_apex" not in [x.code for x in validate(kit.plan())]


def test_grouped_gemm_with_the_local_spec_says_sequential_mlp_runs(kit):
    f = kit.one(_moe(kit, ep=1, transformer_impl="local", moe_grouped_gemm=True), "grouped_gemm_ignored_by_local_spec")
    assert f.severity == "info" and "SequentialMLP" in f.message and "the 8 local experts" in f.message
    assert "grouped_gemm_ignored_by_local_spec" not in [x.code for x in validate(_moe(kit, ep=1, moe_grouped_gemm=True))]


# ---- token drop and the combined 1F1B schedule (TransformerConfig.__post_init__'s asserts) ----


def test_padding_to_capacity_needs_a_capacity_factor(kit):
    f = kit.one(_moe(kit, moe_pad_expert_input_to_capacity=True), "pad_needs_capacity_factor")
    assert f.severity == "error"
    assert f.fields == ["implementation.moe_pad_expert_input_to_capacity", "implementation.moe_expert_capacity_factor"]
    assert "moe_expert_capacity_factor" in f.fix
    assert "pad_needs_capacity_factor" not in kit.codes(_moe(kit, moe_pad_expert_input_to_capacity=True,
                                                               moe_expert_capacity_factor=1.0))


def test_all_to_all_overlap_needs_expert_parallelism_and_alltoall(kit):
    f = kit.one(_moe(kit, ep=1, overlap_moe_expert_parallel_comm=True), "ep_overlap_needs_ep")
    assert f.severity == "error" and "expert_model_parallel_size > 1" in f.message
    g = kit.one(_moe(kit, overlap_moe_expert_parallel_comm=True, moe_token_dispatcher_type="allgather"),
                "ep_overlap_needs_ep")
    assert "dispatcher allgather" in g.message and "alltoall" in g.fix
    assert "ep_overlap_needs_ep" not in kit.codes(_moe(kit, overlap_moe_expert_parallel_comm=True))


def test_all_to_all_overlap_refuses_full_recompute(kit):
    p = kit.plan(model=kit.MIXTRAL, cluster={"num_gpus": 8},
                 parallelism={"expert_model_parallel_size": 8, "recompute_granularity": "full",
                              "recompute_method": "uniform", "recompute_num_layers": 1},
                 implementation={"overlap_moe_expert_parallel_comm": True})
    f = kit.one(p, "ep_overlap_recompute")
    assert f.severity == "error" and "parallelism.recompute_granularity" in f.fields
    assert "moe_act" in f.fix


def test_all_to_all_overlap_with_pipeline_needs_the_interleaved_schedule(kit):
    par = {"expert_model_parallel_size": 4, "pipeline_model_parallel_size": 2}
    p = kit.plan(model=kit.MIXTRAL, cluster={"num_gpus": 8}, parallelism=par,
                 implementation={"overlap_moe_expert_parallel_comm": True})
    f = kit.one(p, "ep_overlap_needs_vp")
    assert f.severity == "error" and "virtual_pipeline_model_parallel_size" in f.fix
    q = kit.plan(model=kit.MIXTRAL, cluster={"num_gpus": 8},
                 parallelism={**par, "virtual_pipeline_model_parallel_size": 2},
                 implementation={"overlap_moe_expert_parallel_comm": True})
    assert "ep_overlap_needs_vp" not in kit.codes(q)


def test_delay_wgrad_needs_the_overlap(kit):
    f = kit.one(_moe(kit, delay_wgrad_compute=True), "delay_wgrad_needs_overlap")
    assert f.severity == "error" and f.fields[0] == "implementation.delay_wgrad_compute"
    assert "overlap_moe_expert_parallel_comm true" in f.fix
    assert "delay_wgrad_needs_overlap" not in kit.codes(_moe(kit, delay_wgrad_compute=True,
                                                             overlap_moe_expert_parallel_comm=True))
