"""The MCP adapter: registers the tools, resources and prompts on the official SDK's MCPServer.

Thin by design: the work is the core's (and the job manager's). Here: flat arguments in
(server/params.py), compact answers out (server/views.py), charts as images, progress for profile
jobs, CPU-heavy calls on worker threads with a bound on concurrent searches, and input errors as
ToolErrors that name the field (server/errors.py).
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import anyio.to_thread
from mcp.server import MCPServer
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel, ValidationError

from mcore_advisor import __version__
from mcore_advisor.launcher import jobs
from mcore_advisor.launcher.spec import render_with_job_spec
from mcore_advisor.server import views
from mcore_advisor.server.errors import describe_validation_error, quote, tool_errors
from mcore_advisor.server.params import (
    PLAN_FIELDS,
    RECOMMEND_FIXED,
    PlanStore,
    arg,
    build_plan,
    check_strings,
    field_schema,
    flat_schema,
    parse_object,
    recommend_request,
    suggest,
    with_plan_args,
)
from mcore_advisor.server.progress import job_phase
from mcore_advisor.server.resources import register_prompts, register_resources
from mcore_advisor.tools.estimate_memory import estimate_memory as _estimate_memory
from mcore_advisor.tools.evaluate import evaluate_plan as _evaluate_plan
from mcore_advisor.tools.mfu import MfuRequest
from mcore_advisor.tools.mfu import check_mfu as _check_mfu
from mcore_advisor.tools.recommend import FixedParallelism, RecommendRequest
from mcore_advisor.tools.recommend import recommend_parallelism as _recommend
from mcore_advisor.tools.render import RenderRequest

log = logging.getLogger("mcore_advisor.server")

INSTRUCTIONS = """\
Plan, check, launch and profile NVIDIA Megatron-Core training runs.
- recommend_parallelism(model, num_gpus, gpu, seq_length): ranked TP/PP/VP/CP/EP/micro-batch/recompute plans; each has a plan_id.
  A model outside the catalog: hf_config (its Hugging Face config.json) instead of model.
- evaluate_plan / estimate_memory / render_chart / render_launch_script / run_profile_job take a plan_id,
  a full plan, or flat arguments (model, num_gpus, tp, pp, ...).
