"""Rendered scripts against real launchers: a local Slurm 22.05 (scripts/slurm/up.sh) and torchrun on CPU.

Slurm tests (marker `slurm`) skip unless a cluster started by scripts/slurm/up.sh answers; the CPU runs
of the profile entry (marker `slow`) skip without torch + megatron-core.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _render_cases import DENSE

from mcore_advisor.launcher.spec import job_spec
from mcore_advisor.rendering.render import render_launch_script
from mcore_advisor.rendering.request import RenderRequest
from mcore_advisor.schemas import Plan

VENV_BIN = Path(sys.executable).parent
SLURM_RUN_DIR = Path(os.environ.get("SLURM_RUN_DIR", "/tmp/mcore-advisor-slurm"))

# A GPT small enough for two CPU processes: 2 layers, width 64, TP 2 (the profile entry's CPU path).
TINY = Plan(model={"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128, "swiglu": True,
                   "normalization": "RMSNorm", "add_bias_linear": False, "untie_embeddings_and_output_weights": True},
            cluster={"gpu": "h100-sxm", "num_gpus": 2},
            training={"seq_length": 64, "global_batch_size": 4, "micro_batch_size": 1},
            parallelism={"tensor_model_parallel_size": 2})


def _slurm_env() -> dict[str, str] | None:
    """Environment for Slurm's CLI, from the caller or from up.sh's env.sh; None when no cluster answers."""
    env = dict(os.environ)
    env_file = SLURM_RUN_DIR / "env.sh"
    if "SLURM_CONF" not in env and env_file.exists():
        for line in env_file.read_text().splitlines():
            m = re.match(r"export (\w+)=(.*)", line)
            if m:
                env[m.group(1)] = m.group(2)
    if "SLURM_CONF" not in env or shutil.which("sbatch") is None:
        return None
    ping = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True)
    return env if ping.returncode == 0 and "UP" in ping.stdout else None


@pytest.fixture(scope="module")
def slurm() -> dict[str, str]:
    env = _slurm_env()
    if env is None:
        pytest.skip("no local Slurm: run scripts/slurm/up.sh (as root) first")
    return env


def _needs_entry():
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("needs torch + megatron-core (the job extra)")
    if importlib.util.find_spec("mcore_advisor.launcher.entry.profile") is None:
        pytest.skip("the profile entry (launcher/entry/profile.py) is not there yet")


def _sbatch_wait(script: Path, cwd: Path, env: dict[str, str], timeout_s: float = 300) -> tuple[str, str]:
    """Submit, wait for the end, return (job id, final state)."""
    sub = subprocess.run(["sbatch", "--parsable", str(script)], cwd=cwd, env=env, capture_output=True, text=True)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
        m = re.search(r"JobState=(\w+)", out)
        state = m.group(1) if m else ""
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return job_id, state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env)
    pytest.fail(f"job {job_id} still {state} after {timeout_s} s")


# ---- Slurm ---------------------------------------------------------------------------------------

@pytest.mark.slurm
def test_rendered_sbatch_for_two_full_nodes_is_accepted_by_sbatch(slurm, tmp_path):
    plan = DENSE.model_copy(update={"cluster": DENSE.cluster.model_copy(update={"num_gpus": 16})})
    art = render_launch_script(RenderRequest(plan=plan, launcher="slurm", slurm_partition="debug",
                                             job_name="-J llama3 'tp2'; $(touch pwned) \"x\"", slurm_log_dir="log dir"))
    (tmp_path / "log dir").mkdir()
    (tmp_path / art.script_name).write_text(art.script)
    proc = subprocess.run(["sbatch", "--test-only", art.script_name], cwd=tmp_path, env=slurm,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stderr
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slurm
def test_sbatch_rejects_a_rendered_script_asking_for_more_nodes_than_exist(slurm, tmp_path):
    # The local cluster has 2 nodes x 8 GPUs; a 24-GPU plan needs 3.
    plan = DENSE.model_copy(update={"cluster": DENSE.cluster.model_copy(update={"num_gpus": 24})})
    art = render_launch_script(RenderRequest(plan=plan, launcher="slurm", allow_invalid=True))
    (tmp_path / "run.sbatch").write_text(art.script)
    proc = subprocess.run(["sbatch", "--test-only", "run.sbatch"], cwd=tmp_path, env=slurm, capture_output=True, text=True)
    assert proc.returncode != 0 and "node configuration is not available" in proc.stderr


_FAKE_PYTHON = """#!{python}
# Stands in for python on the Slurm nodes: records what one srun task was asked to run.
import json, os, sys
rec = {{"argv": sys.argv[1:], "nodeid": os.environ.get("SLURM_NODEID"), "procid": os.environ.get("SLURM_PROCID"),
        "master": os.environ.get("MASTER_ADDR"), "jwt": os.environ.get("SLURM_JWT"),
        "cdmc": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}}
