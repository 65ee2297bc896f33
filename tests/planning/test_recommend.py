"""recommend_parallelism: fits, honours constraints, explains itself, and says what is needed when nothing fits."""

from __future__ import annotations

import math

import pytest

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.anatomy import count_params
from mcore_advisor.physics.memory import CUDA_CONTEXT_GIB, memory_breakdown
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.planning.recommend import (
    FixedParallelism,
    Recommendation,
    RecommendRequest,
    default_global_batch_size,
    format_recommendation,
    recommend_parallelism,
    request_from_options,
)
from mcore_advisor.rendering.render import render_launch_script
from mcore_advisor.rendering.request import RenderRequest
from mcore_advisor.schemas import ClusterSpec, ImplementationSpec, ModelSpec, with_changes
from mcore_advisor.validators import errors, validate


def _req(model="llama3-8b", n=8, seq=4096, gbs=64, gpu="h100-sxm", **kw) -> RecommendRequest:
    kw.setdefault("what_if", False)
    return RecommendRequest(model=ModelSpec(name=model), cluster=ClusterSpec(gpu=gpu, num_gpus=n), seq_length=seq,
                            global_batch_size=gbs, **kw)


def _assert_sound(rec: Recommendation, req: RecommendRequest) -> None:
    """Every plan validates, fits with the requested headroom, and its figures are the core's."""
    assert rec.feasible and rec.plans
    cap = rec.plans[0].capacity_gib
    need = max(req.min_headroom_gib, req.min_headroom_fraction * cap)
    for p in rec.plans:
        assert not errors(validate(p.plan)), p.layout
        mem = memory_breakdown(p.plan)
        assert mem.fits and mem.total_gib <= cap - need + 1e-9
        assert p.memory_total_gib == pytest.approx(mem.total_gib)
        assert p.tokens_per_s_per_gpu == pytest.approx(step_time(p.plan).tokens_per_s_per_gpu)
        assert p.plan.cluster.num_gpus == req.cluster.num_gpus
        assert p.plan.training.seq_length == req.seq_length
        assert p.plan.training.global_batch_size == req.global_batch_size


# ---- soundness and ranking -----------------------------------------------------------------


def test_llama3_8b_on_8_h100_returns_five_sound_plans_sorted_by_throughput():
    req = _req()
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    assert len(rec.plans) == 5
    tps = [p.tokens_per_s_per_gpu for p in rec.plans]
    assert tps == sorted(tps, reverse=True)
    assert rec.plans[0].relative_throughput == 1.0 and all(p.relative_throughput <= 1.0 for p in rec.plans)
    # Runners-up are distinct parallel layouts, not micro-batch variants of the winner.
    layouts = {(p.plan.parallelism.tensor_model_parallel_size, p.plan.parallelism.pipeline_model_parallel_size,
                p.plan.parallelism.virtual_pipeline_model_parallel_size, p.plan.parallelism.context_parallel_size)
               for p in rec.plans}
    assert len(layouts) == 5


def test_best_plan_is_at_least_as_fast_as_the_published_nemo_layout_for_llama3_70b():
    # NeMo 24.07 performance summary: Llama3-70B FP8 on 64 H100, s=8192, GBS 128, TP4 PP4 VP5 CP2
    # (measured 1524 tokens/s/GPU). The published layout is in the search space, so the best plan's
    # predicted throughput cannot be below its prediction.
    req = _req("llama3-70b", 64, 8192, 128, precision="fp8", min_headroom_fraction=0.0)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    from mcore_advisor.schemas import ParallelismSpec, Plan, TrainingSpec

    published = Plan(model=req.model, cluster=req.cluster,
                     training=TrainingSpec(seq_length=8192, global_batch_size=128, micro_batch_size=1, precision="fp8"),
                     parallelism=ParallelismSpec(tensor_model_parallel_size=4, pipeline_model_parallel_size=4,
                                                 virtual_pipeline_model_parallel_size=5, context_parallel_size=2,
                                                 sequence_parallel=True))
    assert memory_breakdown(published).fits
    assert rec.plans[0].tokens_per_s_per_gpu >= step_time(published).tokens_per_s_per_gpu * (1 - 1e-9)
    near = rec.nearest_published_run
    assert near is not None and near.source == "NEMO_2407" and near.measured_tokens_per_s_per_gpu == 1524.0


