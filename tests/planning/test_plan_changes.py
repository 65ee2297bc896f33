"""One generator of plan changes: estimate_memory and the OOM diagnosis offer the same memory fixes."""

from __future__ import annotations

from pathlib import Path

from mcore_advisor.diagnosis.mfu import MfuRequest, check_mfu
from mcore_advisor.planning.plan_changes import MIN_SAVING_GIB, plan_changes
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)
from mcore_advisor.tools.estimate_memory import estimate_memory
from mcore_advisor.validators import errors, validate

OOM_LOG = (Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "torch_2_11_oom_overcommitted_h200.log").read_text()


def _plan(gpn: int | None = None, mbs: int = 2, **par) -> Plan:
    # Llama-3-8B at 8k tokens, no distributed optimizer: over an H100's 80 GB (117 GiB at TP2, mbs 2).
    return Plan(model=ModelSpec(name="llama3-8b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=16, gpus_per_node=gpn),
                training=TrainingSpec(seq_length=8192, global_batch_size=64, micro_batch_size=mbs),
                parallelism=ParallelismSpec(use_distributed_optimizer=False, overlap_param_gather=False, **par),
                # the fused 'native' loss (10 B/logit) the figures below were taken with; Megatron-LM's default is off
                implementation=ImplementationSpec(cross_entropy_loss_fusion=True))


def _both(plan: Plan) -> tuple[set, set, int]:
    est = estimate_memory(plan)
    assert not est.fits and est.suggestions
    oom = check_mfu(MfuRequest(plan=plan, log_text=OOM_LOG)).oom_diagnosis
    from_estimate = {(s.field, repr(s.proposed)) for s in est.suggestions}
    from_diagnosis = {(f.fields[0], repr(getattr(getattr(f.plan, f.fields[0].split(".")[0]), f.fields[0].split(".")[1])))
                      for f in oom.fixes}
    return from_estimate, from_diagnosis, len(oom.fixes)


def test_estimate_memory_and_the_oom_diagnosis_offer_the_same_fixes_for_the_same_plan():
    est, diag, n = _both(_plan(tensor_model_parallel_size=2, sequence_parallel=True))
    # the diagnosis shows at most 8 (MAX_FIXES), all of them among estimate_memory's suggestions
    assert diag <= est and n == min(8, len(est))
    assert ("parallelism.use_distributed_optimizer", "True") in diag


def test_both_tools_take_the_node_size_from_the_cluster():
    # 4 GPUs per node: TP 4 -> 8 would leave the NVLink domain, so neither tool offers it (the OOM
    # diagnosis used to read the catalog's 8 GPUs per node and offered it).
    # TP4 at micro-batch 4 needs 82 GiB.
    plan = _plan(gpn=4, mbs=4, tensor_model_parallel_size=4, sequence_parallel=True)
    est, diag, _ = _both(plan)
    assert all(field != "parallelism.tensor_model_parallel_size" for field, _ in est | diag)
    on_8 = _plan(gpn=8, mbs=4, tensor_model_parallel_size=4, sequence_parallel=True)
    assert ("parallelism.tensor_model_parallel_size", "8") in _both(on_8)[0]


def test_memory_fixes_add_no_validator_error_and_save_more_than_rounding():
    plan = _plan(tensor_model_parallel_size=2, sequence_parallel=True)
    rep = estimate_memory(plan)
    base = rep.breakdown.total_gib
    for s in rep.suggestions:
        assert s.saves_gib > MIN_SAVING_GIB and abs(base - s.saves_gib - s.total_gib_after) < 0.02
    # every candidate the generator makes is checked: the ones that break a Megatron rule are dropped
    bad = [ch for ch in plan_changes(plan, "memory") if errors(validate(ch.plan))]
    offered = {(s.field, repr(s.proposed)) for s in rep.suggestions}
    assert all((ch.changes[0][0], repr(ch.changes[0][2])) not in offered for ch in bad)


def test_speed_changes_each_make_a_distinct_plan_and_name_every_field_they_move():
    plan = _plan(tensor_model_parallel_size=4, pipeline_model_parallel_size=2, sequence_parallel=False,
                 recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    changes = plan_changes(plan, "speed")
    assert len({ch.plan.model_dump_json() for ch in changes}) == len(changes)
    for ch in changes:
        for field, current, proposed in ch.changes:
            section, name = field.split(".")
            assert getattr(getattr(plan, section), name) == current != proposed == getattr(getattr(ch.plan, section), name)
    tp_half = next(ch for ch in changes if ch.fields[0] == "parallelism.tensor_model_parallel_size")
    assert tp_half.plan.parallelism.tensor_model_parallel_size == 2


def test_uneven_moe_routing_is_offered_a_larger_cublaslt_cache_and_forced_routing_is_not():
    from mcore_advisor.planning.plan_changes import CUBLASLT_CACHE_FIX
    from mcore_advisor.planning.plan_changes import plan_changes as changes
    from mcore_advisor.schemas import with_changes

    moe = Plan(model={"name": "mixtral-8x7b"}, cluster={"gpu": "h100-sxm", "num_gpus": 64},
               training={"seq_length": 4096, "global_batch_size": 256, "micro_batch_size": 1},
               parallelism={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                            "expert_model_parallel_size": 8})
    fields = [ch.fields for ch in changes(moe, "speed")]
    assert ["implementation.cublaslt_heuristics_cache_capacity"] in fields
    offered = next(ch for ch in changes(moe, "speed") if ch.fields == ["implementation.cublaslt_heuristics_cache_capacity"])
    assert offered.plan.implementation.cublaslt_heuristics_cache_capacity == CUBLASLT_CACHE_FIX
    forced = with_changes(moe, "implementation", moe_router_force_load_balancing=True)
    assert ["implementation.cublaslt_heuristics_cache_capacity"] not in [ch.fields for ch in changes(forced, "speed")]


def test_the_all_to_all_overlap_is_offered_where_megatron_accepts_it_and_pays_on_a_fast_host():
    from mcore_advisor.physics.step_time import step_time
    from mcore_advisor.planning.plan_changes import plan_changes as changes
    from mcore_advisor.schemas import with_changes

    overlap = ["implementation.overlap_moe_expert_parallel_comm", "implementation.delay_wgrad_compute"]
    moe = Plan(model={"name": "qwen3-30b-a3b"}, cluster={"gpu": "h100-sxm", "num_gpus": 16, "host_floor_ms_per_layer": 1.0},
               training={"seq_length": 4096, "global_batch_size": 512, "micro_batch_size": 2},
               parallelism={"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 12,
                            "expert_model_parallel_size": 8},
               implementation={"moe_router_force_load_balancing": True})
    offered = next(ch for ch in changes(moe, "speed") if ch.fields == overlap)
    assert not errors(validate(offered.plan))
    # the EP8 all-to-alls inside a node hide under the other micro-batch's work on a bare-metal host
    assert step_time(offered.plan).iteration_time_s < 0.95 * step_time(moe).iteration_time_s
    plain_pp = with_changes(moe, "parallelism", virtual_pipeline_model_parallel_size=None)  # Megatron asks for VP
    full = with_changes(moe, "parallelism", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    one_ep = with_changes(moe, "parallelism", expert_model_parallel_size=1)
    for p in (plain_pp, full, one_ep):
        assert overlap not in [ch.fields for ch in changes(p, "speed")]


def test_cuda_graphs_are_offered_as_megatron_accepts_them_and_win_on_a_host_bound_step():
    from mcore_advisor.physics.step_time import step_time
    from mcore_advisor.schemas import with_changes

    # the Z set's host-bound dense model on one H100 (benchmarks/results/gpu_h100_Z_runs.jsonl: 1.61-1.93 s eager,
    # 0.49 s with the layer graphed)
    dense = Plan(model={"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "num_query_groups": 4,
                        "ffn_hidden_size": 5632, "vocab_size": 32000, "swiglu": True, "normalization": "RMSNorm",
                        "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
                        "position_embedding_type": "rope"},
                 cluster={"gpu": "h100-sxm", "num_gpus": 1}, training={"seq_length": 2048, "global_batch_size": 16})
    graphs = next(ch for ch in plan_changes(dense, "speed") if ch.fields[0] == "implementation.cuda_graph_impl")
    assert graphs.plan.implementation.cuda_graph_impl == "transformer_engine"
    assert graphs.plan.implementation.cuda_graph_modules is None  # the whole layer
    assert step_time(graphs.plan).iteration_time_s < 0.5 * step_time(dense).iteration_time_s
    # a dropless MoE model gets the router graphs (the whole layer would hold the dispatcher's host sync)
    moe = Plan(model={"name": "qwen3-30b-a3b"}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
               training={"seq_length": 4096, "global_batch_size": 64}, parallelism={"expert_model_parallel_size": 8})
    g = next(ch for ch in plan_changes(moe, "speed") if ch.fields[0] == "implementation.cuda_graph_impl")
    assert g.plan.implementation.cuda_graph_modules == ["attn", "moe_router", "moe_preprocess"]
    assert not errors(validate(g.plan))
    # none for a plan with graphs already, or without Transformer Engine
    for done in (g.plan, with_changes(dense, "implementation", transformer_impl="local")):
        assert "implementation.cuda_graph_impl" not in [ch.fields[0] for ch in plan_changes(done, "speed")]
