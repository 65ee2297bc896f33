"""CUDA-graph rules (validators/cuda_graphs.py), each against Megatron's own assertion or a measured failure."""

from __future__ import annotations

import warnings

import pytest

from mcore_advisor.knowledge.cuda_graphs import WHOLE_LAYER, captured_parts
from mcore_advisor.validators import errors, validate

MODULES = "implementation.cuda_graph_modules"
ROUTER = ["attn", "moe_router", "moe_preprocess"]
DROP_PAD = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}


def _moe(kit, **impl):
    return kit.plan(model=kit.MIXTRAL, parallelism={"pipeline_model_parallel_size": 1, "expert_model_parallel_size": 8},
                    implementation={"moe_token_dispatcher_type": "alltoall", **impl})


def _dense(kit, **impl):
    return kit.plan(implementation=impl)


def _graph_errors(plan) -> list[str]:
    return [f.code for f in errors(validate(plan)) if f.code.startswith("cuda_graph")]


def test_what_each_implementation_captures():
    assert captured_parts("none", ["attn"]) == frozenset()
    assert captured_parts("transformer_engine", None) == WHOLE_LAYER
    assert captured_parts("full_iteration", []) == WHOLE_LAYER
    assert captured_parts("transformer_engine", ["attn"]) == {"attn"}
    # the local impl: a layer listed for attn or mlp gets one graph of its whole forward
    assert captured_parts("local", ["attn"]) == WHOLE_LAYER
    assert captured_parts("local", ["moe_router"]) == {"moe_router", "moe_preprocess"}


def test_router_graphs_on_a_dropless_moe_are_fine_with_te(kit):
    assert _graph_errors(_moe(kit, cuda_graph_impl="transformer_engine", cuda_graph_modules=ROUTER)) == []


def test_whole_layer_on_a_dropless_moe_is_refused_with_the_router_graphs_as_the_fix(kit):
    f = kit.one(_moe(kit, cuda_graph_impl="transformer_engine"), "cuda_graph_moe_needs_drop_pad")
    assert f.severity == "error" and f.fields[0] == MODULES
    assert "whole layer" in f.message and "attn, moe_router and moe_preprocess" in f.fix
    assert _graph_errors(_moe(kit, cuda_graph_impl="transformer_engine", **DROP_PAD)) == []


def test_local_attn_on_a_dropless_moe_names_the_measured_capture_failure(kit):
    f = kit.one(_moe(kit, cuda_graph_impl="local", cuda_graph_modules=ROUTER), "cuda_graph_moe_needs_drop_pad")
    assert f.fields[0] == "implementation.cuda_graph_impl"
    assert "cudaErrorCapturedEvent" in f.message and "transformer_engine" in f.fix
    # the local impl's router graphs alone take Megatron's partial path
    assert _graph_errors(_moe(kit, cuda_graph_impl="local", cuda_graph_modules=["moe_router"])) == []


@pytest.mark.parametrize(("impl", "code", "says"), [
    ({"cuda_graph_impl": "local", "cuda_graph_modules": ["moe", "moe_router"], **DROP_PAD}, "cuda_graph_moe_and_router",
     "must not contain both"),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_preprocess"]},
     "cuda_graph_preprocess_needs_router", "only captured together with moe_router"),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["mlp"]}, "cuda_graph_mlp_all_moe", "no dense MLP"),
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ROUTER, "moe_expert_capacity_factor": 1.0},
     "cuda_graph_preprocess_with_sync", "syncs"),
])
def test_megatrons_moe_graph_assertions(kit, impl, code, says):
    f = kit.one(_moe(kit, **impl), code)
    assert f.severity == "error" and says in f.message and f.fix