def test_runners_up_say_which_step_time_terms_make_them_slower():
    rec = recommend_parallelism(_req("llama3-70b", 64, 8192, 128))
    assert rec.plans[0].why_slower is None
    for p in rec.plans[1:]:
        assert "fewer tokens/s than #1" in p.why_slower and "%" in p.why_slower
    assert any(line.startswith("vs #2") for line in rec.explanation)
    assert rec.explanation[0].startswith("best: ") and "MFU" in rec.explanation[0]


def test_rejection_counts_add_up():
    s = recommend_parallelism(_req("mixtral-8x7b", 16, 4096, 64)).stats
    assert s.layouts_enumerated == s.layouts_pruned_by_model_state + sum(s.layouts_rejected_by_rule.values()) + s.layouts_searched
    assert s.candidates_enumerated == (sum(s.candidates_rejected_by_rule.values()) + s.candidates_over_memory
                                       + s.candidates_dominated + s.candidates_timed)
    assert s.candidates_evaluated == s.candidates_enumerated - sum(s.candidates_rejected_by_rule.values())
    assert s.plans_verified >= 1 and s.elapsed_s is None and s.candidates_per_s is None


def test_a_clock_from_the_caller_gives_the_search_rate():
    ticks = iter([0.0, 0.5])
    s = recommend_parallelism(_req(), clock=lambda: next(ticks)).stats
    assert s.elapsed_s == 0.5 and s.candidates_per_s == pytest.approx(s.candidates_evaluated / 0.5)


# ---- constraints ---------------------------------------------------------------------------


def test_fixed_dimensions_are_honoured():
    req = _req(fixed=FixedParallelism(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2,
                                      recompute_granularity="none"))
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    for p in rec.plans:
        par = p.plan.parallelism
        assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size) == (2, 2)
        assert p.plan.training.micro_batch_size == 2 and par.recompute_granularity is None


def test_max_tensor_parallel_is_honoured_for_tp_and_expert_tp():
    req = _req("mixtral-8x7b", 16, 4096, 64, max_tensor_model_parallel_size=2)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    for p in rec.plans:
        par = p.plan.parallelism
        assert par.tensor_model_parallel_size <= 2 and (par.expert_tensor_parallel_size or par.tensor_model_parallel_size) <= 2


def test_no_recompute_when_recompute_is_not_allowed():
    req = _req(seq=8192, allow_recompute=False)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    assert all(p.plan.parallelism.recompute_granularity is None for p in rec.plans)


def test_headroom_fraction_is_honoured():
    req = _req(min_headroom_fraction=0.3)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    assert all(p.headroom_gib >= 0.3 * p.capacity_gib for p in rec.plans)


def test_contradictory_constraints_raise_value_errors_naming_the_fields():
    with pytest.raises(ValueError, match="max_tensor_model_parallel_size"):
        _req(max_tensor_model_parallel_size=2, fixed=FixedParallelism(tensor_model_parallel_size=4))
    with pytest.raises(ValueError, match="allow_recompute"):
        _req(allow_recompute=False, fixed=FixedParallelism(recompute_granularity="full"))
    with pytest.raises(ValueError, match="recompute_granularity"):
        FixedParallelism(recompute_granularity="selective", recompute_method="block")


# ---- model families ------------------------------------------------------------------------