- check_mfu: a pasted log, OOM or NCCL error, or measured numbers -> MFU/HFU (both FLOP conventions) and ranked fixes.
- run_profile_job -> get_job / list_jobs / cancel_job: a short profiled job, measured vs predicted.
Answers are short; pass detail='full' for everything, or read mcore://plans/{plan_id}.
"""

READ_ONLY = ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)
DETAIL = arg({"type": "string", "enum": ["summary", "full"], "description": "summary (default) or full: the complete result, much larger."})
JOB_ID = arg({"type": "string", "description": "The job_id run_profile_job returned."})
JOB_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Searches use both cores for seconds: at most this many at once; cheap calls have their own slots.
MAX_CONCURRENT_SEARCHES = 2
MAX_CONCURRENT_CALLS = 8
PROGRESS_POLL_S = 1.0
PROGRESS_WAIT_S = 50.0  # under the ~60 s after which some hosts drop a tool call

_NAN_TEXT = re.compile(r"(?<![\w.])-?(?:nan|inf)(?![\w])")


def _detail(value: Any) -> views.Detail:
    if value in (None, "summary"):
        return "summary"
    if value == "full":
        return "full"
    raise ValueError(f"detail: not an allowed value (got {quote(value)}); allowed: 'summary' or 'full'")


def answer(tool: str, text: str, structured: dict[str, Any], *, large: bool = False) -> CallToolResult:
    """Text for the reader, numbers for the program; never a NaN or infinity in either."""
    clean, bad = views.finite(structured)
    if bad:
        log.warning("%s: non-finite values replaced by null at %s", tool, ", ".join(bad[:20]))
    text = _NAN_TEXT.sub("n/a", text)
    meta = None
    if large:
        chars = len(text) + len(json.dumps(clean))
        meta = {"mcore-advisor/result_chars": chars, "mcore-advisor/approx_tokens": chars // 4}
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=clean, _meta=meta)


def _model_error(exc: ValidationError, model: type[BaseModel], rename: dict[str, str]) -> ValueError:
    return ValueError(describe_validation_error(exc, model, rename))


class StaticTokenVerifier:
    """Bearer-token check for the HTTP transport: one shared secret, compared in constant time."""

    def __init__(self, token: str):
        self._token = token

    async def verify_token(self, token: str) -> AccessToken | None:
        if secrets.compare_digest(token.encode(), self._token.encode()):
            return AccessToken(token=token, client_id="mcore-advisor-client", scopes=["mcore"])
        return None


class Runner:
    """CPU-heavy core calls on worker threads: searches share few slots so cheap calls stay quick."""

    def __init__(self) -> None:
        self.searches = anyio.CapacityLimiter(MAX_CONCURRENT_SEARCHES)
        self.calls = anyio.CapacityLimiter(MAX_CONCURRENT_CALLS)

    async def search(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.searches)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.calls)


# ---- recommend_parallelism's request from flat arguments ---------------------------------------

def _recommend_params() -> dict[str, Any]:
    fixed = {n: arg(field_schema(FixedParallelism, PLAN_FIELDS[n][1], PLAN_FIELDS[n][2] + " Pinned; default: searched."))
             for n in RECOMMEND_FIXED if n != "recompute"}
    return {
        "model": arg(flat_schema("model")),
        "hf_config": arg(flat_schema("hf_config")),
        "num_gpus": arg(flat_schema("num_gpus")),
        "gpu": arg(flat_schema("gpu")),
        "seq_length": arg({**flat_schema("seq_length"), "description": "Tokens per sample (default 4096)."}),
        "global_batch_size": arg({**flat_schema("global_batch_size"), "description": "Samples per step (default ~4M tokens)."}),
        "precision": arg(flat_schema("precision")),
        **fixed,
        "recompute": arg({"type": "string", "enum": ["none", "selective", "full"], "description": "Pin activation recompute; default: searched."}),
        "max_tp": arg(field_schema(RecommendRequest, "max_tensor_model_parallel_size", "Upper bound on TP.")),
        "allow_fp8": arg(field_schema(RecommendRequest, "allow_fp8", "Also consider FP8 and pick it when faster.")),
        "top_k": arg(field_schema(RecommendRequest, "top_k", "How many plans (default 5).")),
        "what_if": arg(field_schema(RecommendRequest, "what_if", "Also answer 2x GPUs and 2x sequence (default true).")),
        "request": arg({"type": "object", "additionalProperties": True,
                        "description": "Advanced: a full RecommendRequest (fixed, implementation, headroom ...); flat arguments override it."}),
        "detail": DETAIL,
    }


def _signature(fn: Callable[..., Any], params: dict[str, Any]) -> Callable[..., Any]:
    """Give `fn(**kwargs)` a published signature of keyword arguments, all optional."""
    ps = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=a) for n, a in params.items()]
    fn.__signature__ = inspect.Signature(ps, return_annotation=inspect.signature(fn, eval_str=True).return_annotation)  # type: ignore[attr-defined]
    return fn


def _invocation(plan_args: dict[str, Any], own: dict[str, Any]) -> str:
    """The call as the script's header shows it: one line, a config.json by its size only."""
    shown = {k: v for k, v in plan_args.items() if v is not None and k != "plan"}
    if "hf_config" in shown:
        cfg = shown["hf_config"]
        shown["hf_config"] = f"<config.json, {len(cfg if isinstance(cfg, str) else json.dumps(cfg)):,} characters>"
    return "render_launch_script(" + ", ".join(
        f"{k}={v if k == 'hf_config' else repr(v)}" for k, v in {**shown, **own}.items() if v is not None) + ")"


# ---- the server ------------------------------------------------------------------------------------


