"""Parallel-layout rules: world size, node shape, silently dropped switches."""

from __future__ import annotations

TP = "parallelism.tensor_model_parallel_size"
PP = "parallelism.pipeline_model_parallel_size"
NUM_GPUS = "cluster.num_gpus"


def test_63_gpus_with_tp8_is_an_error_naming_num_gpus_and_suggesting_56_or_64(kit):
    p = kit.plan(cluster={"num_gpus": 63}, parallelism={"pipeline_model_parallel_size": 1})
    f = kit.one(p, "world_not_divisible_by_model_parallel")
    assert f.severity == "error"
    assert f.fields[0] == NUM_GPUS and TP in f.fields
    assert "(63)" in f.message and "= 8" in f.message
    assert "56 or 64" in f.fix


def test_world_must_divide_by_expert_tensor_times_expert_times_pipeline(kit):
    # 12 GPUs in nodes of 4, TP2 (DP6): ETP1 x EP8 x PP1 = 8 does not divide 12 although 8 experts / EP8 is fine.
    p = kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 12, "gpus_per_node": 4},
        parallelism={
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 8,
            "expert_tensor_parallel_size": 1,
        },
        training={"global_batch_size": 12},
    )
    f = kit.one(p, "world_not_divisible_by_expert_parallel")
    assert f.severity == "error"
    assert set(f.fields) >= {NUM_GPUS, "parallelism.expert_model_parallel_size"}
    assert "1x8x1 = 8" in f.message
    # num_gpus must be a multiple of lcm(8, TP*PP*CP = 2) = 8; EP 4 divides both 12 and the 8 experts.
    assert "8 or 16" in f.fix and "expert_model_parallel_size to" in f.fix and "4" in f.fix.split("to")[-1]


def test_dense_model_does_not_repeat_the_world_error_as_an_expert_error(kit):
    p = kit.plan(cluster={"num_gpus": 63}, parallelism={"pipeline_model_parallel_size": 1})
    assert "world_not_divisible_by_expert_parallel" not in kit.codes(p)


def test_twelve_gpus_on_eight_gpu_nodes_is_an_error_with_node_multiples(kit):
    p = kit.plan(
        cluster={"num_gpus": 12},
        parallelism={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1},
        training={"global_batch_size": 12},
    )
    f = kit.one(p, "num_gpus_not_multiple_of_node")
    assert f.severity == "error"
    assert f.fields == [NUM_GPUS, "cluster.gpus_per_node"]
    assert "8 or 16" in f.fix and "gpus_per_node to 6" in f.fix


def test_a_partial_single_node_is_fine(kit):
    p = kit.plan(
        cluster={"num_gpus": 4},
        parallelism={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1},
    )
    assert "num_gpus_not_multiple_of_node" not in kit.codes(p)


def test_virtual_pipeline_with_pp1_is_a_warning_not_silence(kit):
    p = kit.plan(parallelism={"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": 2})
    f = kit.one(p, "virtual_pipeline_ignored_without_pp")
    assert f.severity == "warning"
    assert f.fields == ["parallelism.virtual_pipeline_model_parallel_size", PP]
    assert "(2)" in f.message and "pipeline_model_parallel_size >= 2" in f.fix


def test_sequence_parallel_with_tp1_is_a_warning_because_megatron_disables_it(kit):
    p = kit.plan(
        model={"name": "llama3-8b"},
        cluster={"num_gpus": 8},
        parallelism={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": True,
        },
    )
    f = kit.one(p, "sequence_parallel_without_tp")
    assert f.severity == "warning"
    assert f.fields == ["parallelism.sequence_parallel", TP]
    assert "Disabling sequence parallelism" in f.message


def test_tp_without_sequence_parallel_gets_an_info_quantifying_the_saving(kit):
    p = kit.plan(parallelism={"sequence_parallel": False})
    f = kit.one(p, "sequence_parallel_recommended")
    assert f.severity == "info"
    # Korthikanti 2022 eq. 2 - eq. 4: 10*s*b*h*(1 - 1/t) bytes per layer; 40 layers per stage.
    saving = 10 * 8192 * 1 * 8192 * (1 - 1 / 8) * 40 / 2**30
    assert f"{saving:.1f} GiB" in f.message  # 21.9 GiB
    assert f.fix == "set parallelism.sequence_parallel true"


def test_moe_with_tensor_parallel_and_no_sp_is_an_error_like_megatron(kit):
    p = kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 8},
        parallelism={
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1,
            "expert_model_parallel_size": 4,
            "sequence_parallel": False,
        },
    )
    f = kit.one(p, "expert_and_tensor_parallel_without_sp")
    assert f.severity == "error"
    assert "parallelism.sequence_parallel" in f.fields
    assert "sequence parallelism must be used" in f.message
    assert "sequence_parallel_recommended" not in kit.codes(p)


def test_distributed_optimizer_with_dp1_is_harmless_info(kit):
    p = kit.plan(
        model={"name": "llama3-8b"},
        cluster={"num_gpus": 8},
        parallelism={"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 1},
    )
    f = kit.one(p, "distributed_optimizer_without_data_parallel")
    assert f.severity == "info" and f.fields == ["parallelism.use_distributed_optimizer"]
    assert f.fix is None


def test_expert_tensor_parallel_on_a_dense_model_is_a_warning(kit):
    p = kit.plan(parallelism={"expert_tensor_parallel_size": 4})
    f = kit.one(p, "expert_tensor_parallel_ignored_dense")
    assert f.severity == "warning" and f.fields == ["parallelism.expert_tensor_parallel_size"]
    assert "(4)" in f.message
