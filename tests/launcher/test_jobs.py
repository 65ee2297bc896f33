"""The job tools end to end on the local backend: submit, poll, cancel, restart, hostile input.

Most tests run a fake entry point (a small python script, no torch) so they stay fast; one slow
test runs the real Megatron-Core entry on CPU when torch and megatron-core are installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mcore_advisor.launcher import jobs
from mcore_advisor.launcher.backends.base import JobResources
from mcore_advisor.launcher.jobs import JobManager, ProfileJobRequest, compare, predicted_figures
from mcore_advisor.launcher.store import JobStore
from mcore_advisor.schemas import ClusterSpec, ModelSpec, ParallelismSpec, Plan, TrainingSpec

FAKE_ENTRY = r'''
import json, os, sys, time
mode = sys.argv[1]
out = sys.argv[sys.argv.index("--out-dir") + 1]
def write(name, data):
    with open(os.path.join(out, name), "w") as fh:
        json.dump(data, fh)
if mode == "wait":  # runs until the test creates <out>/go
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.01)
    mode = "ok"
if mode == "ok":
    with open(os.path.join(out, "train.log"), "w") as fh:
        fh.write(" iteration        1/       4 | elapsed time per iteration (ms): 2500.0 |\n")
    write("result.json", {"status": "ok", "iter_s": 2.5, "tokens_per_s_per_gpu": 800.0,
                          "tflops_per_gpu_causal": 400.0, "peak_allocated_gib": [30.0, 40.0]})
elif mode == "fail":
    # PyTorch >= 2.1 c10 CUDACachingAllocator wording.
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
          "79.11 GiB of which 1.05 GiB is free. Including non-PyTorch memory, this process has 78.05 GiB memory in use. "
          "Of the allocated memory 74.20 GiB is allocated by PyTorch, and 2.31 GiB is reserved by PyTorch but "
          "unallocated.", file=sys.stderr, flush=True)
    write("error.json", {"status": "failed", "error_type": "OutOfMemoryError", "message": "CUDA out of memory", "rank": 0})
    sys.exit(3)
elif mode == "sleep":
    time.sleep(60)
elif mode == "silent":
    pass
'''


def tiny_plan(**parallel) -> Plan:
    return Plan(
        model=ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256),
        cluster=ClusterSpec(num_gpus=1),
        training=TrainingSpec(seq_length=32, global_batch_size=2, micro_batch_size=1),
        parallelism=ParallelismSpec(**parallel),
    )


def two_node_plan() -> Plan:
    return tiny_plan().model_copy(update={
        "cluster": ClusterSpec(num_gpus=16, gpus_per_node=8),
        "training": TrainingSpec(seq_length=32, global_batch_size=16, micro_batch_size=1),
    })


@pytest.fixture
def fake_entry(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fake") / "fake_entry.py"
    path.write_text(FAKE_ENTRY)
    return path


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch):
    # The local backend must take the CPU path whatever machine runs the tests.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def manager(tmp_path: Path, fake_entry: Path, mode: str) -> JobManager:
    return JobManager(JobStore(tmp_path / "state" / "jobs.sqlite3"), entry=[str(fake_entry), mode])


def wait_for(mgr: JobManager, job_id: str, states: set[str], timeout_s: float = 8.0):
    deadline = time.monotonic() + timeout_s
    while True:
        st = mgr.get(job_id)
        if st.state in states or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def test_a_submitted_job_returns_at_once_running_then_completes_with_result_and_comparison(tmp_path, fake_entry, monkeypatch):
    # Predicted figures as evaluate_plan would report them; the measured ones come from the fake result.json.
    monkeypatch.setattr(jobs, "_predict", lambda plan: {"performance": {
        "iteration_time_s": 2.0, "tokens_per_s_per_gpu": 1000.0, "model_tflops_per_gpu_causal": 380.0},
        "memory": {"peak_allocated_gib": 44.0, "peak_reserved_gib": 50.0}})
    mgr = manager(tmp_path, fake_entry, "wait")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan()))
    assert (sub.dry_run, sub.backend, sub.state) == (False, "local", "RUNNING")
    assert sub.command == [sys.executable, str(fake_entry), "wait", "--spec", f"{sub.job_dir}/spec.json", "--out-dir", sub.job_dir]
    assert json.loads(Path(sub.job_dir, "spec.json").read_text())["dims"]["world_size"] == 1
    assert mgr.get(sub.job_id).state == "RUNNING"

    Path(sub.job_dir, "go").touch()
    st = wait_for(mgr, sub.job_id, {"COMPLETED"})
    assert st.state == "COMPLETED" and st.exit_code == 0
    assert st.result["tokens_per_s_per_gpu"] == 800.0
    assert "elapsed time per iteration (ms): 2500.0" in st.log_tail
    by = {c.figure: c for c in st.comparison}
    # error = (predicted - measured) / measured: (2.0 - 2.5) / 2.5 = -20 %; (1000 - 800) / 800 = +25 %;
    # (380 - 400) / 400 = -5 %; peak memory is the most-loaded rank: (44 - 40) / 40 = +10 %.
    assert by["iteration_time_s"].error_pct == pytest.approx(-20.0)
    assert by["tokens_per_s_per_gpu"].error_pct == pytest.approx(25.0)
    assert by["tflops_per_gpu_causal"].error_pct == pytest.approx(-5.0)
    assert (by["peak_allocated_gib"].measured, by["peak_allocated_gib"].error_pct) == (40.0, pytest.approx(10.0))
    assert st.comparison_note and "CPU" in st.comparison_note


def test_a_failing_job_is_failed_with_the_entry_error_stderr_exit_code_and_oom_diagnosis(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "fail")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan()))
    st = wait_for(mgr, sub.job_id, {"FAILED"})
    assert (st.state, st.exit_code) == ("FAILED", 3)
    assert st.error.startswith("OutOfMemoryError on rank 0: CUDA out of memory")
    assert "Tried to allocate 2.00 GiB" in st.stderr_tail
    if importlib.util.find_spec("mcore_advisor.tools.mfu") is not None:
        oom = st.diagnosis["oom_diagnosis"]
        assert oom["event"]["tried_to_allocate_gib"] == 2.0 and oom["event"]["reserved_unallocated_gib"] == 2.31
        assert "plan" not in json.dumps(oom.get("fixes", []))  # whole plans are dropped, the change lines stay


def test_exit_zero_without_result_json_is_a_failure_not_a_success(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "silent")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan()))
    st = wait_for(mgr, sub.job_id, {"FAILED", "COMPLETED"})
    assert st.state == "FAILED" and "no result.json" in st.error


def test_the_time_limit_ends_a_job_as_timeout(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "sleep")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan(), resources=JobResources(time_limit_min=0.4 / 60)))
    st = wait_for(mgr, sub.job_id, {"TIMEOUT"})
    assert st.state == "TIMEOUT" and "wall-clock limit" in st.error


def test_cancel_job_cancels_a_running_job_and_leaves_ended_jobs_alone(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "sleep")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan()))
    st = mgr.cancel(sub.job_id)
    assert st.state == "CANCELLED" and st.ended_at is not None
    assert mgr.cancel(sub.job_id).state == "CANCELLED"
    assert wait_for(mgr, sub.job_id, {"X"}, timeout_s=0.3).state == "CANCELLED"  # stays put on later polls

    done = manager(tmp_path, fake_entry, "ok").submit(ProfileJobRequest(plan=tiny_plan()))
    assert wait_for(mgr, done.job_id, {"COMPLETED"}).state == "COMPLETED"
    assert mgr.cancel(done.job_id).state == "COMPLETED"


def test_list_jobs_is_newest_first_filters_by_state_and_rejects_unknown_states(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "sleep")
    a = mgr.submit(ProfileJobRequest(plan=tiny_plan(), name="first"))
    b = mgr.submit(ProfileJobRequest(plan=tiny_plan(), name="second"))
    mgr.cancel(a.job_id)
    assert [w.code for w in b.warnings if w.code == "local_jobs_running"] == ["local_jobs_running"]
    assert a.job_id in next(w.message for w in b.warnings if w.code == "local_jobs_running")
    listed = mgr.list()
    assert [j.job_id for j in listed.jobs] == [b.job_id, a.job_id]
    assert [j.job_id for j in mgr.list(state="CANCELLED").jobs] == [a.job_id]
    assert [j.job_id for j in mgr.list(limit=1).jobs] == [b.job_id]
    with pytest.raises(ValueError, match="state: unknown job state 'DONE'"):
        mgr.list(state="DONE")
    mgr.cancel(b.job_id)


def test_an_unknown_job_id_is_a_key_error_that_says_so(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "ok")
    with pytest.raises(KeyError, match="job_id: no job 'deadbeef0000' in this store"):
        mgr.get("deadbeef0000")
    with pytest.raises(KeyError, match="job_id: no job "):
        mgr.cancel("deadbeef0000")


def test_dry_run_returns_the_command_and_creates_no_job(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "ok")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan(), dry_run=True))
    assert sub.dry_run and sub.job_id is None and sub.state is None
    # The prediction comes from the real estimators (evaluate_plan, or perf + memory until it exists).
    assert sub.predicted.iteration_time_s > 0 and sub.predicted.tokens_per_s_per_gpu > 0
    assert sub.predicted.peak_allocated_gib > 0
    assert sub.command[:3] == [sys.executable, str(fake_entry), "ok"]
    assert not Path(sub.job_dir).exists()
    assert mgr.list().jobs == []


def test_dry_run_for_slurm_shows_sbatch_and_the_script_without_touching_slurm(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "ok")
    sub = mgr.submit(ProfileJobRequest(plan=two_node_plan(), backend="slurm",
                                       resources=JobResources(slurm_partition="gpu", time_limit_min=10), dry_run=True))
    assert sub.command[:2] == ["sbatch", "--parsable"]
    assert "--nodes=2" in sub.command and "--gpus-per-node=8" in sub.command and "--partition=gpu" in sub.command
    assert "--nproc_per_node=8" in sub.script and "--nnodes=2" in sub.script
    assert mgr.list().jobs == []


@pytest.mark.parametrize("name", ["x; rm -rf ~", "$(touch pwned)", "two words", "line\nbreak", "`id`", "-rf", ""])
def test_hostile_job_names_are_rejected_and_create_no_job(tmp_path, fake_entry, name):
    mgr = manager(tmp_path, fake_entry, "ok")
    for backend in ("local", "slurm"):
        with pytest.raises(ValueError, match="name: .* is not a valid job name"):
            mgr.submit(ProfileJobRequest(plan=tiny_plan(), name=name, backend=backend))
    assert mgr.list().jobs == []
    assert not (tmp_path / "state" / "jobs").exists() or not any((tmp_path / "state" / "jobs").iterdir())


@pytest.mark.parametrize("field", ["slurm_partition", "slurm_account"])
@pytest.mark.parametrize("value", ["gpu;reboot", "$(id)", "a b", "-x", "--wrap=id", "p\n#SBATCH --x"])
def test_hostile_slurm_options_are_rejected_naming_the_field(tmp_path, fake_entry, field, value):
    mgr = manager(tmp_path, fake_entry, "ok")
    with pytest.raises(ValueError, match=f"resources.{field}"):
        mgr.submit(ProfileJobRequest(plan=tiny_plan(), backend="slurm", resources=JobResources(**{field: value}), dry_run=True))


def test_slurm_options_on_the_local_backend_are_an_error_not_ignored(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "ok")
    with pytest.raises(ValueError, match="resources.slurm_partition is an option of the slurm backends"):
        mgr.submit(ProfileJobRequest(plan=tiny_plan(), resources=JobResources(slurm_partition="debug")))
    assert mgr.list().jobs == []


def test_an_invalid_plan_is_rejected_naming_the_field_and_creates_no_job(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "ok")
    bad = tiny_plan(tensor_model_parallel_size=3).model_copy(update={"cluster": ClusterSpec(num_gpus=3)})
    with pytest.raises(ValueError, match=r"parallelism\.tensor_model_parallel_size"):
        mgr.submit(ProfileJobRequest(plan=bad))
    assert mgr.list().jobs == []


def test_nodes_times_gpus_per_node_must_equal_the_world_size(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "ok")
    plan = two_node_plan()
    with pytest.raises(ValueError, match=r"resources\.nodes: 3 node\(s\) x 8 GPU\(s\) per node = 24"):
        mgr.submit(ProfileJobRequest(plan=plan, backend="slurm", resources=JobResources(nodes=3), dry_run=True))


RESTART_SCRIPT = textwrap.dedent("""
    import sys
    from mcore_advisor.launcher.jobs import JobManager, ProfileJobRequest
    from mcore_advisor.launcher.store import JobStore
    from mcore_advisor.schemas import Plan
    db, entry, mode, plan_json = sys.argv[1:5]
    mgr = JobManager(JobStore(db), entry=[entry, mode])
    sub = mgr.submit(ProfileJobRequest(plan=Plan.model_validate_json(plan_json)))
    print(sub.job_id)
