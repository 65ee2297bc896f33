"""Merge the multi-GPU device calls (benchmarks/gpu/multi_gpu.sh) into benchmarks/results/ and
compare every row with evaluate_plan's prediction for the plan as it ran (issue 20).

    .venv/bin/python benchmarks/gpu/report_multi.py --session s3 /work/.device/14 /work/.device/15

Writes, with PREFIX = gpu_<gpu><count> of the machine the rows ran on (e.g. gpu_h200x2):
- PREFIX_runs.jsonl: every multi-GPU row (runner.py's row, failed ones with their error), its plan
  as run (launcher/as_ran.py, and cluster.gpu = the GPU it ran on), the prediction, the errors, the
  held-out flag (configs_multi.held_out) and, where the step time is off by more than 10%, the term
  the trace points at;
- PREFIX_fakepg.jsonl: each --fake-process-group row beside the real run's rank it plays;
- PREFIX_nccl.jsonl, PREFIX_kernel_moe.jsonl: the probes' rows as measured (+ the model's ring time);
- PREFIX_env.json: machine, versions, per-GPU matmul rate, build logs, git state of the calls;
- PREFIX_constants.json: the measured constants, each with the model term it should replace
  (derived here from the rows above, never edited by hand);
- PREFIX_table.md: the tables and the held-out summary.
Figures are copied from the runs, never recomputed or extrapolated; predictions are evaluate_plan's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
from pathlib import Path

from configs_multi import held_out

from mcore_advisor.knowledge.hardware import gpu, gpu_key_from_label
from mcore_advisor.launcher.as_ran import as_ran, earlier_machine_probes
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.physics.step_time import NVLINK_EFFICIENCY, ring_collective_s
from mcore_advisor.schemas import Plan, parallel_dims, with_changes
from mcore_advisor.tools.evaluate import evaluate_plan

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
OFF_PCT = 10.0
COMM_TERMS = ("tp_comm_exposed_s", "cp_comm_exposed_s", "ep_comm_s", "pp_p2p_s", "dp_comm_exposed_s", "pipeline_bubble_s")
COMPUTE_TERMS = ("gemm_s", "attention_s", "ssm_scan_s", "elementwise_s", "recompute_s", "optimizer_s", "overhead_s")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _misc(call: Path) -> dict[str, str]:
    """Text files of the call's misc.tar.gz (build and probe logs, the fake rows' results)."""
    out: dict[str, str] = {}
    if (call / "misc.tar.gz").exists():
        with tarfile.open(call / "misc.tar.gz") as tf:
            for m in tf.getmembers():
                if m.isfile() and m.name.endswith((".log", ".jsonl")):
                    out[m.name.removeprefix("misc/")] = tf.extractfile(m).read().decode(errors="replace")
    return out


def with_machine_probes(rows: list[dict], machines: list) -> list[dict]:
    """The rows (in the order they ran) with the earlier host probes of each one's machine (as_ran.earlier_machine_probes);
    `machines` names each row's machine where its result has no hostname (rows before s14: its results file and call)."""
    earlier = earlier_machine_probes([r.get("result") for r in rows], machines)
    return [{**r, "machine_probes_ms": e} for r, e in zip(rows, earlier, strict=True)]


def _as_ran(row: dict):
    return as_ran(Plan.model_validate(row["plan"]), row.get("result"), row.get("machine_probes_ms", ()))


def ran_plan(row: dict) -> Plan:
    """The plan as the job ran it, on the GPU it ran on."""
    plan = _as_ran(row).plan
    key = gpu_key_from_label((row.get("result") or {}).get("device") or "")
    return with_changes(plan, "cluster", gpu=key) if key and key != plan.cluster.gpu else plan


def _err(pred: float | None, meas: float | None) -> float | None:
    return round(100.0 * (pred / meas - 1.0), 2) if pred is not None and meas else None


def _rank_peaks(plan: Plan) -> dict[int, float]:
    """Predicted peak allocated GiB per pipeline rank (the stages memory_breakdown evaluates)."""
    return {s.pipeline_rank: s.peak_allocated_gib for s in memory_breakdown(plan).stages}


