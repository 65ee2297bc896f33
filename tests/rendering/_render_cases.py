"""Plans, hostile values and a fake-launcher sandbox shared by the render tests."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from mcore_advisor.launcher.spec import job_spec
from mcore_advisor.schemas import Plan

# Llama 3 8B (Llama 3 paper, Table 3: 32 layers, width 4096, FFN 14336, 32 heads, 8 KV heads, vocab 128K).
DENSE = Plan(model={"name": "llama3-8b"}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
             training={"seq_length": 8192, "global_batch_size": 128},
             parallelism={"tensor_model_parallel_size": 2, "sequence_parallel": True},
             implementation={"expandable_segments": True})
# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts, top-2) with experts over all 8 GPUs.
MOE = Plan(model={"name": "mixtral-8x7b"}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
           training={"seq_length": 4096, "global_batch_size": 64},
           parallelism={"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8,
                        "expert_tensor_parallel_size": 1, "sequence_parallel": True},
           implementation={"expandable_segments": True})
FP8 = Plan(model={"name": "llama3-8b"}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
           training={"seq_length": 8192, "global_batch_size": 128, "precision": "fp8", "fp8_param_gather": True},
           parallelism={"tensor_model_parallel_size": 2, "sequence_parallel": True, "tp_comm_overlap": True},
           implementation={"expandable_segments": True})
CP = Plan(model={"name": "llama3-8b"}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
          training={"seq_length": 32768, "global_batch_size": 16},
          parallelism={"tensor_model_parallel_size": 2, "context_parallel_size": 4, "sequence_parallel": True,
                       "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
          implementation={"expandable_segments": True})
PLANS = {"dense": DENSE, "moe": MOE, "fp8": FP8, "cp": CP}


def request_kwargs(plan: Plan, launcher: str, target: str) -> dict:
    """A render request for the matrix: Slurm spreads the 8 GPUs over 2 nodes."""
    kw: dict = {"plan": plan, "launcher": launcher, "target": target, "allow_invalid": True}
    if launcher == "slurm":
        kw |= {"gpus_per_node": 4, "slurm_partition": "batch", "slurm_account": "proj-1"}
    if target == "profile":
        kw["profile_spec"] = job_spec(plan)
    return kw


def marker_payloads(marker: Path) -> list[str]:
    """Strings that would create `marker` if any shell ever evaluated them."""
    m = str(marker)
    return [f"$(touch {m})", f"`touch {m}`", f"; touch {m} ;", f"' ; touch {m} ; '", f'" ; touch {m} ; "',
            f"&& touch {m}", f"| touch {m}", f"$({{touch,{m}}})"]


def hostile(marker: Path) -> str:
    """One value combining every payload with spaces, quotes and a glob."""
    return "x y " + " ".join(marker_payloads(marker)) + " * ? [a] {b,c} \\ $HOME ~"


_FAKE = """#!{python}
# Fake {name}: records its argv (and a few environment variables) as one JSON line, does nothing else.
import json, os, sys
rec = {{"prog": {name!r}, "argv": sys.argv[1:],
        "env": {{k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF",
                                               "SITE_SETTING", "NVTE_FLASH_ATTN", "SLURM_JWT", "MASTER_ADDR")}}}}
with open(os.environ["FAKE_ARGV_LOG"], "a") as f:
    f.write(json.dumps(rec) + "\\n")
"""

_FAKE_SCONTROL = """#!/bin/bash
# Fake scontrol: two nodes; node addresses are not their names (as on the emulated cluster).
case "$1 $2" in
  "show hostnames") printf 'gpu-a01\\ngpu-a02\\n' ;;
  "show node") echo "NodeName=$3 Arch=x86_64"; echo "   NodeAddr=10.1.2.3 NodeHostName=$3 Version=22.05.8" ;;
  *) exit 1 ;;
esac
"""


def make_fake_bin(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("torchrun", "python", "srun", "nsys"):
        p = directory / name
        p.write_text(_FAKE.format(python=sys.executable, name=name))
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    p = directory / "scontrol"
    p.write_text(_FAKE_SCONTROL)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return directory


def run_script(script: str, cwd: Path, fake_bin: Path, extra_env: dict[str, str] | None = None) -> list[dict]:
    """Run a rendered script with bash, fakes first on PATH; return the recorded launcher calls."""
    path = cwd / "script.sh"
    path.write_text(script)
    log = cwd / "argv.jsonl"
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "HOME": str(cwd), "FAKE_ARGV_LOG": str(log),
           "NVTE_FLASH_ATTN": "1", "SLURM_JWT": "token-from-the-submitter"}
    env |= extra_env or {}
    proc = subprocess.run(["bash", str(path)], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def slurm_job_env(nodes: int = 2) -> dict[str, str]:
    return {"SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_NNODES": str(nodes), "SLURM_JOB_ID": "777",
            "SLURM_NODEID": "0"}


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
