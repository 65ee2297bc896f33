"""The profile entry point end to end on CPU (gloo): a tiny GPT trains, reports and traces; a crash
leaves error.json and a non-zero exit. Needs torch + megatron-core (the `job` extra)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from mcore_advisor.launcher.spec import job_spec  # noqa: E402
from mcore_advisor.schemas import Plan  # noqa: E402

TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
SRC = str(Path(__file__).resolve().parents[2] / "src")
# Megatron-LM training.py training_log, one line per iteration
LOG_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|"
    r" elapsed time per iteration \(ms\): ([\d.]+) \| throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|"
    r" learning rate: [\d.E+-]+ \| global batch size: +(\d+) \| lm loss: ([\d.E+-]+) \| loss scale: 1\.0 \|"
    r" grad norm: [\d.]+ \| number of skipped iterations: +0 \| number of nan iterations: +0 \|$"
)
MEM_LINE = re.compile(r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: [\d.]+ \|"
                      r" reserved: [\d.]+ \| max reserved: [\d.]+$")


def _run(tmp_path: Path, plan: dict, nproc: int = 1, script: Path | None = None, **kw) -> tuple[subprocess.CompletedProcess, Path]:
    spec = job_spec(Plan(**plan), **({"warmup_steps": 1, "measure_steps": 2, "profile_steps": (1, 1)} | kw))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    target = [str(script)] if script else ["-m", "mcore_advisor.launcher.entry.profile"]
    entry = [*target, "--spec", str(spec_path), "--out-dir", str(out), "--device", "cpu"]
    if nproc == 1:
        cmd = [sys.executable, *entry]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(29700 + os.getpid() % 200), *entry]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return proc, out


def _plan(gpus: int = 1, **kw) -> dict:
    return {"model": TINY, "cluster": {"gpu": "h100-sxm", "num_gpus": gpus},
            "training": {"seq_length": 64, "global_batch_size": 8, "micro_batch_size": 2}} | kw


def _check_ok(proc, out: Path, world: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not (out / "error.json").exists()
    r = json.loads((out / "result.json").read_text())
    assert r["status"] == "ok" and r["world_size"] == world
    assert r["iterations"] == ["profile", "measure", "measure"]
    assert len(r["step_times_s"]) == 3 and all(t > 0 for t in r["step_times_s"])
    assert r["iter_s"] > 0 and r["tokens_per_s_per_gpu"] > 0
    # tokens/s = GBS * seq / iter_s / world
    assert r["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / r["iter_s"] / world)
    assert r["tflops_per_gpu_full"] > r["tflops_per_gpu_causal"] > 0
    assert r["mfu_pct_causal"] is None and r["mfu_peak_tflops"] is None  # no peak for a CPU
    assert len(r["peak_allocated_gib"]) == world and all(x > 0.05 for x in r["peak_allocated_gib"])
    assert len(r["peak_reserved_gib"]) == world and "RSS" in r["memory_source"]
    assert r["versions"]["torch"] and r["versions"]["megatron_core"] and r["versions"]["transformer_engine"] is None
    assert r["transformer_impl"] == "local"
    assert r["exposed_comm_s"] is not None and r["exposed_comm_s"] >= 0
    trace = json.loads((out / "trace_rank0.json").read_text())
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    lines = (out / "train.log").read_text().splitlines()
    iters = [m for m in map(LOG_LINE.match, lines) if m]
    assert [int(m.group(1)) for m in iters] == [1, 2, 3]
    assert all(int(m.group(6)) == 8 for m in iters)
    # a fresh model on random tokens starts near ln(padded vocab) and the loss falls
    losses = [float(m.group(7)) for m in iters]
    assert 4.0 < losses[0] < 6.5 and losses[-1] < losses[0]
    mem = [m for m in map(MEM_LINE.match, lines) if m]
    assert {int(m.group(2)) for m in mem} == {1, 2, 3}
    return r


def test_tiny_gpt_world_size_1_reports_times_memory_log_and_trace(tmp_path):
    proc, out = _run(tmp_path, _plan(parallelism={"recompute_granularity": "selective"}))
    r = _check_ok(proc, out, 1)
    assert "scaled_dot_product_attention" in r["attention_impl"]
    assert r["settings"]["recompute_granularity"] == "selective"
    # One data-parallel rank: the plan's overlap flags have nothing to overlap, so the job drops
    # them (their hooks only cost host time) and says so; only finalize_model_grads remains.
    assert r["settings"]["schedule_hooks"] == ["finalize_model_grads_func"]
    assert r["settings"]["overlap_grad_reduce"] is False
    assert any("data-parallel size 1" in n for n in r["notes"])
    assert r["settings"]["align_param_gather"] is False
    # The wgrad-accumulation fusion needs CUDA kernels (TE's GEMM or Apex's); on CPU it is off.
    assert r["settings"]["gradient_accumulation_fusion"] is False
    host = r["host"]
    assert len(host["gc_pause_s_per_iteration"]) == 3 and all(x >= 0 for x in host["gc_pause_s_per_iteration"])
    assert len(host["gc_gen2_collections_per_iteration"]) == 3
    assert host["cpu_count"] >= 1 and host["local_processes_of_this_job"] == 1
    assert host["cpu_steal_fraction_measured"] is None or 0.0 <= host["cpu_steal_fraction_measured"] <= 1.0
    # GPU busy time needs CUDA kernels in the trace
    assert r["device_busy_s_per_profiled_iteration"] is None and r["device_idle_fraction_profiled"] is None


def test_manual_gc_collects_only_at_the_chosen_iterations(tmp_path):
    plan = _plan(implementation={"transformer_impl": "local", "manual_gc": True, "manual_gc_interval": 2})
    proc, out = _run(tmp_path, plan)
    r = _check_ok(proc, out, 1)
    assert r["settings"]["manual_gc"] is True and r["settings"]["manual_gc_interval"] == 2
    # threshold GC off: the only full collection inside the timed iterations is Megatron's every-2-steps one
    assert r["host"]["gc_gen2_collections_per_iteration"] == [0, 1, 0]


def test_forward_step_and_loss_func_read_nothing_back_to_the_host():
    # A device->host read per micro-batch (.item(), float(), bool(), .tolist(), .cpu()) makes the
    # CPU wait for the GPU before launching the next micro-batch; at small micro-batches the GPU
    # then idles (H200 sweep, benchmarks/results/gpu_h200_summary.md). The schedule's part of a
    # micro-batch must launch work only.
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from mcore_advisor.launcher.entry.profile import forward_step

    host_reads = []
    reading = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
               torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}

    class Methods(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in reading or (func is torch.Tensor.to and any(str(a).startswith("cpu") for a in args[1:])):
                host_reads.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                host_reads.append("aten._local_scalar_dense")
            return func(*args, **(kwargs or {}))

    w = torch.ones((), requires_grad=True)
    tokens = torch.arange(8).view(2, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]])
    batch = {"tokens": tokens, "labels": tokens, "position_ids": tokens, "loss_mask": mask}

    def model_chunk(tok, pos, attn_mask, labels):
        return (tok.float() + 1.0) * w  # per-token "losses" 1..8, as GPTModel returns [b, s]

    with Methods(), Ops():
        output, loss_fn = forward_step(iter([batch]), model_chunk)
        loss, num_tokens, reported = loss_fn(output)
        # what schedules.forward_step_calc_loss does next with calculate_per_token_loss=False
        loss /= torch.clamp(num_tokens, min=1)
        loss /= 4
    assert host_reads == []
    # masked per-token losses: 1+2+4 + 5+7+8 = 27 over 6 tokens; the report keeps the sums
    assert reported["lm loss"].tolist() == [27.0, 6.0]
    assert num_tokens.dtype == torch.int32 and int(num_tokens) == 6
    assert float(loss.detach()) == pytest.approx(27.0 / 6 / 4)
    loss.backward()
    assert float(w.grad) == pytest.approx(27.0 / 24)


def test_h200_traces_flag_the_small_micro_batch_run_as_host_bound_and_not_the_large_one():
    # Rank-0 torch.profiler traces of two H200 runs (benchmarks/results/gpu_traces, step times
    # from gpu_memory_sweep.jsonl / gpu_h200_runs.jsonl): GPT 1.3B TE, DP2 mbs 4 (4 micro-batches
    # per rank; profiled iteration 0.990 s) and one GPU mbs 8 (1.077 s).
    import gzip

    from mcore_advisor.launcher.entry import trace
    from mcore_advisor.launcher.entry.profile import device_idle

    traces = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_traces"

    def busy(name: str) -> float:
        events = json.loads(gzip.decompress((traces / f"{name}.trace_rank0.json.gz").read_bytes()))["traceEvents"]
        return trace.exposed_comm(events, num_steps=1)["device_busy_s"]

    small = busy("m_gpt1.3b_dp2_distopt_mbs4")
    idle, note = device_idle(small, 0.990)
    assert small == pytest.approx(0.508, abs=0.005) and idle == pytest.approx(0.49, abs=0.01)
    assert note and note.startswith("host-bound")
    idle, note = device_idle(busy("t_gpt1.3b_te_bf16_mbs8"), 1.077)
    assert idle < 0.06 and note is None


_COUNTING_ENTRY = """
import collections, json, os, sys
import torch.distributed as dist
from mcore_advisor.launcher.entry import profile

