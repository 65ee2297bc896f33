"""The profile job's diagnostics: how the MoE router routed (entry/moe_routing.py) and what is live at the
memory peak (entry/mem_peak.py). The summaries are pure and checked on hand-made inputs; one CPU run
of a tiny MoE plan checks the recorder inside Megatron's own training loop."""

from __future__ import annotations

import math

import pytest

from mcore_advisor.launcher.entry import mem_peak as P
from mcore_advisor.launcher.entry import moe_routing as M


def _rank(rank, calls, *, group=(0, 1), pp=0, tp=1, sp=False, local=2):
    return {"rank": rank, "pp_rank": pp, "ep_group": list(group), "tp": tp, "sequence_parallel": sp,
            "num_local_experts": local, "calls": calls, "dropped_calls": 0}


# --------------------------------------------------------------------------- routing summary

def test_two_ep_ranks_sum_their_counts_and_each_receives_its_block_of_experts():
    # 4 experts, 2 per EP rank; each rank routes 4 tokens x top-2 = 8 per call
    r0 = _rank(0, [[1, [3, 1, 2, 2]], [2, [2, 2, 2, 2]]])
    r1 = _rank(1, [[1, [1, 1, 4, 2]], [2, [2, 2, 2, 2]]])
    s = M.summarize([r1, r0])
    # layer 1: experts [4, 2, 6, 4] (mean 4); EP rank 0 gets 4+2 = 6, rank 1 6+4 = 10 (mean 8)
    # layer 2: [4, 4, 4, 4]: balanced
    assert s["calls"] == 2 and s["ep_size"] == 2 and s["num_experts"] == 4 and s["ep_groups"] == 1
    assert s["rank_imbalance_max"] == pytest.approx(10 / 8)
    assert s["rank_imbalance_mean"] == pytest.approx((10 / 8 + 1) / 2)
    # population std of [4, 2, 6, 4]: deviations 0, -2, 2, 0 -> variance 8/4
    assert s["expert_load_cv_mean"] == pytest.approx((math.sqrt(2) / 4 + 0) / 2)
    assert s["expert_max_over_mean_mean"] == pytest.approx((6 / 4 + 1) / 2)
    assert s["per_layer"] == pytest.approx({"1": 10 / 8, "2": 1.0})
    assert s["tokens_per_ep_rank_mean"] == pytest.approx([(6 + 8) / 2, (10 + 8) / 2])
    # expert row counts in call order: 4, 2, 6, 4 | 4, 4, 4, 4: three distinct, new at 3 of 8 expert GEMMs
    assert s["expert_rows_distinct"] == 3 and s["expert_rows_new_fraction"] == pytest.approx(3 / 8)
    # the per-rank counts as routed (before the EP sum), rank order
    assert [(c["rank"], c["layer"], sum(c["tokens_per_expert"])) for c in s["first_call_per_rank"]] == [(0, 1, 8), (1, 1, 8)]


def test_warm_up_calls_count_for_new_shapes_only_and_each_ep_rank_keeps_its_own_shapes():
    # 4 experts over 2 EP ranks (2 local each); iteration 1 is warm-up, 2 and 3 are measured
    calls = [[1, [3, 1, 2, 2], 1, False], [1, [3, 1, 2, 2], 2, True], [1, [5, 1, 0, 2], 3, True]]
    s = M.summarize([_rank(0, calls), _rank(1, [[lay, [0, 0, 0, 0], it, m] for lay, _, it, m in calls])])
    assert s["calls"] == 2  # the routing figures: measured calls only
    # group totals = rank 0's counts. EP rank 0 owns experts 0-1: {3, 1} new in 1; none new in 2; 5 new in 3.
    # EP rank 1 owns experts 2-3: {2} new in 1 (two experts, one shape); nothing new after; 0 rows run no GEMM.
    assert s["expert_rows_new_per_iteration"] == {"1": [2, 2], "2": [0, 2], "3": [1, 2]}


def test_the_lru_replay_counts_the_measured_iterations_misses_first_met_or_evicted():
    # one EP rank with 1 local expert; cache of 2 row counts. Warm-up: 5, 6 (not counted). Measured: 5 (hit),
    # 7 (new: evicts 6), 6 (evicted earlier: evicts 5), 6 (hit) -> 2 of 4 measured calls
    calls = [(1, [5.0], 1, False), (1, [6.0], 1, False), (1, [5.0], 2, True), (1, [7.0], 2, True),
             (1, [6.0], 3, True), (1, [6.0], 3, True)]
    assert M.heuristic_misses(calls, 1, capacity=2) == (2, 4)
    # a cache that holds every count misses only the first-met 7; experts with no token run no GEMM
    assert M.heuristic_misses(calls, 1, capacity=3) == (1, 4)
    assert M.heuristic_misses([(1, [0.0], 1, True)], 1, capacity=1) == (0, 0)


