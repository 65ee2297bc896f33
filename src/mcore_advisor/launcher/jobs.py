"""The job tools: run_profile_job, get_job, list_jobs, cancel_job (and reattach_all for startup).

A profile job runs the Megatron-Core entry point (launcher/entry/profile.py) for a plan on a
backend, then reports measured iteration time, throughput and memory next to what
evaluate_plan predicted. Submitting returns at once; the state is refreshed from the backend
whenever a job is read, so nothing needs to run in the background and a restarted server picks
every job up again from the store.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import re
import shlex
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hardware import gpu
from mcore_advisor.physics.memory import memory_breakdown
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import Finding, Plan
from mcore_advisor.tools.evaluate import evaluate_plan
from mcore_advisor.tools.mfu import MfuRequest, check_mfu
from mcore_advisor.tools.render import RenderRequest, render_launch_script
from mcore_advisor.validators import validate

from .as_ran import as_ran, earlier_machine_probes, machine_key, measured_host_floor_ms, rank_terms
from .backends.base import (
    ERROR_FILE,
    JOB_ENV_MARKER,
    RESULT_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    TRAIN_LOG,
    Backend,
    BackendError,
    BackendStatus,
    JobArtifact,
    JobRef,
    JobResources,
    check_job_name,
    read_json,
    read_outcome,
    tail_text,
)
from .backends.local import LocalBackend, local_gpu_count
from .entry import result as result_contract
from .entry.result import Figure
from .spec import job_spec
from .store import (
    ACTIVE_STATES,
    JOB_STATES,
    STATE_DIR_ENV,
    JobRecord,
    JobStateName,
    JobStore,
    StoreError,
    new_job_id,
    quote,
    record_from,
)

log = logging.getLogger("mcore_advisor.launcher")

BackendName = Literal["local", "slurm", "slurm_rest"]
ENTRY_MODULE = "mcore_advisor.launcher.entry.profile"
SPEC_FILE = "spec.json"
PLAN_FILE = "plan.json"
PREDICTED_FILE = "predicted.json"
REF_FILE = "ref.json"  # the backend's JobRef, also stored in the job row
LOG_TAIL_LINES = 40
LOG_TAIL_BYTES = 8192
DIAGNOSIS_LOG_BYTES = 256 * 1024
UNSUBMITTED_GRACE_S = 120.0
#: completed jobs read for a machine's earlier host probes (newest first; as_ran keeps the last MACHINE_PROBES_KEPT)
MACHINE_JOBS_SCANNED = 200

# What get_job/list_jobs report: a stored state, or UNKNOWN while the backend cannot be asked (the
# stored state is then left as it was: a controller outage is not a job failure).
ReportedState = Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "UNKNOWN"]


# ---- request / response models -------------------------------------------------------------


class ProfileJobRequest(BaseModel):
    """A plan to run for a few steps and measure. Returns at once; poll with get_job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    plan: Plan = Field(description="The training plan to run (world size = cluster.num_gpus processes).")
    backend: BackendName = Field("local", description="'local' (this host, detached process), 'slurm' (sbatch/squeue/scancel on this host) or 'slurm_rest' (slurmrestd at $SLURM_REST_URL).")
    resources: JobResources = Field(default_factory=JobResources, description="Nodes, GPUs per node, wall-clock limit; slurm_* options for the Slurm backends.")
    name: str | None = Field(None, description="Job name (1-64 of A-Z a-z 0-9 _ . -); None = 'profile-<model>'.")
    warmup_steps: int = Field(3, ge=0, le=1000, description="Training steps run before timing starts (excluded from the figures).")
    measure_steps: int = Field(10, ge=1, le=10000, description="Timed training steps the figures average over.")
    profile_steps: tuple[int, int] | None = Field((3, 3), description="(first, last) iterations, numbered from 1 and inclusive, traced with torch.profiler into trace_rank0.json; they never count as measured. None = no trace.")
    seed: int = Field(1234, ge=0, le=2**31 - 1, description="Random seed for weights and mock data.")
    mode: Literal["profile", "memory_at_scale"] = Field("profile", description="'profile': the plan on cluster.num_gpus processes. 'memory_at_scale': one process (one GPU) plays `rank` of the plan's world through Megatron's --fake-process-group and reports that rank's memory after iteration 2, next to estimate_memory's figure for it.")
    rank: int | Literal["most_loaded"] = Field("most_loaded", description="memory_at_scale: the global rank to measure, or 'most_loaded' (the memory model's most-loaded pipeline stage).")
    record_memory_history: bool = Field(False, description="Megatron's --record-memory-history: a CUDA memory snapshot (memory_snapshot.pickle) with every allocation's stack.")
    dry_run: bool = Field(False, description="Return the exact command / batch script without creating a job.")