# Patched before megatron is imported: its grad buffers bind the collectives at import time.
counts = collections.defaultdict(collections.Counter)
for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "_reduce_scatter_base", "_all_gather_base"):
    orig = getattr(dist, name)
    def counted(*a, _orig=orig, _name=name, **k):
        group = k.get("group")
        if (dist.get_world_size(group) if group is not None else dist.get_world_size()) > 1:
            counts[profile._State.iteration][_name] += 1
        return _orig(*a, **k)
    setattr(dist, name, counted)
rc = profile.main(sys.argv[1:])
if os.environ.get("RANK") == "0":
    out = sys.argv[sys.argv.index("--out-dir") + 1]
    with open(os.path.join(out, "collectives.json"), "w") as f:
        json.dump({str(k): dict(v) for k, v in counts.items()}, f)
sys.exit(rc)
"""


def test_data_parallel_gradients_are_reduced_once_per_iteration_not_per_micro_batch(tmp_path):
    # DP=2, 4 micro-batches per rank, distributed optimizer with overlapped grad reduce and param
    # gather (the plan defaults). The tiny model (~0.1 M parameters) fits in one DDP bucket
    # (40 M parameters, Megatron-LM resolve_ddp_bucket_size), so each iteration must show exactly
    # one reduce-scatter of the gradients and one all-gather of the updated parameters, however
    # many micro-batches it has.
    script = tmp_path / "counting_entry.py"
    script.write_text(_COUNTING_ENTRY)
    plan = _plan(gpus=2, training={"seq_length": 64, "global_batch_size": 8, "micro_batch_size": 1})
    proc, out = _run(tmp_path, plan, nproc=2, script=script)
    r = _check_ok(proc, out, 2)
    assert r["spec"]["dims"]["dp"] == 2 and r["spec"]["dims"]["num_microbatches"] == 4
    counts = json.loads((out / "collectives.json").read_text())
    for it in ("1", "2", "3"):
        assert counts[it].get("reduce_scatter_tensor", 0) + counts[it].get("_reduce_scatter_base", 0) == 1, counts
        assert counts[it].get("all_gather_into_tensor", 0) + counts[it].get("_all_gather_base", 0) == 1, counts


def test_interleaved_pipeline_trains_with_a_finite_falling_loss_over_gloo(tmp_path):
    # PP=2 with 2 virtual stages (one layer per chunk). Freeing a stage output while its async
    # gloo send was still in flight once gave NaN from the first iteration on CPU.
    plan = _plan(gpus=2, model={**TINY, "num_layers": 4},
                 parallelism={"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2})
    proc, out = _run(tmp_path, plan, nproc=2)
    r = _check_ok(proc, out, 2)
    assert r["settings"]["deallocate_pipeline_outputs"] is False
    assert sorted(x["pp_rank"] for x in r["ranks"]) == [0, 1]
    # PP2 on 2 processes leaves one data-parallel rank: no gradient or parameter overlap to align
    assert r["settings"]["align_param_gather"] is False and "param_sync_func" not in r["settings"]["schedule_hooks"]


def test_tiny_gpt_tensor_parallel_2_with_sequence_parallel_over_gloo(tmp_path):
    plan = _plan(gpus=2, parallelism={"tensor_model_parallel_size": 2, "sequence_parallel": True})
    proc, out = _run(tmp_path, plan, nproc=2)
    r = _check_ok(proc, out, 2)
    assert r["settings"]["sequence_parallel"] is True
    assert sorted(x["tp_rank"] for x in r["ranks"]) == [0, 1]
    # each TP rank holds about half of the layer weights
    assert r["ranks"][0]["num_params_local"] == r["ranks"][1]["num_params_local"]


def test_impossible_shape_writes_error_json_and_exits_nonzero(tmp_path):
    # 4 query heads cannot be split into 3 K/V groups
    plan = _plan(model={**TINY, "num_query_groups": 3})
    proc, out = _run(tmp_path, plan)
    assert proc.returncode != 0
    err = json.loads((out / "error.json").read_text())
    assert err["status"] == "failed" and err["rank"] == 0
    assert err["error_type"] and err["message"]
    assert not (out / "result.json").exists()


def test_world_size_mismatch_is_reported_with_the_fix(tmp_path):
    proc, out = _run(tmp_path, _plan(gpus=2))
    assert proc.returncode != 0
    err = json.loads((out / "error.json").read_text())
    assert err["error_type"] == "ValueError" and "cluster.num_gpus" in err["message"]


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path):
    yield
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