def test_the_miss_share_is_reported_only_where_warm_up_calls_were_recorded():
    old = M.summarize([_rank(0, [[1, [3, 1, 2, 2]]]), _rank(1, [[1, [1, 1, 4, 2]]])])
    assert "expert_gemm_heuristic_miss_share" not in old  # a pre-s9 record: measured calls only
    calls = [[1, [3, 1, 2, 2], 1, False], [1, [3, 1, 2, 2], 2, True]]
    new = M.summarize([_rank(0, calls), _rank(1, [[lay, [0, 0, 0, 0], it, m] for lay, _, it, m in calls])])
    assert new["expert_gemm_heuristic_miss_share"] == 0.0  # the measured call meets the warm-up's counts again


def test_tensor_parallel_ranks_without_sequence_parallelism_route_the_same_tokens_once():
    # ranks 0 and 1 are one TP pair that is also the EP group: without SP both routed the same 4 tokens
    calls = [[1, [3, 1, 2, 2]]]
    no_sp = M.summarize([_rank(0, calls, tp=2), _rank(1, calls, tp=2)])
    sp = M.summarize([_rank(0, calls, tp=2, sp=True), _rank(1, calls, tp=2, sp=True)])
    assert no_sp["tokens_per_ep_rank_mean"] == pytest.approx([4, 4])  # (3+1, 2+2): counted once
    assert sp["tokens_per_ep_rank_mean"] == pytest.approx([8, 8])  # SP: each rank its own tokens
    assert no_sp["rank_imbalance_mean"] == sp["rank_imbalance_mean"] == pytest.approx(1.0)


def test_pipeline_stages_are_summed_apart_and_call_for_call_within_their_group():
    stage0 = [_rank(0, [[1, [4, 0, 2, 2]]], group=(0, 1)), _rank(1, [[1, [4, 0, 2, 2]]], group=(0, 1))]
    stage1 = [_rank(2, [[3, [1, 1, 1, 1]]], group=(2, 3), pp=1), _rank(3, [[3, [2, 2, 0, 0]]], group=(2, 3), pp=1)]
    s = M.summarize(stage0 + stage1)
    # stage 0, layer 1: experts [8, 0, 4, 4] -> EP ranks 8, 8; stage 1, layer 3: [3, 3, 1, 1] -> 6, 2 (mean 4)
    assert s["ep_groups"] == 2 and s["calls"] == 2
    assert s["per_layer"] == pytest.approx({"1": 1.0, "3": 6 / 4})
    assert s["tokens_per_ep_rank_mean"] == pytest.approx([(8 + 6) / 2, (8 + 2) / 2])
    # one summary over all four ranks would mix layers 1 and 3: a rank of another stage is never summed in
    with pytest.raises(ValueError, match="schedules differ"):
        M.summarize([_rank(0, [[1, [1, 1, 1, 1]]]), _rank(1, [[3, [1, 1, 1, 1]]])])


def test_no_moe_layer_or_no_recorded_call_gives_no_summary():
    assert M.summarize([None, None]) is None
    assert M.summarize([_rank(0, []), _rank(1, [])]) is None


def test_a_recorder_fault_stops_recording_with_a_note_instead_of_failing_the_step():
    rec = M.Recorder()
    rec.recording = True
    rec._add(object(), (None, None))  # no routing map: what a changed Megatron could return
    assert rec.recording is False and rec.calls == [] and "MoE routing recording stopped" in rec.notes[0]


# --------------------------------------------------------------------------- memory peak replay