class PredictedFigures(BaseModel):
    """The four figures a profile job measures, as evaluate_plan predicted them at submit time."""

    model_config = ConfigDict(frozen=True)

    iteration_time_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu_causal: float | None = Field(None, description="Model TFLOP/s per GPU, causal convention (Megatron since 2025-03).")
    peak_allocated_gib: float | None = Field(None, description="Peak torch-allocated memory on the most-loaded rank, GiB.")


class JobSubmission(BaseModel):
    """What run_profile_job did (or, with dry_run, would do)."""

    model_config = ConfigDict(frozen=True)

    job_id: str | None = Field(description="Use with get_job / cancel_job; None for a dry run.")
    dry_run: bool
    backend: str
    state: JobStateName | None = Field(description="State right after submission; None for a dry run.")
    name: str
    job_dir: str = Field(description="Where the job writes spec.json, logs, result.json (for a dry run: where it would).")
    command: list[str] = Field(description="The exact argv that starts the job (local: the process; Slurm: the submit command).")
    command_line: str = Field(description="`command` as one shell-quoted line.")
    script: str | None = Field(None, description="The batch script (Slurm backends).")
    backend_job_id: str | None = Field(None, description="Local supervisor pid or Slurm job id.")
    nodes: int
    gpus_per_node: int
    use_gpus: bool = Field(description="False = CPU processes over gloo (no GPU visible to the local backend).")
    predicted: PredictedFigures | None = None
    warnings: list[Finding] = Field(default_factory=list, description="Validator warnings and launch notes; errors would have rejected the request.")


class FigureComparison(BaseModel):
    """Measured vs predicted for one figure."""

    model_config = ConfigDict(frozen=True)

    figure: Figure
    measured: float | None
    predicted: float | None
    error_pct: float | None = Field(description="(predicted - measured) / measured * 100: positive = the model over-predicts.")


class JobStatus(BaseModel):
    """A job's state, and once it ended its result, measured-vs-predicted figures or failure diagnosis."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    name: str
    backend: str
    backend_job_id: str | None
    state: ReportedState = Field(description="UNKNOWN: the backend did not answer just now (see error); last_known_state is the stored one.")
    last_known_state: JobStateName = Field(description="The state as last seen and stored.")
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    elapsed_s: float | None = Field(description="Run time so far (running) or in total (ended).")
    job_dir: str
    command_line: str
    exit_code: int | None
    error: str | None = Field(description="Why the job failed, timed out or was cancelled.")
    log_file: str | None = Field(description="The log the tail comes from.")
    log_tail: str | None = Field(description=f"Last <= {LOG_TAIL_LINES} lines of the training log.")
    stderr_tail: str | None = Field(None, description="Last lines of stderr (failed jobs).")
    result: dict[str, Any] | None = Field(description="The entry point's result.json.")
    predicted: PredictedFigures | None
    comparison: list[FigureComparison] = Field(default_factory=list)
    comparison_note: str | None = None
    memory_terms: list[dict[str, Any]] | None = Field(None, description="memory_at_scale: measured vs predicted per memory term for the measured rank (parameters, weights+gradients+optimizer, activations+temporaries, peak).")
    diagnosis: dict[str, Any] | None = Field(None, description="check_mfu's reading of a failed job's log (OOM, NCCL timeout, ...).")
    host_floor_ms_per_layer: float | None = Field(None, description="This machine's host speed as its jobs measured it: the median of this job's host probe and those of the jobs run on the same machine before it (ms to launch the reference layer). Pass it as cluster.host_floor_ms_per_layer to evaluate_plan, estimate or recommend_parallelism for plans on this machine; None without a Transformer Engine probe.")


class JobSummary(BaseModel):
    model_config = ConfigDict(frozen=True)

    job_id: str
    name: str
    backend: str
    state: ReportedState
    created_at: datetime
    ended_at: datetime | None
    num_gpus: int | None
    error: str | None


class JobList(BaseModel):
    model_config = ConfigDict(frozen=True)

    jobs: list[JobSummary]


# ---- the core's tools the job system calls ---------------------------------------------------


def _plan_findings(plan: Plan) -> list[Finding]:
    return list(validate(plan))


def _job_spec(plan: Plan, request: ProfileJobRequest) -> dict[str, Any]:
    return dict(
        job_spec(
            plan,
            warmup_steps=request.warmup_steps,
            measure_steps=request.measure_steps,
            profile_steps=request.profile_steps,
            seed=request.seed,
            mode=request.mode,
            rank=request.rank,
            record_memory_history=request.record_memory_history,
        )
    )


def _render_profile_script(plan: Plan, spec: dict[str, Any], artifact: JobArtifact) -> str | None:
    """render_launch_script's sbatch script for the profile target."""
    try:
        node_size = gpu(plan.cluster.gpu).gpus_per_node
    except KeyError:
        node_size = artifact.gpus_per_node
    r = artifact.resources
    rendered = render_launch_script(RenderRequest(
        plan=plan, target="profile", launcher="slurm", nodes=artifact.nodes, gpus_per_node=artifact.gpus_per_node,
        time_limit_min=r.slurm_time_limit_min, job_name=artifact.name, run_dir=str(artifact.job_dir),
        python_executable=artifact.python, slurm_account=r.slurm_account, slurm_partition=r.slurm_partition,
        slurm_log_dir=str(artifact.job_dir),
        # Whole nodes when the job fills them: a profile must not share NVLink, NICs or host memory.
        slurm_exclusive=artifact.gpus_per_node >= node_size,
        profile_spec=spec, extra_env={JOB_ENV_MARKER: artifact.job_id},
        invocation=f"run_profile_job(backend=slurm, job_id={artifact.job_id})",
    ))
    return rendered.script