def test_mixtral_gets_expert_parallelism_dividing_its_eight_experts():
    req = _req("mixtral-8x7b", 16, 4096, 64)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    best = rec.plans[0].plan.parallelism
    assert best.expert_model_parallel_size > 1
    for p in rec.plans:
        ep = p.plan.parallelism.expert_model_parallel_size
        assert 8 % ep == 0
        # Megatron asserts SP whenever MoE runs with TP > 1.
        assert p.plan.parallelism.sequence_parallel or p.plan.parallelism.tensor_model_parallel_size == 1


def test_llama3_8b_at_128k_tokens_needs_context_parallelism():
    # One 131072-token sample: even with full recompute the per-layer checkpoints (2*s*h bytes =
    # 1 GiB per layer) and the s*V logits do not fit one H100 without splitting the sequence.
    req = _req(n=8, seq=131072, gbs=8)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    assert all(p.plan.parallelism.context_parallel_size * p.plan.parallelism.tensor_model_parallel_size > 1 for p in rec.plans)
    assert rec.plans[0].plan.parallelism.context_parallel_size > 1


def test_fp8_is_chosen_only_when_allowed_and_is_faster_on_h100():
    off = recommend_parallelism(_req())
    on = recommend_parallelism(_req(allow_fp8=True))
    assert all(p.plan.training.precision == "bf16" for p in off.plans)
    assert on.plans[0].plan.training.precision == "fp8"
    assert on.plans[0].tokens_per_s_per_gpu > off.plans[0].tokens_per_s_per_gpu
    assert on.plans[0].mfu_fp8_causal_pct is not None


def test_fp8_is_not_offered_on_a100():
    rec = recommend_parallelism(_req(gpu="a100-80gb", allow_fp8=True))
    assert all(p.plan.training.precision == "bf16" for p in rec.plans)
    assert any("allow_fp8 ignored" in n for n in rec.notes)


def test_405b_on_256_gpus_uses_an_uneven_pipeline_split_that_validates():
    # 126 layers divide by no power-of-two PP above 2: stages get decoder_first/last_pipeline_num_layers.
    req = _req("llama3.1-405b", 256, 8192, 256)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    par = rec.plans[0].plan.parallelism
    assert par.pipeline_model_parallel_size > 2 and par.decoder_first_pipeline_num_layers is not None
    assert any("uneven pipeline split" in n for n in rec.notes)


# Megatron-Bridge's Llama-3.1-405B H100 performance row (docs/performance-summary.md, 25.09: 1,024 GPUs, GBS 512,
# seq 8192, TP8 PP8 CP2 VP8, 302 tokens/s/GPU measured) as its scripts run it: FP8 current scaling with FP8
# parameter gather (LLAMA31_405B_PRETRAIN_CONFIG_H100_FP8_CS_V1), bf16 gradient reduction, userbuffers TP
# overlap, NaN checks off (scripts/performance/utils/overrides.py _set_common_perf_overrides).
_BRIDGE_405B = dict(precision="fp8", fp8_recipe="tensorwise", fp8_param_gather=True,
                    implementation=ImplementationSpec(grad_reduce_in_fp32=False, check_for_nan_in_loss_and_grad=False))


