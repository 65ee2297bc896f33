"""Precision against the GPU, and parallel groups against the node boundary."""

from __future__ import annotations

PRECISION = "training.precision"


def test_fp8_on_ampere_is_an_error_with_a_fix(kit):
    p = kit.plan(cluster={"gpu": "a100-80gb"}, training={"precision": "fp8"})
    f = kit.one(p, "fp8_needs_hopper")
    assert f.severity == "error"
    assert f.fields == [PRECISION, "cluster.gpu"]
    assert "ampere" in f.message and "bf16" in f.fix and "h100-sxm" in f.fix


def test_fp8_on_hopper_is_fine(kit):
    assert "fp8_needs_hopper" not in kit.codes(kit.plan(training={"precision": "fp8"}))


def test_mxfp8_needs_blackwell(kit):
    p = kit.plan(training={"precision": "fp8", "fp8_recipe": "mxfp8"})
    f = kit.one(p, "mxfp8_needs_blackwell")
    assert f.severity == "error" and f.fields[0] == "training.fp8_recipe"
    assert "hopper" in f.message
    b200 = kit.plan(cluster={"gpu": "b200"}, training={"precision": "fp8", "fp8_recipe": "mxfp8"})
    assert "mxfp8_needs_blackwell" not in kit.codes(b200)


def test_fp8_with_the_local_spec_is_an_error(kit):
    p = kit.plan(
        training={"precision": "fp8"},
        parallelism={"sequence_parallel": False},
        implementation={"transformer_impl": "local"},
    )
    f = kit.one(p, "fp8_needs_transformer_engine")
    assert f.severity == "error"
    assert f.fields == [PRECISION, "implementation.transformer_impl"]
    assert "transformer_engine" in f.fix


def test_fp8_param_gather_without_fp8_is_an_error(kit):
    p = kit.plan(training={"fp8_param_gather": True})
    f = kit.one(p, "fp8_param_gather_without_fp8")
    assert f.severity == "error"
    assert f.message.startswith("fp8_param must be used together with fp8 mode.")


def test_fp8_param_gather_needs_the_distributed_optimizer(kit):
    p = kit.plan(
        training={"precision": "fp8", "fp8_param_gather": True},
        parallelism={"use_distributed_optimizer": False, "overlap_param_gather": False},
    )
    f = kit.one(p, "fp8_param_gather_needs_distributed_optimizer")
    assert f.severity == "error"
    assert f.fields == ["training.fp8_param_gather", "parallelism.use_distributed_optimizer"]
    assert f.message.startswith("--fp8-param-gather only supported with distributed optimizer")


def test_fp8_recipe_on_a_bf16_run_is_info(kit):
    p = kit.plan(training={"fp8_recipe": "tensorwise"})
    f = kit.one(p, "fp8_options_ignored")
    assert f.severity == "info" and "tensorwise" in f.message


def test_fp8_needs_gemm_widths_divisible_by_16(kit):
    model = dict(num_layers=8, hidden_size=1000, num_attention_heads=8, vocab_size=32000)
    p = kit.plan(
        model=model,
        cluster={"num_gpus": 8},
        training={"precision": "fp8"},
        parallelism={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": False,
        },
    )
    f = kit.one(p, "fp8_dims_not_aligned")
    assert f.severity == "error"
    assert "hidden_size = 1000" in f.message and "ffn_hidden_size / TP = 4000" not in f.message


def test_tp16_across_two_nodes_warns_with_the_network_cost(kit):
    p = kit.plan(
        model={"name": "llama3-8b"},
        cluster={"num_gpus": 32},
        parallelism={"tensor_model_parallel_size": 16, "pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "tp_spans_nodes")
    assert f.severity == "warning"
    assert f.fields == ["parallelism.tensor_model_parallel_size", "cluster.gpus_per_node"]
    # Korthikanti 2022 sec. 4.2.2: 8 ring collectives per layer and micro-batch, each moving (t-1)/t of
    # s*b*h bf16: 32 layers, DP 2 -> 64 micro-batches per step.
    per_layer = 8 * (15 / 16) * 8192 * 1 * 4096 * 2
    gb = per_layer * 32 * 64 / 1e9
    assert f"~{gb:.1f} GB per GPU per step" in f.message
    assert f"~{gb / 50:.2f} s at 50 GB/s" in f.message and "(9x slower)" in f.message
    assert "8" in f.fix


def test_tp3_on_eight_gpu_nodes_straddles_node_boundaries(kit):
    model = dict(num_layers=24, hidden_size=3072, num_attention_heads=24, vocab_size=32000)
    p = kit.plan(
        model=model,
        cluster={"num_gpus": 48},
        parallelism={"tensor_model_parallel_size": 3, "pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "tp_group_straddles_nodes")
    assert f.severity == "warning"
    assert "gpus_per_node (8) is not a multiple of tensor_model_parallel_size (3)" in f.message
    assert f.fix.endswith("2, 4 or 8")


def test_expert_parallel_group_beyond_a_node_warns_with_the_share_leaving_it(kit):
    p = kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 16},
        parallelism={
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 8,
            "expert_tensor_parallel_size": 2,
        },
    )
    f = kit.one(p, "expert_group_spans_nodes")
    assert f.severity == "warning"
    assert "(8 x 2 = 16)" in f.message
    assert "about 50% of the MoE token all-to-all" in f.message  # 1 - 8/16 with uniform routing


def test_context_parallel_across_nodes_is_info_with_the_kv_traffic(kit):
    p = kit.plan(parallelism={"pipeline_model_parallel_size": 1, "context_parallel_size": 2})
    f = kit.one(p, "cp_spans_nodes")
    assert f.severity == "info"
    # K and V of the local 4096 tokens, one KV head per TP rank (8 groups / TP8), head dim 128, bf16,
    # passed once (CP-1) forward and about twice backward.
    kv = 2 * 4096 * 1 * 1 * 128 * 2
    assert f"~{3 * kv / 1e6:.0f} MB" in f.message