with open(os.path.join(os.environ["FAKE_LOG_DIR"], "task-" + rec["procid"] + ".json"), "w") as f:
    json.dump(rec, f)
"""


# sbatch's #SBATCH reader has its own quoting (quotes of both kinds, backslash escapes, '#' comments).
EVIL_JOB_NAME = "evil 'name' \"dq\" back\\slash #hash; $(touch pwned) `touch pwned`"


@pytest.mark.slurm
def test_rendered_sbatch_runs_one_launcher_per_node_on_real_slurm(slurm, tmp_path):
    # The megatron target with python replaced by a recorder: real sbatch/srun/scontrol, 2 nodes.
    bindir = tmp_path / "fake bin"
    bindir.mkdir()
    fake = bindir / "python"
    fake.write_text(_FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    plan = DENSE.model_copy(update={"cluster": DENSE.cluster.model_copy(update={"num_gpus": 16})})
    art = render_launch_script(RenderRequest(
        plan=plan, launcher="slurm", slurm_partition="debug", time_limit_min=2, python_executable=str(fake),
        job_name=EVIL_JOB_NAME, slurm_log_dir="job logs", run_dir="out $(touch pwned)",
        megatron_lm_dir="/opt/Megatron LM; touch pwned", extra_args=["--wandb-exp-name", "a'b\"c $(touch pwned)"]))
    (tmp_path / "job logs").mkdir()
    (tmp_path / art.script_name).write_text(art.script)
    env = slurm | {"FAKE_LOG_DIR": str(tmp_path), "SLURM_JWT": slurm.get("SLURM_JWT", "x")}
    job_id, state = _sbatch_wait(tmp_path / art.script_name, tmp_path, env, timeout_s=120)
    log = tmp_path / "job logs" / f"{EVIL_JOB_NAME}-{job_id}.out"
    assert state == "COMPLETED", sorted(p.name for p in (tmp_path / "job logs").iterdir())
    assert log.exists()  # sbatch read the quoted job name and log directory literally
    assert not (tmp_path / "pwned").exists()
    tasks = sorted((json.loads(p.read_text()) for p in tmp_path.glob("task-*.json")), key=lambda r: r["nodeid"])
    assert [t["nodeid"] for t in tasks] == ["0", "1"]
    expected = ["-m", "torch.distributed.run", "--nproc_per_node", "8", "--nnodes", "2", "--rdzv_id", job_id,
                "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29500", *art.program, *art.program_args]
    for t in tasks:
        assert t["argv"] == expected
        assert (t["master"], t["jwt"], t["cdmc"]) == ("127.0.0.1", None, "1")


@pytest.mark.slurm
@pytest.mark.slow
def test_profile_entry_runs_on_cpu_through_a_rendered_sbatch(slurm, tmp_path):
    _needs_entry()
    spec = job_spec(TINY, warmup_steps=1, measure_steps=2, profile_steps=(1, 1))
    art = render_launch_script(RenderRequest(plan=TINY, target="profile", launcher="slurm", profile_spec=spec,
                                             python_executable=str(VENV_BIN / "python"), slurm_partition="debug",
                                             time_limit_min=5, run_dir="run 1", allow_invalid=True))
    (tmp_path / "logs").mkdir()
    (tmp_path / art.script_name).write_text(art.script)
    job_id, state = _sbatch_wait(tmp_path / art.script_name, tmp_path, slurm, timeout_s=300)
    out = (tmp_path / "logs" / f"{art.script.split('--job-name=')[1].split()[0]}-{job_id}.err")
    assert state == "COMPLETED", out.read_text()[-3000:] if out.exists() else state
    result = json.loads((tmp_path / "run 1" / "result.json").read_text())
    assert json.loads((tmp_path / "run 1" / "spec.json").read_text()) == spec
    assert result  # the entry's own tests check the figures; here: it ran to the end under srun


# ---- torchrun on CPU -----------------------------------------------------------------------------

@pytest.mark.slow
def test_rendered_torchrun_script_runs_the_profile_entry_on_cpu(tmp_path):
    _needs_entry()
    spec = job_spec(TINY, warmup_steps=1, measure_steps=2, profile_steps=(1, 1))
    art = render_launch_script(RenderRequest(plan=TINY, target="profile", profile_spec=spec, run_dir="out dir",
                                             torchrun_executable=str(VENV_BIN / "torchrun"), allow_invalid=True))
    (tmp_path / art.script_name).write_text(art.script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", art.script_name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out dir" / "result.json").exists()
    assert (tmp_path / "out dir" / "train.log").read_text().strip()


def test_slurm_bringup_scripts_pass_bash_and_shellcheck():
    scripts = sorted((Path(__file__).resolve().parents[2] / "scripts" / "slurm").glob("*.sh"))
    assert {p.name for p in scripts} >= {"up.sh", "down.sh"}
    for p in scripts:
        assert subprocess.run(["bash", "-n", str(p)]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (Debian: apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
