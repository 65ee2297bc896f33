"""The layout search engine: its memory and time are memory_breakdown's and step_time's (one function on a
batch and on a row), its dominance premises hold in physics.step_time, its uneven splits are Megatron's,
FSDP2 is searched, and its counts add up."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import model_catalog, resolve_model
from mcore_advisor.physics.anatomy import count_params
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.physics.step_time import hardware_params, step_time, step_time_arrays
from mcore_advisor.planning import search as search_module
from mcore_advisor.planning.recommend import SEARCH_CPU_BUDGET_S, RecommendRequest, recommend_parallelism
from mcore_advisor.planning.search import (
    RC_BLOCK,
    RC_NONE,
    RC_SELECTIVE,
    Fixed,
    SearchInputs,
    StageSplit,
    chunk_layers,
    pipeline_splits,
    search,
)
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)
from mcore_advisor.validators import errors, validate

SMALL_GPT = dict(num_layers=12, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096, vocab_size=32000)


def _inputs(model: ModelSpec, n: int, seq: int, gbs: int, *, g: str = "h100-sxm", impl=None, prec=("bf16",),
            fixed: Fixed | None = None, headroom=0.0, capacity=None, gpn=None, **extra) -> SearchInputs:
    cl = ClusterSpec(gpu=g, num_gpus=n, gpus_per_node=gpn)
    return SearchInputs(
        shape=resolve_model(model), gpu=gpu(g), hardware=hardware_params(cl), cluster=cl, seq_length=seq,
        global_batch_size=gbs, precisions=prec, implementation=impl or ImplementationSpec(),
        capacity_gib=capacity or gpu(g).hbm_capacity_gib, required_headroom_gib=headroom, fixed=fixed or Fixed(), **extra,
    )


def _plan(inp: SearchInputs, model: ModelSpec, out, i: int) -> Plan:
    lo = out.layouts[int(out.layout[i])]
    rc = int(out.recompute[i])
    dist = bool(out.dist_opt[i])
    return Plan(
        model=model, cluster=inp.cluster,
        training=TrainingSpec(seq_length=inp.seq_length, global_batch_size=inp.global_batch_size,
                              micro_batch_size=int(out.mbs[i]), precision=lo.precision, fp8_recipe=inp.fp8_recipe,
                              fp8_param_gather=inp.fp8_param_gather and lo.precision == "fp8"),
        parallelism=ParallelismSpec(
            tensor_model_parallel_size=lo.tp, pipeline_model_parallel_size=lo.pp,
            virtual_pipeline_model_parallel_size=lo.vp if lo.vp > 1 else None,
            decoder_first_pipeline_num_layers=lo.split.first, decoder_last_pipeline_num_layers=lo.split.last,
            account_for_embedding_in_pipeline_split=lo.split.embedding, account_for_loss_in_pipeline_split=lo.split.loss,
            tp_comm_overlap=lo.tp_overlap,
            context_parallel_size=lo.cp, expert_model_parallel_size=lo.ep, expert_tensor_parallel_size=lo.etp,
            sequence_parallel=lo.sp, use_distributed_optimizer=dist, overlap_param_gather=dist,
            recompute_granularity=[None, "selective", "full", "full"][rc],
            recompute_method=[None, None, "block", "uniform"][rc],
            recompute_num_layers=int(out.recompute_num_layers[i]) if rc >= RC_BLOCK else None,
        ),
        implementation=inp.implementation,
    )


REPLICA_CASES = [
    # (id, model, gpus, seq, gbs, gpu, implementation, precisions, fixed)
    ("te-dense", ModelSpec(name="llama3-8b"), 8, 4096, 64, "h100-sxm", None, ("bf16",), Fixed()),
    ("local-unfused", ModelSpec(**SMALL_GPT), 4, 2048, 32, "h200",
     ImplementationSpec(transformer_impl="local", attention_backend="local"), ("bf16",), Fixed()),
    ("fp8-bf16grads-expandable-te-loss", ModelSpec(name="llama3-8b"), 8, 8192, 32, "h100-sxm",
     ImplementationSpec(grad_reduce_in_fp32=False, expandable_segments=True, cross_entropy_fusion_impl="te"),
     ("bf16", "fp8"), Fixed()),
    ("unfused-loss", ModelSpec(name="llama3-8b"), 8, 4096, 64, "h100-sxm",
     ImplementationSpec(cross_entropy_loss_fusion=False), ("bf16",), Fixed()),
    ("moe", ModelSpec(name="mixtral-8x7b"), 16, 4096, 64, "h100-sxm", None, ("bf16",), Fixed(pp=2)),
    ("pinned-uniform-2", ModelSpec(name="llama3-8b"), 8, 4096, 64, "h100-sxm", None, ("bf16",),
     Fixed(pp=2, recompute="full", recompute_method="uniform", recompute_num_layers=2)),
    ("pinned-block-3-no-distopt", ModelSpec(name="llama3-8b"), 8, 4096, 64, "h100-sxm", None, ("bf16",),
     Fixed(pp=4, recompute="full", recompute_method="block", recompute_num_layers=3, dist_opt=False)),
    ("uneven-405b", ModelSpec(name="llama3.1-405b"), 256, 8192, 256, "h100-sxm", None, ("bf16",), Fixed(pp=16)),
    # 126 layers as 128 slots on PP8, interleaved (VP 2-16), FP8 with TP overlap
    ("account-vp-overlap-405b", ModelSpec(name="llama3.1-405b"), 512, 8192, 256, "h100-sxm",
     ImplementationSpec(grad_reduce_in_fp32=False), ("fp8",), Fixed(tp=8, pp=8)),
]


@pytest.mark.parametrize("case", REPLICA_CASES, ids=[c[0] for c in REPLICA_CASES])
def test_vectorised_memory_and_time_equal_memory_breakdown_and_step_time(case):
    _, model, n, seq, gbs, g, impl, prec, fixed = case
    inp = _inputs(model, n, seq, gbs, g=g, impl=impl, prec=prec, fixed=fixed)
    out = search(inp)
    assert len(out.mbs) > 0
    idx = random.Random(7).sample(range(len(out.mbs)), min(25, len(out.mbs)))
    for i in idx:
        plan = _plan(inp, model, out, i)
        assert memory_breakdown(plan).total_gib == pytest.approx(float(out.memory_total_gib[i]), rel=1e-9)
        assert step_time(plan).tokens_per_s_per_gpu == pytest.approx(float(out.tokens_per_s_per_gpu[i]), rel=1e-9)


def test_pinned_recompute_is_the_only_recompute_timed():
    inp = _inputs(ModelSpec(name="llama3-8b"), 8, 4096, 64,
                  fixed=Fixed(pp=2, recompute="full", recompute_method="uniform", recompute_num_layers=2))
    out = search(inp)
    assert set(out.recompute.tolist()) == {3} and set(out.recompute_num_layers.tolist()) == {2.0}


def test_smallest_fitting_block_k_is_the_boundary():
    # Squeeze memory so full recompute is needed; the chosen k fits and k - 1 does not.
    model = ModelSpec(name="llama3-8b")
    inp = _inputs(model, 8, 8192, 64, fixed=Fixed(tp=1, pp=1, cp=1, mbs=1, recompute="full", recompute_method="block"),
                  capacity=90.0)
    out = search(inp)
    assert len(out.mbs) == 1 and out.recompute[0] == RC_BLOCK
    k = int(out.recompute_num_layers[0])
    plan = _plan(inp, model, out, 0)
    assert memory_breakdown(plan).total_gib <= 90.0 and 1 < k < 32
    tighter = plan.model_copy(update={"parallelism": plan.parallelism.model_copy(update={"recompute_num_layers": k - 1})})
    assert memory_breakdown(tighter).total_gib > 90.0


def test_distributed_optimizer_is_never_slower_in_the_time_model():
    # Premise of counting optimizer-off variants as dominated (planning/search.py).
    shape = resolve_model(ModelSpec(name="llama3-70b"))
    hw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=512))
    tp, pp, cp = np.meshgrid([1, 2, 4, 8], [1, 2, 4, 8], [1, 2], indexing="ij")
    tp, pp, cp = tp.ravel(), pp.ravel(), cp.ravel()
    dp = 512 // (tp * pp * cp)
    kw = dict(tp=tp, pp=pp, cp=cp, dp=dp, micro_batch_size=1, sequence_parallel=tp > 1)
    on = step_time_arrays(LayoutBatch(shape, 4096, 1024, use_distributed_optimizer=True, overlap_param_gather=True, **kw), hw)
    off = step_time_arrays(LayoutBatch(shape, 4096, 1024, use_distributed_optimizer=False, overlap_param_gather=False, **kw), hw)
    assert np.all(on["iteration_time_s"] <= off["iteration_time_s"] * (1 + 1e-12))


def test_recomputing_never_runs_faster_than_not_recomputing():
    shape = resolve_model(ModelSpec(name="llama3-8b"))
    hw = hardware_params(ClusterSpec(gpu="h100-sxm", num_gpus=8))
    kw = dict(tp=np.array([1, 2, 4, 8]), dp=np.array([8, 4, 2, 1]), micro_batch_size=2)
    none = step_time_arrays(LayoutBatch(shape, 4096, 64, recompute=0, **kw), hw)["iteration_time_s"]
    sel = step_time_arrays(LayoutBatch(shape, 4096, 64, recompute=1, **kw), hw)["iteration_time_s"]
    # block recompute of 8 of the 32 layers (a quarter)
    full = step_time_arrays(LayoutBatch(shape, 4096, 64, recompute=2, recompute_block=True, recompute_num_layers=8, **kw),
                            hw)["iteration_time_s"]
    assert np.all(sel >= none) and np.all(full >= none)


def test_each_vp_is_searched_under_the_most_balanced_split_megatron_builds_with_it():
    # Llama-3.1-405B on PP16: 126 = 7 + 14 x 8 + 7 (decoder_first/last 7), which interleaves over no VP (gcd 7, 8 = 1);
    # counting the embedding and the loss as layers gives 128 slots = 8 per stage, the same 7 + 14 x 8 + 7
    # layers, over VP 2, 4 or 8 (the 6 + 14 x 8 + 8 split's VP2 is no longer needed).
    emb_loss = StageSplit(embedding=True, loss=True)
    assert pipeline_splits(126, 16) == [(StageSplit(7, 7), (1,)), (emb_loss, (2, 4, 8))]
    # PP8: 16 slots per stage, VP 2-16 (the NeMo/Megatron-Bridge recipe's TP8 PP8 VP8 CP2)
    assert pipeline_splits(126, 8) == [(StageSplit(15, 15), (1,)), (emb_loss, (2, 4, 8, 16))]
    # PP2 with an odd layer count: 30 + 31 layers, or 31 + 30 with the loss as the 62nd slot (VP 31)
    assert pipeline_splits(61, 2) == [(StageSplit(30, None), (1,)), (StageSplit(loss=True), (31,))]
    # 80 layers divide by PP4; 81 and 82 slots do not: only the even split
    assert pipeline_splits(80, 4) == [(StageSplit(), (1, 2, 4, 5, 10, 20))]


def test_chunks_are_the_stage_slots_over_vp_less_the_embedding_and_the_loss():
    # 128 slots on PP8 VP8: 2 layers per chunk, 1 in the first chunk of stage 0 and the last chunk of stage 7.
    assert chunk_layers(126, 8, 8, StageSplit(embedding=True, loss=True)) == (1, 2)
    # Qwen3-235B's 94 layers on PP32 VP3 (Megatron's MoE model zoo): 96 slots, 1 per chunk, the ends' empty.
    assert chunk_layers(94, 32, 3, StageSplit(embedding=True, loss=True)) == (0, 1)
    assert chunk_layers(126, 16, 1, StageSplit(7, 7)) == (7, 8)
    assert chunk_layers(80, 4, 5, StageSplit()) == (4,)


def test_searched_embedding_loss_splits_are_the_validators_and_tile_uniform_recompute():
    inp = _inputs(ModelSpec(name="llama3.1-405b"), 512, 8192, 256, fixed=Fixed(tp=8, pp=8, cp=1, mbs=1),
                  prec=("fp8",), fp8_param_gather=True, impl=ImplementationSpec(grad_reduce_in_fp32=False))
    out = search(inp)
    assert {lo.vp for lo in out.layouts if lo.split.embedding and lo.split.loss} == {2, 4, 8, 16}
    for i in range(len(out.mbs)):
        assert not errors(validate(_plan(inp, ModelSpec(name="llama3.1-405b"), out, i))), out.layouts[int(out.layout[i])]
    # Uniform groups must tile every chunk: 16 slots over VP v leave chunks of 16/v - 1 and 16/v layers,
    # coprime, so only groups of 1 (Megatron's _checkpointed_forward indexes past a shorter chunk otherwise).
    def uniform(n):
        return search(replace(inp, fixed=replace(inp.fixed, recompute="full", recompute_method="uniform",
                                                 recompute_num_layers=n)))

    ones = uniform(1)
    assert {ones.layouts[int(j)].vp for j in ones.layout} >= {2, 4, 8}
    assert len(uniform(2).mbs) == 0  # 15 + 6 x 16 + 15 without the split (VP1) has odd stages too


def test_the_moe_model_zoos_qwen3_pp32_vp3_is_searchable_as_96_slots():
    # Megatron's MoE model zoo: Qwen3-235B-A22B (94 layers) on 256 H100 as TP2 PP32 VP3 EP8 (+ embedding + loss).
    model = ModelSpec(name="qwen3-235b-a22b")
    inp = _inputs(model, 256, 4096, 2048, fixed=Fixed(tp=2, pp=32, vp=3, ep=8, etp=1, cp=1, mbs=1), capacity=200.0)
    out = search(inp)
    assert out.layouts and all(lo.split == StageSplit(embedding=True, loss=True) and lo.vp == 3 for lo in out.layouts)
    plan = _plan(inp, model, out, 0)
    assert not errors(validate(plan))
    assert memory_breakdown(plan).total_gib == pytest.approx(float(out.memory_total_gib[0]), rel=1e-9)


def test_hybrid_models_are_not_given_the_embedding_loss_split():
    # Megatron-LM validate_args: --account-for-*-in-pipeline-split should not be used with --hybrid-layer-pattern.
    out = search(_inputs(ModelSpec(name="nemotron-h-8b"), 64, 4096, 128))
    assert out.layouts and not any(lo.split.embedding or lo.split.loss for lo in out.layouts)
    assert "account_for_split_with_hybrid_pattern" not in out.stats.layouts_rejected_by_rule


def test_tp_overlap_is_tried_exactly_where_megatron_and_te_can_run_it():
    # TE userbuffers: sequence parallel (so TP > 1), Transformer Engine, the TP group inside one node.
    inp = _inputs(ModelSpec(name="llama3-8b"), 16, 4096, 64, gpn=4)
    out = search(inp)
    assert {lo.tp for lo in out.layouts} >= {1, 2, 4, 8}
    for lo in out.layouts:
        assert not lo.tp_overlap or (lo.sp and lo.tp in (2, 4)), lo
    assert {lo.tp_overlap for lo in out.layouts if lo.sp and lo.tp in (2, 4)} == {True, False}
    assert not any(lo.tp_overlap for lo in search(_inputs(ModelSpec(name="llama3-8b"), 16, 4096, 64, gpn=4,
                                                           tp_comm_overlap=False)).layouts)
    local = ImplementationSpec(transformer_impl="local", attention_backend="local")
    assert not any(lo.tp_overlap for lo in search(_inputs(ModelSpec(name="llama3-8b"), 16, 4096, 64, impl=local)).layouts)


def test_tp_overlap_trades_exposed_collectives_for_slower_gemms_and_changes_no_memory():
    # Why the search times each layout with and without --tp-comm-overlap (planning/search.py _overlap_options).
    from mcore_advisor.knowledge.hardware import gpu_catalog
    from mcore_advisor.physics.memory import memory_arrays
    from mcore_advisor.physics.step_time import UB_GEMM_STRETCH

    shape = resolve_model(ModelSpec(name="llama3-70b"))
    tp, cp, mbs, fp8 = (x.ravel() for x in np.meshgrid([2, 4, 8], [1, 2], [1, 4], [False, True], indexing="ij"))
    kw = dict(tp=tp, pp=4, cp=cp, dp=256 // (tp * 4 * cp), micro_batch_size=mbs, fp8=fp8, sequence_parallel=True)
    for key in gpu_catalog():
        hw = hardware_params(ClusterSpec(gpu=key, num_gpus=256))
        on, off = (LayoutBatch(shape, 8192, 512, tp_comm_overlap=v, **kw) for v in (True, False))
        t_on, t_off = step_time_arrays(on, hw), step_time_arrays(off, hw)
        # at worst every GEMM-bound part of the step stretched; where TP traffic is large the overlap wins
        assert np.all(t_on["iteration_time_s"] <= t_off["iteration_time_s"] * UB_GEMM_STRETCH), key
        if key in ("h100-sxm", "h200"):  # TP8's traffic on Hopper: the overlap wins (A100's slower GEMMs hide less)
            assert np.any(t_on["iteration_time_s"] < t_off["iteration_time_s"]), key
        assert np.array_equal(memory_arrays(on).total_gib, memory_arrays(off).total_gib), key


def test_the_search_times_each_overlap_capable_layout_with_and_without_the_overlap():
    out = search(_inputs(ModelSpec(name="llama3-70b"), 64, 8192, 128))
    pairs = {}
    for i in range(len(out.mbs)):
        lo = out.layouts[int(out.layout[i])]
        key = (lo.tp, lo.pp, lo.vp, lo.split, lo.cp, lo.precision, int(out.mbs[i]), int(out.recompute[i]))
        pairs.setdefault(key, {})[lo.tp_overlap] = float(out.iteration_time_s[i])
    both = [v for v in pairs.values() if len(v) == 2]
    assert both and all(k[0] > 1 for k, v in pairs.items() if True in v)
    assert any(v[True] < v[False] for v in both) or any(v[True] > v[False] for v in both)


def test_layout_and_candidate_counts_add_up():
    out = search(_inputs(ModelSpec(name="mixtral-8x7b"), 16, 4096, 64, fixed=Fixed(pp=2)))
    s = out.stats
    assert s.layouts_enumerated == s.layouts_pruned_by_model_state + sum(s.layouts_rejected_by_rule.values()) + s.layouts_searched
    assert s.layouts_not_reached == 0
    assert s.configurations_enumerated == (sum(s.configurations_rejected_by_rule.values()) + s.configurations_over_memory
                                           + s.configurations_dominated + s.configurations_timed)
    assert s.configurations_timed == len(out.mbs)
    assert min(s.configurations_over_memory, s.configurations_dominated, s.configurations_timed) >= 0
    # Mixtral with TP > 1 and no SP is refused as Megatron refuses it (now a validator error).
    assert s.layouts_rejected_by_rule.get("expert_and_tensor_parallel_without_sp", 0) > 0


def test_timed_candidates_never_include_a_recompute_variant_when_no_recompute_fits():
    out = search(_inputs(ModelSpec(name="llama3-8b"), 8, 4096, 64))
    by_cfg: dict[tuple, set[int]] = {}
    for i in range(len(out.mbs)):
        by_cfg.setdefault((int(out.layout[i]), int(out.mbs[i])), set()).add(int(out.recompute[i]))
    for kinds in by_cfg.values():
        assert RC_NONE not in kinds or kinds == {RC_NONE}
    assert any(kinds == {RC_NONE} for kinds in by_cfg.values())
    assert RC_SELECTIVE in set(out.recompute.tolist()) or RC_BLOCK in set(out.recompute.tolist())


def _catalog_inputs(name: str, impl: ImplementationSpec | None = None) -> tuple[ModelSpec, SearchInputs]:
    """A quick search with room for the model: GPUs for ~18 B/param of model state in 50 GiB each."""
    model = ModelSpec(name=name)
    shape = resolve_model(model)
    n = 8
    while count_params(shape, 4096) * 18 / n > 50 * 2**30:
        n *= 2
    cl = ClusterSpec(gpu="h100-sxm", num_gpus=n)
    return model, SearchInputs(
        shape=shape, gpu=gpu("h100-sxm"), hardware=hardware_params(cl), cluster=cl, seq_length=4096,
        global_batch_size=2 * n, precisions=("bf16",), implementation=impl or ImplementationSpec(),
        capacity_gib=gpu("h100-sxm").hbm_capacity_gib, quick=True,
    )


@pytest.mark.parametrize("name", sorted(model_catalog()))
def test_the_searchs_memory_is_memory_breakdowns_on_every_catalog_model(name):
    # The search and memory_breakdown run one function (physics.memory.memory_arrays) on a batch and
    # on one row: every timed candidate of every catalog model has the same total, not a sample.
    model, inp = _catalog_inputs(name)
    out = search(inp)
    assert len(out.mbs) > 0, f"{name}: nothing fits on {inp.cluster.num_gpus} GPUs"
    for i in range(len(out.mbs)):
        plan = _plan(inp, model, out, i)
        assert memory_breakdown(plan).total_gib == pytest.approx(float(out.memory_total_gib[i]), rel=1e-9, abs=0)


def test_fsdp2_layouts_are_searched_with_their_sharded_memory():
    model, inp = _catalog_inputs("llama3-8b", ImplementationSpec(use_torch_fsdp2=True))
    out = search(inp)
    assert len(out.mbs) > 0
    layouts = [out.layouts[int(j)] for j in out.layout]
    # FSDP2 in Megatron: no PP, no EP, no distributed optimizer (the validators' rules)
    assert all(lo.pp == 1 and lo.ep == 1 for lo in layouts) and not out.dist_opt.any()
    for i in range(len(out.mbs)):
        plan = _plan(inp, model, out, i)
        plan = plan.model_copy(update={"parallelism": plan.parallelism.model_copy(update={"overlap_param_gather": False})})
        assert not errors(validate(plan))
        assert memory_breakdown(plan).total_gib == pytest.approx(float(out.memory_total_gib[i]), rel=1e-9, abs=0)
    # sharding weights and gradients too: at TP1 (DP8) a layout needs less than with the distributed optimizer
    _, ddp_inp = _catalog_inputs("llama3-8b")
    ddp = search(ddp_inp)

    def tp1(o):
        return {(int(o.mbs[i]), int(o.recompute[i])): float(o.memory_total_gib[i]) for i in range(len(o.mbs))
                if o.layouts[int(o.layout[i])].tp == 1}

    fsdp, dist = tp1(out), tp1(ddp)
    assert set(fsdp) & set(dist) and all(fsdp[k] < dist[k] for k in set(fsdp) & set(dist))


_OUTCOME_ARRAYS = ("layout", "mbs", "dist_opt", "recompute", "recompute_num_layers", "iteration_time_s",
                   "tokens_per_s_per_gpu", "memory_total_gib")


def test_a_search_in_groups_is_one_search_whatever_the_group_size(monkeypatch):
    # With a deadline, layouts are checked and scored in groups, likeliest winners first; uncut, the
    # merged outcome must be the one batch's, candidate for candidate and in its order (ties rank by it).
    inp = _inputs(ModelSpec(name="mixtral-8x7b"), 64, 4096, 256)
    whole = search(inp)
    assert whole.stats.layouts_searched > 50 and len(whole.mbs) > 100
    for size in (5, 10**9):
        monkeypatch.setattr(search_module, "GROUP_LAYOUTS", size)
        out = search(inp, deadline=lambda: False)
        assert out.layouts == whole.layouts and out.stats == whole.stats
        for name in _OUTCOME_ARRAYS:
            assert np.array_equal(getattr(out, name), getattr(whole, name)), (size, name)
        assert out.min_model_state_gib == whole.min_model_state_gib


def test_a_deadline_stops_the_search_after_a_group_and_counts_the_layouts_left(monkeypatch):
    monkeypatch.setattr(search_module, "GROUP_LAYOUTS", 16)
    inp = _inputs(ModelSpec(name="llama3-8b"), 64, 4096, 256)
    full = search(inp)
    asked = []
    cut = search(inp, deadline=lambda: asked.append(1) or len(asked) >= 2)  # time is up at the second look
    s = cut.stats
    assert len(asked) == 2 and s.layouts_not_reached > 0 and full.stats.layouts_not_reached == 0
    assert s.layouts_enumerated == full.stats.layouts_enumerated == (
        s.layouts_pruned_by_model_state + sum(s.layouts_rejected_by_rule.values()) + s.layouts_searched + s.layouts_not_reached)
    assert 0 < s.layouts_searched < full.stats.layouts_searched
    # What it checked it scored exactly as the full search did: the same candidates of those layouts.
    assert all(lo in full.layouts for lo in cut.layouts)
    where = np.asarray([full.layouts.index(lo) for lo in cut.layouts])
    keep = np.isin(full.layout, where)
    assert np.array_equal(where[cut.layout], full.layout[keep])
    for name in _OUTCOME_ARRAYS[1:]:
        assert np.array_equal(getattr(cut, name), getattr(full, name)[keep]), name
    # it checked the likeliest winners first: the full search's best is among them
    assert full.layout[np.argmax(full.tokens_per_s_per_gpu)] in where


def test_a_spent_cpu_budget_gives_the_best_plan_of_what_was_searched_and_says_so(monkeypatch):
    # A clock that jumps past the budget after its first reading: the main search stops after its
    # first group, the what-if searches are skipped, and the answer is still a verified plan.
    monkeypatch.setattr(search_module, "GROUP_LAYOUTS", 64)
    readings = iter([0.0] + [10 * SEARCH_CPU_BUDGET_S] * 1000)
    req = RecommendRequest(model=ModelSpec(name="llama3-8b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=64),
                           seq_length=4096)
    rec = recommend_parallelism(req, cpu_clock=lambda: next(readings))
    s = rec.stats
    checked = s.layouts_searched + sum(s.layouts_rejected_by_rule.values())
    assert rec.feasible and rec.what_if == []
    stop = next(x for x in rec.notes if x.startswith("search stopped"))
    assert f"{checked:,} of the {s.layouts_enumerated - s.layouts_pruned_by_model_state:,} layouts" in stop
    assert f"{SEARCH_CPU_BUDGET_S:g} s CPU limit" in stop
    assert any("2 follow-up search(es)" in x and "CPU limit" in x for x in rec.notes)
    best = rec.plans[0]
    assert not errors(validate(best.plan)) and best.memory_total_gib <= best.capacity_gib
    # without a clock the same request is searched in full
    full = recommend_parallelism(req)
    assert not any(x.startswith("search stopped") for x in full.notes) and full.what_if
    assert full.stats.layouts_searched > s.layouts_searched


def test_full_recompute_is_not_searched_where_the_all_to_all_overlap_refuses_it():
    # TransformerConfig asserts no full recompute with --overlap-moe-expert-parallel-comm; the search asks the
    # validators, so memory-bound layouts get selective or no recompute, never an unlaunchable plan
    model = ModelSpec(name="qwen3-30b-a3b")
    overlap = ImplementationSpec(overlap_moe_expert_parallel_comm=True, moe_token_dispatcher_type="alltoall")
    tight = dict(fixed=Fixed(ep=8))  # 30B on 8 x 80 GB: some layouts fit only with full recompute
    with_overlap = _inputs(model, 8, 4096, 64, impl=overlap, **tight)
    plain = _inputs(model, 8, 4096, 64, **tight)
    assert search_module._recompute_allowed(with_overlap) == (True, True, False, False)
    assert search_module._recompute_allowed(plain) == (True, True, True, True)
    out, base = search(with_overlap), search(plain)
    assert (base.recompute >= RC_BLOCK).any()  # the budget does call for full recompute without the overlap
    assert not (out.recompute >= RC_BLOCK).any()
    assert all(not errors(validate(_plan(with_overlap, model, out, i))) for i in range(min(5, len(out.mbs))))