def _predict(plan: Plan) -> dict[str, Any] | None:
    """evaluate_plan's answer at submit time (None where the core cannot evaluate the plan)."""
    try:
        return evaluate_plan(plan).model_dump(mode="json")
    except (ValueError, KeyError) as exc:
        log.info("no prediction for this plan: %s", exc)
        return None


def _rounded(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


def _as_ran_prediction(plan: Mapping[str, Any], result: Mapping[str, Any] | None,
                       machine_probes: Sequence[float] = ()) -> tuple[PredictedFigures | None, str | None]:
    """Predicted figures for the plan as the job ran it (the entry's fall-backs from the plan: no Transformer
    Engine, no Apex, ...; the host its probe and `machine_probes` measured); (None, None) when it ran the plan
    as given."""
    if not result:
        return None, None
    try:
        ran = as_ran(Plan.model_validate(plan), result, machine_probes)
    except ValueError:
        return None, None
    if not ran.differences:
        return None, None
    try:
        perf = step_time(ran.plan)
        mem = memory_breakdown(ran.plan)
    except (ValueError, KeyError) as exc:
        log.info("no prediction for the plan as it ran: %s", exc)
        return None, None
    figures = PredictedFigures(iteration_time_s=perf.iteration_time_s, tokens_per_s_per_gpu=perf.tokens_per_s_per_gpu,
                               tflops_per_gpu_causal=perf.model_tflops_per_gpu_causal,
                               peak_allocated_gib=mem.peak_allocated_gib)
    return figures, "predicted for the plan as the job ran it: " + "; ".join(ran.differences)


def _at_scale_prediction(plan: Mapping[str, Any], result: Mapping[str, Any]) -> tuple[PredictedFigures, list[dict[str, Any]], str]:
    """estimate_memory's figures for the rank a memory_at_scale job measured (as_ran.rank_terms)."""
    try:
        peak, terms, note = rank_terms(Plan.model_validate(plan), result)
    except (ValueError, KeyError) as exc:
        return PredictedFigures(), [], f"no prediction for the measured rank: {exc}"
    return PredictedFigures(peak_allocated_gib=peak), terms, note


def _drop_plans(value: Any) -> Any:
    """Fix suggestions carry a whole changed plan each; the change line says the same in one row."""
    if isinstance(value, dict):
        return {k: _drop_plans(v) for k, v in value.items() if k != "plan"}
    if isinstance(value, list):
        return [_drop_plans(v) for v in value]
    return value


def _diagnose(plan: Mapping[str, Any], log_text: str) -> dict[str, Any] | None:
    """check_mfu's reading of a failed job's log and error (OOM cause and fixes, NCCL timeouts, ...)."""
    try:
        report = check_mfu(MfuRequest(plan=Plan.model_validate(plan), log_text=log_text))
    except Exception as exc:  # a diagnosis is a bonus: it must never break get_job
        log.warning("check_mfu could not diagnose the job log: %s: %s", type(exc).__name__, exc)
        return None
    dumped = report.model_dump(mode="json", include={"oom_diagnosis", "diagnosis", "findings", "notes"})
    return _drop_plans({k: v for k, v in dumped.items() if v}) or None


# ---- figures ---------------------------------------------------------------------------------

#: figure -> where evaluate_plan (physics/evaluate.py Evaluation) holds its prediction: (section, field)
PREDICTED_FIELDS: dict[str, tuple[str, str]] = {
    "iteration_time_s": ("performance", "iteration_time_s"),
    "tokens_per_s_per_gpu": ("performance", "tokens_per_s_per_gpu"),
    "tflops_per_gpu_causal": ("performance", "model_tflops_per_gpu_causal"),
    "peak_allocated_gib": ("memory", "peak_allocated_gib"),
}


GC_PAUSE_NOTE_FRACTION = 0.05
"""A garbage-collection pause inside a measured iteration worth naming: 5% of the median step."""


def _gc_note(result: Mapping[str, Any] | None, plan: Mapping[str, Any]) -> str | None:
    """Name the worst Python GC pause inside the measured iterations when it is large."""
    if not result:
        return None
    pauses = (result.get("host") or {}).get("gc_pause_s_per_iteration") or []
    kinds = result.get("iterations") or []
    step = result_contract.measured(result, "iteration_time_s")
    measured = [(i + 1, p) for i, (k, p) in enumerate(zip(kinds, pauses, strict=False))
                if k == "measure" and isinstance(p, int | float)]
    if not measured or not step:
        return None
    it, worst = max(measured, key=lambda x: x[1])
    if worst < GC_PAUSE_NOTE_FRACTION * step:
        return None
    if (plan.get("implementation") or {}).get("manual_gc"):
        return f"Python garbage collection paused iteration {it} for {worst:.3f} s ({worst / step:.0%} of the median step) despite manual_gc"
    return (f"Python garbage collection paused iteration {it} for {worst:.3f} s ({worst / step:.0%} of the median step): "
            "implementation.manual_gc (--manual-gc, with manual_gc_interval) runs collections at chosen steps instead")


def predicted_figures(predicted: Mapping[str, Any] | None) -> PredictedFigures | None:
    """The named figures of evaluate_plan's answer as stored at submit time (absent sections give None)."""
    if not predicted:
        return None
    values = {}
    for name, (section, key) in PREDICTED_FIELDS.items():
        v = (predicted.get(section) or {}).get(key)
        values[name] = float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None
    return PredictedFigures(**values)


def compare(result: Mapping[str, Any] | None, predicted: PredictedFigures | None) -> list[FigureComparison]:
    """Measured vs predicted per named figure: the measured one from result.json's contract
    (launcher/entry/result.py MEASURED), the predicted one from PREDICTED_FIELDS."""
    if not result:
        return []
    out = []
    for name in result_contract.MEASURED:
        measured = result_contract.measured(result, name)
        pred = getattr(predicted, name) if predicted is not None else None
        err = None
        if measured is not None and pred is not None and measured != 0:
            err = round((pred - measured) / measured * 100.0, 2)
        out.append(FigureComparison(figure=name, measured=measured, predicted=pred, error_pct=err))  # type: ignore[arg-type]
    return out


# ---- the manager -----------------------------------------------------------------------------

_NAME_CLEAN_RE = re.compile(r"[^A-Za-z0-9_.-]+")


def _default_name(plan: Plan) -> str:
    model = plan.model.name or "custom"
    name = "profile-" + _NAME_CLEAN_RE.sub("-", model).strip("-.")
    return name[:64]


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC) if value is not None else None