def build_server(
    *, http_url: str | None = None, token: str | None = None, manager: jobs.JobManager | None = None
) -> MCPServer:
    """The MCP server. `http_url` + `token` turn on bearer auth for the streamable-HTTP transport."""
    auth_kwargs: dict = {}
    if token:
        from mcp.server.auth.settings import AuthSettings

        auth_kwargs = {
            "token_verifier": StaticTokenVerifier(token),
            "auth": AuthSettings(
                issuer_url=http_url, resource_server_url=http_url, required_scopes=["mcore"],
                validate_token_resource=False,
            ),
        }
    mcp = MCPServer("mcore-advisor", version=__version__, instructions=INSTRUCTIONS, **auth_kwargs)
    plans = PlanStore()
    run = Runner()

    def plan_of(plan_args: dict[str, Any]):
        plan = build_plan(plan_args, plans)
        return plan, plans.add(plan)

    async def recommend_parallelism(**kw: Any) -> Annotated[CallToolResult, views.RecommendOut]:
        """Ranked parallel layouts (TP/PP/VP/CP/EP, micro-batch, recompute, SP, FP8) for a model on N GPUs, with predicted step time, tokens/s/GPU, TFLOP/s, MFU and memory.

        Use it first for "how do I train MODEL on N GPUs". Each plan has a plan_id that evaluate_plan,
        estimate_memory, render_chart, render_launch_script and run_profile_job accept. Pin any dimension
        (tp, pp, ...) to search the rest. When nothing fits it says what would.
        """
        detail = _detail(kw.pop("detail", None))
        req = recommend_request(kw)
        rec = await run.search(lambda: _recommend(req, clock=time.perf_counter, cpu_clock=time.thread_time))
        text, data = views.recommend_view(rec, plans.add, detail)
        return answer("recommend_parallelism", text, data, large=detail == "full")

    mcp.tool(annotations=READ_ONLY)(tool_errors(_signature(recommend_parallelism, _recommend_params())))

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    @with_plan_args()
    async def evaluate_plan(plan_args: dict[str, Any], detail: DETAIL = None) -> Annotated[CallToolResult, views.EvaluateOut]:
        """Validation findings, per-GPU memory and predicted speed of one plan.

        Use it to check a layout. valid=false: Megatron would refuse it (blocking findings first, no
        speed quoted). A plan that does not fit is a normal result (feasible=false), not an error.
        """
        d = _detail(detail)
        plan, pid = plan_of(plan_args)
        ev = await run.call(_evaluate_plan, plan)
        return answer("evaluate_plan", *views.evaluate_view(ev, pid, d), large=d == "full")

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    @with_plan_args()
    async def estimate_memory(plan_args: dict[str, Any], detail: DETAIL = None) -> Annotated[CallToolResult, views.MemoryReportOut]:
        """Per-GPU memory on the most-loaded rank by term (weights, grads, optimizer, activations, logits, buffers, fragmentation), whether it fits, and single-field fixes with the GiB each saves.

        Use it for "will this fit?" and "why does this OOM?". render_chart(chart='memory') draws it.
        """
        d = _detail(detail)
        plan, pid = plan_of(plan_args)
        rep = await run.call(_estimate_memory, plan)
        return answer("estimate_memory", *views.memory_view(rep, pid, d), large=d == "full")

    mfu_params = ("plan_id", "plan", "model", "gpu", "num_gpus", "seq_length", "global_batch_size", "micro_batch_size",
                  "precision", "tp", "pp", "vp", "cp", "ep")
    # Alone, these go to the core as they are: it takes the rest from the log (its config dump) and asks
    # only for what neither gives. Any other plan argument describes the whole plan instead.
    mfu_request_args = {"model", "gpu", "num_gpus", "seq_length"}

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    @with_plan_args(mfu_params)
    async def check_mfu(
        plan_args: dict[str, Any],
        log_text: arg({"type": "string", "description": "Pasted training log, OOM traceback or NCCL timeout (Megatron-LM, Megatron-Bridge, NeMo)."}) = None,
        iteration_time_s: arg(field_schema(MfuRequest, "iteration_time_s", "Measured seconds per step.")) = None,
        tokens_per_s_per_gpu: arg(field_schema(MfuRequest, "tokens_per_s_per_gpu", "Measured tokens/s per GPU.")) = None,
        reported_tflops_per_gpu: arg(field_schema(MfuRequest, "reported_tflops_per_gpu", "TFLOP/s/GPU as reported.")) = None,
        claimed_mfu_pct: arg(field_schema(MfuRequest, "claimed_mfu_pct", "An MFU % to check.")) = None,
        detail: DETAIL = None,
    ) -> Annotated[CallToolResult, views.MfuOut]:
        """MFU/HFU in both FLOP conventions against the dense peak, from a pasted log or measured numbers, with a ranked diagnosis.

        Use it for low MFU/TFLOP/s, a pasted log, an OOM or NCCL error, or a throughput claim. No plan is
        needed when the log holds Megatron's argument dump; for other logs (Megatron-Bridge, NeMo, a crash)
        model, num_gpus and seq_length are enough: it asks for what the log does not say. Fixes come as
        plan_ids with predicted before/after throughput (or memory for an OOM).
        """
        d = _detail(detail)
        req: dict[str, Any] = {"log_text": log_text, "iteration_time_s": iteration_time_s,
                               "tokens_per_s_per_gpu": tokens_per_s_per_gpu, "reported_tflops_per_gpu": reported_tflops_per_gpu,
                               "claimed_mfu_pct": claimed_mfu_pct}
        given = {k for k, v in plan_args.items() if v is not None}
        if given - mfu_request_args:
            req["plan"] = plan_of(plan_args)[0]
        else:
            check_strings(plan_args, "")
            req.update({k: plan_args[k] for k in given})
        try:
            request = MfuRequest.model_validate({k: v for k, v in req.items() if v is not None})
        except ValidationError as exc:
            raise _model_error(exc, MfuRequest, {}) from None
        rep = await run.call(_check_mfu, request)
        return answer("check_mfu", *views.mfu_view(rep, plans.add, d), large=d == "full")

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    @with_plan_args()
    async def render_launch_script(
        plan_args: dict[str, Any],
        launcher: arg({"type": "string", "enum": ["torchrun", "slurm"], "description": "torchrun (one node) or slurm (sbatch, srun per node)."}) = None,
        target: arg({"type": "string", "enum": ["megatron", "profile"], "description": "megatron: pretrain_gpt.py (pretrain_hybrid.py for hybrid Mamba models); profile: the profile job."}) = None,
        nodes: arg(field_schema(RenderRequest, "nodes", "Nodes (default num_gpus / GPUs per node).")) = None,
        train_iters: arg(field_schema(RenderRequest, "train_iters", "Training steps.")) = None,
        job_name: arg({"type": "string", "description": "Slurm job name."}) = None,
        container_image: arg({"type": "string", "description": "Slurm + Pyxis container image."}) = None,
        extra_args: arg({"type": "array", "items": {"type": "string"}, "description": "Extra Megatron flags, e.g. ['--rotary-base', '500000']."}) = None,
        options: arg({"type": "object", "additionalProperties": True, "description": "Any other RenderRequest field (data_path, slurm_account, ...)."}) = None,
        detail: DETAIL = None,
    ) -> Annotated[CallToolResult, views.RenderOut]:
        """A runnable torchrun or Slurm sbatch script (Megatron-LM pretrain_gpt.py, pretrain_hybrid.py for hybrid Mamba models, or the profile job) for a plan; the script is the text answer.

        Every value is validated and shell-quoted; the header states the plan's predicted figures.
        Nothing is executed.
        """
        d = _detail(detail)
        plan, pid = plan_of(plan_args)
        req = parse_object("options", options) if options is not None else {}
        own = {"launcher": launcher, "target": target, "nodes": nodes, "train_iters": train_iters, "job_name": job_name,
               "container_image": container_image, "extra_args": extra_args}
        req.update({k: v for k, v in own.items() if v is not None})
        req.setdefault("invocation", _invocation(plan_args, own))
        try:
            request = RenderRequest.model_validate({**req, "plan": plan})
        except ValidationError as exc:
            raise _model_error(exc, RenderRequest, {}) from None
        art = await run.call(render_with_job_spec, request)
        return answer("render_launch_script", *views.render_view(art, pid, d), large=d == "full")

    @mcp.tool(annotations=READ_ONLY)
    @tool_errors
    @with_plan_args()
    async def render_chart(
        plan_args: dict[str, Any],
        chart: arg({"type": "string", "enum": ["memory", "step_time", "pipeline", "job"],
                    "description": "memory: per-GPU memory by term and stage; step_time: where a step goes; "
                                   "pipeline: the schedule and its bubble; job: measured vs predicted (needs job_id)."}) = None,
        job_id: JOB_ID = None,
    ) -> CallToolResult:
        """A PNG chart of a plan (memory by term and stage, step-time breakdown, pipeline schedule with bubble) or of a profile job (measured vs predicted)."""
        kind = chart or ("job" if job_id is not None else "memory")
        from mcore_advisor import charts

        if kind == "job":
            st = await run.call(lambda: jobs.get_job(_job_id(job_id), manager=manager))
            result = st.result or {}
            pred = st.predicted.iteration_time_s if st.predicted is not None else None
            png = await run.call(lambda: charts.job_png([c.model_dump() for c in st.comparison],
                                                       result.get("step_times_s") or [], pred, f"job {st.job_id}: {st.name}"))
            caption = f"job {st.job_id} ({st.state}): measured vs predicted"
        else:
            plan, pid = plan_of(plan_args)
            if kind == "memory":
                png = await run.call(lambda: charts.memory_png(_estimate_memory(plan)))
            elif kind in ("step_time", "pipeline"):
                ev = await run.call(_evaluate_plan, plan)
                if any(f.severity == "error" for f in ev.findings):
                    raise ValueError("plan: Megatron would refuse this plan (evaluate_plan lists why): no step time to draw")
                png = await run.call(charts.step_time_png if kind == "step_time" else charts.pipeline_png, ev)
            else:
                raise ValueError(f"chart: not an allowed value (got {quote(kind)}); allowed: memory, step_time, pipeline, job")
            caption = f"{kind.replace('_', ' ')} chart of plan {pid}"
        return CallToolResult(content=[TextContent(type="text", text=caption),
                                       ImageContent(type="image", data=base64.b64encode(png).decode(), mime_type="image/png")])

    profile_params = ("plan_id", "plan", "model", "gpu", "num_gpus", "seq_length", "global_batch_size", "micro_batch_size",
                      "precision", "tp", "pp", "vp", "cp", "ep", "sequence_parallel", "recompute")

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=True))
    @tool_errors
    @with_plan_args(profile_params)
    async def run_profile_job(
        plan_args: dict[str, Any],
        ctx: Context,
        backend: arg({"type": "string", "enum": ["local", "slurm", "slurm_rest"], "description": "Where it runs (default local)."}) = None,
        warmup_steps: arg(field_schema(jobs.ProfileJobRequest, "warmup_steps", "Untimed steps first (default 3).")) = None,
        measure_steps: arg(field_schema(jobs.ProfileJobRequest, "measure_steps", "Timed steps (default 10).")) = None,
        dry_run: arg({"type": "boolean", "description": "Show the exact command; create no job."}) = None,
        name: arg({"type": "string", "description": "Job name (A-Z a-z 0-9 _ . -)."}) = None,
        options: arg({"type": "object", "additionalProperties": True, "description": "Other ProfileJobRequest fields (resources, profile_steps, seed)."}) = None,
    ) -> Annotated[CallToolResult, views.SubmissionOut]:
        """Submit a short profiled Megatron-Core job for a plan (local torchrun, or Slurm); returns the job_id.

        With a progress token it also waits up to 50 s reporting queued / started / warm-up / measured
        steps. Poll get_job for phase, ETA and measured-vs-predicted figures. dry_run shows the command.
        """
        plan, pid = plan_of(plan_args)
        req = parse_object("options", options) if options is not None else {}
        own = {"backend": backend, "warmup_steps": warmup_steps, "measure_steps": measure_steps, "dry_run": dry_run, "name": name}
        req.update({k: v for k, v in own.items() if v is not None})
        try:
            request = jobs.ProfileJobRequest.model_validate({**req, "plan": plan})
        except ValidationError as exc:
            raise _model_error(exc, jobs.ProfileJobRequest, {}) from None
        sub = await run.call(lambda: jobs.run_profile_job(request, manager=manager))
        phase = None
        if sub.job_id is not None and _wants_progress(ctx):
            phase = await _report_progress(ctx, run, sub.job_id, manager)
        out = views.SubmissionOut(
            job_id=sub.job_id, dry_run=sub.dry_run, backend=sub.backend, state=phase.state if phase else sub.state,
            phase=phase.phase.phase if phase else None, job_dir=sub.job_dir, command_line=sub.command_line, plan_id=pid,
            predicted=sub.predicted.model_dump() if sub.predicted else None, warnings=views.findings_out(sub.warnings))
        text = (f"dry run: would run {sub.command_line}" if sub.dry_run else
                f"job {sub.job_id} submitted ({sub.backend}, {out.state}{', ' + out.phase if out.state in ('PENDING', 'RUNNING') and out.phase else ''}); "
                f"poll get_job('{sub.job_id}')")
        if sub.predicted is not None:
            p = sub.predicted
            text += f"\npredicted: step {views.fmt(p.iteration_time_s, 3)} s, {views.fmt(p.tokens_per_s_per_gpu, 0)} tokens/s/GPU"
        text += "".join(f"\n{x}" for x in views.findings_text(sub.warnings))
        return answer("run_profile_job", text, out.model_dump(mode="json"))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=False, open_world_hint=False))
    @tool_errors
    async def get_job(job_id: JOB_ID = None, detail: DETAIL = None) -> Annotated[CallToolResult, views.JobOut]:
        """State, phase and ETA of a profile job; when done, measured vs predicted (% error per figure); failures come with a diagnosis."""
        d = _detail(detail)
        st = await run.call(lambda: jobs.get_job(_job_id(job_id), manager=manager))
        return answer("get_job", *_job_view(st, d), large=d == "full")

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=False, open_world_hint=False))
    @tool_errors
    async def list_jobs(
        state: arg({"type": "string", "enum": ["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"],
                    "description": "Only jobs in this state."}) = None,
        limit: arg({"type": "integer", "minimum": 1, "maximum": 1000, "description": "At most this many (default 20)."}) = None,
    ) -> Annotated[CallToolResult, views.JobsOut]:
        """Profile jobs, newest first, optionally filtered by state."""
        lst = await run.call(lambda: jobs.list_jobs(state, 20 if limit is None else _int("limit", limit), manager=manager))
        rows = [j.model_dump(mode="json", include={"job_id", "name", "backend", "state", "num_gpus", "error"}) for j in lst.jobs]
        text = views.table([[j["job_id"], j["name"], j["backend"], j["state"], j["num_gpus"]] for j in rows],
                           ["job", "name", "backend", "state", "GPUs"]) if rows else "no jobs"
        return answer("list_jobs", text, views.JobsOut(jobs=rows).model_dump(mode="json"))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=True))
    @tool_errors
    async def cancel_job(job_id: JOB_ID = None) -> Annotated[CallToolResult, views.JobOut]:
        """Cancel a pending or running profile job (its process group or Slurm job is stopped); returns the final state."""
        st = await run.call(lambda: jobs.cancel_job(_job_id(job_id), manager=manager))
        return answer("cancel_job", *_job_view(st, "summary"))

    register_resources(mcp, plans)
    register_prompts(mcp)
    _finish_tools(mcp)
    return mcp


