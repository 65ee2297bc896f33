"""Predictions for the plan as a profile job ran it (Megatron's parsed arguments in result.json)
and for the rank a memory_at_scale job measured."""

from __future__ import annotations

import pytest

from mcore_advisor.launcher import jobs
from mcore_advisor.launcher.as_ran import MACHINE_PROBES_KEPT, as_ran, earlier_machine_probes, rank_terms
from mcore_advisor.launcher.store import JobStore, record_from
from mcore_advisor.physics.memory import GIB, memory_breakdown
from mcore_advisor.physics.step_time import HOST_PROBE_TO_LAYER, host_floor_from_probe, step_time
from mcore_advisor.schemas import ClusterSpec, ModelSpec, Plan, TrainingSpec, with_changes

PLAN = Plan(model=ModelSpec(name="gpt3-1.3b"), cluster=ClusterSpec(gpu="h200", num_gpus=1),
            training=TrainingSpec(seq_length=2048, global_batch_size=32, micro_batch_size=8))
#: what entry/profile.py records of Megatron's arguments for PLAN run as rendered on a TE machine without Apex
AS_RENDERED = {"transformer_impl": "transformer_engine",
               "settings": {"attention_backend": "AttnBackend.auto", "gradient_accumulation_fusion": False,
                            "cross_entropy_loss_fusion": False, "cross_entropy_fusion_impl": "native",
                            "moe_grouped_gemm": False, "grad_reduce_in_bf16": False}}


def test_a_run_as_rendered_predicts_for_the_rendered_choices_only():
    ran = as_ran(PLAN, AS_RENDERED)
    # the script passes --no-gradient-accumulation-fusion without Apex; nothing else differs
    assert ran.plan == with_changes(PLAN, "implementation", gradient_accumulation_fusion=False)
    assert ran.differences == ["gradient_accumulation_fusion False"]
    assert as_ran(PLAN, None).plan == PLAN
    assert jobs._as_ran_prediction(PLAN.model_dump(mode="json"), None) == (None, None)


def test_the_local_spec_fallback_without_te_is_what_gets_predicted():
    result = {"transformer_impl": "local",
              "settings": {**AS_RENDERED["settings"], "cross_entropy_loss_fusion": False}}
    ran = as_ran(PLAN, result)
    im = ran.plan.implementation
    assert (im.transformer_impl, im.gradient_accumulation_fusion, im.cross_entropy_loss_fusion) == ("local", False, False)
    assert "transformer_impl local (the plan asked for transformer_engine)" in ran.differences
    figures, note = jobs._as_ran_prediction(PLAN.model_dump(mode="json"), result)
    assert figures.iteration_time_s == pytest.approx(step_time(ran.plan).iteration_time_s)
    assert figures.iteration_time_s != pytest.approx(step_time(PLAN).iteration_time_s)
    assert figures.peak_allocated_gib == pytest.approx(memory_breakdown(ran.plan).peak_allocated_gib)
    assert "as the job ran it" in note and "transformer_impl local" in note


