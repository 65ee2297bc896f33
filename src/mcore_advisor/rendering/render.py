"""render_launch_script: a plan -> a runnable torchrun or sbatch script for Megatron-LM or the profile job.

Safety model: every value that reaches the script is validated here (no control characters, no
leading '-' where a value could be read as an option, Megatron-shaped extra flags only) and then
quoted for the one parser that will read it: `shlex.quote` for bash, sbatch's own quoting for
`#SBATCH` lines. Flags and environment are built as lists in Python; the Jinja2 templates only lay
them out, and their `finalize` hook refuses any value that did not come out of a quoting function,
so a template cannot print a raw string by mistake. Nothing edits the text after rendering.

Pure: no I/O besides reading the packaged templates; no clock, environment or subprocess.
"""

from __future__ import annotations

import json
import re
import shlex
import unicodedata
from functools import cache
from typing import Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor import __version__
from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.evaluate import Evaluation, evaluate_plan
from mcore_advisor.rendering.megatron_args import Flag, as_rendered, entry_script, megatron_flags
from mcore_advisor.rendering.request import Launcher, RenderRequest, Target
from mcore_advisor.schemas import ModelShape, Plan, parallel_dims

PROFILE_ENTRY_MODULE = "mcore_advisor.launcher.entry.profile"
#: Below this fraction of free HBM (per the memory estimate) the script turns on expandable segments:
#: fragmentation in PyTorch's caching allocator typically costs a few GiB on an 80 GiB GPU.
TIGHT_MEMORY_HEADROOM = 0.10


def profile_job_refusal(shape: ModelShape) -> str | None:
    """Why the profile job cannot run this model (None: it can). Its model provider
    (launcher/entry/gpt.py) builds Megatron-Core's GPTModel, which would make every layer of a hybrid
    Mamba model attention + MLP and measure a different model."""
    if not shape.is_hybrid:
        return None
    return ("model.hybrid_layer_pattern: the profile job builds GPT models only (its model_provider makes a GPTModel; "
            "a hybrid Mamba model needs Megatron-LM's HybridModel from pretrain_hybrid.py), so it would measure another "
            "model; render target 'megatron' for a pretrain_hybrid.py script instead, or profile a GPT model")


# ---- validation of untrusted text ------------------------------------------------------------

def _check_text(field: str, value: str, *, allow_empty: bool = False) -> str:
    """Reject control characters (newline, NUL, ESC, DEL, Unicode line separators) in any value."""
    if not value and not allow_empty:
        raise ValueError(f"{field} must not be empty")
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in "\u0085":
            raise ValueError(f"{field} contains a control character ({ch!r}); remove newlines and control characters")
    return value


def _check_operand(field: str, value: str) -> str:
    """A value that follows a flag or is a program path: must not be readable as an option."""
    _check_text(field, value)
    if value.startswith("-"):
        raise ValueError(f"{field} {value!r} starts with '-', which Megatron/torchrun would read as an option; "
                         f"write it as ./{value} (paths) or choose another name")
    return value


_FLAG_RE = re.compile(r"--[a-z0-9][a-z0-9-]*")
_NUMBER_RE = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_extra_args(tokens: list[str]) -> list[str]:
    """Megatron-shaped flags only: `--name [values...]` or `--name=value`; values never option-like."""
    if tokens and not tokens[0].startswith("--"):
        raise ValueError(f"extra_args must start with a --flag, got {tokens[0]!r}")
    for i, tok in enumerate(tokens):
        _check_text(f"extra_args[{i}]", tok)
        if tok.startswith("--"):
            name = tok.split("=", 1)[0]
            if not _FLAG_RE.fullmatch(name):
                raise ValueError(f"extra_args[{i}] {tok!r} is not a Megatron flag (--lowercase-words)")
        elif tok.startswith("-") and not _NUMBER_RE.fullmatch(tok):
            raise ValueError(f"extra_args[{i}] {tok!r}: values may start with '-' only when they are numbers")
    return tokens


