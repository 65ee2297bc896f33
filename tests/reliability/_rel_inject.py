"""Shell, scheduler and path injection through every string that reaches a script, sbatch or a path.

Each payload tries to create a canary file. A payload is either rejected with an error that names
the field, or accepted; an accepted one is rendered into a script (render_launch_script) or
submitted through a stand-in sbatch (run_profile_job on the Slurm backend), and that script is run
under bash with stand-ins for torchrun/srun/sbatch/scontrol/python/nsys that only record their
argv. `executed` counts canaries that appeared: it must stay 0. An accepted value must also arrive
intact (never split, expanded or globbed) and must not add #SBATCH directives.
Used by tests/reliability/test_injection.py and benchmarks/reliability.py.
"""

from __future__ import annotations

import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STANDINS = ("torchrun", "srun", "sbatch", "scontrol", "python", "python3", "nsys", "scancel", "squeue", "sacct")
# Records its argv (fields end with US, the call with RS: no payload holds those bytes) and does nothing else.
STANDIN = """#!/bin/bash
printf '%s\\037' "${0##*/}" "$@" >> "$ARGV_LOG"
printf '\\036' >> "$ARGV_LOG"
case "${0##*/}" in
  scontrol) if [ "${1:-}" = show ] && [ "${2:-}" = hostnames ]; then echo node1; else echo "NodeName=node1 NodeAddr=127.0.0.1"; fi ;;
  sbatch) echo 4242 ;;
esac
exit 0
"""


def payloads(canary: Path) -> list[str]:
    """Each tries to run `touch CANARY` (or to become an option or escape a directory)."""
    c = str(canary)
    return [
        f"; touch {c}", f"$(touch {c})", f"`touch {c}`", f"x' ; touch {c} ; '", f'x" ; touch {c} ; "',
        f"x\ntouch {c}\n", f"x\r\ntouch {c}", f"--wrap=touch {c}", f"-o{c}", f"x && touch {c} #", f"x | touch {c}",
        f"$'\\x3b' touch {c}", f"x\n#SBATCH --wrap=touch {c}", "../../../../../tmp/escape", f"{canary.parent}/abs dir/*",
    ]


@dataclass
class InjectionReport:
    tried: int = 0
    rejected: int = 0
    rendered: int = 0
    scripts_run: int = 0
    intact: int = 0  # accepted values seen whole inside one argv element of the launcher
    executed: int = 0
    baseline_submitted: bool = False
    problems: list[str] = field(default_factory=list)


# Fields whose value becomes (part of) one argument of srun/torchrun/python when the script runs.
ARGV_FIELDS = {"run_dir", "megatron_lm_dir", "pretrain_script", "python_executable", "data_path", "tokenizer_model",
               "save_dir", "load_dir", "container_image", "container_mounts", "extra_args"}
LAUNCHERS = {"srun", "torchrun", "python", "python3", "nsys"}