class JobManager:
    """Submits, refreshes and cancels jobs; the store is the only state it keeps."""

    def __init__(
        self,
        store: JobStore | None = None,
        *,
        backends: Mapping[str, Backend] | None = None,
        entry: Sequence[str] | None = None,
        job_root: Path | None = None,
        backend_factories: Mapping[str, Callable[[], Backend]] | None = None,
    ):
        """`entry` replaces `-m mcore_advisor.launcher.entry.profile` (tests run a fake entry script)."""
        self.store = store or JobStore()
        self.job_root = (job_root or self.store.state_dir / "jobs").resolve()
        self.entry = list(entry) if entry is not None else ["-m", ENTRY_MODULE]
        self._backends: dict[str, Backend] = dict(backends or {})
        self._factories: dict[str, Callable[[], Backend]] = {
            "local": LocalBackend,
            "slurm": _slurm_cli_backend,
            "slurm_rest": _slurm_rest_backend,
        }
        self._factories.update(backend_factories or {})
        self._lock = threading.Lock()

    def backend(self, name: str) -> Backend:
        with self._lock:
            if name not in self._backends:
                if name not in self._factories:
                    raise ValueError(f"backend: unknown backend {quote(name)}; use one of {', '.join(sorted(self._factories))}")
                self._backends[name] = self._factories[name]()
            return self._backends[name]

    # -- submit ------------------------------------------------------------------------------

    def submit(self, request: ProfileJobRequest) -> JobSubmission:
        plan = request.plan
        findings = _plan_findings(plan)
        errors = [f for f in findings if f.severity == "error"]
        if errors:
            parts = [f"{', '.join(f.fields) or 'plan'}: {f.message}" + (f" (fix: {f.fix})" if f.fix else "") for f in errors]
            raise ValueError("plan rejected, no job created: " + "; ".join(parts))
        warnings = [f for f in findings if f.severity != "error"]

        name = request.name if request.name is not None else _default_name(plan)
        check_job_name(name)
        # memory_at_scale is one process whatever the plan's world (a fake process group)
        nodes, gpus_per_node = (1, 1) if request.mode == "memory_at_scale" else resolve_layout(plan, request.resources)
        use_gpus = request.backend != "local" or local_gpu_count() > 0
        if not use_gpus:
            warnings.append(Finding(
                code="no_gpu_cpu_run", severity="warning", fields=["backend"],
                message=f"no GPU is visible on this host: the job runs {gpus_per_node} CPU process(es) over gloo; "
                "its times and memory are not GPU figures",
                fix="run on a GPU host or a Slurm backend to compare against the prediction",
            ))
        if request.backend == "local":
            busy = [r.job_id for r in self.store.list(states=ACTIVE_STATES, limit=1000) if r.backend == "local"]
            if busy:
                warnings.append(Finding(
                    code="local_jobs_running", severity="warning", fields=["backend"],
                    message=f"{len(busy)} other local job(s) still active ({', '.join(busy[:5])}): they share this "
                    "host's GPUs/CPUs, so the measured times and memory will be disturbed",
                    fix="wait for them (get_job) or cancel them (cancel_job) before profiling",
                ))
        backend = self.backend(request.backend)
        job_id = new_job_id()
        job_dir = self.job_root / job_id
        spec = _job_spec(plan, request)
        program = [*self.entry, "--spec", str(job_dir / SPEC_FILE), "--out-dir", str(job_dir)]
        # The entry sets the CUDA variables the plan implies (allocator, max connections) itself.
        env = {"PYTHONUNBUFFERED": "1"}
        artifact = JobArtifact(
            job_id=job_id, name=name, job_dir=job_dir, program=program, resources=request.resources,
            nodes=nodes, gpus_per_node=gpus_per_node, use_gpus=use_gpus, env=env,
        )
        if request.backend != "local" and self.entry == ["-m", ENTRY_MODULE] and request.mode == "profile":
            script = _render_profile_script(plan, spec, artifact)
            if script is not None:
                artifact = replace(artifact, script=script)
        backend.check(artifact)
        command, script = backend.launch_text(artifact)
        predicted = _predict(plan)
        figures = predicted_figures(predicted)
        common = dict(
            backend=request.backend, name=name, job_dir=str(job_dir), command=command,
            command_line=shlex.join(command), script=script, nodes=nodes, gpus_per_node=gpus_per_node,
            use_gpus=use_gpus, predicted=figures, warnings=warnings,
        )
        if request.dry_run:
            return JobSubmission(job_id=None, dry_run=True, state=None, **common)

        try:
            job_dir.mkdir(parents=True, mode=0o700)
            (job_dir / PLAN_FILE).write_text(plan.model_dump_json(indent=1))
            (job_dir / SPEC_FILE).write_text(json.dumps(spec, indent=1))
            if predicted is not None:
                (job_dir / PREDICTED_FILE).write_text(json.dumps(predicted, indent=1))
        except OSError as exc:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise BackendError(job_dir_error(job_dir, exc)) from exc
        record = record_from(
            job_id=job_id, name=name, backend=request.backend, job_dir=job_dir, command=command,
            plan=plan.model_dump(mode="json"), spec=spec, predicted=predicted,
            resources={**request.resources.model_dump(mode="json"), "nodes": nodes, "gpus_per_node": gpus_per_node, "use_gpus": use_gpus},
            paths={"spec": str(job_dir / SPEC_FILE), "result": str(job_dir / RESULT_FILE), "error": str(job_dir / ERROR_FILE),
                   "train_log": str(job_dir / TRAIN_LOG), "stdout": str(job_dir / STDOUT_FILE), "stderr": str(job_dir / STDERR_FILE)},
        )
        try:
            self.store.insert(record)
        except Exception:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise
        try:
            ref = backend.submit(artifact)
        except Exception as exc:
            # A submission the backend refused leaves no job behind: no row, no directory.
            self._forget(job_id, job_dir)
            if isinstance(exc, BackendError):
                raise
            if isinstance(exc, OSError):
                raise BackendError(job_dir_error(job_dir, exc)) from exc
            raise BackendError(f"backend {request.backend!r} could not start the job: {type(exc).__name__}: {exc}") from exc
        _write_ref(job_dir, ref)
        state: JobStateName = "RUNNING" if request.backend == "local" else "PENDING"
        now = time.time()
        try:
            rec = self.store.update(job_id, backend_ref=ref.model_dump(mode="json"), state=state,
                                    started_at=now if state == "RUNNING" else None)
        except StoreError as exc:
            raise StoreError(f"{exc}. Job {job_id} did start; it is picked up from {job_dir / REF_FILE} "
                             "once the store can be written (get_job, list_jobs or a server restart)") from exc
        return JobSubmission(job_id=job_id, dry_run=False, state=rec.state, backend_job_id=ref.native_id, **common)

    # -- refresh -----------------------------------------------------------------------------

    def _forget(self, job_id: str, job_dir: Path) -> None:
        try:
            self.store.delete(job_id)
        except StoreError as exc:  # the row stays without a backend ref: reattach_all fails it later
            log.warning("could not remove the row of unsubmitted job %s: %s", job_id, exc)
        shutil.rmtree(job_dir, ignore_errors=True)

    def _adopt_refs(self, records: Sequence[JobRecord]) -> list[JobRecord]:
        """Rows whose job started but whose backend ref never reached the store take it from ref.json."""
        out = []
        for rec in records:
            if rec.state in ACTIVE_STATES and not rec.backend_ref:
                ref = _read_ref(Path(rec.job_dir))
                if ref is not None:
                    rec = self.store.update(rec.job_id, only_if_active=True, backend_ref=ref.model_dump(mode="json"))
            out.append(rec)
        return out

    def refresh(self, records: Sequence[JobRecord]) -> list[JobRecord]:
        """Poll the backends for the active ones among `records`; returns the records as stored now."""
        return self._poll(records)[0]

    def _poll(self, records: Sequence[JobRecord]) -> tuple[list[JobRecord], dict[str, str]]:
        """(the records as stored now, {job_id: why its backend could not be asked}).

        A backend that cannot be asked (controller down, daemon unreachable, credentials refused)
        leaves its jobs' stored states alone; the reason is reported, never turned into FAILED.
        """
        records = self._adopt_refs(records)
        by_backend: dict[str, dict[str, JobRef]] = {}
        for rec in records:
            if rec.state in ACTIVE_STATES and rec.backend_ref:
                by_backend.setdefault(rec.backend, {})[rec.job_id] = JobRef.model_validate(rec.backend_ref)
        updated: dict[str, JobRecord] = {}
        unreachable: dict[str, str] = {}
        for backend_name, refs in by_backend.items():
            try:
                statuses = self.backend(backend_name).status(refs)
            except (BackendError, OSError) as exc:
                log.warning("cannot poll backend %s: %s", backend_name, exc)
                unreachable.update(dict.fromkeys(refs, str(exc)))
                continue
            for job_id, st in statuses.items():
                rec = next(r for r in records if r.job_id == job_id)
                updated[job_id] = self._apply(rec, st)
        return [updated.get(r.job_id, r) for r in records], unreachable

    def _apply(self, rec: JobRecord, st: BackendStatus) -> JobRecord:
        now = time.time()
        if st.state in ACTIVE_STATES:
            if st.state == rec.state:
                return rec
            fields: dict[str, Any] = {}
            if st.state == "RUNNING" and rec.started_at is None:
                fields["started_at"] = st.started_at or now
            return self.store.transition(rec.job_id, st.state, **fields)
        outcome = read_outcome(Path(rec.job_dir))
        state: str = st.state
        error = st.reason
        result = outcome.result if outcome else None
        if st.state == "COMPLETED":
            if outcome is None:
                state, error = "FAILED", "the job exited with code 0 but wrote no result.json (see the log tail)"
            elif outcome.state == "FAILED":
                state, error = "FAILED", outcome.error
        elif st.state == "FAILED":
            if outcome is not None and outcome.state == "COMPLETED" and st.lost:
                state, error = "COMPLETED", None  # the result is complete; only the exit record is missing
            elif outcome is not None and outcome.error:
                error = outcome.error if not st.reason else f"{outcome.error} [{st.reason}]"
        diagnosis = self._diagnosis(rec, error) if state == "FAILED" else None
        return self.store.transition(
            rec.job_id, state,
            started_at=rec.started_at or st.started_at,
            ended_at=st.ended_at or now,
            exit_code=st.exit_code,
            error=error,
            result=result,
            diagnosis=diagnosis,
        )

    @staticmethod
    def _diagnosis(rec: JobRecord, error: str | None) -> dict[str, Any] | None:
        """Run once, when the job is seen failed; stored with the job."""
        job_dir = Path(rec.job_dir)
        parts = [
            tail_text(job_dir / TRAIN_LOG, max_lines=2000, max_bytes=DIAGNOSIS_LOG_BYTES),
            tail_text(job_dir / STDERR_FILE, max_lines=2000, max_bytes=DIAGNOSIS_LOG_BYTES),
            error,
        ]
        text = "\n".join(p for p in parts if p)
        return _diagnose(rec.plan, text) if text else None

    # -- read --------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobStatus:
        rec = self.store.get(job_id)
        unreachable: dict[str, str] = {}
        if rec.state in ACTIVE_STATES:
            [rec], unreachable = self._poll([rec])
        return self._status(rec, unreachable.get(rec.job_id))

    def list(self, state: str | None = None, limit: int = 20) -> JobList:
        if state is not None and state not in JOB_STATES:
            raise ValueError(f"state: unknown job state {quote(state)}; use one of {', '.join(JOB_STATES)}")
        if not 1 <= limit <= 1000:
            raise ValueError(f"limit: {quote(limit)} is out of range; use 1..1000")
        _, unreachable = self._poll(self.store.list(states=ACTIVE_STATES, limit=1000))
        return JobList(jobs=[self._summary(r, unreachable.get(r.job_id)) for r in self.store.list(state=state, limit=limit)])

    def cancel(self, job_id: str) -> JobStatus:
        rec = self.store.get(job_id)
        if rec.state in ACTIVE_STATES:
            rec = self.refresh([rec])[0]
        if rec.state in ACTIVE_STATES:
            if rec.backend_ref:
                self.backend(rec.backend).cancel(JobRef.model_validate(rec.backend_ref))
            self.store.transition(job_id, "CANCELLED", error="cancelled by request")
        return self._status(self.store.get(job_id))

    def reattach_all(self) -> list[JobSummary]:
        """Refresh every job the store thinks is active (call once at server start).

        Jobs still running stay attached; local jobs whose process vanished without an exit
        record or result become FAILED ("lost: process ... exited without result").
        """
        active = self._adopt_refs(self.store.list(states=ACTIVE_STATES, limit=100_000))
        now = time.time()
        for rec in active:
            # A row without a backend ref: a server stopped between recording and submitting the job.
            # The age guard leaves alone a submission another server process is making right now.
            if not rec.backend_ref and now - rec.created_at > UNSUBMITTED_GRACE_S:
                self.store.transition(rec.job_id, "FAILED", error="lost: the server stopped before the job was submitted")
        still_active = [r for r in self.store.list(states=ACTIVE_STATES, limit=100_000) if r.backend_ref]
        _, unreachable = self._poll(still_active)
        return [self._summary(self.store.get(r.job_id), unreachable.get(r.job_id)) for r in active]

    # -- views -------------------------------------------------------------------------------

    def _summary(self, rec: JobRecord, unreachable: str | None = None) -> JobSummary:
        return JobSummary(
            job_id=rec.job_id, name=rec.name, backend=rec.backend, state="UNKNOWN" if unreachable else rec.state,
            created_at=_ts(rec.created_at), ended_at=_ts(rec.ended_at),  # type: ignore[arg-type]
            num_gpus=(rec.plan.get("cluster") or {}).get("num_gpus"),
            error=_unreachable_error(rec, unreachable) if unreachable else rec.error,
        )

    def _machine_probes(self, rec: JobRecord) -> list[float]:
        """The host probes of the completed jobs that ran on rec's machine before it (as_ran.earlier_machine_probes)."""
        if machine_key(rec.result) is None:
            return []
        earlier = [r for r in self.store.list(state="COMPLETED", limit=MACHINE_JOBS_SCANNED) if r.created_at < rec.created_at]
        earlier.sort(key=lambda r: r.created_at)
        results = [r.result for r in earlier] + [rec.result]
        return earlier_machine_probes(results, [None] * len(results))[-1]

    def _status(self, rec: JobRecord, unreachable: str | None = None) -> JobStatus:
        job_dir = Path(rec.job_dir)
        log_file = None
        for candidate in (TRAIN_LOG, STDOUT_FILE, *sorted(p.name for p in job_dir.glob("slurm-*.out"))):
            if (job_dir / candidate).is_file() and (job_dir / candidate).stat().st_size > 0:
                log_file = job_dir / candidate
                break
        log_tail = tail_text(log_file, max_lines=LOG_TAIL_LINES, max_bytes=LOG_TAIL_BYTES) if log_file else None
        stderr_tail = None
        if rec.state == "FAILED":
            stderr_tail = tail_text(job_dir / STDERR_FILE, max_lines=LOG_TAIL_LINES, max_bytes=LOG_TAIL_BYTES)
        predicted = predicted_figures(rec.predicted)
        machine_probes = self._machine_probes(rec)
        ran_predicted, ran_note = _as_ran_prediction(rec.plan, rec.result, machine_probes)
        if ran_predicted is not None:
            predicted = ran_predicted
        terms = None
        if rec.result and rec.result.get("mode") == "memory_at_scale":
            predicted, terms, ran_note = _at_scale_prediction(rec.plan, rec.result)
        comparison = compare(rec.result, predicted)
        note = ran_note
        if rec.result and (not rec.resources.get("use_gpus", True) or result_contract.measured_on_cpu(rec.result)):
            note = (f"{note}; " if note else "") + (f"measured on CPU processes ({rec.result.get('device') or 'cpu'}), not on the plan's GPU: "
                    "the errors check the plumbing, not the model's accuracy")
        gc_note = _gc_note(rec.result, rec.plan)
        if gc_note:
            note = f"{note}; {gc_note}" if note else gc_note
        end = rec.ended_at or (time.time() if rec.state in ACTIVE_STATES else None)
        ref = rec.backend_ref or {}
        return JobStatus(
            job_id=rec.job_id, name=rec.name, backend=rec.backend, backend_job_id=ref.get("native_id"),
            state="UNKNOWN" if unreachable else rec.state, last_known_state=rec.state,
            created_at=_ts(rec.created_at), started_at=_ts(rec.started_at),  # type: ignore[arg-type]
            ended_at=_ts(rec.ended_at),
            elapsed_s=round(end - rec.started_at, 3) if (end is not None and rec.started_at is not None) else None,
            job_dir=rec.job_dir, command_line=shlex.join(rec.command), exit_code=rec.exit_code,
            error=_unreachable_error(rec, unreachable) if unreachable else rec.error,
            log_file=str(log_file) if log_file else None, log_tail=log_tail, stderr_tail=stderr_tail,
            result=rec.result, predicted=predicted, comparison=comparison, comparison_note=note, diagnosis=rec.diagnosis,
            memory_terms=terms, host_floor_ms_per_layer=_rounded(measured_host_floor_ms(rec.result, machine_probes)),
        )


