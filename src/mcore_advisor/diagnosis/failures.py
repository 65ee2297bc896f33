"""Diagnosis of a run that failed: an NCCL watchdog timeout, or a crash before any training step
(an import error, an argument Megatron's parser or validate_args rejects, a CUDA or NCCL error, a
killed process). Works from the log alone; a plan, when there is one, only adds detail (which of its
groups a collective of that size belongs to, and how big its tensors are). OOMs have their own
diagnosis (diagnose.oom).

Pure: no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.diagnosis.logparse import NcclTimeout, ParsedLog
from mcore_advisor.knowledge.models import resolve_model
from mcore_advisor.physics.anatomy import count_params
from mcore_advisor.schemas import Plan, parallel_dims

FailureKind = Literal["nccl_timeout", "import_error", "argument_error", "nccl_error", "cuda_error", "host_oom_kill",
                      "process_killed", "python_exception"]


class FailureDiagnosis(BaseModel):
    """What failed, why it usually does, what to check, and the fix."""

    model_config = ConfigDict(frozen=True)

    kind: FailureKind
    summary: str = Field(description="One sentence: what failed, where.")
    details: list[str] = Field(default_factory=list, description="What the log says about it (collective, size, group, ranks, exception).")
    likely_causes: list[str] = Field(default_factory=list, description="Most likely first.")
    checks: list[str] = Field(default_factory=list, description="What to look at to tell the causes apart.")
    fix: str | None = None


# ---------------------------------------------------------------------------------------------
# NCCL watchdog timeout
# ---------------------------------------------------------------------------------------------

def _size(numel: int | None) -> str:
    if numel is None:
        return "size not printed (torch < 2.3)"
    return f"{numel:,} elements ({numel * 2 / 2**20:,.1f} MiB in bf16, {numel * 4 / 2**20:,.1f} MiB in fp32)"


def _plan_match(plan: Plan, t: NcclTimeout) -> list[str]:
    """Which of the plan's tensors a collective of this element count could be (all on one rank)."""
    shape = resolve_model(plan.model)
    d = parallel_dims(plan)
    tr = plan.training
    b, s, h = tr.micro_batch_size, tr.seq_length // d.cp, shape.hidden_size
    n = t.numel_in
    out = [f"the plan's groups: TP {d.tp}, PP {d.pp}, CP {d.cp}, DP {d.dp}, EP {d.ep} on {d.world} GPUs"]
    if n is None:
        return out
    grads = count_params(shape, tr.seq_length) // (d.tp * d.pp)
    candidates = [
        (b * s * h, f"one micro-batch's activations (micro-batch {b} x seq {s} x hidden {h}): a TP all-reduce without "
                    "sequence parallelism, or a pipeline send/receive between stages"),
        (b * s * h // max(d.tp, 1), "one micro-batch's activations split over TP: a sequence-parallel all-gather / reduce-scatter shard"),
    ]
    hits = [why for size, why in candidates if size == n]
    if n == 1:
        hits.append("a scalar: the loss average, grad-norm or found-inf/NaN all-reduce of the optimizer step, or a "
                    "timer/straggler check; every rank reaches it once per step, so one rank was a whole step behind")
    elif not hits and n > 0.01 * grads:
        hits.append(f"gradient- or parameter-sized ({100 * n / grads:.0f}% of this rank's ~{grads / 1e6:,.0f}M parameters): a "
                    "data-parallel gradient bucket (reduce-scatter/all-reduce) or the distributed optimizer's parameter all-gather")
    out += [f"{n:,} elements matches {h}" for h in hits] or [f"{n:,} elements matches none of the plan's activation sizes"]
    return out


def nccl_timeout(parsed: ParsedLog, plan: Plan | None) -> FailureDiagnosis:
    t = parsed.nccl_timeouts[0] if parsed.nccl_timeouts else None
    ranks = sorted({x.rank for x in parsed.nccl_timeouts if x.rank is not None})
    details: list[str] = []
    if t is not None:
        details.append(f"collective {t.op_type} (SeqNum {t.seq_num}), {_size(t.numel_in)}"
                       + (f" in, {t.numel_out:,} out" if t.numel_out is not None and t.numel_out != t.numel_in else ""))
        details.append(f"timed out after {t.ran_for_ms or 0:,} ms against a {t.timeout_ms or 0:,} ms limit "
                       f"(TORCH_NCCL / init_process_group timeout); {parsed.num_nccl_timeouts} watchdog report(s) from "
                       f"rank(s) {', '.join(map(str, ranks)) or 'unknown'}")
    groups = sorted({st.process_group for st in parsed.nccl_work_status if st.process_group})
    for st in parsed.nccl_work_status[:4]:
        ahead = (st.last_enqueued or 0) - (st.failed_seq or 0)
        details.append(f"{st.process_group}, rank {st.rank} within that group: failed at work {st.failed_seq}, last completed "
                       f"{st.last_completed}, last enqueued {st.last_enqueued}"
                       + (f" (it had queued {ahead} more: it was waiting, not stuck itself)" if ahead > 0 else ""))
    if groups:
        details.append("process group(s): " + "; ".join(groups))
    if parsed.crash and parsed.crash.failed_rank is not None:
        details.append(f"torchrun's first observed failure: rank {parsed.crash.failed_rank}"
                       + (f" ({parsed.crash.signal})" if parsed.crash.signal else "")
                       + (f" on {parsed.crash.host}" if parsed.crash.host else ""))
    if plan is not None and t is not None:
        details += _plan_match(plan, t)
    early = t is not None and t.seq_num is not None and t.seq_num < 10
    causes = [
        "a rank stopped reaching this collective: it crashed, ran out of memory or hung elsewhere (data loader, a "
        "checkpoint write, an exception on one rank only) while the others waited in it; the ranks that did NOT "
        "report a timeout are the suspects",
        "a straggler: one rank slower than the whole timeout (a stalled filesystem read or checkpoint save, a GC "
        "pause, a throttled or failing GPU)",
        "the network: an InfiniBand/RoCE link or NIC down, or NCCL transport errors, so the collective never completes",
    ]
    if early:
        causes.insert(0, f"SeqNum {t.seq_num} is among the first collectives: ranks disagree from the start (a rank that "
                         "did not start or builds a different model/layout, mismatched world sizes, or a firewall "
                         "between nodes)")
    checks = [
        "the first error printed by ANY rank before the timeout (grep the logs of all ranks for 'Error', 'Traceback', "
        "'out of memory'): a rank that died first is the cause, the timeouts are the consequence",
        "which ranks did not print the watchdog message: map them to nodes (a single node points at its GPU or NIC)",
        "rerun with TORCH_NCCL_DESYNC_DEBUG=1 (names the rank that did not join) and NCCL_DEBUG=WARN; "
        "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 keeps a flight-recorder dump of the last collectives",
        "the fabric: ibstat / ibv_devinfo on the suspect nodes, nvidia-smi -q for Xid errors, dmesg",
    ]
    return FailureDiagnosis(
        kind="nccl_timeout",
        summary=(f"NCCL watchdog timeout: {t.op_type} SeqNum {t.seq_num} never completed on rank(s) "
                 f"{', '.join(map(str, ranks)) or '?'}" if t else "NCCL watchdog timeout"),
        details=details, likely_causes=causes, checks=checks,
        fix="find the rank that failed or fell behind first and fix that; raising the timeout only helps a genuine "
            "straggler (e.g. a long checkpoint save: --async-save, or a larger --distributed-timeout-minutes)",
    )


# ---------------------------------------------------------------------------------------------
# Crashes before (or without) a training step
# ---------------------------------------------------------------------------------------------

_RENAMED_FLAGS = {
    "--virtual-pipeline-model-parallel-size": "--num-virtual-stages-per-pipeline-rank (Megatron-LM >= 0.10)",
    "--use-flash-attn": "--attention-backend flash",
    "--hybrid-override-pattern": "--hybrid-layer-pattern",
}


def _argument_error(line: str) -> FailureDiagnosis:
    bad = [tok for tok in line.replace(",", " ").split() if tok.startswith("--")]
    renamed = [f"{f} -> {_RENAMED_FLAGS[f]}" for f in bad if f in _RENAMED_FLAGS]
    return FailureDiagnosis(
        kind="argument_error", summary="Megatron's argument parser rejected the command line: " + line.split("error: ", 1)[-1],
        details=[line] + ([f"renamed in this Megatron-LM: {', '.join(renamed)}"] if renamed else []),
        likely_causes=["a flag from another Megatron-LM release (renamed or removed), a typo, or a value outside the "
                       "flag's choices"],
        checks=["python pretrain_gpt.py --help | grep the flag, in the same checkout the job runs"],
        fix=("use " + "; ".join(renamed)) if renamed else
            "remove or rename the flag for this Megatron-LM version; render_launch_script writes flags Megatron-LM 0.19's parser accepts",
    )


def _exception(parsed: ParsedLog) -> FailureDiagnosis | None:
    c = parsed.crash
    if c is None or c.exception_type is None:
        return None
    where = f" in {c.raised_in}" if c.raised_in else ""
    text = f"{c.exception_type}: {c.exception_message}"
    short = c.exception_type.rsplit(".", 1)[-1]
    if short in ("ModuleNotFoundError", "ImportError"):
        return FailureDiagnosis(
            kind="import_error", summary=f"the job failed at import, before training: {text}", details=[text + where],
            likely_causes=["a package missing in the job's environment (Transformer Engine, Apex, flash-attn, the "
                           "megatron package itself on PYTHONPATH)",
                           "a Megatron-LM checkout and an installed megatron-core of different releases (a name that "
                           "moved or was renamed)"],
            checks=["python -c 'import megatron.core, transformer_engine; print(megatron.core.__version__)' inside the same "
                    "container/venv the job uses", "pip list | grep -i -E 'megatron|transformer|apex|flash'"],
            fix="install the missing package in the job's image, or check out the Megatron-LM release that matches the "
                "installed megatron-core (or run Megatron-LM's own megatron/ package, not a second copy)")
    if short == "AssertionError" and c.raised_in and "arguments.py" in c.raised_in:
        return FailureDiagnosis(
            kind="argument_error", summary=f"Megatron's validate_args rejected the flag combination: {c.exception_message}",
            details=[text + where], likely_causes=["two flags Megatron-LM does not allow together, or a size that does "
                                                   "not divide (heads by TP, layers by PP, batch by DP)"],
            checks=["the assertion's message names the flags; evaluate_plan reports the same rules with fixes"],
            fix="change the flags the message names (evaluate_plan on the plan lists Megatron's constraints with fixes)")
    return FailureDiagnosis(
        kind="python_exception", summary=f"the job raised {text}{where}", details=[text + where],
        likely_causes=["see the exception: it is the first one the training code raised (torchrun's ChildFailedError "
                       "only reports it)"],
        checks=["the full traceback of the first rank that failed (torchrun's 'Root Cause' names it)"],
        fix=None)


def _kill(parsed: ParsedLog) -> FailureDiagnosis | None:
    c = parsed.crash
    if "host_oom_kill" in parsed.error_lines or (c and c.signal and "SIGKILL" in c.signal):
        return FailureDiagnosis(
            kind="host_oom_kill", summary="a rank was killed with SIGKILL: the host's out-of-memory killer (or the scheduler) stopped it",
            details=[parsed.error_lines.get("host_oom_kill") or (c.signal if c else "")],
            likely_causes=["host (CPU) memory exhausted: data-loader workers x prefetch, pinned memory, checkpoint "
                           "staging, or many ranks per node loading a checkpoint at once",
                           "the scheduler's memory limit (Slurm --mem) or wall-clock limit"],
            checks=["dmesg | grep -i -E 'killed process|out of memory' on the node", "sacct -j JOBID -o JobID,State,MaxRSS,ReqMem"],
            fix="fewer --num-workers, a smaller prefetch, or more host memory per task (Slurm --mem=0 takes the whole node)")
    if c and c.signal:
        return FailureDiagnosis(
            kind="process_killed", summary=f"rank {c.failed_rank} died with {c.signal}"
            + (f" on {c.host}" if c.host else ""), details=[c.signal],
            likely_causes=["SIGABRT: a C++ exception or the NCCL watchdog taking the process down (look for an NCCL or "
                           "CUDA error above)", "SIGSEGV: a native crash in an extension (TE, Apex, NCCL)"],
            checks=["the lines just before the signal on that rank"], fix=None)
    return None


def crash(parsed: ParsedLog) -> FailureDiagnosis | None:
    """The failure a log without training lines (or ending in one) shows, most specific first."""
    if parsed.crash and parsed.crash.argparse_error:
        return _argument_error(parsed.crash.argparse_error)
    exc = _exception(parsed)
    if exc is not None and exc.kind in ("import_error", "argument_error"):
        return exc
    if "nccl_error" in parsed.error_lines:
        line = parsed.error_lines["nccl_error"]
        return FailureDiagnosis(
            kind="nccl_error", summary="NCCL reported an error: " + line, details=[line],
            likely_causes=["a network fault (IB link, NIC, RoCE config)", "a CUDA error on one GPU surfacing inside NCCL "
                                                                           "(ncclUnhandledCudaError)", "mismatched NCCL versions or environment between nodes"],
            checks=["NCCL_DEBUG=WARN output of every rank", "ibstat, nvidia-smi -q (Xid errors)", "the same NCCL_* environment on every node"],
            fix="fix the link or node NCCL_DEBUG points at; exclude the node and resubmit")
    if "cuda_error" in parsed.error_lines:
        line = parsed.error_lines["cuda_error"]
        return FailureDiagnosis(
            kind="cuda_error", summary="a CUDA error: " + line, details=[line],
            likely_causes=["a faulty GPU (Xid errors)", "an illegal memory access in a kernel (a bug or an unsupported shape)"],
            checks=["nvidia-smi -q -d ECC,PAGE_RETIREMENT and dmesg for Xid on that node",
                    "rerun with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel"],
            fix="drain the node if it shows Xid/ECC errors; otherwise report the kernel CUDA_LAUNCH_BLOCKING names")
    return _kill(parsed) or exc


__all__ = ["FailureDiagnosis", "crash", "nccl_timeout"]
