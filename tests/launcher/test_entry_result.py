"""result.json's contract (launcher/entry/result.py): what the entry writes is what get_job reads, and
each figure get_job compares is read by name from one typed place on both sides."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from mcore_advisor.launcher import jobs
from mcore_advisor.launcher.entry import result as R
from mcore_advisor.physics.evaluate import Evaluation

PROFILE = Path(R.__file__).with_name("profile.py")


def _result(**changes) -> dict:
    """A well-formed result of a 2-rank job with one measured window (the shape entry/profile.py writes)."""
    mem = {"allocated_mb": 1.0, "max_allocated_mb": 2.0, "reserved_mb": 3.0, "max_reserved_mb": 4.0}
    rank = {"rank": 0, "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "cp_rank": 0, "ep_rank": 0, "num_params_local": 10}
    base = {
        "status": "ok", "mode": "profile", "measured_rank": None, "device": "NVIDIA H100 80GB HBM3", "world_size": 2,
        "processes": 2, "versions": {"torch": "2.14.1", "megatron_core": "0.19.2", "transformer_engine": None,
                                     "cuda": "12.8", "python": "3.12.1"},
        "megatron_argv": ["--num-layers", "2"], "argv_adjustments": [{"flag": "--x", "action": "dropped", "values": [], "why": "w"}],
        "notes": [], "iterations": ["warmup", "measure"], "ranks": [rank, {**rank, "rank": 1, "num_params_local": None}],
        "megatron": {"iteration_lines": [], "memory_lines": [], "timer_lines": [], "theoretical_memory_lines": []},
        "host": {"cpu_count": 16, "cpus_usable": 16, "local_processes_of_this_job": 2, "cpu_steal_fraction_measured": None,
                 "loadavg_1m_measure_start_end": [0.5, 0.7], "steal_source": "s", "gc_pause_s_per_iteration": [0.0, 0.1],
                 "gc_gen2_collections_per_iteration": [0, 1], "gc_source": "g"},
        "spec": {"mode": "profile"}, "step_times_s": [2.0, 1.5], "step_times_source": "s", "host_step_times_s": [2.0, 1.5],
        "losses": [10.5, None], "grad_norms": [1.0, "nan"], "megatron_tflops_per_gpu": [None, 300.0],
        "flops_per_iteration_causal": 1e15, "flops_per_iteration_full": None, "flops_source": "f",
        "measured_step_times_s": [1.5], "iter_s": 1.5, "iter_s_mean": 1.5, "iter_s_min": 1.5, "tokens_per_s_per_gpu": 800,
        "tflops_per_gpu_causal": 333.3, "tflops_per_gpu_full": None, "mfu_peak_tflops": 989.0, "mfu_peak_note": "n",
        "mfu_pct_causal": 33.7, "mfu_pct_full": None, "trace": None, "exposed_comm_s": None, "comm_s": None,
        "exposed_comm_method": None, "device_busy_s_per_profiled_iteration": None, "device_idle_fraction": None,
        "peak_allocated_gib": [30.0, 40.0], "peak_reserved_gib": [31.0, 41.0], "memory_source": "torch.cuda caching allocator",
        "memory_after_setup_mb": [mem, None], "memory_after_iteration_mb": [{"1": mem}, {}],
        "settings": {"transformer_impl": "transformer_engine", "attention_backend": "AttnBackend.auto"},
        "transformer_impl": "transformer_engine",
    }
    return {**base, **changes}


def test_a_well_formed_result_meets_the_contract_and_each_breach_is_named():
    assert R.check(_result()) == []
    no_window = {k: v for k, v in _result().items() if k not in R.ProfileResult.__optional_keys__}
    assert R.check(no_window) == []  # a job that measured no iteration
    assert R.check({k: v for k, v in _result().items() if k != "peak_allocated_gib"}) == ["result.peak_allocated_gib: missing"]
    assert R.check(_result(iter_s="1.5")) == ["result.iter_s: '1.5' is not float"]
    assert R.check(_result(mode="train")) == ["result.mode: 'train' is not one of ('profile', 'memory_at_scale')"]
    assert R.check(_result(elapsed=1.0)) == ["result.elapsed: not in the contract (launcher/entry/result.py)"]
    host = {**_result()["host"], "gc_pause_s_per_iteration": [0.0, True]}
    assert R.check(_result(host=host)) == ["result.host.gc_pause_s_per_iteration[1]: True is not float"]
    ranks = [{"rank": 0}]
    assert R.check(_result(ranks=ranks))[0] == "result.ranks[0].tp_rank: missing"


def test_measured_figures_are_read_by_name_from_one_key_each():
    r = _result()
    assert R.measured(r, "iteration_time_s") == 1.5 and R.measured(r, "tokens_per_s_per_gpu") == 800.0
    assert R.measured(r, "peak_allocated_gib") == 40.0  # the most-loaded rank
    assert R.measured({"iter_s": float("nan")}, "iteration_time_s") is None
    assert R.measured({}, "tflops_per_gpu_causal") is None
    hints = typing.get_type_hints(R.ProfileResult)
    assert all(key in hints for key, _ in R.MEASURED.values())
    assert set(typing.get_args(R.Figure)) == set(R.MEASURED) == set(jobs.PREDICTED_FIELDS)


def test_predicted_figures_name_fields_of_evaluate_plans_answer():
    for section, field in jobs.PREDICTED_FIELDS.values():
        model = typing.get_args(Evaluation.model_fields[section].annotation)[0]  # Optional[PerfEstimate | MemoryBreakdown]
        assert field in model.model_fields, (section, field)


def test_get_job_compares_each_named_figure():
    pred = jobs.PredictedFigures(iteration_time_s=2.0, tokens_per_s_per_gpu=1000.0, tflops_per_gpu_causal=300.0,
                                 peak_allocated_gib=44.0)
    rows = {c.figure: c for c in jobs.compare(_result(), pred)}
    # (predicted - measured) / measured: (2 - 1.5) / 1.5, (1000 - 800) / 800, (300 - 333.3) / 333.3, (44 - 40) / 40
    assert rows["iteration_time_s"].error_pct == pytest.approx(33.33, abs=0.01)
    assert rows["tokens_per_s_per_gpu"].error_pct == pytest.approx(25.0)
    assert rows["tflops_per_gpu_causal"].error_pct == pytest.approx(-9.99, abs=0.01)
    assert rows["peak_allocated_gib"].error_pct == pytest.approx(10.0)


def _written_keys() -> set[str]:
    """String keys the entry's report functions write (dict literals, .update(k=...), x["k"] = ...)."""
    tree = ast.parse(PROFILE.read_text())
    job = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Job")
    keys: set[str] = set()
    for fn in job.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name in ("_report", "_base", "_timing", "_trace", "_memory",
                                                                "_host_report")):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
                keys |= {kw.arg for kw in node.keywords if kw.arg}
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
    return keys