def make_standins(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in STANDINS:
        path = bin_dir / name
        path.write_text(STANDIN)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def run_script(script: str, work: Path, bin_dir: Path, argv_log: Path) -> subprocess.CompletedProcess[str]:
    """bash -n, then bash with only the stand-ins (and coreutils) on PATH, in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "script.sh"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        return check
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(work), "ARGV_LOG": str(argv_log), "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_PROCID": "0", "LANG": "C.UTF-8"}
    return subprocess.run(["bash", str(path)], cwd=work, env=env, capture_output=True, text=True, timeout=60)


def recorded_argv(argv_log: Path) -> list[list[str]]:
    try:
        text = argv_log.read_text()
    except OSError:
        return []
    return [call.split("\x1f")[:-1] for call in text.split("\x1e") if call]


def sbatch_directives(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def error_names_field(text: str, field_name: str) -> bool:
    leaf = field_name.rsplit(".", 1)[-1]
    return leaf in text


# ---- the cases ------------------------------------------------------------------------------------------

PLAN = {"model": {"name": "llama3-8b"}, "cluster": {"num_gpus": 8}, "training": {"seq_length": 4096, "global_batch_size": 64},
        "parallelism": {"tensor_model_parallel_size": 2}}
SHAPE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256}
TINY = {"model": SHAPE, "cluster": {"num_gpus": 1}, "training": {"seq_length": 64, "global_batch_size": 4, "micro_batch_size": 2},
        "parallelism": {}, "implementation": {"transformer_impl": "local"}}


def render_cases(p: str) -> list[tuple[str, dict[str, Any]]]:
    """(field, render_launch_script arguments) for every string option that reaches the script."""
    slurm = {"plan": PLAN, "launcher": "slurm"}
    data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "gpt2"}
    return [
        ("job_name", {**slurm, "job_name": p}),
        ("run_dir", {**slurm, "options": {"run_dir": p}}),
        ("run_dir", {"plan": PLAN, "target": "profile", "options": {"run_dir": p}}),
        ("script_name", {**slurm, "options": {"script_name": p}}),
        ("megatron_lm_dir", {**slurm, "options": {"megatron_lm_dir": p}}),
        ("pretrain_script", {"plan": PLAN, "options": {"pretrain_script": p}}),
        ("python_executable", {**slurm, "options": {"python_executable": p}}),
        ("torchrun_executable", {"plan": PLAN, "options": {"torchrun_executable": p}}),
        ("data_path", {"plan": PLAN, "options": {"data_path": [p], **data}}),
        ("tokenizer_model", {"plan": PLAN, "options": {"data_path": ["/data/x_text_document"], "tokenizer_type": "HuggingFaceTokenizer",
                                                      "tokenizer_model": p}}),
        ("save_dir", {"plan": PLAN, "options": {"save_dir": p}}),
        ("load_dir", {**slurm, "options": {"load_dir": p}}),
        ("container_image", {**slurm, "container_image": p}),
        ("container_mounts", {**slurm, "container_image": "nvcr.io#nvidia/pytorch:25.01-py3", "options": {"container_mounts": [p]}}),
        ("slurm_account", {**slurm, "options": {"slurm_account": p}}),
        ("slurm_partition", {**slurm, "options": {"slurm_partition": p}}),
        ("slurm_log_dir", {**slurm, "options": {"slurm_log_dir": p}}),
        ("extra_args", {"plan": PLAN, "extra_args": ["--rotary-base", p]}),
        ("extra_args", {**slurm, "extra_args": [p]}),
        ("extra_env", {**slurm, "options": {"extra_env": {"NCCL_DEBUG": p}}}),
        ("extra_env", {"plan": PLAN, "options": {"extra_env": {p: "1"}}}),
        ("invocation", {**slurm, "options": {"invocation": p}}),
        ("model.name", {"plan": {**PLAN, "model": {**SHAPE, "name": p}}, "launcher": "slurm"}),
    ]


def job_cases(p: str) -> list[tuple[str, dict[str, Any]]]:
    """(field, run_profile_job arguments): the Slurm backend really submits (through the stand-in sbatch)."""
    slurm = {"plan": TINY, "backend": "slurm"}
    return [
        ("name", {**slurm, "name": p}),
        ("name", {"plan": TINY, "backend": "local", "name": p, "dry_run": True}),
        ("resources.slurm_partition", {**slurm, "options": {"resources": {"slurm_partition": p}}}),
        ("resources.slurm_account", {**slurm, "options": {"resources": {"slurm_account": p}}}),
        ("model.name", {**slurm, "plan": {**TINY, "model": {**SHAPE, "name": p}}}),
    ]


def _text(res: Any) -> str:
    return " ".join(getattr(c, "text", "") or "" for c in res.content)


async def run_injection(client: Any, sandbox: Path, bin_dir: Path, canary: Path, job_root: Path,
                        payload_list: list[str] | None = None) -> InjectionReport:
    """Every case with every payload; `executed` counts canaries that appeared."""
    report = InjectionReport()
    argv_log = sandbox / "argv.log"
    baseline: dict[str, int] = {}
    # A plain submission first: the stand-in sbatch takes it and its batch script runs (the path the payloads try).
    ok = await client.call_tool("run_profile_job", {"plan": TINY, "backend": "slurm", "name": "inject-baseline",
                                                   "options": {"resources": {"slurm_partition": "debug"}}})
    job_id = (ok.structured_content or {}).get("job_id")
    if ok.is_error or not job_id:
        report.problems.append(f"baseline submission failed: {_text(ok)[:300]}")
    else:
        proc = run_script((job_root / job_id / "job.sbatch").read_text(), sandbox / "baseline", bin_dir, argv_log)
        calls = recorded_argv(argv_log)
        report.baseline_submitted = proc.returncode == 0 and any(c[0] == "srun" for c in calls)
        if not report.baseline_submitted:
            report.problems.append(f"baseline batch script did not reach srun: {proc.stderr[-300:]}")
    for i, p in enumerate(payload_list or payloads(canary)):
        for j, (name, args) in enumerate(render_cases(p)):
            await _one(client, "render_launch_script", name, args, sandbox / f"r{i}-{j}", bin_dir, argv_log, canary, report, baseline)
        for j, (name, args) in enumerate(job_cases(p)):
            await _one(client, "run_profile_job", name, args, sandbox / f"j{i}-{j}", bin_dir, argv_log, canary, report, baseline,
                       job_root=job_root)
    return report


async def _one(client: Any, tool: str, name: str, args: dict[str, Any], work: Path, bin_dir: Path, argv_log: Path,
               canary: Path, report: InjectionReport, baseline: dict[str, int], job_root: Path | None = None) -> None:
    report.tried += 1
    res = await client.call_tool(tool, args)
    if res.is_error:
        report.rejected += 1
        if not error_names_field(_text(res), name):
            report.problems.append(f"{tool} {name}: rejection does not name the field: {_text(res)[:200]}")
        _check_canary(canary, report, f"{tool} {name} (rejected)")
        return
    report.rendered += 1
    data = res.structured_content or {}
    if tool == "render_launch_script":
        script = (data.get("full") or {}).get("script") or _text(res)
        if "#!/bin/bash" in script:
            script = script[script.index("#!/bin/bash"):]
        key = f"{args.get('launcher', 'torchrun')}-{args.get('target', 'megatron')}"
        directives = len(sbatch_directives(script))
        if args.get("launcher") == "slurm":
            base = baseline.setdefault(key + name, directives)
            if directives > base:
                report.problems.append(f"{tool} {name}: {directives - base} extra #SBATCH directive(s)")
    else:
        job_id = data.get("job_id")
        if job_id is None:  # a dry run: the command is an argv list, nothing to run
            _check_canary(canary, report, f"{tool} {name}")
            return
        script_path = (job_root or Path(".")) / job_id / "job.sbatch"
        script = script_path.read_text() if script_path.exists() else ""
        if not script:
            report.problems.append(f"{tool} {name}: accepted but no batch script at {script_path}")
            return
    argv_log.unlink(missing_ok=True)
    proc = run_script(script, work, bin_dir, argv_log)
    report.scripts_run += 1
    if "syntax error" in proc.stderr:
        report.problems.append(f"{tool} {name}: bash syntax error: {proc.stderr[-200:]}")
    _check_canary(canary, report, f"{tool} {name}")
    value = _value(args, name)
    if name in ARGV_FIELDS and value is not None:
        args_seen = [arg for call in recorded_argv(argv_log) if call and call[0] in LAUNCHERS for arg in call[1:]]
        whole = any(value in arg for arg in args_seen)
        # A piece of the value (its target path) in an argument that lacks the rest: it was split or expanded.
        piece = str(canary) if str(canary) in value else value.strip("./ *")
        if whole:
            report.intact += 1
        elif piece and any(piece in arg for arg in args_seen):
            report.problems.append(f"{tool} {name}: accepted value {value[:80]!r} reached a command split or altered")


def _value(args: dict[str, Any], name: str) -> str | None:
    """The payload a case put into `name`."""
    opts = args.get("options") or {}
    for source in (args, opts):
        v = source.get(name)
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and isinstance(v[-1], str):
            return v[-1]
    return None


def _check_canary(canary: Path, report: InjectionReport, where: str) -> None:
    if canary.exists():
        report.executed += 1
        report.problems.append(f"EXECUTED via {where}")
        canary.unlink()