def _write_ref(job_dir: Path, ref: JobRef) -> None:
    """The backend ref in the job directory too: the store may be unwritable right after a submit."""
    tmp = job_dir / f".{REF_FILE}.tmp"
    try:
        tmp.write_text(ref.model_dump_json())
        tmp.replace(job_dir / REF_FILE)
    except OSError as exc:
        log.warning("could not write %s: %s", job_dir / REF_FILE, exc)


def _read_ref(job_dir: Path) -> JobRef | None:
    try:
        data = read_json(job_dir / REF_FILE, 64 * 1024)
        return JobRef.model_validate(data) if data is not None else None
    except ValueError:  # too large or not a JobRef: not the one we wrote
        return None


def job_dir_error(job_dir: Path, exc: OSError) -> str:
    """What went wrong writing a job directory and what to do; no job was created."""
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free space there or set {STATE_DIR_ENV} to a directory on another disk"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"check its permissions and that the file system is not mounted read-only, or set {STATE_DIR_ENV} to a writable directory"
    else:
        fix = f"check the disk, or set {STATE_DIR_ENV} to another directory"
    return f"cannot write the job directory {job_dir} ({why}): {fix}; no job was created"


def _unreachable_error(rec: JobRecord, reason: str) -> str:
    return (f"state unknown: {reason}; the job was last seen {rec.state} and may still be running "
            "(nothing was changed); ask again with get_job")