def test_a_memory_at_scale_job_is_compared_with_the_stage_it_measured_term_by_term():
    plan = Plan(model=ModelSpec(name="llama3-70b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=64),
                training=TrainingSpec(seq_length=8192, global_batch_size=128, micro_batch_size=1),
                parallelism={"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "sequence_parallel": True})
    ran = as_ran(plan, AS_RENDERED).plan
    stage = next(s for s in memory_breakdown(ran).stages if s.pipeline_rank == 1)
    # rank 16 = pipeline stage 1; measured: 20 GiB after iteration 1, 30 GiB peak
    result = {**AS_RENDERED, "mode": "memory_at_scale", "measured_rank": 16, "memory_read_after_iteration": 2,
              "ranks": [{"num_params_local": stage.num_params}], "peak_allocated_gib": [30.0],
              "memory_after_iteration_mb": [{"1": {"allocated_mb": 20 * 1024.0}}]}
    peak, rows, note = rank_terms(plan, result)
    assert peak == pytest.approx(stage.peak_allocated_bytes / GIB)
    by = {r["term"]: r for r in rows}
    assert by["num_params"]["error_pct"] == 0.0
    static = (stage.weights_bytes + stage.gradients_bytes + stage.optimizer_bytes) / GIB
    assert by["weights_gradients_optimizer_gib"]["predicted"] == pytest.approx(static)
    assert by["weights_gradients_optimizer_gib"]["error_pct"] == pytest.approx((static - 20) / 20 * 100, abs=0.01)
    assert by["activations_transient_buffers_gib"]["measured"] == pytest.approx(10.0)
    assert by["peak_allocated_gib"]["error_pct"] == pytest.approx((peak - 30) / 30 * 100, abs=0.01)
    assert "rank 16 (pipeline stage 1" in note
    figures, terms, _ = jobs._at_scale_prediction(plan.model_dump(mode="json"), result)
    assert figures.peak_allocated_gib == pytest.approx(peak) and terms == rows


def test_the_jobs_host_probe_sets_the_host_speed_it_predicts_with():
    from mcore_advisor.physics.step_time import HOST_PROBE_TO_LAYER

    probe = {"ms_per_layer": 8.0, "impl": "transformer_engine"}
    ran = as_ran(PLAN, {**AS_RENDERED, "host": {"probe": probe}})
    assert ran.plan.cluster.host_floor_ms_per_layer == pytest.approx(8.0 * HOST_PROBE_TO_LAYER)
    assert any(d.startswith("host_floor_ms_per_layer") and "8.00 ms per TE layer" in d for d in ran.differences)
    # a slower host can only lengthen the predicted step
    fast = as_ran(PLAN, {**AS_RENDERED, "host": {"probe": {**probe, "ms_per_layer": 1.0}}}).plan
    assert step_time(ran.plan).iteration_time_s > step_time(fast).iteration_time_s
    # a plan that names its host, a torch-only probe or a failed probe keeps the plan's own figure
    pinned = with_changes(PLAN, "cluster", host_floor_ms_per_layer=3.0)
    assert as_ran(pinned, {**AS_RENDERED, "host": {"probe": probe}}).plan.cluster.host_floor_ms_per_layer == 3.0
    for other in ({**probe, "impl": "torch"}, {"error": "RuntimeError: no TE"}):
        assert as_ran(PLAN, {**AS_RENDERED, "host": {"probe": other}}).plan.cluster.host_floor_ms_per_layer is None


def test_a_probe_run_with_the_heuristics_cache_off_loses_its_layers_queries():
    from mcore_advisor.physics.moe import HEURISTIC_QUERY_REF_LAYERS
    from mcore_advisor.physics.step_time import HOST_PROBE_GEMMS, HOST_PROBE_TO_LAYER

    probe = {"ms_per_layer": 8.0, "impl": "transformer_engine"}
    off = as_ran(PLAN, {**AS_RENDERED, "host": {"probe": probe, "cublaslt_heuristics_cache_capacity": 0}})
    # floor + 12 queries of 0.0245 floors each = 8.0 ms -> floor = 8.0 / 1.294
    floor = 8.0 * HOST_PROBE_TO_LAYER / (1 + HOST_PROBE_GEMMS * HEURISTIC_QUERY_REF_LAYERS)
    assert HOST_PROBE_GEMMS == 12 and floor == pytest.approx(6.18, abs=0.01)
    assert off.plan.cluster.host_floor_ms_per_layer == pytest.approx(floor, abs=1e-4)
    assert any("the cache was off" in d for d in off.differences)
    # any cache size that keeps the cache leaves the probe as measured
    big = as_ran(PLAN, {**AS_RENDERED, "host": {"probe": probe, "cublaslt_heuristics_cache_capacity": 65536}})
    assert big.plan.cluster.host_floor_ms_per_layer == pytest.approx(8.0 * HOST_PROBE_TO_LAYER)


def test_the_routing_a_job_recorded_is_what_gets_predicted_and_a_plan_figure_wins():
    result = {**AS_RENDERED, "moe_routing": {"rank_imbalance_mean": 1.3164}}
    ran = as_ran(PLAN, result)
    assert ran.plan.implementation.moe_routing_imbalance == 1.3164
    assert "moe_routing_imbalance 1.316 (the job's routing record)" in ran.differences
    own = with_changes(PLAN, "implementation", moe_routing_imbalance=1.1)
    assert as_ran(own, result).plan.implementation.moe_routing_imbalance == 1.1
    assert as_ran(PLAN, AS_RENDERED).plan.implementation.moe_routing_imbalance is None  # no record: the model's estimate


def test_a_fake_process_group_run_is_predicted_with_the_mean_expert_load():
    moe = with_changes(PLAN, "model", name=None, num_layers=4, hidden_size=1024, num_attention_heads=16,
                       ffn_hidden_size=2816, vocab_size=32000, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2816)
    ran = as_ran(moe, {**AS_RENDERED, "mode": "memory_at_scale"})
    assert ran.plan.implementation.moe_routing_imbalance == 1.0  # the fake all-to-all returns a rank's own tokens
    assert as_ran(PLAN, {**AS_RENDERED, "mode": "memory_at_scale"}).plan.implementation.moe_routing_imbalance is None


def test_the_jobs_cublaslt_cache_and_measured_miss_share_are_what_gets_predicted():
    result = {**AS_RENDERED, "host": {"cublaslt_heuristics_cache_capacity": 0},
              "moe_routing": {"expert_gemm_heuristic_miss_share": 0.62, "heuristic_cache_row_counts": 0}}
    ran = as_ran(PLAN, result)
    assert ran.plan.implementation.cublaslt_heuristics_cache_capacity == 0
    assert ran.plan.implementation.moe_heuristic_miss_share == 0.62
    assert "cublaslt_heuristics_cache_capacity 0 (the job's environment)" in ran.differences
    assert as_ran(PLAN, AS_RENDERED).plan.implementation.cublaslt_heuristics_cache_capacity is None


def test_a_miss_share_replayed_at_another_cache_than_the_run_had_is_not_used():
    rec = {"expert_gemm_heuristic_miss_share": 0.8}  # the first s9 jobs: replayed at cuBLASLt's default
    big = as_ran(PLAN, {**AS_RENDERED, "host": {"cublaslt_heuristics_cache_capacity": 65536}, "moe_routing": rec})
    assert big.plan.implementation.moe_heuristic_miss_share is None  # the model's estimate at 65536 instead
    same = {**rec, "heuristic_cache_row_counts": 65536 // 6}
    ok = as_ran(PLAN, {**AS_RENDERED, "host": {"cublaslt_heuristics_cache_capacity": 65536}, "moe_routing": same})
    assert ok.plan.implementation.moe_heuristic_miss_share == 0.8


def _probed(ms: float, host: str | None = "node-a", impl: str = "transformer_engine", cache: int | None = None) -> dict:
    report = {"probe": {"ms_per_layer": ms, "impl": impl}, "cublaslt_heuristics_cache_capacity": cache}
    return {**AS_RENDERED, "device": "NVIDIA H200", "host": {**report, **({"hostname": host} if host else {})}}


def test_a_machines_earlier_probes_are_pooled_by_hostname_and_order_without_cache_off_probes():
    results = [_probed(4.0), _probed(9.0, host="node-b"), _probed(5.0), _probed(6.0, cache=0), _probed(7.0, impl="torch"),
               None, _probed(8.0)]
    earlier = earlier_machine_probes(results, [None] * len(results))
    # node-a's third TE probe sees its first two, and so does the cache-off job; its probe (queries timed too)
    # joins no pool; node-b and the torch probe start their own
    assert earlier == [[], [], [4.0], [4.0, 5.0], [], [], [4.0, 5.0]]
    # rows without a hostname pool only under the machine their caller names
    bare = [_probed(4.0, host=None), _probed(6.0, host=None), _probed(8.0, host=None)]
    assert earlier_machine_probes(bare, [None, None, None]) == [[], [], []]
    assert earlier_machine_probes(bare, ["call1", "call1", "call2"]) == [[], [4.0], []]
    # one hostname over two boots (a VM lease's generic 'vm' on two machines) is two machines
    booted = [{**r, "host": {**r["host"], "boot_id": b}} for r, b in zip([_probed(4.0), _probed(6.0), _probed(8.0)], "aba", strict=True)]
    assert earlier_machine_probes(booted, [None] * 3) == [[], [], [4.0]]
    many = [_probed(float(i)) for i in range(MACHINE_PROBES_KEPT + 3)]
    assert earlier_machine_probes(many, [None] * len(many))[-1] == [float(i) for i in range(2, MACHINE_PROBES_KEPT + 2)]


def test_the_host_speed_is_the_median_of_the_jobs_probe_and_its_machines_earlier_ones():
    alone = as_ran(PLAN, _probed(8.0))
    pooled = as_ran(PLAN, _probed(8.0), machine_probes=[4.0, 5.0])
    assert alone.plan.cluster.host_floor_ms_per_layer == pytest.approx(8.0 * HOST_PROBE_TO_LAYER)
    assert pooled.plan.cluster.host_floor_ms_per_layer == pytest.approx(5.0 * HOST_PROBE_TO_LAYER)
    assert any("8.00 ms per TE layer; the median with this machine's 2 earlier probes: 5.00 ms" in d for d in pooled.differences)
    assert step_time(pooled.plan).iteration_time_s < step_time(alone.plan).iteration_time_s


def test_a_cache_off_job_reads_its_host_from_its_machines_cache_on_probes():
    off = _probed(9.5, cache=0)
    pooled = as_ran(PLAN, off, machine_probes=[4.8, 5.4, 4.5])
    alone = as_ran(PLAN, off)
    # the Y set's H100 VM: 9.0-9.5 ms with the cache off, 4.5-5.4 ms with it on; the earlier cache-on median stands
    assert pooled.plan.cluster.host_floor_ms_per_layer == pytest.approx(4.8 * HOST_PROBE_TO_LAYER)
    assert any("the cache off; the median of this machine's 3 earlier probes with it on: 4.80 ms" in d
               for d in pooled.differences)
    # no cache-on probe of the machine: the job's own, less the probe GEMMs' queries
    assert alone.plan.cluster.host_floor_ms_per_layer == pytest.approx(host_floor_from_probe(9.5, heuristics_cache_off=True), abs=1e-4)
    assert any("less its GEMMs heuristic queries" in d for d in alone.differences)


def test_get_job_predicts_on_the_probes_of_the_jobs_that_ran_on_the_same_machine_before(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    manager = jobs.JobManager(store, job_root=tmp_path / "jobs")
    plan = PLAN.model_dump(mode="json")
    for i, (ms, host) in enumerate([(4.0, "node-a"), (30.0, "node-b"), (5.0, "node-a"), (8.0, "node-a"), (3.0, "node-a")]):
        rec = record_from(job_id=f"j{i}", name="n", backend="local", job_dir=tmp_path / f"j{i}", command=["x"], plan=plan,
                          spec={}, resources={}, created_at=1000.0 + i)
        store.insert(rec)
        store.update(rec.job_id, state="COMPLETED", result=_probed(ms, host))
    # j3 (8.0 ms on node-a) ran after j0 and j2 there (4.0, 5.0); node-b's job and the later j4 do not count
    assert manager._machine_probes(store.get("j3")) == [4.0, 5.0]
    figures, note = jobs._as_ran_prediction(plan, store.get("j3").result, manager._machine_probes(store.get("j3")))
    expected = as_ran(PLAN, _probed(8.0), machine_probes=[4.0, 5.0]).plan
    assert figures.iteration_time_s == pytest.approx(step_time(expected).iteration_time_s)
    assert "the median with this machine's 2 earlier probes: 5.00 ms" in note
    assert manager._machine_probes(store.get("j1")) == []
    # get_job hands the assistant the machine's host figure for other plans on it (cluster.host_floor_ms_per_layer)
    assert manager.get("j3").host_floor_ms_per_layer == pytest.approx(5.0 * HOST_PROBE_TO_LAYER, abs=1e-3)
    assert manager.get("j1").host_floor_ms_per_layer == pytest.approx(30.0 * HOST_PROBE_TO_LAYER, abs=1e-3)
