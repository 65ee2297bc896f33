"""layout_errors (the recommender's plain-int fast path) agrees with validate() on every plan."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.schemas import ClusterSpec, ModelSpec, Plan, TrainingSpec
from mcore_advisor.validators import Ctx, _ctx_from_plan, errors, layout_errors, validate

# Plan field -> Ctx field where the names differ (the search fills a Ctx from plain values).
_RENAMED = {
    "global_batch_size": "gbs", "micro_batch_size": "mbs", "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp", "virtual_pipeline_model_parallel_size": "vp_raw",
    "context_parallel_size": "cp", "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp_raw",
    "sequence_parallel": "sp", "nvlink_bandwidth_gbps": "nvlink_gbps", "scaleout_bandwidth_gbps": "scaleout_gbps",
    "gpu_memory_gib": "hbm_gib",
}


def _ctx(model: dict, cluster: dict, training: dict, parallelism: dict, implementation: dict, **extra) -> Ctx:
    values = {_RENAMED.get(k, k): v for part in (cluster, training, parallelism, implementation) for k, v in part.items()}
    values.pop("gpu", None)
    return Ctx(resolve_model(ModelSpec(**model)), gpu(cluster.get("gpu", "h100-sxm")), **values, **extra)


def _both(model: dict, cluster: dict, training: dict, parallelism: dict, implementation: dict):
    plan = Plan.model_validate(
        {
            "model": model,
            "cluster": cluster,
            "training": training,
            "parallelism": parallelism,
            "implementation": implementation,
        }
    )
    full = [f.code for f in errors(validate(plan))]
    return full, layout_errors(_ctx(model, cluster, training, parallelism, implementation))


MODELS = {
    "llama3-70b": {"name": "llama3-70b"},
    "mha-28-heads": dict(num_layers=28, hidden_size=3584, num_attention_heads=28, vocab_size=32000),
}


@pytest.mark.parametrize("model", list(MODELS))
def test_fast_path_matches_validate_on_a_grid_of_dense_layouts(model):
    n = 0
    for tp, pp, vp, cp, sp, num_gpus, gbs in itertools.product(
        (1, 2, 3, 4, 8, 16), (1, 2, 3, 4), (None, 2), (1, 2), (False, True), (8, 48, 63, 64), (96, 128)
    ):
        par = dict(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            context_parallel_size=cp,
            sequence_parallel=sp,
        )
        full, fast = _both(
            MODELS[model],
            {"num_gpus": num_gpus},
            {"seq_length": 4096, "global_batch_size": gbs, "micro_batch_size": 1},
            par,
            {},
        )
        assert fast == full, (par, num_gpus, gbs)
        n += bool(full)
    assert n > 100  # the grid does exercise the error rules


def test_fast_path_matches_validate_on_moe_layouts(kit):
    for tp, ep, etp, pp, num_gpus in itertools.product(
        (1, 2, 4), (1, 2, 3, 8, 16), (None, 1, 2), (1, 2), (8, 12, 16, 64)
    ):
        par = dict(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            sequence_parallel=tp > 1,
        )
        full, fast = _both(
            kit.MIXTRAL,
            {"num_gpus": num_gpus},
            {"seq_length": 4096, "global_batch_size": 96, "micro_batch_size": 1},
            par,
            {"moe_token_dispatcher_type": "flex" if ep == 1 else "alltoall"},
        )
        assert fast == full, (par, num_gpus)


def test_fast_path_matches_validate_on_random_option_mixes(kit):
    rng = random.Random(20260101)
    models = [{"name": "llama3-70b"}, {"name": "llama3-8b"}, kit.MIXTRAL, kit.DSV2_LITE]
    for _ in range(1500):
        model = rng.choice(models)
        gran = rng.choice([None, "selective", "full"])
        par = dict(
            tensor_model_parallel_size=rng.choice([1, 2, 4, 8]),
            pipeline_model_parallel_size=rng.choice([1, 2, 3, 4]),
            virtual_pipeline_model_parallel_size=rng.choice([None, 2, 3]),
            context_parallel_size=rng.choice([1, 2]),
            expert_model_parallel_size=rng.choice([1, 2, 4]),
            sequence_parallel=rng.random() < 0.7,
            use_distributed_optimizer=rng.random() < 0.8,
            overlap_param_gather=rng.random() < 0.7,
            overlap_grad_reduce=rng.random() < 0.9,
            tp_comm_overlap=rng.random() < 0.2,
            recompute_granularity=gran,
            recompute_method=rng.choice([None, "uniform", "block"]),
            recompute_num_layers=rng.choice([None, 1, 3, 50]),
            recompute_modules=rng.choice([None, ["core_attn"], ["moe_act", "layernorm"], ["mla_up_proj"]]),
        )
        training = dict(
            seq_length=rng.choice([4096, 4100, 8192]),
            global_batch_size=rng.choice([64, 100, 128]),
            micro_batch_size=rng.choice([1, 2]),
            precision=rng.choice(["bf16", "fp8"]),
            fp8_recipe=rng.choice(["delayed", "tensorwise", "mxfp8"]),
            fp8_param_gather=rng.random() < 0.2,
        )
        impl = dict(
            transformer_impl=rng.choice(["transformer_engine", "transformer_engine", "local"]),
            attention_backend=rng.choice(["auto", "flash", "unfused", "local"]),
            moe_token_dispatcher_type=rng.choice(["alltoall", "allgather", "flex"]),
            moe_grouped_gemm=rng.random() < 0.8,
            use_torch_fsdp2=rng.random() < 0.1,
        )
        cluster = {
            "gpu": rng.choice(["h100-sxm", "a100-80gb", "b200"]),
            "num_gpus": rng.choice([8, 16, 24, 64]),
        }
        full, fast = _both(model, cluster, training, par, impl)
        assert fast == full, (model, cluster, training, par, impl)


def test_fast_path_rejects_unknown_options():
    with pytest.raises(TypeError, match="recompute_granularty"):
        _ctx({"name": "llama3-8b"}, {"num_gpus": 8}, {"seq_length": 4096, "global_batch_size": 128}, {}, {},
             recompute_granularty="full")


def test_fast_path_on_a_valid_layout_is_empty_and_on_a_bad_one_names_the_rules():
    base = Ctx(resolve_model(ModelSpec(name="llama3-70b")), gpu("h100-sxm"), num_gpus=64, seq_length=8192, gbs=128,
               tp=8, pp=2, sp=True)
    assert layout_errors(base) == []
    # a neighbouring layout, as the search derives it: every derived field follows the change
    assert layout_errors(base.with_layout(num_gpus=63, pp=1, sp=False)) == [
        "world_not_divisible_by_model_parallel",
        "num_gpus_not_multiple_of_node",
    ]


def test_a_ctx_built_from_values_takes_the_plans_defaults_and_the_gpus_cluster_values():
    c = Ctx(resolve_model(ModelSpec(name="llama3-8b")), gpu("h100-sxm"), num_gpus=16, seq_length=4096, gbs=128)
    plan_c = _ctx_from_plan(Plan(model=ModelSpec(name="llama3-8b"), cluster=ClusterSpec(num_gpus=16),
                                 training=TrainingSpec(seq_length=4096, global_batch_size=128)))
    # the plan path adds what only the catalog knows (the model's trained context, whether it sets kv_channels)
    assert replace(c, seq_length_max=plan_c.seq_length_max, kv_channels_given=plan_c.kv_channels_given) == plan_c
    assert (c.gpus_per_node, c.dp, c.num_microbatches, c.use_distributed_optimizer) == (8, 16, 8, True)
