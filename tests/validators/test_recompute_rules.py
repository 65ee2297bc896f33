"""Activation recomputation rules, each against Megatron's own assertion or behaviour."""

from __future__ import annotations

METHOD = "parallelism.recompute_method"
NUM_LAYERS = "parallelism.recompute_num_layers"


def _rc(kit, **par):
    return kit.plan(parallelism=par)


def test_full_recompute_without_method_is_megatrons_error(kit):
    f = kit.one(_rc(kit, recompute_granularity="full", recompute_num_layers=1), "full_recompute_needs_method")
    assert f.severity == "error" and f.fields[0] == METHOD
    assert f.message == 'Using recompute_granularity: full so recompute_method must be "block" or "uniform"'
    assert "uniform" in f.fix and "block" in f.fix


def test_full_recompute_without_num_layers_names_the_layers_per_stage(kit):
    f = kit.one(
        _rc(kit, recompute_granularity="full", recompute_method="uniform"), "full_recompute_needs_num_layers"
    )
    assert f.severity == "error" and f.fields[0] == NUM_LAYERS
    assert f.message.endswith("num_layers_per_pipeline_rank: 40")
    assert "up to 40" in f.fix


def test_selective_with_recompute_method_is_an_error_as_megatron_asserts(kit):
    f = kit.one(
        _rc(kit, recompute_granularity="selective", recompute_method="uniform"),
        "selective_recompute_with_method",
    )
    assert f.severity == "error" and f.fields[0] == METHOD
    assert "not yet supported for selective recomputing granularity" in f.message


def test_selective_with_recompute_num_layers_is_an_error(kit):
    p = _rc(kit, recompute_granularity="selective", recompute_num_layers=2)
    f = kit.one(p, "selective_recompute_with_num_layers")
    assert f.severity == "error" and f.fields[0] == NUM_LAYERS
    assert "recompute_num_layers must be None" in f.message


def test_recompute_method_without_granularity_is_a_warning(kit):
    f = kit.one(_rc(kit, recompute_method="uniform"), "recompute_options_ignored")
    assert f.severity == "warning" and "parallelism.recompute_granularity" in f.fields


def test_recompute_modules_outside_selective_are_ignored(kit):
    p = _rc(
        kit,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        recompute_modules=["mlp"],
    )
    f = kit.one(p, "recompute_modules_ignored")
    assert f.severity == "warning" and f.fields[0] == "parallelism.recompute_modules"
    assert "['mlp']" in f.message


def test_uniform_groups_that_do_not_tile_a_stage_are_an_error(kit):
    p = _rc(kit, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3)
    f = kit.one(p, "uniform_recompute_not_dividing_chunk")
    assert f.severity == "error"
    assert "the 40 layers of each pipeline stage" in f.message
    assert f.fix.endswith("2, 4 or 5")


def test_uniform_groups_are_checked_per_virtual_chunk(kit):
    # 80 layers / PP2 / VP4 = 10 layers per chunk; groups of 4 do not tile 10 (they would tile 40)
    p = _rc(
        kit,
        virtual_pipeline_model_parallel_size=4,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=4,
    )
    f = kit.one(p, "uniform_recompute_not_dividing_chunk")
    assert "the 10 layers of each model chunk" in f.message
    assert f.fix.endswith("2, 5 or 10")


def test_block_recompute_of_more_layers_than_a_stage_is_a_warning(kit):
    p = _rc(kit, recompute_granularity="full", recompute_method="block", recompute_num_layers=50)
    f = kit.one(p, "block_recompute_exceeds_chunk")
    assert f.severity == "warning"
    assert f.fix.endswith("at most 40")


def test_mla_up_proj_recompute_needs_mla(kit):
    f = kit.one(
        _rc(kit, recompute_granularity="selective", recompute_modules=["mla_up_proj"]),
        "recompute_mla_up_proj_without_mla",
    )
    assert f.severity == "error"
    assert f.message == "mla_up_proj in recompute_modules is only supported with multi_latent_attention."


def test_moe_act_recompute_needs_grouped_gemm(kit):
    p = kit.plan(
        model=kit.MIXTRAL,
        cluster={"num_gpus": 8},
        parallelism={
            "pipeline_model_parallel_size": 1,
            "recompute_granularity": "selective",
            "recompute_modules": ["moe_act"],
        },
        implementation={"moe_grouped_gemm": False},
    )
    f = kit.one(p, "recompute_moe_act_needs_grouped_gemm")
    assert f.severity == "error" and "implementation.moe_grouped_gemm" in f.fields
    assert f.message == "moe_act in recompute_modules is only supported with moe_grouped_gemm."


def test_moe_recompute_modules_on_a_dense_model_warn(kit):
    f = kit.one(
        _rc(kit, recompute_granularity="selective", recompute_modules=["moe", "mlp"]),
        "recompute_moe_modules_on_dense",
    )
    assert f.severity == "warning" and "['moe']" in f.message