def _trace_parts(res: dict) -> dict | None:
    """What rank 0's trace of the profiled iteration shows, against the measured step: GPU compute
    (busy minus exposed NCCL), exposed NCCL (pipeline waits included) and GPU idle (host-bound)."""
    busy, exposed = res.get("device_busy_s_per_profiled_iteration"), res.get("exposed_comm_s")
    if busy is None or exposed is None:
        return None
    return {"compute_s": busy - exposed, "exposed_comm_s": exposed, "idle_s": max(0.0, res["iter_s"] - busy),
            "comm_s": res.get("comm_s"), "overlap_fraction": 1.0 - exposed / res["comm_s"] if res.get("comm_s") else None}


def _predicted_parts(bd: dict) -> dict:
    return {"compute_s": sum(bd[k] for k in COMPUTE_TERMS), "exposed_comm_s": sum(bd[k] for k in COMM_TERMS),
            "idle_s": bd["host_bound_s"]}


def _blame(meas: dict | None, pred: dict) -> str | None:
    """The trace part whose prediction is furthest off (seconds), named with the model's terms."""
    if meas is None:
        return None
    names = {"compute_s": "compute (" + "+".join(COMPUTE_TERMS[:4]) + ")",
             "exposed_comm_s": "exposed communication (" + "+".join(COMM_TERMS) + ")", "idle_s": "host_bound_s (GPU idle)"}
    k = max(names, key=lambda k: abs(pred[k] - meas[k]))
    return f"{names[k]}: predicted {pred[k]:.3f} s, trace {meas[k]:.3f} s"


def real_row(row: dict, call: str) -> dict:
    """A runner row with its prediction, errors and the trace's split of the step."""
    # the train log stays in gpu_logs/SESSION_multi/NAME/train.log (load() unpacks it there)
    out = {**{k: v for k, v in row.items() if k != "train_log"}, "device_call": call, "held_out": held_out(row["name"]),
           "plan_requested": row["plan"]}
    res = row.get("result") or {}
    if row["status"] != "ok" or not res.get("iter_s"):
        return out
    plan = ran_plan(row)
    ev = evaluate_plan(plan).model_dump(mode="json")
    perf, bd = ev["performance"], ev["performance"]["breakdown"]
    d = parallel_dims(plan)
    peaks = _rank_peaks(plan)
    per_rank = [peaks.get(r["pp_rank"]) for r in res.get("ranks") or []]
    meas_mem = res.get("peak_allocated_gib") or []
    mem_err = [_err(p, m) for p, m in zip(per_rank, meas_mem, strict=False)]
    meas_parts, pred_parts = _trace_parts(res), _predicted_parts(bd)
    step_err = _err(perf["iteration_time_s"], res["iter_s"])
    out.update(plan=plan.model_dump(mode="json"), differences=_as_ran(row).differences,
               prediction={"iteration_time_s": perf["iteration_time_s"], "tflops_per_gpu_causal": perf["model_tflops_per_gpu_causal"],
                           "peak_allocated_gib_per_rank": per_rank, "breakdown": bd, "parts": pred_parts,
                           "dims": {"tp": d.tp, "pp": d.pp, "vp": d.vp, "cp": d.cp, "ep": d.ep, "dp": d.dp}},
               measured_parts=meas_parts, step_error_pct=step_err, memory_error_pct_per_rank=mem_err,
               off_by_term=_blame(meas_parts, pred_parts) if step_err is not None and abs(step_err) > OFF_PCT else None)
    return out


def fake_pair(fake: dict, reals: dict[str, dict], call: str) -> dict:
    """A fake-process-group row beside the real run's rank it played."""
    name = fake["name"].removeprefix("fake_")
    res = fake.get("result") or {}
    real = reals.get(name) or {}
    rank = res.get("measured_rank")
    real_peaks = (real.get("result") or {}).get("peak_allocated_gib") or []
    real_peak = real_peaks[rank] if rank is not None and rank < len(real_peaks) else None
    fake_peak = (res.get("peak_allocated_gib") or [None])[0]
    slim = {k: v for k, v in fake.items() if k not in ("train_log",)}
    return {"name": name, "device_call": call, "status": fake["status"], "held_out": held_out(name), "measured_rank": rank,
            "fake_peak_allocated_gib": fake_peak, "real_rank_peak_allocated_gib": real_peak,
            "fake_vs_real_pct": _err(fake_peak, real_peak), "real_status": real.get("status"),
            "error": fake.get("error"), "fake_run": slim}