def resolve_layout(plan: Plan, resources: JobResources) -> tuple[int, int]:
    """(nodes, gpus_per_node) so that nodes * gpus_per_node == cluster.num_gpus."""
    world = plan.cluster.num_gpus
    gpn = resources.gpus_per_node or plan.cluster.gpus_per_node
    if gpn is None:
        try:
            gpn = min(world, gpu(plan.cluster.gpu).gpus_per_node)
        except KeyError:
            gpn = min(world, 8)
    nodes = resources.nodes or -(-world // gpn)
    if nodes * gpn != world:
        field = "resources.nodes" if resources.nodes else "resources.gpus_per_node"
        raise ValueError(
            f"{field}: {nodes} node(s) x {gpn} GPU(s) per node = {nodes * gpn} processes, but cluster.num_gpus is "
            f"{world}; choose nodes and gpus_per_node whose product is {world}"
        )
    return nodes, gpn


def _slurm_cli_backend() -> Backend:
    from .backends.slurm_cli import SlurmCliBackend

    return SlurmCliBackend()


def _slurm_rest_backend() -> Backend:
    from .backends.slurm_rest import SlurmRestBackend

    return SlurmRestBackend.from_env()


# ---- module-level tool functions -------------------------------------------------------------

_manager: JobManager | None = None
_manager_lock = threading.Lock()


def default_manager() -> JobManager:
    """The process-wide manager on the default store ($MCORE_ADVISOR_STATE_DIR or the XDG state dir)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = JobManager()
        return _manager


def run_profile_job(request: ProfileJobRequest, *, manager: JobManager | None = None) -> JobSubmission:
    """Start a short profiled Megatron-Core run of the plan and return its job id at once.

    Validates the plan first (errors reject it and create no job). Poll with get_job; the result
    compares measured iteration time, tokens/s/GPU, TFLOP/s/GPU and peak memory with evaluate_plan's
    prediction. `dry_run=True` shows the exact command or batch script without starting anything.
    """
    return (manager or default_manager()).submit(request)


def get_job(job_id: str, *, manager: JobManager | None = None) -> JobStatus:
    """State, timestamps, log tail, result, measured-vs-predicted figures and failure diagnosis of a job."""
    return (manager or default_manager()).get(job_id)


def list_jobs(state: str | None = None, limit: int = 20, *, manager: JobManager | None = None) -> JobList:
    """Jobs newest first, optionally only those in one state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT)."""
    return (manager or default_manager()).list(state=state, limit=limit)


def cancel_job(job_id: str, *, manager: JobManager | None = None) -> JobStatus:
    """Stop a pending or running job (its state becomes CANCELLED); an ended job is returned unchanged."""
    return (manager or default_manager()).cancel(job_id)


def reattach_all(*, manager: JobManager | None = None) -> list[JobSummary]:
    """Re-attach to every job left active by a previous server process; call once at startup."""
    return (manager or default_manager()).reattach_all()


__all__ = [
    "FigureComparison", "JobList", "JobManager", "JobStatus", "JobSubmission", "JobSummary",
    "PredictedFigures", "ProfileJobRequest", "cancel_job", "default_manager", "get_job", "list_jobs",
    "reattach_all", "resolve_layout", "run_profile_job",
]
