"""Megatron's own MoE modules' host time on one H100 against the step-time model's host units (issue 15).

Reads benchmarks/results/gpu_h100_H_moe_host_probe.jsonl (benchmarks/gpu/moe_host_probe.py: Megatron-Core 0.19.2's
TEGroupedMLP alone over 2-128 local experts and its whole MoELayer over 8-128 experts, bf16 / FP8 delayed / FP8
current scaling, with and without Megatron's DDP around them; five runs over two leases of one H100 VM) and
compares, per case, the host's time to issue the forward and the backward (wall time, the GPU drained before
each iteration, few tokens: the GPU never holds the host back) with what physics.moe charges for the same
module (host units: experts' GROUPED_EXPERTS_HOST_KERNELS + PER_EXPERT_HOST_KERNELS x local experts + the FP8
terms; the layer adds the router, the fused permute and the alltoall dispatcher's local work), priced with the
reference layer's host probe that bracketed the section in the same run (launcher/entry/host_probe.py, what the
profile job measures: step_time.host_floor_from_probe, HOST_FORWARD_SHARE).
The probe's module has no attention, no DDP bucket traffic and no expert parallelism: it checks the MoE units
alone. Held out, fixed before any choice: a case whose key crc32 % 3 == 0.

    .venv/bin/python benchmarks/moe_host_accuracy.py    # -> benchmarks/results/moe_host_accuracy.txt
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
from moe_kernel_accuracy import _pct, _summary  # this folder's: the scripts run from it

from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics import moe, step_time
from mcore_advisor.physics.layouts import LayoutBatch
from mcore_advisor.schemas import Plan

RESULTS = Path(__file__).resolve().parent / "results"
PROBE = RESULTS / "gpu_h100_H_moe_host_probe.jsonl"
OUT = RESULTS / "moe_host_accuracy.txt"
FP8 = {"bf16": {}, "fp8_delayed": {"precision": "fp8", "fp8_recipe": "delayed"},
       "fp8_tensorwise": {"precision": "fp8", "fp8_recipe": "tensorwise"}}


def key(r: dict) -> str:
    n = r.get("local_experts", r.get("experts"))
    return f"{r['kind']}_{r['precision']}_e{n}{'_ddp' if r.get('ddp') else ''}"


def held_out(r: dict) -> bool:
    return zlib.crc32(key(r).encode()) % 3 == 0


def _plan(r: dict, probe_ms: float) -> Plan:
    experts = r.get("local_experts", r.get("experts"))
    return Plan(model={"num_layers": 1, "hidden_size": r["hidden"], "num_attention_heads": 32, "ffn_hidden_size": 6144,
                       "num_experts": experts, "moe_router_topk": r.get("topk", 2), "moe_ffn_hidden_size": r["ffn"],
                       "swiglu": True, "vocab_size": 32000},
                cluster={"gpu": "h100-sxm", "num_gpus": 1,
                         "host_floor_ms_per_layer": step_time.host_floor_from_probe(probe_ms)},
                training={"seq_length": 2048, "global_batch_size": 1, "micro_batch_size": 1, **FP8[r["precision"]]},
                implementation={"moe_grouped_gemm": True, "moe_permute_fusion": True, "moe_token_dispatcher_type": "alltoall",
                                "moe_router_force_load_balancing": True, "moe_heuristic_miss_share": 0.0})


def predicted_ms(r: dict, probe_ms: float) -> tuple[float, float]:
    """(forward, backward) host ms physics.moe charges for the probe's module at this host probe."""
    plan = _plan(r, probe_ms)
    c = step_time._context(LayoutBatch.from_plan(plan, resolve_model(plan.model)), step_time.hardware_params(plan.cluster),
                           plan.training.precision == "fp8")
    parts = moe.moe_parts(c, step_time._moe_kit())
    kf, kb = parts["experts"]["kernels"]
    if r["kind"] == "moe_layer":
        local, _ = moe.dispatcher_kernels(c)
        for piece in (parts["router"]["kernels"], parts["permute"]["kernels"], local):
            kf, kb = kf + piece[0], kb + piece[1]
    return 1e3 * float(np.ravel(c.host_f * kf)[0]), 1e3 * float(np.ravel(c.host_b * kb)[0])


def cases() -> list[dict]:
    """Every measured case with its run's bracketing host probe (the mean of the probes before and after its section)."""
    by_run: dict[str, list[dict]] = {}
    for line in PROBE.read_text().splitlines():
        r = json.loads(line)
        if "run" in r:
            by_run.setdefault(r["run"], []).append(r)
    out = []
    for rows in by_run.values():
        probes = {p["at"]: p["ms_per_layer"] for p in rows if p["kind"] == "host_probe"}
        for r in rows:
            if r["kind"] in ("moe_experts", "moe_layer") and "error" not in r:
                section = "experts" if r["kind"] == "moe_experts" else "layer"
                before = probes["start" if section == "experts" else "after_experts"]
                out.append({**r, "probe_ms": 0.5 * (before + probes[f"after_{section}"])})
    return out