def nccl_rows(rows: list[dict], gpu_key: str) -> list[dict]:
    """Probe rows with the model's time for the ring collectives it models."""
    link = gpu(gpu_key).nvlink_bandwidth_gbps * NVLINK_EFFICIENCY
    out = []
    for r in rows:
        if r.get("op") in ("all_gather", "reduce_scatter", "all_reduce"):
            model = ring_collective_s(r["bytes"], r["ranks"], link, r["op"])
            r = {**r, "model_time_us": round(model * 1e6, 1), "model_error_pct": _err(model * 1e6, r["time_us"])}
        out.append(r)
    return out


def _median(xs: list[float]) -> float | None:
    xs = [abs(x) for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def summary(runs: list[dict], pairs: list[dict]) -> dict:
    ok = [r for r in runs if r.get("step_error_pct") is not None]
    out = {}
    for tag, sel in (("held_out", [r for r in ok if r["held_out"]]), ("others", [r for r in ok if not r["held_out"]])):
        out[tag] = {"rows": len(sel), "median_abs_step_error_pct": _median([r["step_error_pct"] for r in sel]),
                    "median_abs_memory_error_pct": _median([max(r["memory_error_pct_per_rank"], key=abs) for r in sel
                                                            if r["memory_error_pct_per_rank"]]),
                    "rows_memory_within_5pct_every_rank": sum(all(abs(e) <= 5 for e in r["memory_error_pct_per_rank"]) for r in sel)}
    fp = [p for p in pairs if p["fake_vs_real_pct"] is not None]
    out["fake_vs_real"] = {"pairs": len(fp), "max_abs_pct": max((abs(p["fake_vs_real_pct"]) for p in fp), default=None),
                           "within_1pct": sum(abs(p["fake_vs_real_pct"]) <= 1 for p in fp)}
    # The step split by rank 0's trace: where the error sits (GPU work, exposed communication, GPU idle).
    traced = [r for r in ok if r.get("measured_parts")]
    out["trace_split"] = {
        "rows": len(traced),
        "median_abs_compute_error_pct": _median([_err(r["prediction"]["parts"]["compute_s"], r["measured_parts"]["compute_s"]) for r in traced]),
        "median_gpu_idle_share_measured_pct": _median([100 * r["measured_parts"]["idle_s"] / r["result"]["iter_s"] for r in traced]),
        "median_gpu_idle_share_predicted_pct": _median([100 * r["prediction"]["parts"]["idle_s"] / r["prediction"]["iteration_time_s"] for r in traced]),
    }
    out["rows"] = {"measured": len(ok), "failed": len(runs) - len(ok)}
    return out


CATALOG_NVLINK_NOTE = ("physics/step_time.py NVLINK_EFFICIENCY (x the catalog's nvlink_bandwidth_gbps), "
                      "COLLECTIVE_HALF_BANDWIDTH_BYTES (size ramp) and COLLECTIVE_LATENCY_S + NVLINK_HOP_LATENCY_S")


def nvlink_constants(nccl: list[dict], link_gbps: float) -> dict:
    """Per collective: bus bandwidth by size, its peak over the catalog link, the smallest-size time."""
    out: dict = {"replaces": CATALOG_NVLINK_NOTE, "catalog_nvlink_gbps": link_gbps, "model_efficiency": NVLINK_EFFICIENCY}
    for op in sorted({r["op"] for r in nccl if "busbw_gbps" in r}):
        rows = sorted((r for r in nccl if r.get("op") == op), key=lambda r: r["bytes"])
        peak = max(r["busbw_gbps"] for r in rows)
        out[op] = {"ranks": rows[0]["ranks"], "busbw_gbps_by_bytes": {str(r["bytes"]): r["busbw_gbps"] for r in rows},
                   "peak_busbw_gbps": peak, "peak_efficiency_vs_catalog": round(peak / link_gbps, 3),
                   "time_us_at_smallest": rows[0]["time_us"], "smallest_bytes": rows[0]["bytes"],
                   "bytes_at_half_peak": next((r["bytes"] for r in rows if r["busbw_gbps"] >= peak / 2), None)}
    return out


def grouped_gemm_constants(kernels: list[dict]) -> dict:
    """Expert GEMM (SwiGLU fc1+fc2, fwd+bwd) rate per implementation over the dense rate at the same tokens."""
    ok = [r for r in kernels if r.get("kind") == "moe_grouped_gemm" and "error" not in r]
    dense = {(r["hidden"], r["ffn"], r["local_experts"], r["tokens_per_expert"]): r["fwd_bwd_tflops"]
             for r in ok if r["impl"] == "dense_same_tokens"}
    rows = [{k: r[k] for k in ("impl", "hidden", "ffn", "local_experts", "tokens_per_expert", "fwd_bwd_tflops")}
            | {"efficiency_vs_dense_same_tokens": round(r["fwd_bwd_tflops"] / dense[key], 3)}
            for r in ok if r["impl"] != "dense_same_tokens"
            and (key := (r["hidden"], r["ffn"], r["local_experts"], r["tokens_per_expert"])) in dense]
    missing = sorted({r["impl"] for r in kernels if r.get("kind") == "moe_grouped_gemm" and "error" in r})
    return {"replaces": "physics/step_time.py _expert_gemms: the experts' GEMMs run at the dense GEMM rate of their "
                        "(M_e = tokens*topk/E per expert) shape; these rows give the measured rate per tokens-per-expert",
            "rows": rows, "implementations_failed": missing,
            "notes": [r["note"] for r in kernels if r.get("kind") == "moe_note"]}


def moe_kernel_constants(kernels: list[dict]) -> dict:
    perm = [r for r in kernels if r.get("kind") == "moe_permute" and "error" not in r]
    router = [r for r in kernels if r.get("kind") == "moe_router" and "error" not in r]
    keep = ("fused", "tokens", "hidden", "experts", "topk")
    return {
        "permute": {"replaces": "physics/step_time.py MoE layer elementwise: permute = 2*2*T*k*h*2 bytes at the "
                                "elementwise bandwidth + 20 routing/permute kernel launches",
                    "note": "permute_fwd_s from permute_gbps (full precision); the other times were rounded to 0.1 ms",
                    "rows": [{k: r[k] for k in keep} | {"permute_fwd_s": 2 * r["tokens"] * r["topk"] * r["hidden"] * 2 / r["permute_gbps"] / 1e9,
                                                        "unpermute_fwd_s": r["unpermute_fwd_s"], "roundtrip_fwd_bwd_s": r["roundtrip_fwd_bwd_s"]}
                             for r in perm]},
        "router": {"replaces": "physics/step_time.py MoE layer: router softmax/top-k bytes (T*E*4*4) + its share of the 20 kernels",
                   "rows": [{k: r[k] for k in (*keep, "aux_loss", "fwd_bwd_s")} for r in router]},
        "layer_graph": [r for r in kernels if r.get("kind") == "moe_layer_graph"],
    }


def overlap_constants(runs: list[dict]) -> dict:
    """Per measured row: the share of NCCL kernel time hidden behind compute, and the GPU-idle share."""
    rows = []
    for r in runs:
        m = r.get("measured_parts")
        if m:
            rows.append({"name": r["name"], "dims": r["prediction"]["dims"], "comm_s": m["comm_s"],
                         "exposed_comm_s": m["exposed_comm_s"], "overlap_fraction": m["overlap_fraction"],
                         "gpu_idle_fraction": round(m["idle_s"] / r["result"]["iter_s"], 3)})
    return {"replaces": "physics/step_time.py: the *_comm_exposed_s terms (which overlap they assume per layout) "
                        "and host_bound_s (GPU idle)", "rows": rows}


def constants(runs: list[dict], nccl: list[dict], kernels: list[dict], gpu_key: str) -> dict:
    return {"nvlink": nvlink_constants(nccl, gpu(gpu_key).nvlink_bandwidth_gbps),
            "grouped_gemm": grouped_gemm_constants(kernels), **moe_kernel_constants(kernels),
            "overlap": overlap_constants(runs)}


def _f(x, fmt="{:.3f}") -> str:
    return fmt.format(x) if isinstance(x, int | float) else "-"


def run_table(runs: list[dict]) -> list[str]:
    lines = ["| call | run | held out | status | iter_s meas | iter_s pred | err % | TFLOP/s meas | peak GiB meas (per rank) | "
             "peak GiB pred | mem err % | exposed comm s (trace / pred) | GPU idle s (trace / pred) | off by (term) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        res, pr = r.get("result") or {}, r.get("prediction") or {}
        m, pp = r.get("measured_parts") or {}, pr.get("parts") or {}
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('error') or {}).get('message', '')[:90]}"
        lines.append(
            f"| {r['device_call']} | {r['name']} | {'yes' if r['held_out'] else ''} | {status} | {_f(res.get('iter_s'))} | "
            f"{_f(pr.get('iteration_time_s'))} | {_f(r.get('step_error_pct'), '{:+.1f}')} | {_f(res.get('tflops_per_gpu_causal'), '{:.1f}')} | "
            f"{', '.join(_f(x, '{:.2f}') for x in res.get('peak_allocated_gib') or []) or '-'} | "
            f"{', '.join(_f(x, '{:.2f}') for x in pr.get('peak_allocated_gib_per_rank') or []) or '-'} | "
            f"{', '.join(_f(x, '{:+.1f}') for x in r.get('memory_error_pct_per_rank') or []) or '-'} | "
            f"{_f(m.get('exposed_comm_s'))} / {_f(pp.get('exposed_comm_s'))} | {_f(m.get('idle_s'))} / {_f(pp.get('idle_s'))} | "
            f"{r.get('off_by_term') or '-'} |")
    return lines