# ---- jobs ------------------------------------------------------------------------------------------


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name}: not an integer (got {quote(value)})")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: not an integer (got {quote(value)})") from None


def _job_id(value: Any) -> str:
    if value is None:
        raise ValueError("job_id: required: the id run_profile_job returned (list_jobs shows them)")
    if not isinstance(value, str) or not JOB_ID_RE.fullmatch(value):
        raise ValueError(f"job_id: not a job id (got {quote(value, 40)}); ids are up to 64 of A-Z a-z 0-9 _ . - "
                         "(list_jobs shows them)")
    return value


def _job_view(st: Any, detail: views.Detail) -> tuple[str, dict[str, Any]]:
    ph = job_phase(st)
    out = views.JobOut(
        job_id=st.job_id, name=st.name, backend=st.backend, state=st.state, phase=ph.phase, steps_done=ph.steps_done,
        steps_total=ph.steps_total, eta_s=ph.eta_s, elapsed_s=st.elapsed_s, error=st.error,
        comparison=[c.model_dump() for c in st.comparison], comparison_note=st.comparison_note,
        host_floor_ms_per_layer=st.host_floor_ms_per_layer,
        log_tail=None if st.state == "COMPLETED" else _tail(st.stderr_tail or st.log_tail),
        full=st.model_dump(mode="json") if detail == "full" else None,
    )
    lines = [f"job {st.job_id} ({st.name}, {st.backend}): {st.state}" + (f", {ph.phase}" if st.state in ("PENDING", "RUNNING") else "")
             + (f", ETA {ph.eta_s:.0f} s" if ph.eta_s is not None and st.state == "RUNNING" else "")
             + (f", {st.elapsed_s:.0f} s elapsed" if st.elapsed_s else "")]
    if st.error:
        lines.append(f"error: {st.error}")
    if st.comparison:
        lines.append(views.table([[c.figure, c.measured, c.predicted, c.error_pct] for c in st.comparison],
                                 ["figure", "measured", "predicted", "error %"]))
    if st.comparison_note:
        lines.append(f"note: {st.comparison_note}")
    if st.host_floor_ms_per_layer is not None:
        lines.append(f"this machine's host: {st.host_floor_ms_per_layer:.2f} ms per reference layer "
                     "(cluster.host_floor_ms_per_layer for more plans on it)")
    if st.diagnosis:
        lines.append("diagnosis: " + str(st.diagnosis.get("summary") or st.diagnosis.get("oom_diagnosis", {}).get("message") or "see detail='full'"))
    return "\n".join(lines), out.model_dump(mode="json")


