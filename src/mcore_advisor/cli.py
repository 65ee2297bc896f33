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


def _read_hf_config(path: str | None) -> str | None:
    """The text of a --hf-config file; the core parses it (and names what it cannot map)."""
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--hf-config {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _load_plan(path: str, hf_config: str | None = None):
    """A plan file; `hf_config` (a config.json path) replaces its model, as the MCP tools' hf_config does."""
    from mcore_advisor.schemas import Plan

    data = _read_json(path)
    if isinstance(data, dict) and "plan" in data and "model" not in data:
        data = data["plan"]  # accept a recommend/evaluate result or a request wrapper
    if hf_config:
        if not isinstance(data, dict):
            raise CliError(f"{path}: not a plan object")
        if data.get("model"):
            print(f"mcore-advisor: --hf-config {hf_config} replaces the plan's model", file=sys.stderr)
        data = {**data, "model": {"hf_config": _read_hf_config(hf_config)}}
    return Plan.model_validate(data)


def _emit(result: BaseModel, as_json: bool, summary: Callable[[Any], str]) -> None:
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        print(summary(result))


def _write_png(path: str | None, make: Callable[[], bytes]) -> None:
    """Write a chart when --png was given (the MCP server's render_chart draws the same bytes)."""
    if path:
        Path(path).write_bytes(make())
        print(f"wrote {path}", file=sys.stderr)


def cmd_recommend(a: argparse.Namespace) -> None:
    import time

    from mcore_advisor.server.params import recommend_request
    from mcore_advisor.server.views import recommend_text
    from mcore_advisor.tools.recommend import recommend_parallelism

    # the MCP tool's own arguments, so the CLI and the tool take the same inputs
    args = {"model": a.model, "num_gpus": a.gpus, "gpu": a.gpu, "seq_length": a.seq_length,
            "global_batch_size": a.global_batch_size, "precision": a.precision, "top_k": a.top, "tp": a.tp,
            "pp": a.pp, "vp": a.vp, "cp": a.cp, "ep": a.ep, "micro_batch_size": a.micro_batch_size,
            "sequence_parallel": a.sequence_parallel, "recompute": a.recompute, "max_tp": a.max_tp,
            "allow_fp8": a.allow_fp8 or None, "what_if": False if a.no_what_if else None,
            "request": _read_json(a.request) if a.request else None, "hf_config": _read_hf_config(a.hf_config)}
    req = recommend_request(args)
    if a.gpus_per_node is not None:
        req = req.model_copy(update={"cluster": req.cluster.model_copy(update={"gpus_per_node": a.gpus_per_node})})
    rec = recommend_parallelism(req, clock=time.perf_counter, cpu_clock=time.thread_time)
    _emit(rec, a.json, recommend_text)


def _evaluate(a: argparse.Namespace):
    from mcore_advisor.tools.evaluate import evaluate_plan

    return evaluate_plan(_load_plan(a.plan, getattr(a, "hf_config", None)))


def cmd_evaluate(a: argparse.Namespace) -> None:
    from mcore_advisor.server.views import evaluate_text

    ev = _evaluate(a)
    _write_png(a.png, lambda: _chart_of(ev, "step_time"))
    _emit(ev, a.json, evaluate_text)


def cmd_memory(a: argparse.Namespace) -> None:
    from mcore_advisor.server.views import memory_text
    from mcore_advisor.tools.estimate_memory import estimate_memory

    rep = estimate_memory(_load_plan(a.plan, a.hf_config))

    def chart() -> bytes:
        from mcore_advisor.charts import memory_png

        return memory_png(rep)

    _write_png(a.png, chart)
    _emit(rep, a.json, memory_text)


def _chart_of(ev, kind: str) -> bytes:
    from mcore_advisor import charts

    if any(f.severity == "error" for f in ev.findings):
        raise CliError("Megatron would refuse this plan (see `mcore-advisor evaluate`): no step time to draw")
    return charts.step_time_png(ev) if kind == "step_time" else charts.pipeline_png(ev)


def cmd_chart(a: argparse.Namespace) -> None:
    from mcore_advisor import charts

    if a.kind == "job":
        from mcore_advisor.launcher import jobs

        st = jobs.get_job(a.source)
        pred = st.predicted.iteration_time_s if st.predicted is not None else None
        png = charts.job_png([c.model_dump() for c in st.comparison], (st.result or {}).get("step_times_s") or [],
                             pred, f"job {st.job_id}: {st.name}")
    elif a.kind == "memory":
        from mcore_advisor.tools.estimate_memory import estimate_memory

        png = charts.memory_png(estimate_memory(_load_plan(a.source)))
    else:
        a.plan = a.source
        png = _chart_of(_evaluate(a), a.kind)
    Path(a.png).write_bytes(png)
    print(f"wrote {a.png}")


def cmd_mfu(a: argparse.Namespace) -> None:
    from mcore_advisor.tools.mfu import MfuRequest, check_mfu

    log_text = None
    if a.log:
        data = sys.stdin.buffer.read() if a.log == "-" else Path(a.log).read_bytes()
        log_text = data.decode("utf-8", errors="replace")
    req = MfuRequest(
        plan=_load_plan(a.plan) if a.plan else None, gpu=a.gpu, model=a.model, num_gpus=a.gpus,
        seq_length=a.seq_length, log_text=log_text,
        iteration_time_s=a.iteration_time_s, tokens_per_s_per_gpu=a.tokens_per_s_per_gpu,
        reported_tflops_per_gpu=a.tflops, claimed_mfu_pct=a.claimed_mfu,
    )
    rep = check_mfu(req)
    _emit(rep, a.json, lambda r: r.summary_text())


def cmd_render(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher.spec import render_with_job_spec
    from mcore_advisor.tools.render import RenderRequest

    launcher, target = a.launcher, a.target
    if target in ("torchrun", "slurm"):  # old command lines: --target named the launcher
        print(f"mcore-advisor render: --target {target} is read as --launcher {target}; --target names the "
              "program (megatron or profile)", file=sys.stderr)
        launcher, target = target, "megatron"
    opts: dict[str, Any] = {"plan": _load_plan(a.plan), "target": target, "launcher": launcher}
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

    st = jobs.get_job(a.job_id)
    if a.png:
        a.kind, a.source = "job", a.job_id
        cmd_chart(a)
    _emit(st, a.json, lambda s: s.model_dump_json(indent=2))


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
        from mcore_advisor.server.views import table

        print(table(rows, header))


def cmd_serve(a: argparse.Namespace) -> None:
    from mcore_advisor.launcher import jobs
    from mcore_advisor.server import transport
    from mcore_advisor.server.app import build_server

    token = os.environ.get(a.token_env) or None
    if a.http:
        try:
            transport.check_bind(a.host, token, a.token_env)
        except ValueError as exc:
            raise CliError(str(exc)) from None
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
    server.run("streamable-http", host=a.host, port=a.port, max_request_body_size=int((a.max_body_mb or transport.MAX_BODY_MB) * 2**20),
               transport_security=transport.security(a.host, a.allow_host))


# ---- parser ----------------------------------------------------------------------------------

HF_CONFIG_HELP = "the model's Hugging Face config.json, instead of a catalog model"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcore-advisor", description="Plan, check, launch and profile Megatron-Core training runs.")
    p.add_argument("--version", action="version", version=f"mcore-advisor {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], None], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        sp.add_argument("--json", action="store_true", help="machine-readable JSON output")
        return sp

    sp = add("recommend", cmd_recommend, "rank parallel layouts for a model on a cluster (the MCP tool's inputs)")
    sp.add_argument("--model", help="catalog key, e.g. llama3-70b (see `mcore-advisor models`)")
    sp.add_argument("--hf-config", metavar="FILE", help=HF_CONFIG_HELP)
    sp.add_argument("--gpus", type=int, help="total GPUs (world size)")
    sp.add_argument("--gpu", default=None, help="GPU catalog key (default h100-sxm; see `mcore-advisor gpus`)")
    sp.add_argument("--gpus-per-node", type=int, default=None)
    sp.add_argument("--seq-length", type=int, default=None, help="tokens per sample (default 4096)")
    sp.add_argument("--global-batch-size", type=int, default=None, help="samples per step (default: about 4M tokens)")
    sp.add_argument("--precision", choices=["bf16", "fp8"], default=None)
    sp.add_argument("--top", type=int, default=None, help="how many plans (default 5)")
    for flag, what in (("tp", "tensor"), ("pp", "pipeline"), ("vp", "virtual pipeline"), ("cp", "context"), ("ep", "expert")):
        sp.add_argument(f"--{flag}", type=int, help=f"pin the {what} parallel size (default: searched)")
    sp.add_argument("--micro-batch-size", type=int, help="pin the micro-batch size (default: searched)")
    sp.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None, help="pin sequence parallelism")
    sp.add_argument("--recompute", choices=["none", "selective", "full"], help="pin activation recompute (default: searched)")
    sp.add_argument("--max-tp", type=int, help="upper bound on TP")
    sp.add_argument("--allow-fp8", action="store_true", help="also consider FP8 and pick it when faster")
    sp.add_argument("--no-what-if", action="store_true", help="skip the 2x GPUs / 2x sequence what-ifs")
    sp.add_argument("--request", help="JSON file with a full RecommendRequest (fixed, implementation, headroom ...); options override it")

    sp = add("evaluate", cmd_evaluate, "validate a plan and predict its memory and performance")
    sp.add_argument("plan", help="plan JSON file ('-' = stdin)")
    sp.add_argument("--hf-config", metavar="FILE", help=HF_CONFIG_HELP + "; replaces the plan's model")
    sp.add_argument("--png", metavar="FILE", help="also write the step-time breakdown chart (PNG)")
    sp = add("memory", cmd_memory, "per-GPU memory breakdown of a plan and what to change to fit")
    sp.add_argument("plan", help="plan JSON file ('-' = stdin)")
    sp.add_argument("--hf-config", metavar="FILE", help=HF_CONFIG_HELP + "; replaces the plan's model")
    sp.add_argument("--png", metavar="FILE", help="also write the memory-by-term-and-stage chart (PNG)")
    sp = add("chart", cmd_chart, "draw a chart: memory, step_time or pipeline of a plan, job of a profile job")
    sp.add_argument("kind", choices=["memory", "step_time", "pipeline", "job"])
    sp.add_argument("source", help="plan JSON file ('-' = stdin), or the job id for 'job'")
    sp.add_argument("--png", metavar="FILE", required=True, help="where to write the PNG")

    sp = add("mfu", cmd_mfu, "MFU/HFU from numbers or a log, with a diagnosis")
    sp.add_argument("--log", help="training log or OOM text file ('-' = stdin)")
    sp.add_argument("--plan", help="plan JSON file (optional when the log holds Megatron's arguments dump)")
    sp.add_argument("--gpu", help="GPU key when the plan comes from the log")
    sp.add_argument("--model", help="catalog model, for a log without Megatron's arguments dump (Megatron-Bridge, NeMo, a crash log)")
    sp.add_argument("--gpus", type=int, help="the job's GPU count (num_gpus), when the log does not print it")
    sp.add_argument("--seq-length", type=int, help="tokens per sample (seq_length), when the log does not print it")
    sp.add_argument("--iteration-time-s", type=float)
    sp.add_argument("--tokens-per-s-per-gpu", type=float)
    sp.add_argument("--tflops", type=float, help="reported TFLOP/s/GPU")
    sp.add_argument("--claimed-mfu", type=float, help="an MFU %% to check")

    sp = add("render", cmd_render, "render a torchrun or Slurm launch script for a plan")
    sp.add_argument("plan", help="plan JSON file ('-' = stdin)")
    sp.add_argument("--launcher", choices=["torchrun", "slurm"], default="torchrun",
                    help="how the ranks start: torchrun on one node, or an sbatch script that runs torchrun on every node via srun")
    sp.add_argument("--target", choices=["megatron", "profile", "torchrun", "slurm"], default="megatron",
                    help="what every rank runs: megatron = Megatron-LM pretrain_gpt.py, profile = the profile job "
                         "(torchrun/slurm here are read as --launcher, for old command lines)")
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
    sp.add_argument("--png", metavar="FILE", help="also write the measured-vs-predicted chart (PNG)")
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
    sp.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                    help="another host name or address clients use to reach the server (Host/Origin allow-list; repeatable)")
    sp.add_argument("--max-body-mb", type=float, default=None,
                    help="largest request body in MiB; larger requests get HTTP 413 (default: room for a pasted 20 MB log)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "recommend" and (args.model is None and args.hf_config is None or args.gpus is None) and not args.request:
        print("mcore-advisor recommend: --model (or --hf-config) and --gpus are required (or a --request file)", file=sys.stderr)
        return 2
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