""")


def _submit_from_another_process(tmp_path: Path, fake_entry: Path, mode: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", RESTART_SCRIPT, str(tmp_path / "state" / "jobs.sqlite3"), str(fake_entry), mode,
         tiny_plan().model_dump_json()],
        capture_output=True, text=True, timeout=60, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_a_job_outlives_the_server_process_and_a_new_manager_reattaches_to_it(tmp_path, fake_entry):
    job_id = _submit_from_another_process(tmp_path, fake_entry, "wait")  # that "server" has exited now
    mgr = manager(tmp_path, fake_entry, "unused")
    [summary] = mgr.reattach_all()
    assert (summary.job_id, summary.state) == (job_id, "RUNNING")
    job_dir = Path(mgr.store.get(job_id).job_dir)
    (job_dir / "go").touch()
    st = wait_for(mgr, job_id, {"COMPLETED"})
    assert st.state == "COMPLETED" and st.result["iter_s"] == 2.5


def test_reattach_marks_a_job_whose_process_vanished_without_result_as_lost(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "sleep")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan()))
    ref = mgr.store.get(sub.job_id).backend_ref["data"]
    os.killpg(ref["pgid"], 9)  # the supervisor and the job die without an exit record
    deadline = time.monotonic() + 3
    while Path(f"/proc/{ref['pid']}").exists() and open(f"/proc/{ref['pid']}/stat").read().split(") ")[1][0] != "Z" \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    fresh = manager(tmp_path, fake_entry, "sleep")
    [summary] = fresh.reattach_all()
    assert summary.state == "FAILED"
    assert summary.error.startswith(f"lost: process {ref['pid']} exited without result")


def test_predicted_and_measured_figures_are_read_by_name_from_their_typed_places():
    # evaluate_plan's sections (Evaluation.performance / .memory) and result.json's keys (entry/result.py)
    pred = predicted_figures({"performance": {"iteration_time_s": 4.0, "tokens_per_s_per_gpu": 90.0},
                              "memory": {"peak_allocated_gib": 10}})
    assert (pred.iteration_time_s, pred.tokens_per_s_per_gpu, pred.peak_allocated_gib) == (4.0, 90.0, 10.0)
    assert pred.tflops_per_gpu_causal is None
    # a figure under another section's name is not picked up by guessing
    assert predicted_figures({"perf": {"iteration_time_s": 4.0}}).iteration_time_s is None
    rows = {c.figure: c for c in compare({"iter_s": 5.0, "peak_allocated_gib": [8.0, 12.5]}, pred)}
    assert rows["iteration_time_s"].error_pct == pytest.approx(-20.0)  # (4 - 5) / 5
    assert rows["peak_allocated_gib"].measured == 12.5
    assert rows["tokens_per_s_per_gpu"].error_pct is None  # not measured: no error figure invented
    assert compare(None, pred) == []


def _have_job_extra() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "megatron.core")) and \
        importlib.util.find_spec("mcore_advisor.launcher.entry.profile") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _have_job_extra(), reason="needs torch + megatron-core (the job extra) and the entry point")
def test_the_real_entry_on_cpu_completes_a_tiny_plan_and_fails_a_crashing_one(tmp_path):
    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"))
    ok = mgr.submit(ProfileJobRequest(plan=tiny_plan(), warmup_steps=1, measure_steps=2, profile_steps=None,
                                      resources=JobResources(time_limit_min=5)))
    st = wait_for(mgr, ok.job_id, {"COMPLETED", "FAILED", "TIMEOUT"}, timeout_s=300)
    assert st.state == "COMPLETED", (st.error, st.stderr_tail, st.log_tail)
    by = {c.figure: c for c in st.comparison}
    assert by["tokens_per_s_per_gpu"].measured > 0
    assert by["iteration_time_s"].measured > 0
    assert by["peak_allocated_gib"].measured is None or by["peak_allocated_gib"].measured >= 0

    # FP8 needs Transformer Engine on a GPU: without TE the entry must fail and say so in error.json.
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: the FP8 plan would run instead of crashing")
    crash = tiny_plan().model_copy(update={"training": TrainingSpec(seq_length=32, global_batch_size=2, micro_batch_size=1, precision="fp8")})
    bad = mgr.submit(ProfileJobRequest(plan=crash, warmup_steps=1, measure_steps=1, profile_steps=None))
    st = wait_for(mgr, bad.job_id, {"COMPLETED", "FAILED", "TIMEOUT"}, timeout_s=300)
    assert (st.state, st.exit_code) == ("FAILED", 1)
    assert "training.precision='fp8' needs Transformer Engine" in st.error


@pytest.mark.slow
@pytest.mark.skipif(not _have_job_extra(), reason="needs torch + megatron-core (the job extra) and the entry point")
def test_the_real_entry_under_torchrun_runs_two_cpu_ranks_with_tensor_parallelism(tmp_path):
    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"))
    plan = tiny_plan(tensor_model_parallel_size=2).model_copy(update={"cluster": ClusterSpec(num_gpus=2)})
    sub = mgr.submit(ProfileJobRequest(plan=plan, warmup_steps=1, measure_steps=2, profile_steps=None))
    assert "--nproc_per_node" in sub.command and "--standalone" in sub.command
    st = wait_for(mgr, sub.job_id, {"COMPLETED", "FAILED", "TIMEOUT"}, timeout_s=300)
    assert st.state == "COMPLETED", (st.error, st.stderr_tail)
    assert st.result["world_size"] == 2 and len(st.result["peak_allocated_gib"]) == 2
    assert st.result["tokens_per_s_per_gpu"] > 0


def test_reattach_fails_a_job_recorded_but_never_submitted_once_it_is_old(tmp_path, fake_entry):
    from mcore_advisor.launcher.store import record_from

    mgr = manager(tmp_path, fake_entry, "ok")
    for job_id, age_s in (("old000000000", 3600.0), ("new000000000", 1.0)):
        mgr.store.insert(record_from(job_id=job_id, name="n", backend="local", job_dir=tmp_path / job_id, command=["x"],
                                     plan=tiny_plan().model_dump(mode="json"), spec={}, resources={},
                                     created_at=time.time() - age_s))
    states = {s.job_id: (s.state, s.error) for s in mgr.reattach_all()}
    assert states["old000000000"] == ("FAILED", "lost: the server stopped before the job was submitted")
    assert states["new000000000"] == ("PENDING", None)


def _gc_result(pauses, kinds=("warmup", "measure", "measure", "measure"), iter_s=0.75):
    return {"iter_s": iter_s, "iterations": list(kinds), "host": {"gc_pause_s_per_iteration": list(pauses)}}


def test_a_large_gc_pause_in_a_measured_iteration_is_named_with_the_manual_gc_fix():
    # The H200 PP2+VP2 run: a gen-2 collection took 0.362 s inside iteration 3 of a 0.75 s step;
    # the 0.9 s of the warm-up iteration does not count.
    note = jobs._gc_note(_gc_result([0.9, 0.002, 0.362, 0.002]), {"implementation": {}})
    assert "iteration 3" in note and "0.362 s" in note and "48%" in note and "manual_gc" in note
    assert jobs._gc_note(_gc_result([0.9, 0.002, 0.030, 0.002]), {"implementation": {}}) is None  # 4% < 5%
    assert "despite manual_gc" in jobs._gc_note(_gc_result([0.0, 0.0, 0.2, 0.0]), {"implementation": {"manual_gc": True}})
    assert jobs._gc_note({"iter_s": 1.0}, {}) is None and jobs._gc_note(None, {}) is None


def test_a_job_whose_backend_ref_never_reached_the_store_is_picked_up_from_ref_json(tmp_path, fake_entry):
    mgr = manager(tmp_path, fake_entry, "ok")
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan()))
    assert json.loads((Path(sub.job_dir) / jobs.REF_FILE).read_text())["native_id"] == sub.backend_job_id
    mgr.store.update(sub.job_id, backend_ref=None)  # as if the store was locked right after the submit
    assert wait_for(mgr, sub.job_id, {"COMPLETED", "FAILED"}).state == "COMPLETED"
    assert mgr.store.get(sub.job_id).backend_ref["native_id"] == sub.backend_job_id


def test_a_backend_that_cannot_be_asked_reports_unknown_and_keeps_the_stored_state(tmp_path, fake_entry):
    from mcore_advisor.launcher.backends.base import BackendUnavailable
    from mcore_advisor.launcher.backends.local import LocalBackend

    class Flaky(LocalBackend):
        down = True

        def status(self, refs):
            if self.down:
                raise BackendUnavailable("backend 'local': not answering (tried 2 times over 1 s)")
            return super().status(refs)

    flaky = Flaky()
    mgr = JobManager(JobStore(tmp_path / "jobs.sqlite3"), entry=[str(fake_entry), "ok"], backends={"local": flaky})
    sub = mgr.submit(ProfileJobRequest(plan=tiny_plan()))
    st = mgr.get(sub.job_id)
    assert (st.state, st.last_known_state) == ("UNKNOWN", "RUNNING")
    assert st.error.startswith("state unknown: backend 'local': not answering (tried 2 times over 1 s); the job was last seen RUNNING")
    assert [(j.state, j.error == st.error) for j in mgr.list().jobs] == [("UNKNOWN", True)]
    assert mgr.store.get(sub.job_id).state == "RUNNING"
    flaky.down = False
    assert wait_for(mgr, sub.job_id, {"COMPLETED", "FAILED"}).state == "COMPLETED"