def _tail(text: str | None, lines: int = 12) -> str | None:
    return None if text is None else "\n".join(text.splitlines()[-lines:])


def _wants_progress(ctx: Context) -> bool:
    """Did the client send a progress token? (In-process clients pass a callback instead: the SDK
    exposes it only on its private dispatch context.)"""
    try:
        rc = ctx.request_context
    except ValueError:
        return False
    if (rc.meta or {}).get("progress_token") is not None:
        return True
    inner = getattr(getattr(rc.session, "_request_outbound", None), "_inner", None)
    return getattr(inner, "_on_progress", None) is not None


async def _report_progress(ctx: Context, run: Runner, job_id: str, manager: jobs.JobManager | None):
    """Poll the job, sending a progress notification whenever it moves on, until it ends or the wait is over."""

    class Seen:
        state: str
        phase: Any

    seen = Seen()
    last, total = -1.0, 2
    deadline = time.monotonic() + PROGRESS_WAIT_S
    while True:
        st = await run.call(lambda: jobs.get_job(job_id, manager=manager))
        ph = job_phase(st)
        seen.state, seen.phase = st.state, ph
        total = max(total, (ph.steps_total or 0) + 2)  # queued, started, the steps, done
        value = 0.0 if st.state == "PENDING" else 1.0 + (ph.steps_done or 0)
        if st.state not in ("PENDING", "RUNNING"):
            value = float(total)
        if value > last:
            await ctx.report_progress(value, total, f"{st.state.lower()}: {ph.phase}")
            last = value
        if st.state not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            return seen
        await anyio.sleep(PROGRESS_POLL_S)