def test_delayed_fp8_cannot_recompute_layernorm(kit):
    p = kit.plan(
        training={"precision": "fp8"},
        parallelism={"recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
    )
    f = kit.one(p, "fp8_delayed_recompute_modules")
    assert f.severity == "error"
    assert f.message == "Delayed scaling does not support moe_act and layernorm recompute for fp8."
    assert "tensorwise" in f.fix
    p_ok = kit.plan(
        training={"precision": "fp8", "fp8_recipe": "tensorwise"},
        parallelism={"recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
    )
    assert "fp8_delayed_recompute_modules" not in kit.codes(p_ok)


def test_core_attn_recompute_with_te_attention_is_info(kit):
    f = kit.one(_rc(kit, recompute_granularity="selective"), "core_attn_recompute_with_fused_attention")
    assert f.severity == "info"
    assert "no need to set" in f.message


def test_block_recompute_skips_mtp_layers(kit):
    p = kit.plan(
        model={"name": "llama3-70b", "mtp_num_layers": 1},
        parallelism={"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 4},
    )
    f = kit.one(p, "mtp_block_recompute_skipped")
    assert f.severity == "warning" and "uniform" in f.fix


# ------------------------------------------- every --recompute-modules choice (issue 16, part 3)

import typing  # noqa: E402

import pytest  # noqa: E402

from mcore_advisor.knowledge import megatron_flags as table  # noqa: E402
from mcore_advisor.knowledge.megatron_flags import RenderView  # noqa: E402
from mcore_advisor.knowledge.models import resolve_model  # noqa: E402
from mcore_advisor.schemas import ParallelismSpec  # noqa: E402

# Megatron-LM 0.19.2 TransformerConfig.__post_init__ allowed_modules for recompute_modules.
MEGATRON_RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
                              "gdn_norm_out"}


def _schema_modules() -> set[str]:
    ann = ParallelismSpec.model_fields["recompute_modules"].annotation
    (lst,) = [a for a in typing.get_args(ann) if a is not type(None)]
    return set(typing.get_args(typing.get_args(lst)[0]))


def test_the_schema_offers_exactly_megatrons_recompute_modules():
    assert _schema_modules() == MEGATRON_RECOMPUTE_MODULES


@pytest.mark.slow
def test_megatrons_own_allowed_modules_are_the_schemas():
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    import inspect

    src = inspect.getsource(tc.TransformerConfig.__post_init__)
    block = src[src.index("allowed_modules = {"):]
    block = block[:block.index("}")]
    assert {m for m in _schema_modules() if f'"{m}"' in block} == _schema_modules()
    assert block.count('"') // 2 == len(_schema_modules())


def _sel(kit, modules, model=None, **impl):
    # DeepSeek-V2-Lite: MLA, MoE with shared experts, grouped GEMM: every module but gdn_norm_out applies.
    return kit.plan(model=model or kit.DSV2_LITE, cluster={"num_gpus": 64},
                    parallelism={"pipeline_model_parallel_size": 1, "expert_model_parallel_size": 8,
                                 "recompute_granularity": "selective", "recompute_modules": modules},
                    implementation=impl)


@pytest.mark.parametrize("module", sorted(MEGATRON_RECOMPUTE_MODULES - {"gdn_norm_out"}))
def test_each_module_is_valid_on_a_model_that_has_it_and_round_trips_through_the_flag_table(kit, module):
    plan = _sel(kit, [module])
    assert not [f for f in kit.findings(plan) if f.severity == "error" and f.fields[0].startswith("parallelism.recompute")]
    flags = table.render(RenderView(plan, resolve_model(plan.model), None, None, []), "layout")
    argv = [a for f in flags for a in f.argv]
    i = argv.index("--recompute-modules")
    assert argv[i + 1] == module and argv[argv.index("--recompute-granularity") + 1] == "selective"
    back = table.parse({"recompute_granularity": "selective", "recompute_modules": [module]}).sections["parallelism"]
    assert back["recompute_modules"] == [module]


def test_all_modules_together_round_trip_in_order(kit):
    mods = ["core_attn", "mlp", "moe", "moe_act", "layernorm", "mla_up_proj", "shared_experts"]
    plan = _sel(kit, mods)
    argv = [a for f in table.render(RenderView(plan, resolve_model(plan.model), None, None, []), "layout") for a in f.argv]
    i = argv.index("--recompute-modules")
    assert argv[i + 1:i + 1 + len(mods)] == mods
    assert table.parse({"recompute_granularity": "selective", "recompute_modules": mods}).sections[
        "parallelism"]["recompute_modules"] == mods


def test_gdn_norm_out_needs_gated_delta_net_as_megatron_raises(kit):
    f = kit.one(_sel(kit, ["gdn_norm_out"]), "recompute_gdn_norm_out_without_gated_delta_net")
    assert f.severity == "error" and f.fields == ["parallelism.recompute_modules"]
    assert "experimental_attention_variant='gated_delta_net'" in f.message


def test_moe_recompute_keeps_no_moe_activations_and_saves_more_than_moe_act(kit):
    from mcore_advisor.physics.memory import memory_breakdown

    def act(mods):
        return memory_breakdown(_sel(kit, mods)).stages[0].activations_bytes

    none, moe_act, moe = act(["layernorm"]), act(["layernorm", "moe_act"]), act(["layernorm", "moe"])
    # The 'moe' checkpoint covers router, dispatch, experts, combine and shared experts (MoELayer.forward).
    assert moe < moe_act < none
