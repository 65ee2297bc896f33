"""The layout search engine: its memory and time are memory_breakdown's and step_time's (one function on a
batch and on a row), its dominance premises hold in physics.step_time, its uneven splits are Megatron's,
FSDP2 is searched, and its counts add up."""

from __future__ import annotations

import random

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
    search,
    uneven_splits,
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
            fixed: Fixed | None = None, headroom=0.0, capacity=None) -> SearchInputs:
    cl = ClusterSpec(gpu=g, num_gpus=n)
    return SearchInputs(
        shape=resolve_model(model), gpu=gpu(g), hardware=hardware_params(cl), cluster=cl, seq_length=seq,
        global_batch_size=gbs, precisions=prec, implementation=impl or ImplementationSpec(),
        capacity_gib=capacity or gpu(g).hbm_capacity_gib, required_headroom_gib=headroom, fixed=fixed or Fixed(),
    )


def _plan(inp: SearchInputs, model: ModelSpec, out, i: int) -> Plan:
    lo = out.layouts[int(out.layout[i])]
    rc = int(out.recompute[i])
    dist = bool(out.dist_opt[i])
    return Plan(
        model=model, cluster=inp.cluster,
        training=TrainingSpec(seq_length=inp.seq_length, global_batch_size=inp.global_batch_size,
                              micro_batch_size=int(out.mbs[i]), precision=lo.precision),
        parallelism=ParallelismSpec(
            tensor_model_parallel_size=lo.tp, pipeline_model_parallel_size=lo.pp,
            virtual_pipeline_model_parallel_size=lo.vp if lo.vp > 1 else None,
            decoder_first_pipeline_num_layers=lo.first, decoder_last_pipeline_num_layers=lo.last,
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


def test_uneven_splits_for_405b_on_pp16_are_7_8x14_7_and_a_vp2_split():
    # 126 = 7 + 14 x 8 + 7 (Llama-3.1-405B on PP16); interleaving needs every stage even: 6 + 14 x 8 + 8.
    assert uneven_splits(126, 16) == [(7, 7, (1,)), (6, 8, (2,))]
    # PP2 with an odd layer count puts the extra layer on the last stage.
    assert uneven_splits(61, 2) == [(30, None, (1,))]


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
