"""Accuracy of physics/memory.memory_breakdown against measured peak memory.

Rows:
1. shared/data/device-measurements-h200.jsonl: megatron-core 0.19.2, local spec on one H200
   (unfused DotProductAttention or torch SDPA swapped in), bf16, fp32 grad buffer, Float16
   optimizer without the distributed optimizer, torch.cuda.max_memory_allocated().
2. Megatron-Bridge memory-tuning skill (published-runs-dev.csv, MBRIDGE_SKILL_MEMTUNE): Llama3-70B
   SFT FP8 current scaling on 32 H100. Planned as Bridge's recipe defaults imply: TE, FP8
   'tensorwise' with fp8_param_gather (bf16_with_fp8_current_scaling_mixed), grad_reduce_in_fp32
   (bf16_mixed), distributed optimizer, SP, TE fused cross entropy, no recompute, s = 4096 tokens
   per microbatch. Assumed: "GB" = GiB of max_memory_allocated on the most-loaded rank. Unknown:
   the reporting rank, SFT sequence packing, CUDA graphs / TP-overlap buffers. A weak anchor.
3. Any GPU sweep result another engineer left in benchmarks/results/*.json with a plan and a
   measured peak allocated (a number, or a per-rank list whose max is taken). Where the row says
   what the profile job actually ran (result.transformer_impl, result.settings), the plan is
   corrected to it (launcher/as_ran.py).
4. The H100 evidence set of Megatron-LM's own training loop (gpu_h100_megatron_runs.jsonl, issue 14;
   benchmarks/gpu/megatron_rows.py): one-GPU runs against the most-loaded rank's prediction and
   fake-process-group rows (one rank of a plan's world) against the prediction for that rank's
   stage, per term where the job measures one. Reported apart from the rest: Transformer Engine and
   the local spec separately, and the held-out third (fixed hash rule) separately from the rest.

Peak reserved (max_memory_reserved) is compared too where the source gives it: the error of the
fragmentation allowance (physics.memory.fragmentation_fraction) on top of the allocated figure.

The predictor never sees these numbers; only this script reads them.

    .venv/bin/python benchmarks/memory_accuracy.py      # writes benchmarks/results/memory_accuracy.txt
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

from mcore_advisor.launcher.as_ran import as_ran
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import megatron_rows  # noqa: E402
from _probe import probe_plan  # noqa: E402  (benchmarks/ is not a package)

from mcore_advisor.launcher.as_ran import rank_terms  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHARED = ROOT.parent / "shared"
DEVICE_JSONL = SHARED / "data" / "device-measurements-h200.jsonl"
DEV_CSV = SHARED / "data" / "published-runs-dev.csv"


RESERVED: dict[str, float] = {}  # label -> measured max_memory_reserved where the source gives it


def _h200_rows() -> list[tuple[str, str, Plan, float]]:
    out = []
    if not DEVICE_JSONL.exists():
        return out
    for line in DEVICE_JSONL.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        m = r["model"]
        attn = "unfused" if "unfused" in r["core_attention"] else "flash"
        plan = probe_plan(m, r["micro_batch_size"], r["global_batch_size"], m["seq_length"], impl="local",
                          attn="local" if attn == "unfused" else "auto", recompute=r["recompute"])
        label = f"H200 L{m['num_layers']} h{m['hidden_size']} s{m['seq_length']} mbs{r['micro_batch_size']} {attn} recompute={r['recompute']}"
        out.append((label, "device-measurements-h200.jsonl", plan, float(r["peak_allocated_gib"])))
        RESERVED[label] = float(r["peak_reserved_gib"])
    return out


def _bridge_rows() -> list[tuple[str, str, Plan, float]]:
    out = []
    if not DEV_CSV.exists():
        return out
    with DEV_CSV.open() as f:
        for r in csv.DictReader(f):
            if r["source"] != "MBRIDGE_SKILL_MEMTUNE":
                continue
            measured = float(r["notes"].split("MEASURED peak memory ")[1].split(" GB")[0])
            tp, pp, vp = int(r["tp"]), int(r["pp"]), int(r["vp"]) if r["vp"] else None
            plan = Plan(
                model=ModelSpec(name="llama3-70b"),
                cluster=ClusterSpec(gpu="h100-sxm", num_gpus=int(r["num_gpus"])),
                training=TrainingSpec(seq_length=int(r["seq_len"]), global_batch_size=int(r["gbs"]), micro_batch_size=int(r["mbs"]),
                                      precision="fp8", fp8_recipe="tensorwise", fp8_param_gather=True),
                parallelism=ParallelismSpec(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                            virtual_pipeline_model_parallel_size=vp, sequence_parallel=tp > 1,
                                            use_distributed_optimizer=True, tp_comm_overlap=True),
                # Megatron-Bridge GPTModelProvider: cross_entropy_fusion_impl = "te"
                implementation=ImplementationSpec(grad_reduce_in_fp32=True, cross_entropy_loss_fusion=True,
                                                  cross_entropy_fusion_impl="te"),
            )
            label = f"H100 Llama3-70B SFT FP8-CS TP{tp} PP{pp} VP{vp} DP{r['dp']}"
            out.append((label, "MBRIDGE_SKILL_MEMTUNE", plan, measured))
    return out


def _peak(value) -> float | None:
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, list) and value and all(isinstance(v, int | float) for v in value):
        return float(max(value))
    return None


def _reserved_at_peak(allocated, reserved) -> float | None:
    """max_memory_reserved of the rank whose max_memory_allocated is the largest."""
    if isinstance(reserved, int | float):
        return float(reserved)
    if isinstance(allocated, list) and isinstance(reserved, list) and len(allocated) == len(reserved) and reserved:
        return float(reserved[max(range(len(allocated)), key=lambda i: allocated[i])])
    return None


def _load_items(p: Path) -> list:
    try:
        if p.suffix == ".jsonl":
            return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else data.get("runs") or data.get("results") or [data]


def _sweep_rows() -> list[tuple[str, str, Plan, float]]:
    """benchmarks/results/*.json(l): rows with a 'plan' and a measured peak allocated GiB, either at
    the top level or in 'result' (benchmarks/gpu/runner.py rows: per-rank list, max taken). The
    Megatron-loop H100 set is reported in its own section."""
    out = []
    for p in sorted([*RESULTS.glob("*.json"), *RESULTS.glob("*.jsonl")]):
        if p.name == megatron_rows.FILE:
            continue
        for i, it in enumerate(_load_items(p)):
            if not isinstance(it, dict) or it.get("status", "ok") != "ok":
                continue
            res = it.get("result") or {}
            plan_d = it.get("plan") or (it.get("spec") or {}).get("plan")
            measured = _peak(it.get("peak_allocated_gib") or res.get("peak_allocated_gib"))
            if plan_d is None or measured is None:
                continue
            try:
                plan = Plan.model_validate(plan_d)
            except ValueError:
                continue
            # What the job actually ran (TE or the local spec, wgrad fusion, cross entropy).
            ran = as_ran(plan, res)
            plan = ran.plan
            label = it.get("label") or it.get("name") or f"{p.stem}[{i}]"
            reserved = _reserved_at_peak(it.get("peak_allocated_gib") or res.get("peak_allocated_gib"),
                                         it.get("peak_reserved_gib") or res.get("peak_reserved_gib"))
            if reserved is not None:
                RESERVED[label] = reserved
            out.append((label, p.name, plan, measured))
    return out


def _stats(errs: list[float]) -> str:
    a = [abs(e) for e in errs]
    return (f"n={len(a):2d}  median |err| {statistics.median(a):5.2f}%  max |err| {max(a):5.2f}%  "
            f"mean signed {statistics.fmean(errs):+5.2f}%") if a else "n= 0"


def megatron_section() -> list[str]:
    """Section 4: Megatron-LM's own loop on H100 (module docstring)."""
    rows = megatron_rows.load()
    if not rows:
        return []
    lines = ["", "Megatron-LM's own training loop on H100 (gpu_h100_megatron_runs.jsonl; held out: sha256(name)[0] % 3 == 0):",
             f"{'run':34s} {'part':8s} {'spec':18s} {'pred GiB':>9s} {'meas GiB':>9s} {'err %':>7s}  terms (fake process group)"]
    groups: dict[str, list[float]] = {}
    for r in rows:
        measured = max(r.result["peak_allocated_gib"])
        terms = ""
        if r.group == "at_scale":
            pred, term_rows, _ = rank_terms(r.plan, r.result)
            terms = "; ".join(f"{t['term']} {t['error_pct']:+.2f}%" for t in term_rows if t["error_pct"] is not None)
            key = f"fake-PG/{r.part}"
            spec = f"{r.impl} rank {r.result['measured_rank']}"
        else:
            pred = memory_breakdown(r.plan).peak_allocated_gib
            key = f"{'TE' if r.impl == 'transformer_engine' else 'local'}/{r.part}"
            spec = r.impl
        err = 100.0 * (pred / measured - 1.0)
        groups.setdefault(key, []).append(err)
        lines.append(f"{r.name:34s} {r.part:8s} {spec:18s} {pred:9.2f} {measured:9.2f} {err:+7.2f}  {terms}")
    lines.append("")
    for key in sorted(groups):
        lines.append(f"{key:18s} {_stats(groups[key])}")
    te_all = [e for k, v in groups.items() if not k.startswith("local") for e in v]
    lines.append(f"{'TE + fake-PG, all':18s} {_stats(te_all)}")
    lines.append(f"{'local, all':18s} {_stats([e for k, v in groups.items() if k.startswith('local') for e in v])}")
    return lines


def main() -> int:
    rows = _h200_rows() + _bridge_rows() + _sweep_rows()
    lines = [f"{'case':70s} {'source':32s} {'pred GiB':>9s} {'meas GiB':>9s} {'err %':>7s}  most-loaded (first/middle/last peaks)"]
    errs: dict[str, list[float]] = {}
    res_errs: dict[str, list[float]] = {}
    frag_meas: dict[str, list[float]] = {}
    for label, src, plan, measured in rows:
        bd = memory_breakdown(plan)
        err = 100.0 * (bd.peak_allocated_gib / measured - 1.0)
        group = "h200" if src.startswith("device") else ("bridge" if src.startswith("MBRIDGE") else "sweep")
        errs.setdefault(group, []).append(err)
        per_stage = "/".join(f"{s.peak_allocated_gib:.1f}" for s in bd.stages)
        res = RESERVED.get(label)
        res_txt = ""
        if res is not None:
            full_or_pp = plan.parallelism.recompute_granularity == "full" or plan.parallelism.pipeline_model_parallel_size > 1
            kind = f"{group}/{'full-or-PP' if full_or_pp else 'other'}"
            res_errs.setdefault(kind, []).append(100.0 * (bd.peak_reserved_gib / res - 1.0))
            frag_meas.setdefault(kind, []).append(100.0 * (res / measured - 1.0))
            res_txt = (f"  reserved pred {bd.peak_reserved_gib:.2f} meas {res:.2f} ({100.0 * (bd.peak_reserved_gib / res - 1.0):+.1f}%,"
                       f" measured margin {100.0 * (res / measured - 1.0):.1f}%)")
        lines.append(f"{label:70s} {src:32s} {bd.peak_allocated_gib:9.2f} {measured:9.2f} {err:+7.2f}  "
                     f"rank {bd.most_loaded_pipeline_rank} ({bd.most_loaded_role}) [{per_stage}]{res_txt}")
    lines.append("")
    all_errs = [e for v in errs.values() for e in v]
    for name, v in [*errs.items(), ("all", all_errs)]:
        if v:
            a = [abs(e) for e in v]
            lines.append(f"{name:7s} n={len(v):3d}  median |err| {statistics.median(a):5.2f}%  max |err| {max(a):5.2f}%  "
                         f"mean signed {statistics.fmean(v):+5.2f}%")
    lines.append("")
    lines.append("peak reserved (allocated prediction + fragmentation allowance) vs max_memory_reserved:")
    for name in sorted(res_errs):
        v, a, fm = res_errs[name], [abs(e) for e in res_errs[name]], frag_meas[name]
        lines.append(f"{name:18s} n={len(v):3d}  median |err| {statistics.median(a):5.2f}%  max |err| {max(a):5.2f}%  "
                     f"mean signed {statistics.fmean(v):+5.2f}%  measured reserved/allocated - 1: median "
                     f"{statistics.median(fm):.1f}% (range {min(fm):.1f}-{max(fm):.1f}%)")
    lines += megatron_section()
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_accuracy.txt").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