def test_dense_model_rules(kit):
    assert _graph_errors(_dense(kit, cuda_graph_impl="local", cuda_graph_modules=["attn"])) == []
    f = kit.one(_dense(kit, cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router"]),
                "cuda_graph_moe_modules_dense")
    assert "attn and/or mlp" in f.fix
    f = kit.one(_dense(kit, cuda_graph_impl="full_iteration"), "cuda_graph_full_iteration_nan_checks")
    assert f.fix == "set implementation.check_for_nan_in_loss_and_grad false"
    plan = _dense(kit, cuda_graph_impl="full_iteration", cuda_graph_modules=["attn"], check_for_nan_in_loss_and_grad=False)
    assert _graph_errors(plan) == ["cuda_graph_full_iteration_modules"]


# (impl, modules, MoE model, drop-and-pad or just a capacity factor): every combination Megatron's TransformerConfig
# judges, with our rules beside it; our two stricter rules (a captured dropless MoE block) are not Megatron's
GRID = [(impl, mods, moe, pad)
        for impl in ("local", "transformer_engine")
        for mods in ([], ["attn"], ["mlp"], ["moe"], ["moe_router"], ["attn", "moe_preprocess"], ROUTER, ["moe", "moe_router"])
        for moe in (False, True)
        for pad in ((None, "cf", "pad") if moe else (None,))]
OURS_ONLY = {"cuda_graph_moe_needs_drop_pad"}  # Megatron's where 'moe' is listed, ours where the whole layer is


@pytest.mark.slow
@pytest.mark.parametrize(("impl", "mods", "moe", "pad"), GRID)
def test_megatrons_transformer_config_refuses_what_the_validators_refuse(kit, impl, mods, moe, pad):
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    extra = {"cf": {"moe_expert_capacity_factor": 1.0}, "pad": DROP_PAD}.get(pad, {})
    plan = (_moe if moe else _dense)(kit, cuda_graph_impl=impl, cuda_graph_modules=mods, **extra)
    ours = set(_graph_errors(plan))
    kw = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "cuda_graph_impl": impl, "cuda_graph_modules": list(mods)}
    if moe:
        kw |= {"num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 64, "moe_token_dispatcher_type": "alltoall", **extra}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tc.TransformerConfig(**kw)
            megatron_refuses = False
        except (AssertionError, ValueError):
            megatron_refuses = True
    if megatron_refuses:
        assert ours, f"Megatron refuses {kw}; the validators found nothing"
    else:
        assert ours <= OURS_ONLY, f"Megatron accepts {kw}; the validators refused {ours}"
        # ours alone: a dropless MoE block inside the graph (the whole layer, or the local impl's attn)
        assert not ours or (moe and pad != "pad" and "moe" in captured_parts(impl, mods))


RECOMPUTE_CASES = [  # (parallelism, training, implementation) beside TransformerConfig's own verdict
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, {},
     {"cuda_graph_impl": "transformer_engine", **DROP_PAD}, "cuda_graph_full_recompute"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, {},
     {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ROUTER}, "cuda_graph_moe_recompute_router"),
    ({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}, {"attention_dropout": 0.1},
     {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_router"]}, "cuda_graph_recompute_dropout"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, {"hidden_dropout": 0.1},
     {"cuda_graph_impl": "local", **DROP_PAD}, "cuda_graph_recompute_dropout"),
    ({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}, {"hidden_dropout": 0.1},
     {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ROUTER}, None),
]


@pytest.mark.slow
@pytest.mark.parametrize(("par", "train", "impl", "code"), RECOMPUTE_CASES)
def test_recompute_under_graphs_as_megatron_judges_it(kit, par, train, impl, code):
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    plan = kit.plan(model=kit.MIXTRAL, parallelism={"pipeline_model_parallel_size": 1, "expert_model_parallel_size": 8, **par},
                    training=train, implementation={"moe_token_dispatcher_type": "alltoall", **impl})
    ours = _graph_errors(plan)
    assert ours == ([code] if code else [])
    kw = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_moe_experts": 8, "moe_router_topk": 2,
          "moe_ffn_hidden_size": 64, "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True,
          "attention_dropout": 0.0, "hidden_dropout": 0.0,
          **{k: v for k, v in {**par, **train, **impl}.items() if k != "recompute_num_layers" or par.get("recompute_method")}}
    kw["recompute_num_layers"] = par.get("recompute_num_layers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if code:
            with pytest.raises((AssertionError, ValueError)):
                tc.TransformerConfig(**kw)
        else:
            tc.TransformerConfig(**kw)


def test_every_graphed_plan_is_told_its_memory_estimate_leaves_out_the_graph_pools(kit):
    f = kit.one(_dense(kit, cuda_graph_impl="local"), "cuda_graph_memory_pools")
    assert f.severity == "info" and "0.07-2.86 GiB" in f.message and "headroom" in f.fix
    assert "cuda_graph_memory_pools" not in kit.codes(_dense(kit))