def _units(r: dict) -> tuple[float, float]:
    """The case's measured forward and backward host time in the host units its run's probe prices."""
    unit_f, unit_b = step_time.host_unit_s(1e-3 * step_time.host_floor_from_probe(r["probe_ms"]))
    return r["fwd_wall_s"] / unit_f, r["bwd_wall_s"] / unit_b


def per_expert_slopes(rs: list[dict]) -> dict[tuple[str, bool], tuple[float, float]]:
    """(precision, ddp) -> host units per local expert (forward, backward): the least-squares slope over the
    TEGroupedMLP cases outside the held-out third, every run pooled."""
    out = {}
    for prec in FP8:
        for ddp in (False, True):
            sel = [r for r in rs if r["kind"] == "moe_experts" and r["precision"] == prec
                   and bool(r.get("ddp")) == ddp and not held_out(r)]
            e = np.array([float(r["local_experts"]) for r in sel])
            y = np.array([_units(r) for r in sel])
            design = np.vstack([np.ones_like(e), e]).T
            out[prec, ddp] = tuple(float(np.linalg.lstsq(design, y[:, i], rcond=None)[0][1]) for i in (0, 1))
    return out


def _slope_lines(rs: list[dict]) -> list[str]:
    sl = per_expert_slopes(rs)
    lines = ["", "Host units per local expert (slope over 2-128 experts, cases outside the held-out third), forward / backward:",
             f"  bf16                  plain {sl['bf16', False][0]:5.2f} / {sl['bf16', False][1]:5.2f}   "
             f"DDP {sl['bf16', True][0]:5.2f} / {sl['bf16', True][1]:5.2f}   "
             f"model PER_EXPERT_HOST_KERNELS {moe.PER_EXPERT_HOST_KERNELS[True][0]} / {moe.PER_EXPERT_HOST_KERNELS[True][1]}"]
    model = {"fp8_delayed": moe.FP8_PER_EXPERT_HOST_KERNELS,
             "fp8_tensorwise": tuple(a + b for a, b in zip(moe.FP8_PER_EXPERT_HOST_KERNELS,
                                                           moe.FP8_CURRENT_SCALING_PER_EXPERT_HOST_KERNELS, strict=True))}
    for prec, (mf, mb) in model.items():
        extra = {d: tuple(sl[prec, d][i] - sl["bf16", d][i] for i in (0, 1)) for d in (False, True)}
        lines.append(f"  {prec + ' less bf16':<21} plain {extra[False][0]:5.2f} / {extra[False][1]:5.2f}   "
                     f"DDP {extra[True][0]:5.2f} / {extra[True][1]:5.2f}   model {mf:.2f} / {mb:.2f}")
    return lines


def report() -> str:
    rs = cases()
    lines = [__doc__.split("\n\n")[0], "", f"cases: {len(rs)} over {len({r['run'] for r in rs})} runs "
             f"({sum(map(held_out, rs))} held out)", "",
             f"{'case':<34} {'run':<14} held  probe ms   fwd meas  model  err %    bwd meas  model  err %"]
    errs: dict[tuple, list[float]] = {}
    for r in sorted(rs, key=lambda r: (r["kind"], r["precision"], r.get("local_experts", r.get("experts")), r["run"])):
        pf, pb = predicted_ms(r, r["probe_ms"])
        mf, mb = 1e3 * r["fwd_wall_s"], 1e3 * r["bwd_wall_s"]
        ef, eb = _pct(pf, mf), _pct(pb, mb)
        et = _pct(pf + pb, mf + mb)
        for group in ((r["kind"], r["precision"] != "bf16", held_out(r)), ("all", held_out(r))):
            errs.setdefault(group, []).append(et)
        lines.append(f"{key(r):<34} {r['run'][:14]:<14} {'yes' if held_out(r) else '   '}  {r['probe_ms']:7.2f}   "
                     f"{mf:8.2f} {pf:6.2f} {ef:+6.1f}   {mb:8.2f} {pb:6.2f} {eb:+6.1f}")
    lines += ["", "Forward + backward host time, model against measured:"]
    for kind in ("moe_experts", "moe_layer"):
        for fp8 in (False, True):
            for held in (False, True):
                label = f"{kind[4:]} {'FP8' if fp8 else 'bf16'} {'held-out' if held else 'others'}"
                lines.append(_summary(label, errs.get((kind, fp8, held), [])))
    lines += [_summary("every case, held-out third", errs.get(("all", True), [])),
              _summary("every case, others", errs.get(("all", False), []))]
    lines += _slope_lines(rs)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUT.write_text(_text := report())
    print(_text)