def _extra_flags(tokens: list[str]) -> list[Flag]:
    """Group validated extra_args into flags: each '--name' (or '--name=value') with the values after it."""
    groups: list[list[str]] = []
    for tok in tokens:
        if tok.startswith("--"):
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return [Flag(g[0], tuple(g[1:]), "extra_args, passed through verbatim") for g in groups]


# ---- quoting: the only producers of text a template may print --------------------------------

class _Sh(str):
    """Text already safe for the parser it is printed into (bash, or sbatch's #SBATCH reader)."""


class _Comment(str):
    """One validated line of comment text (no newline can end the comment early)."""


def _q(value: object) -> _Sh:
    return _Sh(shlex.quote(str(value)))


def _join(argv: list[str]) -> _Sh:
    return _Sh(" ".join(shlex.quote(a) for a in argv))


def _comment(text: str) -> _Comment:
    return _Comment(_check_text("comment", text, allow_empty=True))


_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9._/:%=+,@-]+")


def _sbatch_value(value: str) -> _Sh:
    """Quote for sbatch's #SBATCH tokenizer (src/sbatch/opt.c _get_argument): it groups "..." or '...',
    drops a backslash before any character, and starts a comment at an unquoted '#'."""
    if _SBATCH_PLAIN.fullmatch(value):
        return _Sh(value)
    return _Sh('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')


def _finalize(value: Any) -> Any:
    if isinstance(value, jinja2.Undefined):
        str(value)  # StrictUndefined raises UndefinedError naming the variable
    if isinstance(value, _Sh | _Comment | int) and not isinstance(value, bool):
        return value
    raise TypeError(f"template tried to print an unquoted value: {value!r}")