def test_405b_on_1024_h100_ranks_the_recipes_tp8_pp8_interleaved_cp2_with_tp_overlap_in_its_top_3():
    req = _req("llama3.1-405b", 1024, 8192, 512, top_k=3, **_BRIDGE_405B)
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    recipe = [p for p in rec.plans if (p.plan.parallelism.tensor_model_parallel_size, p.plan.parallelism.pipeline_model_parallel_size,
                                       p.plan.parallelism.context_parallel_size) == (8, 8, 2)]
    assert len(recipe) == 1, [p.layout for p in rec.plans]
    par = recipe[0].plan.parallelism
    # TP8's collectives are worth hiding despite the stretched GEMMs (UB_GEMM_STRETCH); each plan says which it assumes
    assert par.tp_comm_overlap
    assert (rec.plans[0].plan.parallelism.tp_comm_overlap
            == any(line.startswith("assumes TP communication overlap") for line in rec.explanation))
    # 126 layers interleave on PP8 only as 128 slots: the embedding and the loss counted as layers
    assert par.virtual_pipeline_model_parallel_size in (2, 4, 8, 16)
    assert par.account_for_embedding_in_pipeline_split and par.account_for_loss_in_pipeline_split
    # without the overlap the same plan is slower (its TP/SP collectives run exposed)
    off = step_time(with_changes(recipe[0].plan, "parallelism", tp_comm_overlap=False))
    assert off.tokens_per_s_per_gpu < recipe[0].tokens_per_s_per_gpu
    assert off.breakdown.tp_comm_exposed_s > recipe[0].evaluation.performance.breakdown.tp_comm_exposed_s
    # the rendered Megatron-LM arguments carry both
    args = render_launch_script(RenderRequest(plan=recipe[0].plan, launcher="slurm")).megatron_args
    assert {"--tp-comm-overlap", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"} <= set(args)


def test_every_plan_of_overlapped_and_embedding_loss_split_searches_passes_the_validators():
    for req in (_req("llama3.1-405b", 256, 8192, 256, top_k=8, what_if=True, **_BRIDGE_405B),
                _req("qwen3-30b-a3b", 64, 4096, 256, top_k=8),
                _req("llama3-70b", 64, 8192, 128, top_k=8, gpu="h200")):
        rec = recommend_parallelism(req)
        _assert_sound(rec, req)
        for p in rec.plans:
            assert not [f for f in validate(p.plan) if f.severity == "error"], p.layout


def test_tp_overlap_can_be_refused_and_fp8_param_gather_needs_fp8_and_the_distributed_optimizer():
    rec = recommend_parallelism(_req("llama3-70b", 64, 8192, 128, allow_tp_comm_overlap=False))
    assert rec.plans and not any(p.plan.parallelism.tp_comm_overlap for p in rec.plans)
    assert not any(line.startswith("assumes TP communication overlap") for line in rec.explanation)
    with pytest.raises(ValueError, match="fp8_param_gather applies to FP8 plans"):
        _req(fp8_param_gather=True)
    with pytest.raises(ValueError, match="fp8_param_gather needs the distributed optimizer"):
        _req(precision="fp8", fp8_param_gather=True, fixed=FixedParallelism(use_distributed_optimizer=False))


# ---- nothing fits --------------------------------------------------------------------------


def test_405b_on_8_gpus_is_infeasible_and_says_how_many_gpus_the_model_state_needs():
    req = _req("llama3.1-405b", 8, 8192, 2048)
    rec = recommend_parallelism(req)
    assert not rec.feasible and not rec.plans
    # bf16 weights 2 + fp32 grads 4 + fp32 main params and Adam m, v 12 = 18 B/param, spread over
    # GPUs of 79.11 GiB minus the 5% headroom and the CUDA context.
    params = count_params(resolve_model(ModelSpec(name="llama3.1-405b")), 8192)
    usable = 79.11 * 0.95 - CUDA_CONTEXT_GIB
    expected = math.ceil(params * 18 / 2**30 / usable)
    assert rec.min_gpus_for_model_state == expected
    text = " ".join(rec.suggestions)
    assert f"at least {expected} GPUs" in text
    assert "--optimizer-cpu-offload" in text and "not model" in text


def test_a_pinned_tp_that_breaks_a_rule_is_reported_with_the_validators_fix():
    rec = recommend_parallelism(_req(fixed=FixedParallelism(tensor_model_parallel_size=3)))
    assert not rec.feasible
    assert "world_not_divisible_by_model_parallel" in rec.suggestions[0] or "heads_not_divisible_by_tp" in rec.suggestions[0]
    assert "fix:" in rec.suggestions[0]


def test_a_sequence_too_long_for_the_gpus_suggests_more_gpus():
    rec = recommend_parallelism(_req(n=1, seq=65536, gbs=8))
    assert not rec.feasible
    assert any("GPUs" in s and "fits" in s for s in rec.suggestions)


# ---- what-if, CLI helper, formatting ---------------------------------------------------------


def test_what_if_doubles_gpus_and_sequence():
    rec = recommend_parallelism(_req(what_if=True))
    by = {w.scenario: w for w in rec.what_if}
    assert by["2x_gpus"].num_gpus == 16 and by["2x_gpus"].seq_length == 4096
    assert by["2x_seq_length"].num_gpus == 8 and by["2x_seq_length"].seq_length == 8192
    w = by["2x_gpus"]
    assert w.feasible and w.tokens_per_s == pytest.approx(w.tokens_per_s_per_gpu * 16)


def test_request_from_cli_options():
    req = request_from_options(model="llama3-70b", num_gpus=64, gpu="h100-sxm", seq_length=8192, global_batch_size=128,
                               tp=8, max_tensor_model_parallel_size=8, gpus_per_node=None)
    assert req.fixed.tensor_model_parallel_size == 8 and req.max_tensor_model_parallel_size == 8
    assert req.cluster.num_gpus == 64 and req.seq_length == 8192
    with pytest.raises(ValueError, match="unknown recommend option"):
        request_from_options(model="llama3-70b", num_gpus=64, bogus=1)
    with pytest.raises(KeyError, match="unknown model"):
        request_from_options(model="llama-7", num_gpus=8)


def test_default_global_batch_is_about_4m_tokens_and_at_least_one_sample_per_8_gpus():
    assert default_global_batch_size(4096, 64) == 1024  # 2^22 / 4096
    assert default_global_batch_size(8192, 16384) == 2048  # 16384 / 8 beats 512
    rec = recommend_parallelism(_req(gbs=None))
    assert rec.global_batch_size == 1024 and rec.plans[0].plan.training.global_batch_size == 1024


def test_text_report_lists_the_plans_and_the_search():
    text = format_recommendation(recommend_parallelism(_req()))
    assert text.count("tokens/s/GPU") >= 5 and "searched" in text


def test_the_nearest_published_run_prefers_the_plan_s_precision():
    from mcore_advisor.knowledge.models import resolve_model
    from mcore_advisor.planning.recommend import _precision_family, nearest_published_run
    from mcore_advisor.schemas import ClusterSpec, ModelSpec

    shape = resolve_model(ModelSpec(name="llama3-70b"))
    cluster = ClusterSpec(gpu="h100-sxm", num_gpus=64)
    fp8 = nearest_published_run(shape, cluster, 8192, "fp8")
    bf16 = nearest_published_run(shape, cluster, 8192, "bf16")
    assert _precision_family(fp8.precision) == "fp8"  # NeMo's Llama-3-70B FP8 row on 64 H100s
    if bf16.row == fp8.row:  # still the closest, but it pays for the precision mismatch
        assert bf16.distance == pytest.approx(fp8.distance + 0.75)
    else:
        assert _precision_family(bf16.precision) != "fp8"
    assert nearest_published_run(shape, cluster, 8192).distance == fp8.distance  # no precision given: no penalty


def test_fsdp2_is_searched_when_the_implementation_asks_for_it():
    # Megatron's --use-torch-fsdp2 shards weights, gradients and optimizer state and excludes PP, EP and
    # the distributed optimizer: the plans respect that, validate and fit (the request used to be refused).
    req = _req(n=16, what_if=False, implementation=ImplementationSpec(use_torch_fsdp2=True))
    rec = recommend_parallelism(req)
    _assert_sound(rec, req)
    for p in rec.plans:
        par = p.plan.parallelism
        assert p.plan.implementation.use_torch_fsdp2 and par.pipeline_model_parallel_size == 1
        assert not par.use_distributed_optimizer and not par.overlap_param_gather