MEG = "/venv/lib/python3.12/site-packages/megatron/core/transformer/moe/experts.py"
TE = "/venv/lib/python3.12/site-packages/transformer_engine/pytorch/module/linear.py"
TORCH = "/venv/lib/python3.12/site-packages/torch/nn/functional.py"


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def _snapshot():
    experts = [_frame(TORCH, 5, "linear"), _frame(MEG, 10, "forward"), _frame(MEG, 99, "outer")]
    te = [_frame(TORCH, 5, "linear"), _frame(TE, 50, "forward"), _frame(MEG, 10, "forward")]
    trace = [
        {"action": "segment_alloc", "addr": 0x9000, "size": 1 << 20},
        {"action": "alloc", "addr": 0x2000, "size": 300, "frames": experts},       # A
        {"action": "alloc", "addr": 0x4000, "size": 200, "frames": te},            # B
        {"action": "free_requested", "addr": 0x5000, "size": 100},
        {"action": "free_completed", "addr": 0x5000, "size": 100},                 # allocated before recording
        {"action": "alloc", "addr": 0x3000, "size": 150, "frames": experts[1:]},   # C, live at the end
        {"action": "alloc", "addr": 0x7000, "size": 50, "frames": []},             # D: autograd thread
        {"action": "free_completed", "addr": 0x2000, "size": 300},
        {"action": "free_completed", "addr": 0x4000, "size": 200},
        {"action": "free_completed", "addr": 0x7000, "size": 50},
        {"action": "free_completed", "addr": 0x6000, "size": 400},                 # before recording
    ]
    blocks = [{"address": 0x1000, "size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []},
              {"address": 0x3000, "size": 512, "requested_size": 150, "state": "active_allocated", "frames": experts[1:]},
              {"address": 0x8000, "size": 4096, "requested_size": 4096, "state": "inactive", "frames": []}]
    other = [{"address": 0x1000, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []}]
    return {"segments": [{"device": 0, "blocks": blocks}, {"device": 1, "blocks": other}],
            "device_traces": [trace, []]}


def test_the_replay_finds_the_peak_and_groups_what_is_live_by_its_innermost_library_frame():
    out = P.peak_live(_snapshot(), device=0)
    # Live before recording: 1000 (still live at the end) + 100 + 400 (freed during it) = 1500.
    # Then +300 +200 -100 +150 +50 = 2100 after D's alloc (event 6), the peak.
    assert out["peak_event"] == 6 and out["events"] == 11
    assert out["peak_bytes_replayed"] == 2100
    # at the peak the 100-byte block is gone, the 400-byte one not yet
    assert out["before_recording_bytes"] == 1400
    assert [(g["where"], g["bytes"], g["count"]) for g in out["groups"]] == [
        (P.BEFORE, 1400, 2),
        ("megatron/core/transformer/moe/experts.py:10 forward", 450, 2),  # A and C, torch's frame skipped
        ("transformer_engine/pytorch/module/linear.py:50 forward", 200, 1),
        (P.NO_FRAME, 50, 1),
    ]
    assert len(P.peak_live(_snapshot(), device=0, top=2)["groups"]) == 2


def test_without_a_library_frame_the_innermost_frame_outside_torch_names_the_allocation():
    ours = "/work/src/mcore_advisor/launcher/entry/gpt.py"
    assert P.where([_frame(TORCH, 5, "linear"), _frame(ours, 12, "forward_step")]) == "launcher/entry/gpt.py:12 forward_step"
    assert P.where([_frame(TORCH, 5, "linear")]) == P.NO_FRAME


def test_the_peak_summaries_kept_are_rank_zeros_and_the_most_loaded_ranks():
    rows = [{"rank": 0, "peak_bytes_replayed": 10}, None, {"rank": 2, "peak_bytes_replayed": 30},
            {"rank": 3, "peak_bytes_replayed": 20}]
    assert [r["rank"] for r in P.pick(rows)] == [0, 2]
    assert [r["rank"] for r in P.pick([{"rank": 0, "peak_bytes_replayed": 9}])] == [0]
    assert P.pick([None]) == []
    assert not P.enabled(use_cuda=False)


# --------------------------------------------------------------------------- in Megatron's loop

@pytest.mark.slow
def test_a_cpu_moe_run_records_each_measured_router_call_of_each_rank(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("megatron.training")
    from test_entry_cpu import TINY, _ok, _plan, _run

    from mcore_advisor.launcher.spec import job_spec

    model = {**TINY, "swiglu": True, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 64}
    plan = _plan(2, model=model, parallelism={"expert_model_parallel_size": 2})
    proc, out = _run(tmp_path, job_spec(plan, warmup_steps=1, measure_steps=2, profile_steps=None), nproc=2)
    r = _ok(proc, out)
    routing = r["moe_routing"]
    # measured: 2 iterations x (global batch 8 / (micro-batch 2 x DP 2)) micro-batches x 2 MoE layers, one
    # EP group; the warm-up iteration and the backward's recompute (none here) are not counted
    assert routing["calls"] == 2 * 2 * 2 and routing["ep_size"] == 2 and routing["ep_groups"] == 1
    assert set(routing["per_layer"]) == {"1", "2"} and routing["rank_imbalance_mean"] >= 1.0
    # each rank routes its micro-batch's 64 x 2 tokens to 2 experts each, before any EP sum
    first = routing["first_call_per_rank"]
    assert [c["rank"] for c in first] == [0, 1]
    assert all(len(c["tokens_per_expert"]) == 4 and sum(c["tokens_per_expert"]) == 64 * 2 * 2 for c in first)
    # both EP ranks together receive every routed token of a call
    assert sum(routing["tokens_per_ep_rank_mean"]) == pytest.approx(2 * 64 * 2 * 2)
    assert "memory_peak" not in r  # off unless MCORE_ADVISOR_MEMORY_PEAK=1 on CUDA


def test_the_jobs_cache_size_in_row_counts_is_the_models():
    from mcore_advisor.physics import moe

    assert M.GEMMS_PER_ROW_COUNT == moe.EXPERT_GEMM_SHAPES
    assert M.HEURISTIC_CACHE_ROW_COUNTS == moe.CUBLASLT_HEURISTICS_CACHE_KEYS // moe.EXPERT_GEMM_SHAPES


def test_a_replay_at_another_cache_size_is_recorded_with_it():
    calls = [[1, [3, 1, 2, 2], 1, False], [1, [4, 1, 2, 2], 2, True]]
    s = M.summarize([_rank(0, calls), _rank(1, [[lay, [0, 0, 0, 0], it, m] for lay, _, it, m in calls])], cache_row_counts=1)
    # EP rank 0 (experts 0-1): warm-up 3, then 1 evicts it; measured 4 evicts 1 (miss), 1 evicts 4 (miss) -> 2 of 2;
    # EP rank 1: 2, 2 in warm-up and measured: hits
    assert s["heuristic_cache_row_counts"] == 1 and s["expert_gemm_heuristic_miss_share"] == 1.0