def _finish_tools(mcp: MCPServer) -> None:
    """Drop what costs context and says nothing (titles, `default: null` of optional arguments, the
    docstrings' indentation), and refuse arguments a tool does not have."""
    for tool in mcp._tool_manager.list_tools():  # noqa: SLF001 (the SDK has no public hook for this)
        tool.description = inspect.cleandoc(tool.description or "")
        schema = tool.parameters
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
            if prop.get("default", 0) is None:
                prop.pop("default")
        _refuse_unknown_arguments(tool)


def _refuse_unknown_arguments(tool: Any) -> None:
    """The SDK drops arguments a tool does not declare; a misspelt `tensor_parallel=8` would then
    answer for another plan without a word. Refuse them, naming the closest known argument."""
    known = list(tool.parameters.get("properties", {}))
    run = tool.run

    async def checked(arguments: dict[str, Any], context: Any, convert_result: bool = False) -> Any:
        unknown = [k for k in arguments if k not in known]
        if unknown:
            lines = []
            for name in unknown[:5]:
                close = suggest(str(name), known)
                lines.append(f"{quote(name, 40)}: unknown argument" + (f"; did you mean {close}?" if close else ""))
            lines.append(f"{tool.name} takes: {', '.join(known)}")
            raise ToolError(f"Error executing tool {tool.name}: " + "\n".join(lines))
        return await run(arguments, context, convert_result=convert_result)

    object.__setattr__(tool, "run", checked)  # Tool is a pydantic model: set past its __setattr__


__all__ = ["INSTRUCTIONS", "StaticTokenVerifier", "answer", "build_server"]