def fake_table(pairs: list[dict]) -> list[str]:
    lines = ["| run | rank | fake-PG peak GiB | real rank peak GiB | fake vs real % | status |", "|---|---|---|---|---|---|"]
    for p in pairs:
        status = p["status"] if p["status"] == "ok" else f"{p['status']}: {(p.get('error') or {}).get('message', '')[:90]}"
        lines.append(f"| {p['name']} | {p['measured_rank']} | {_f(p['fake_peak_allocated_gib'])} | "
                     f"{_f(p['real_rank_peak_allocated_gib'])} | {_f(p['fake_vs_real_pct'], '{:+.2f}')} | {status} |")
    return lines


def table(runs: list[dict], pairs: list[dict], summ: dict, consts: dict, device: str) -> str:
    nv = consts["nvlink"]
    head = [
        f"# Multi-GPU evidence (issue 20): Megatron's own loop on {max(r['nproc'] for r in runs)} x {device}",
        "",
        "Written by benchmarks/gpu/report_multi.py from the device calls of benchmarks/gpu/multi_gpu.sh (rows:",
        "benchmarks/gpu/configs_multi.py). iter_s = median of the measured iterations (Megatron's timer);",
        "predictions = evaluate_plan for the plan as it ran (launcher/as_ran.py; cluster.gpu = the GPU it ran on).",
        "Trace columns: rank 0's torch.profiler trace of iteration 3: exposed comm = NCCL kernel time with no",
        "compute kernel running (pipeline waits included), GPU idle = step - GPU-busy time. Held out: crc32(name) % 3 == 0.",
        "",
        "## Summary", "", "```", json.dumps(summ, indent=1), "```", "",
        "## Multi-GPU rows", "", *run_table(runs), "",
        "## --fake-process-group (one GPU) vs the real run's rank", "", *fake_table(pairs), "",
        "## NCCL bus bandwidth (GB/s) on this machine", "",
    ]
    ops = [k for k, v in nv.items() if isinstance(v, dict) and "busbw_gbps_by_bytes" in v]
    if not ops:  # a lease's later calls carry no NCCL probe (it runs in the first)
        head.append("(no NCCL probe among these calls)")
    else:
        head.append("| op | " + " | ".join(f"{int(b) // 1024} KiB" for b in nv[ops[0]]["busbw_gbps_by_bytes"]) + " |")
        head.append("|---" * (1 + len(nv[ops[0]]["busbw_gbps_by_bytes"])) + "|")
    for op in ops:
        head.append(f"| {op} | " + " | ".join(str(x) for x in nv[op]["busbw_gbps_by_bytes"].values()) + " |")
    head += ["", "## Expert GEMM (SwiGLU fc1+fc2, fwd+bwd) rate over one dense GEMM pair on the same tokens (kernel probe, GPU 1)", "",
             *grouped_table(consts["grouped_gemm"])]
    return "\n".join(head) + "\n"


