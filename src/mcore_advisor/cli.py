"""`mcore-advisor`: the MCP tools for humans, one subcommand each (`--json` for machine output)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from mcore_advisor import __version__
from mcore_advisor.server.errors import user_message


class CliError(Exception):
    """An input problem to report on one line (exit code 2)."""


def _read_json(path: str) -> Any:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _load_plan(path: str):
    from mcore_advisor.schemas import Plan

    data = _read_json(path)
    if isinstance(data, dict) and "plan" in data and "model" not in data:
        data = data["plan"]  # accept a recommend/evaluate result or a request wrapper
    return Plan.model_validate(data)


def _emit(result: BaseModel, as_json: bool, summary: Callable[[Any], str]) -> None:
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        print(summary(result))


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _findings_text(findings) -> str:
    if not findings:
        return "findings: none"
    out = ["findings:"]
    for f in findings:
        out.append(f"  [{f.severity}] {', '.join(f.fields)}: {f.message}" + (f"\n      fix: {f.fix}" if f.fix else ""))
    return "\n".join(out)


def cmd_recommend(a: argparse.Namespace) -> None:
    import time

    from mcore_advisor.tools.recommend import recommend_parallelism, request_from_options

    req = request_from_options(
        model=a.model, num_gpus=a.gpus, gpu=a.gpu, gpus_per_node=a.gpus_per_node, seq_length=a.seq_length,
        global_batch_size=a.global_batch_size, precision=a.precision, top_k=a.top,
    )
    rec = recommend_parallelism(req, clock=time.perf_counter)

    def summary(r) -> str:
        lines = [f"{a.model} on {a.gpus} x {a.gpu}, seq {a.seq_length}, global batch {r.global_batch_size}"]
        rows = [[c.rank, c.layout, c.iteration_time_s, c.tokens_per_s_per_gpu, c.model_tflops_per_gpu_causal,
                 c.mfu_bf16_causal_pct, c.memory_total_gib, c.headroom_gib] for c in r.plans]
        if rows:
            lines.append(_table(rows, ["#", "layout", "step s", "tok/s/GPU", "TFLOP/s causal", "MFU %", "mem GiB", "free GiB"]))
        lines.extend(f"- {x}" for x in r.explanation)
        n = r.nearest_published_run
        if n is not None:
            prec = f" {n.precision.split(' ')[0]}" if n.precision else ""
            lines.append(f"nearest published run: {n.model} on {n.num_gpus} {n.gpu}{prec} ({n.source}), {n.layout}: "
                         f"{_fmt(n.measured_tokens_per_s_per_gpu, 0)} tokens/s/GPU, "
                         f"{_fmt(n.measured_tflops_per_gpu)} TFLOP/s ({n.flop_convention})")
        for w in r.what_if:
            lines.append(f"what if {w.scenario}: {w.note}")
        if not r.feasible:
            lines.append("no plan fits:")
            lines.extend(f"- {x}" for x in r.suggestions)
        st = r.stats
        rate = f" ({st.candidates_per_s:,.0f}/s)" if st.candidates_per_s else ""
        lines.append(f"searched {st.candidates_evaluated:,} configurations{rate}")
        return "\n".join(lines)

    _emit(rec, a.json, summary)


def cmd_evaluate(a: argparse.Namespace) -> None:
    from mcore_advisor.tools.evaluate import evaluate_plan

    ev = evaluate_plan(_load_plan(a.plan))

    def summary(e) -> str:
        lines = [f"feasible: {e.feasible}"]
        lines.extend(f"- {x}" for x in e.explanation)
        if e.performance is not None:
            terms = e.performance.breakdown.model_dump()
            step = e.performance.iteration_time_s
            rows = [[k, v, 100 * v / step] for k, v in terms.items() if isinstance(v, float) and v > 0]
            lines.append(_table(sorted(rows, key=lambda r: -r[1]), ["step-time term", "s", "%"]))
        lines.append(_findings_text(e.findings))
        return "\n".join(lines)

    _emit(ev, a.json, summary)


def cmd_memory(a: argparse.Namespace) -> None:
    from mcore_advisor.tools.estimate_memory import estimate_memory

    rep = estimate_memory(_load_plan(a.plan))

    def summary(r) -> str:
        b = r.breakdown
        names = ("weights", "gradients", "optimizer", "activations", "transient", "buffers", "fragmentation", "non_pytorch")
        rows = [[n.replace("_", "-"), getattr(b, f"{n}_gib")] for n in names]
        lines = [f"most-loaded GPU: pipeline rank {r.most_loaded_pipeline_rank} ({r.most_loaded_role} stage), "
                 f"{r.imbalance_gib:.1f} GiB above the least-loaded", _table(rows, ["term", "GiB"])]
        lines.append(f"peak allocated {b.peak_allocated_gib:.2f} GiB, reserved {b.peak_reserved_gib:.2f} GiB, "
                     f"total {b.total_gib:.2f} of {b.capacity_gib:.2f} GiB -> {'fits' if r.fits else 'DOES NOT FIT'} "
                     f"(headroom {r.headroom_gib:.2f} GiB)")
        for ch in r.suggestions:
            lines.append(f"- {ch.summary}{' (then fits)' if ch.fits_after else ''}: {ch.note}")
        lines.append(_findings_text(r.findings))
        return "\n".join(lines)

    _emit(rep, a.json, summary)


def cmd_mfu(a: argparse.Namespace) -> None:
    from mcore_advisor.tools.mfu import MfuRequest, check_mfu

    log_text = None
    if a.log:
        data = sys.stdin.buffer.read() if a.log == "-" else Path(a.log).read_bytes()
        log_text = data.decode("utf-8", errors="replace")
    req = MfuRequest(
        plan=_load_plan(a.plan) if a.plan else None, gpu=a.gpu, log_text=log_text,
        iteration_time_s=a.iteration_time_s, tokens_per_s_per_gpu=a.tokens_per_s_per_gpu,
        reported_tflops_per_gpu=a.tflops, claimed_mfu_pct=a.claimed_mfu,
    )
    rep = check_mfu(req)
    _emit(rep, a.json, lambda r: r.summary_text())


def cmd_render(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher.spec import render_with_job_spec
    from mcore_advisor.tools.render import RenderRequest

    opts: dict[str, Any] = {"plan": _load_plan(a.plan), "target": a.program, "launcher": a.target}
    for k in ("nodes", "gpus_per_node", "job_name", "megatron_lm_dir", "container_image", "slurm_account",
              "slurm_partition", "time_limit_min", "train_iters"):
        v = getattr(a, k)
        if v is not None:
            opts[k] = v
    if a.extra_args:
        opts["extra_args"] = a.extra_args
    opts["invocation"] = "mcore-advisor " + " ".join(sys.argv[1:])
    art = render_with_job_spec(RenderRequest(**opts))
    _emit(art, a.json, lambda r: r.script.rstrip("\n"))


def cmd_profile(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher import jobs

    req = jobs.ProfileJobRequest(plan=_load_plan(a.plan), backend=a.backend, dry_run=a.dry_run,
                                 warmup_steps=a.warmup_steps, measure_steps=a.steps)
    sub = jobs.run_profile_job(req)
    _emit(sub, a.json, lambda s: s.model_dump_json(indent=2))


def cmd_job(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher import jobs

    _emit(jobs.get_job(a.job_id), a.json, lambda s: s.model_dump_json(indent=2))


def cmd_jobs(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher import jobs

    lst = jobs.list_jobs(a.state, a.limit)
    _emit(lst, a.json, lambda r: r.model_dump_json(indent=2))


def cmd_cancel(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher import jobs

    _emit(jobs.cancel_job(a.job_id), a.json, lambda s: s.model_dump_json(indent=2))


def cmd_catalog(a: argparse.Namespace) -> None:
    if a.command == "gpus":
        from mcore_advisor.knowledge.hardware import gpu_catalog

        items = list(gpu_catalog().values())
        rows = [[g.key, g.name, g.bf16_dense_tflops, g.fp8_dense_tflops, g.hbm_capacity_gib] for g in items]
        header = ["key", "name", "BF16 dense TFLOP/s", "FP8 dense", "HBM GiB"]
    else:
        from mcore_advisor.knowledge.models import model_catalog

        items = list(model_catalog().values())
        rows = [[m.key, m.display_name, m.total_params_b, m.active_params_b] for m in items]
        header = ["key", "name", "params B", "active B"]
    if a.json:
        print(json.dumps([i.model_dump(exclude_none=True) for i in items], indent=2))
    else:
        print(_table(rows, header))


def cmd_serve(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher import jobs
    from mcore_advisor.server.app import build_server

    loopback = a.host in ("127.0.0.1", "localhost", "::1")
    token = os.environ.get(a.token_env) or None
    if a.http and not loopback and not token:
        raise CliError(f"--host {a.host} is not loopback: set a bearer token in ${a.token_env} (clients send 'Authorization: Bearer <token>')")
    try:
        jobs.reattach_all()  # jobs started before a restart keep their state
    except Exception as exc:  # a broken state dir must not stop the planner tools
        print(f"mcore-advisor: could not re-attach jobs: {exc}", file=sys.stderr)
    if not a.http:
        build_server().run()
        return
    url = f"http://{a.host}:{a.port}/mcp"
    server = build_server(http_url=url if token else None, token=token)
    print(f"mcore-advisor MCP server on {url}" + (" (bearer token required)" if token else ""), file=sys.stderr)
    kwargs: dict[str, Any] = {"host": a.host, "port": a.port}
    if not loopback:
        from mcp.server.transport_security import TransportSecuritySettings

        # Behind a bearer token, DNS-rebinding protection (Host header allow-list) would refuse every
        # client that uses the machine's real name.
        kwargs["transport_security"] = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    server.run("streamable-http", **kwargs)


# ---- parser ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcore-advisor", description="Plan, check, launch and profile Megatron-Core training runs.")
    p.add_argument("--version", action="version", version=f"mcore-advisor {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], None], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        sp.add_argument("--json", action="store_true", help="machine-readable JSON output")
        return sp

    sp = add("recommend", cmd_recommend, "rank parallel layouts for a model on a cluster")
    sp.add_argument("--model", required=True, help="catalog key, e.g. llama3-70b (see `mcore-advisor models`)")
    sp.add_argument("--gpus", type=int, required=True, help="total GPUs")
    sp.add_argument("--gpu", default="h100-sxm", help="GPU catalog key (see `mcore-advisor gpus`)")
    sp.add_argument("--gpus-per-node", type=int, default=None)
    sp.add_argument("--seq-length", type=int, default=4096)
    sp.add_argument("--global-batch-size", type=int, default=None, help="samples per step (default: the search's choice)")
    sp.add_argument("--precision", choices=["bf16", "fp8"], default="bf16")
    sp.add_argument("--top", type=int, default=5)

    sp = add("evaluate", cmd_evaluate, "validate a plan and predict its memory and performance")
    sp.add_argument("plan", help="plan JSON file ('-' = stdin)")
    sp = add("memory", cmd_memory, "per-GPU memory breakdown of a plan and what to change to fit")
    sp.add_argument("plan", help="plan JSON file ('-' = stdin)")

    sp = add("mfu", cmd_mfu, "MFU/HFU from numbers or a log, with a diagnosis")
    sp.add_argument("--log", help="training log or OOM text file ('-' = stdin)")
    sp.add_argument("--plan", help="plan JSON file (optional when the log holds Megatron's arguments dump)")
    sp.add_argument("--gpu", help="GPU key when the plan comes from the log")
    sp.add_argument("--iteration-time-s", type=float)
    sp.add_argument("--tokens-per-s-per-gpu", type=float)
    sp.add_argument("--tflops", type=float, help="reported TFLOP/s/GPU")
    sp.add_argument("--claimed-mfu", type=float, help="an MFU %% to check")

    sp = add("render", cmd_render, "render a torchrun or Slurm launch script for a plan")
    sp.add_argument("plan", help="plan JSON file ('-' = stdin)")
    sp.add_argument("--target", choices=["torchrun", "slurm"], default="torchrun", help="how to launch")
    sp.add_argument("--program", choices=["megatron", "profile"], default="megatron", help="Megatron-LM pretrain_gpt.py or the profile job")
    sp.add_argument("--nodes", type=int)
    sp.add_argument("--gpus-per-node", type=int)
    sp.add_argument("--job-name")
    sp.add_argument("--megatron-lm-dir")
    sp.add_argument("--container-image")
    sp.add_argument("--slurm-account")
    sp.add_argument("--slurm-partition")
    sp.add_argument("--time-limit-min", type=int)
    sp.add_argument("--train-iters", type=int)
    sp.add_argument("--extra-args", nargs=argparse.REMAINDER, help="extra Megatron flags (last option)")

    sp = add("profile", cmd_profile, "submit a short profiled Megatron-Core job for a plan")
    sp.add_argument("plan", help="plan JSON file ('-' = stdin)")
    sp.add_argument("--backend", choices=["local", "slurm", "slurm_rest"], default="local")
    sp.add_argument("--dry-run", action="store_true", help="print the command, create no job")
    sp.add_argument("--warmup-steps", type=int, default=3)
    sp.add_argument("--steps", type=int, default=10)
    sp = add("job", cmd_job, "state, log tail and measured-vs-predicted of a profile job")
    sp.add_argument("job_id")
    sp = add("jobs", cmd_jobs, "list profile jobs")
    sp.add_argument("--state")
    sp.add_argument("--limit", type=int, default=20)
    sp = add("cancel", cmd_cancel, "cancel a profile job")
    sp.add_argument("job_id")

    add("gpus", cmd_catalog, "the GPU catalog")
    add("models", cmd_catalog, "the model catalog")

    sp = sub.add_parser("serve", help="run the MCP server (stdio by default)")
    sp.set_defaults(fn=cmd_serve)
    sp.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--token-env", default="MCORE_ADVISOR_TOKEN", help="environment variable holding the bearer token")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except CliError as exc:
        print(f"mcore-advisor: {exc}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, ValidationError, FileNotFoundError) as exc:
        print(f"mcore-advisor {args.command}: {user_message(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
