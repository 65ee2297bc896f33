"""Implementation rules: layer spec, attention kernel, overlap switches, FSDP2, MoE dispatch."""

from __future__ import annotations

import re

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