@cache
def _templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("mcore_advisor.rendering", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        finalize=_finalize,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


# ---- request and result ------------------------------------------------------------------------

class FlagExplanation(BaseModel):
    """One flag of the launched program and why it is there."""

    model_config = ConfigDict(frozen=True)

    flag: str
    values: list[str]
    why: str


class EnvSetting(BaseModel):
    """One environment decision: exported, unset, or deliberately left alone (with the reason)."""

    model_config = ConfigDict(frozen=True)

    name: str
    action: Literal["set", "unset", "leave"]
    value: str | None = Field(None, description="The exported value (action 'set').")
    why: str


class LaunchArtifact(BaseModel):
    """A rendered launch script and everything needed to run or inspect it."""

    model_config = ConfigDict(frozen=True)

    target: Target
    launcher: Launcher
    script_name: str = Field(description="File name the command expects the script under.")
    script: str = Field(description="The script text (bash).")
    command: str = Field(description="Shell line that runs the saved script (creates the Slurm log directory first).")
    program: list[str] = Field(description="What each rank runs: [pretrain_gpt.py] (pretrain_hybrid.py for a hybrid Mamba model) or ['-m', the profile entry module].")
    program_args: list[str] = Field(description="Exact argv after `program` in the script.")
    megatron_args: list[str] = Field(description="Megatron-LM pretrain_gpt.py (or pretrain_hybrid.py) argv equivalent to the plan and options (also for target profile, for reference).")
    explanations: list[FlagExplanation] = Field(description="Each flag of program_args with its reason.")
    env: list[EnvSetting] = Field(description="Environment decisions in script order.")
    nodes: int
    gpus_per_node: int
    notes: list[str] = Field(description="Adjustments made while rendering (dropped or filled-in flags) and validator warnings.")
    spec_json: str | None = Field(None, description="target profile: the spec.json the script writes.")


# ---- helpers -----------------------------------------------------------------------------------

def _layout(req: RenderRequest) -> tuple[int, int]:
    """(nodes, gpus_per_node) consistent with the plan's world size and the node size."""
    plan = req.plan
    world = plan.cluster.num_gpus
    node_size = req.gpus_per_node or plan.cluster.gpus_per_node or gpu(plan.cluster.gpu).gpus_per_node
    if req.gpus_per_node is None and req.nodes is not None:
        if world % req.nodes:
            raise ValueError(f"nodes ({req.nodes}) must divide cluster.num_gpus ({world}), the plan's world size")
        gpn = world // req.nodes
        if gpn > node_size:
            raise ValueError(f"nodes ({req.nodes}) would put {gpn} GPUs on a node of {node_size}; "
                             f"set nodes to {-(-world // node_size)} or more")
    else:
        gpn = min(node_size, world) if req.gpus_per_node is None else node_size
    if world % gpn:
        raise ValueError(f"cluster.num_gpus ({world}) is not a multiple of gpus_per_node ({gpn}); "
                         f"set gpus_per_node to a divisor of {world} or change cluster.num_gpus")
    nodes = world // gpn
    if req.nodes is not None and req.nodes != nodes:
        raise ValueError(f"nodes ({req.nodes}) x gpus_per_node ({gpn}) must equal cluster.num_gpus ({world}), the plan's "
                         f"world size; set nodes to {nodes} or cluster.num_gpus to {req.nodes * gpn}")
    if req.launcher == "torchrun" and nodes > 1:
        raise ValueError(f"launcher 'torchrun' renders a single-node script but the plan needs {nodes} nodes "
                         f"({world} GPUs / {gpn} per node); use launcher 'slurm'")
    return nodes, gpn


def _slurm_time(minutes: int) -> str:
    """Slurm's days-hours:minutes:seconds form (sbatch(1) --time)."""
    d, rest = divmod(minutes, 24 * 60)
    h, m = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:00" if d else f"{h:02d}:{m:02d}:00"


def _predicted_line(ev: Evaluation) -> str:
    parts = []
    perf, mem = ev.performance, ev.memory
    if perf is not None:
        parts += [f"step time {perf.iteration_time_s:.3f} s", f"{perf.tokens_per_s_per_gpu:,.0f} tokens/s/GPU",
                  f"{perf.model_tflops_per_gpu_causal:.1f} TFLOP/s/GPU",
                  f"MFU {perf.mfu_bf16_causal_pct:.1f}% of dense BF16 peak"]
    if mem is not None:
        parts.append(f"peak memory {mem.total_gib:.1f} GiB of {mem.capacity_gib:.1f} GiB")
    if not parts:
        return "predicted: unavailable (evaluate_plan could not estimate this layout)"
    return "predicted by mcore-advisor evaluate_plan (model FLOPs, causal convention): " + " | ".join(parts)


def _memory_headroom(ev: Evaluation) -> float | None:
    """Free fraction of HBM on the most-loaded GPU per the memory estimate; None when unknown."""
    mem = ev.memory
    if mem is None or not mem.capacity_gib:
        return None
    return (mem.capacity_gib - mem.total_gib) / mem.capacity_gib


def _environment(req: RenderRequest, arch: str, headroom: float | None) -> list[EnvSetting]:
    plan = req.plan
    d = parallel_dims(plan)
    fsdp = plan.implementation.use_torch_fsdp2
    env = [EnvSetting(name="PYTHONUNBUFFERED", action="set", value="1",
                      why="log lines reach the job log as they are printed, not when a buffer fills")]
    if fsdp:
        env.append(EnvSetting(name="CUDA_DEVICE_MAX_CONNECTIONS", action="unset",
                              why="Megatron asserts FSDP runs without CUDA_DEVICE_MAX_CONNECTIONS=1 (arguments.py validate_args)"))
    elif (d.tp > 1 or d.cp > 1) and arch in ("ampere", "hopper"):
        env.append(EnvSetting(
            name="CUDA_DEVICE_MAX_CONNECTIONS", action="set", value="1",
            why="TP/CP before Blackwell: one hardware queue keeps communication kernels in launch order so they "
                "overlap with the GEMMs; Megatron's validate_args asserts it"))
    elif d.tp > 1 or d.cp > 1:
        env.append(EnvSetting(name="CUDA_DEVICE_MAX_CONNECTIONS", action="leave",
                              why=f"{arch}: Megatron dropped the =1 requirement from Blackwell on (validate_args checks arch < 10)"))
    else:
        env.append(EnvSetting(name="CUDA_DEVICE_MAX_CONNECTIONS", action="leave",
                              why="TP = CP = 1: no TP/CP communication to order, so the default (8 queues) is kept"))
    if plan.implementation.expandable_segments:
        env.append(EnvSetting(name="PYTORCH_CUDA_ALLOC_CONF", action="set", value="expandable_segments:True",
                              why="implementation.expandable_segments: growable segments, far less allocator fragmentation"))
    elif headroom is not None and headroom < TIGHT_MEMORY_HEADROOM:
        env.append(EnvSetting(name="PYTORCH_CUDA_ALLOC_CONF", action="set", value="expandable_segments:True",
                              why=f"estimated peak leaves {headroom:.0%} of HBM free (< {TIGHT_MEMORY_HEADROOM:.0%}): "
                                  "fragmentation alone could run the job out of memory"))
    if plan.implementation.cuda_graph_impl == "transformer_engine" and any(e.name == "PYTORCH_CUDA_ALLOC_CONF" for e in env):
        env.append(EnvSetting(name="NCCL_GRAPH_REGISTER", action="set", value="0",
                              why="TE's CUDA graphs with expandable segments: NCCL's graph buffer registration hits an "
                                  "illegal memory access (Megatron's validate_args asserts NCCL_GRAPH_REGISTER=0)"))
    if plan.implementation.cublaslt_heuristics_cache_capacity is not None:
        env.append(EnvSetting(name="CUBLASLT_HEURISTICS_CACHE_CAPACITY", action="set",
                              value=str(plan.implementation.cublaslt_heuristics_cache_capacity),
                              why="implementation.cublaslt_heuristics_cache_capacity: GEMM problems cuBLASLt keeps its "
                                  "algorithm choice for (default 8192; uneven fine-grained experts thrash it)"))
    if req.target == "megatron" and plan.implementation.transformer_impl == "transformer_engine":
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            env.append(EnvSetting(name=name, action="unset",
                                  why="Megatron sets NVTE_*_ATTN from --attention-backend and asserts that inherited "
                                      "values agree (language_module.py)"))
    env.append(EnvSetting(name="TORCH_NCCL_AVOID_RECORD_STREAMS", action="leave",
                          why="avoiding recordStream is PyTorch's default now; the variable is deprecated"))
    env.append(EnvSetting(name="NCCL_*", action="leave",
                          why="fabric-specific (IB service level, NVLS, socket interface), so NCCL's own detection is the "
                              "safe default; add site settings with extra_env"))
    for name, value in req.extra_env.items():
        if not _ENV_NAME_RE.fullmatch(name):
            raise ValueError(f"extra_env name {name!r} is not a valid environment variable name")
        _check_text(f"extra_env[{name}]", value, allow_empty=True)
        env.append(EnvSetting(name=name, action="set", value=value, why="extra_env"))
    return env


def _model_label(plan: Plan) -> str:
    if plan.model.name:
        return _check_text("model.name", plan.model.name)
    return "custom model"


def _default_job_name(plan: Plan) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", plan.model.name or "custom").strip("-.") or "custom"
    return f"mcore-{base}"[:64]


def _check_request(req: RenderRequest) -> None:
    for name in ("job_name", "slurm_account", "slurm_partition", "invocation"):
        value = getattr(req, name)
        if value is not None:
            _check_text(name, value)
    for name in ("run_dir", "script_name", "megatron_lm_dir", "pretrain_script", "python_executable",
                 "torchrun_executable", "tokenizer_model", "save_dir", "load_dir", "container_image", "slurm_log_dir"):
        value = getattr(req, name)
        if value is not None:
            _check_operand(name, value)
    if "%" in req.slurm_log_dir:
        raise ValueError("slurm_log_dir must not contain '%': sbatch would expand it as a filename pattern")
    for i, item in enumerate(req.data_path or []):
        _check_operand(f"data_path[{i}]", item)
    for i, m in enumerate(req.container_mounts):
        _check_operand(f"container_mounts[{i}]", m)
        if "," in m:
            raise ValueError(f"container_mounts[{i}] {m!r} contains ',', which separates mounts for Pyxis; give one mount per item")
    if req.container_mounts and not req.container_image:
        raise ValueError("container_mounts needs container_image (Pyxis mounts apply to a container)")
    if (req.container_image or req.container_mounts) and req.launcher != "slurm":
        raise ValueError("container_image/container_mounts use Pyxis' srun options: set launcher 'slurm'")
    if req.data_path and not req.tokenizer_type:
        raise ValueError("tokenizer_type is required with data_path (e.g. HuggingFaceTokenizer with tokenizer_model)")
    if req.profile and req.profile_step_end <= req.profile_step_start:
        raise ValueError(f"profile_step_end ({req.profile_step_end}) must be greater than profile_step_start ({req.profile_step_start})")
    if req.profile and req.profile_step_end > req.train_iters:
        raise ValueError(f"profile_step_end ({req.profile_step_end}) is past train_iters ({req.train_iters}); "
                         f"raise train_iters or move the profile window")
    if req.target == "profile" and req.profile_spec is None:
        raise ValueError("profile_spec is required for target 'profile': pass mcore_advisor.launcher.spec.job_spec(plan)")
    _check_extra_args(req.extra_args)


def _explain(flags: list[Flag]) -> list[FlagExplanation]:
    return [FlagExplanation(flag=f.name, values=list(f.values), why=f.why) for f in flags]


def _nsys_prefix(req: RenderRequest, run_dir: str) -> list[str]:
    if not req.nsys:
        return []
    prefix = ["nsys", "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
              "--force-overwrite=true", f"--output={run_dir}/nsys/profile-%h-%p"]
    if req.profile and req.target == "megatron":
        # Megatron brackets the profile window with cudaProfilerStart/Stop (training.py) when not
        # using the PyTorch profiler; nsys records only that range.
        prefix[2:2] = ["--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    return prefix


def _slurm_options(req: RenderRequest, job_name: str, nodes: int, gpn: int) -> tuple[list[_Sh], list[str]]:
    """(#SBATCH option texts, srun options). #SBATCH values are quoted for sbatch's own reader."""
    log_dir = req.slurm_log_dir.rstrip("/") or "/"
    opts = [
        ("job-name", job_name), ("nodes", str(nodes)), ("ntasks-per-node", "1"), ("gpus-per-node", str(gpn)),
        ("time", _slurm_time(req.time_limit_min)),
        ("output", f"{log_dir}/%x-%j.out"), ("error", f"{log_dir}/%x-%j.err"),
    ]
    srun = ["--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if req.slurm_cpus_per_task:
        opts.append(("cpus-per-task", str(req.slurm_cpus_per_task)))
        # srun does not inherit the batch step's --cpus-per-task (Slurm 22.05 release notes).
        srun.append(f"--cpus-per-task={req.slurm_cpus_per_task}")
    if req.slurm_account:
        opts.append(("account", req.slurm_account))
    if req.slurm_partition:
        opts.append(("partition", req.slurm_partition))
    sbatch = [_Sh(f"--{k}={_sbatch_value(v)}") for k, v in opts]
    if req.slurm_exclusive:
        sbatch.append(_Sh("--exclusive"))
    if req.container_image:
        srun.append(f"--container-image={req.container_image}")
    if req.container_mounts:
        srun.append("--container-mounts=" + ",".join(req.container_mounts))
    return sbatch, srun


# ---- the tool ----------------------------------------------------------------------------------

def render_launch_script(request: RenderRequest) -> LaunchArtifact:
    """Returns a bash launch script (torchrun single node, or sbatch multi-node) for a plan, with the
    Megatron-LM arguments, environment and the reason for each, plus the command that runs it.

    Use after evaluate_plan / recommend_parallelism to turn a plan into something to run: target
    'megatron' runs Megatron-LM's pretrain_gpt.py (pretrain_hybrid.py for a hybrid Mamba model), target
    'profile' runs mcore-advisor's profile job (GPT models only).
    Raises ValueError naming the field for unsafe or inconsistent options, and for plans the
    validators reject (unless allow_invalid).
    """
    req = request
    plan = req.plan
    _check_request(req)
    model_label = _model_label(plan)
    nodes, gpn = _layout(req)
    gpu_spec = gpu(plan.cluster.gpu)
    shape = resolve_model(plan.model)
    d = parallel_dims(plan)
    refusal = profile_job_refusal(shape) if req.target == "profile" else None
    if refusal:
        raise ValueError(refusal)

    apex = req.apex_installed if req.apex_installed is not None else req.container_image is not None
    rendered = as_rendered(plan, apex=apex)
    # The header predicts the run the script starts: the Megatron-LM flags' plan, not the request's.
    ev = evaluate_plan(rendered.plan if req.target == "megatron" else plan)
    findings = ev.findings
    errors = [f for f in findings if f.severity == "error"]
    if errors and not req.allow_invalid:
        listed = "; ".join(f"{', '.join(f.fields)}: {f.message}" + (f" (fix: {f.fix})" if f.fix else "") for f in errors)
        raise ValueError(f"the plan has {len(errors)} error(s): {listed}. Fix the plan, or set allow_invalid to render anyway")
    notes: list[str] = [f"validator {f.severity}: {f.message}" for f in findings if f.severity != "info"]

    job_name = req.job_name or _default_job_name(plan)
    run_dir = req.run_dir or f"runs/{job_name}"
    _check_operand("run_dir", run_dir)
    if req.apex_installed is None and apex and plan.implementation.gradient_accumulation_fusion:
        notes.append("gradient accumulation fusion kept: assuming the container image ships Apex (NGC PyTorch "
                     "images have); set apex_installed false if it does not")
    if plan.implementation.attention_backend == "local" and plan.implementation.transformer_impl == "local":
        notes.append("attention_backend 'local' not passed: Megatron's pretrain_gpt cannot take --spec local; "
                     "transformer_impl local already runs Megatron-Core's own DotProductAttention")
    notes += rendered.notes
    if req.target == "megatron" and rendered.plan != plan:
        notes.append("the predicted figures above are for the plan as these flags run it (the changes noted here), "
                     "not for the plan JSON as given")
    mflags = megatron_flags(rendered, shape, req, run_dir=run_dir, notes=notes)
    extra = _extra_flags(req.extra_args)
    plan_sourced = {f.name for f in mflags}
    clashes = [f.name.split("=", 1)[0] for f in extra if f.name.split("=", 1)[0] in plan_sourced]
    if clashes:
        raise ValueError(f"extra_args repeat flags the plan or options already set ({', '.join(clashes)}); "
                         "change the plan field or render option named in the script's comment instead")
    megatron_argv = [a for f in mflags + extra for a in f.argv]

    spec_json = None
    if req.target == "megatron":
        default_script = f"{req.megatron_lm_dir.rstrip('/')}/{entry_script(shape)}"
        program = [_check_operand("pretrain_script", req.pretrain_script or default_script)]
        arg_flags = mflags + extra
    else:
        spec_json = json.dumps(req.profile_spec, sort_keys=True, separators=(",", ":"))
        program = ["-m", PROFILE_ENTRY_MODULE]
        arg_flags = [
            Flag("--spec", (f"{run_dir}/spec.json",), "the job spec (launcher/spec.py job_spec), written above"),
            Flag("--out-dir", (run_dir,), "where the entry writes its log, trace and result.json"),
        ]
        notes.append("target profile: data, checkpoint, optimizer and profile-window options come from profile_spec")
    program_args = [a for f in arg_flags for a in f.argv]

    env = _environment(req, gpu_spec.architecture, _memory_headroom(ev))
    nsys = _nsys_prefix(req, run_dir)

    script_name = req.script_name or ("run.sbatch" if req.launcher == "slurm" else "run.sh")
    if req.launcher == "slurm":
        command = f"mkdir -p {shlex.quote(req.slurm_log_dir)} && sbatch {shlex.quote(script_name)}"
    else:
        command = f"bash {shlex.quote(script_name)}"

    options = req.model_dump(mode="json", exclude={"plan", "profile_spec", "invocation"}, exclude_defaults=True)
    invocation = req.invocation or f"render_launch_script(target={req.target}, launcher={req.launcher}) options {json.dumps(options, sort_keys=True)}"
    vp = f"VP {d.vp}" if d.vp > 1 else "no VP"
    what = f"Megatron-LM {entry_script(shape)}" if req.target == "megatron" else "mcore-advisor profile job"
    header = [
        f"mcore-advisor {__version__} render_launch_script: {what} via {req.launcher}, "
        f"{nodes} node(s) x {gpn} GPU(s) ({gpu_spec.key})",
        f"rendered by: {invocation}",
        f"plan: {model_label} | TP {d.tp}, PP {d.pp} ({vp}), CP {d.cp}, EP {d.ep}, ETP {d.etp}, DP {d.dp} | "
        f"seq {plan.training.seq_length}, micro-batch {plan.training.micro_batch_size}, "
        f"global batch {plan.training.global_batch_size} | {plan.training.precision}",
        _predicted_line(ev),
        "plan JSON: " + json.dumps(plan.model_dump(mode="json", exclude_defaults=True), sort_keys=True, separators=(",", ":")),
        f"run with: {command}",
    ]
    header += [f"note: {n}" for n in notes]

    launch_prefix = nsys + ([req.torchrun_executable, "--standalone", "--nnodes", "1", "--nproc_per_node", str(gpn)]
                            if req.launcher == "torchrun" else
                            [req.python_executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpn)])
    sbatch, srun_opts = _slurm_options(req, job_name, nodes, gpn) if req.launcher == "slurm" else ([], [])

    context = {
        "header": [_comment(h) for h in header],
        "sbatch": sbatch,
        "env": [
            {"action": e.action, "name": _comment(e.name) if e.action == "leave" else _Sh(e.name),
             "value": _q(e.value or ""), "why": _comment(e.why)}
            for e in env
        ],
        "run_dirs": _join([run_dir] + ([f"{run_dir}/nsys"] if req.nsys else [])),
        "spec_json": _q(spec_json) if spec_json is not None else None,
        "spec_path": _q(f"{run_dir}/spec.json"),
        "args": [{"argv": _join(f.argv), "why": _comment(f.why)} for f in arg_flags],
        "launch": _join(launch_prefix),
        "program": _join(program),
        "srun_opts": _join(srun_opts),
        "master_port": _q(req.master_port),
    }
    template = "slurm.sbatch.j2" if req.launcher == "slurm" else "torchrun.sh.j2"
    script = _templates().get_template(template).render(**context)

    return LaunchArtifact(
        target=req.target, launcher=req.launcher, script_name=script_name, script=script, command=command,
        program=program, program_args=program_args, megatron_args=megatron_argv,
        explanations=_explain(arg_flags), env=env, nodes=nodes, gpus_per_node=gpn, notes=notes, spec_json=spec_json,
    )