def test_the_entry_writes_the_contracts_keys():
    contract = {k for cls in vars(R).values() if typing.is_typeddict(cls) for k in typing.get_type_hints(cls)}
    written = _written_keys()
    # the per-rank rows gathered before the report (host_s, gc_pause_s, ...) are the entry's own working keys
    working = {"host_s", "gc_pause_s", "gc_gen2", "host_probe", "iteration_lines", "memory_lines", "timer_lines", "theoretical_lines",
               "causal", "full"}
    assert written - contract - working == set(), "add these keys to launcher/entry/result.py"
    assert set(R.ProfileResult.__required_keys__) <= written


def test_a_host_probe_summary_as_the_job_writes_it_meets_the_contract():
    from mcore_advisor.launcher.entry import host_probe

    one = {"ms_per_layer": 4.8, "statistic": "median", "mean_ms_per_layer": 5.0, "cpu_ms_per_layer": 2.4,
           "gpu_ms_per_layer": 4.9, "per_iteration_ms": [4.7, 4.8, 5.5], "impl": "transformer_engine", "tokens": 128,
           "iterations": 3}  # the keys of host_probe._measure's answer
    host = {**_result()["host"], "probe": host_probe.summary([one, {**one, "ms_per_layer": 5.2}]),
            "cublaslt_heuristics_cache_capacity": None}
    assert R.check(_result(host=host)) == []
    assert host["probe"]["ms_per_layer"] == 5.2  # the slowest rank