def grouped_table(gg: dict) -> list[str]:
    rows = gg["rows"]
    ts = sorted({r["tokens_per_expert"] for r in rows})
    lines = ["| impl | hidden | expert ffn | local experts | " + " | ".join(f"{t} tok/expert" for t in ts) + " |",
             "|---" * (4 + len(ts)) + "|"]
    keys = sorted({(r["impl"], r["hidden"], r["ffn"], r["local_experts"]) for r in rows})
    for k in keys:
        by_t = {r["tokens_per_expert"]: r for r in rows if (r["impl"], r["hidden"], r["ffn"], r["local_experts"]) == k}
        cells = [f"{by_t[t]['efficiency_vs_dense_same_tokens']:.2f} ({by_t[t]['fwd_bwd_tflops']:.0f})" if t in by_t else "-" for t in ts]
        lines.append(f"| {' | '.join(map(str, k))} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: rate ratio (absolute fwd+bwd TFLOP/s). The dense reference is itself launch-bound at small token counts."]
    lines += [f"Note: {n}" for n in gg["notes"]]
    if gg["implementations_failed"]:
        lines += ["", f"Not measured (error in every case): {', '.join(gg['implementations_failed'])}."]
    return lines


def load(dirs: list[Path], session: str) -> dict:
    data: dict = {"runs": [], "fakes": [], "nccl": [], "kernels": [], "env": {}, "logs": {}}
    for d in dirs:
        call = f"{session}/{d.name}"
        misc = _misc(d)
        # one queue per call since session s4 (runner --share-multi): its groups are told apart here;
        # the 'at_scale' rows go to gpu_h100_megatron_runs.jsonl through collect.py
        rows = _jsonl(d / "real" / "results.jsonl")
        data["runs"] += [(r, call) for r in rows if r["group"] == "multi"]
        data["fakes"] += [(r, call) for r in [*_jsonl(d / "fake_results.jsonl"), *rows] if r["group"] == "multi_fake"]
        data["nccl"] += _jsonl(d / "nccl_probe.jsonl")
        data["kernels"] += _jsonl(d / "kernel_probe.jsonl")
        if (d / "env.json").exists():
            data["env"][call] = json.loads((d / "env.json").read_text())
        data["logs"][call] = {k: v[-3000:] for k, v in misc.items() if k.endswith(".log")}
        if (d / "real" / "logs.tar.gz").exists():
            with tarfile.open(d / "real" / "logs.tar.gz") as tf:
                tf.extractall(RESULTS / "gpu_logs" / f"{session}_multi", filter="data")
    return data


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--session", required=True)
    ap.add_argument("--prefix", help="output files' prefix (default gpu_<gpu>x<N>; the second set: gpu_h100x4_L)")
    ap.add_argument("--gpu", default="h100-sxm", help="the GPU catalog key when no row of the calls names its device")
    ap.add_argument("dirs", nargs="+")
    a = ap.parse_args(argv)
    data = load([Path(d) for d in a.dirs], a.session)
    # a call's rows without a hostname: one machine per call (a lease may span calls; kept apart, the safe side)
    ordered = with_machine_probes([r for r, _ in data["runs"]], [(a.session, c) for _, c in data["runs"]])
    runs = [real_row(r, c) for r, (_, c) in zip(ordered, data["runs"], strict=True)]
    device = next((r["result"]["device"] for r in runs if (r.get("result") or {}).get("device")), "unknown")
    # a call whose every row failed before CUDA came up names no device: its rows are kept, the probes' model is not
    key = gpu_key_from_label(device) or a.gpu
    prefix = a.prefix or f"gpu_{key.split('-')[0]}x{max(r['nproc'] for r in runs)}"
    reals = {r["name"]: r for r in runs}
    pairs = [fake_pair(f, reals, c) for f, c in data["fakes"]]
    nccl = nccl_rows(data["nccl"], key)
    consts = constants(runs, nccl, data["kernels"], key)
    summ = summary(runs, pairs)
    git = (RESULTS / f"{prefix}_git_state.txt")
    env = {"device": device, "calls": data["env"], "logs": data["logs"], "git_state": git.read_text() if git.exists() else None}
    files = {"runs.jsonl": runs, "fakepg.jsonl": pairs, "nccl.jsonl": nccl, "kernel_moe.jsonl": data["kernels"]}
    for suffix, rows in files.items():
        (RESULTS / f"{prefix}_{suffix}").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (RESULTS / f"{prefix}_env.json").write_text(json.dumps(env, indent=1))
    (RESULTS / f"{prefix}_constants.json").write_text(json.dumps(consts, indent=1))
    (RESULTS / f"{prefix}_table.md").write_text(table(runs, pairs, summ, consts, device))
    print(json.dumps(summ, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
