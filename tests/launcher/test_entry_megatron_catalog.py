"""Every catalog model's rendered argv, and recommend_parallelism's top plans for four large runs,
through megatron.training for one iteration on two CPU processes (issue 12: the rendered script
must train; issue 14: the profile job is Megatron's own loop).

Each argv is the one the profile job gets (launcher/spec.py job_spec: render_launch_script's
Megatron argv). The entry shrinks it for the CPU (entry/argv.py `shrink`, recorded in result.json):
size flags only (a couple of layers of hidden 64, seq 64, 2 micro-batches per data-parallel rank),
the layout fitted to 2 processes (TP, then PP, keep what fits; the expert grid likewise), and what
cannot run on a CPU without Transformer Engine: TE_ONLY_ON_CPU below. Hybrid Mamba models are left
out: rendering refuses them (no pretrain_gpt.py argv exists for them). Plans whose shrunk argvs
coincide run once. One torchrun of the entry's --batch mode runs them all (one import of torch and
megatron for the lot)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("megatron.training")

from mcore_advisor.knowledge.models import model_catalog, resolve_model  # noqa: E402
from mcore_advisor.launcher.entry import argv as A  # noqa: E402
from mcore_advisor.launcher.entry.trainlog import parse_iteration_line  # noqa: E402
from mcore_advisor.launcher.spec import job_spec  # noqa: E402
from mcore_advisor.schemas import ClusterSpec, ModelSpec, Plan  # noqa: E402
from mcore_advisor.tools.recommend import RecommendRequest, recommend_parallelism  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
WORLD = 2
#: recommend_parallelism's top plans the issues name: (model, GPUs, sequence length)
RECOMMENDED = (("llama3-70b", 64, 8192), ("llama3.1-405b", 1024, 8192), ("mixtral-8x22b", 256, 4096),
               ("deepseek-v3", 1024, 4096))
#: what the CPU run changes beyond sizes and layout, and why (the entry records each change)
TE_ONLY_ON_CPU = {
    "--transformer-impl": "Transformer Engine's layer spec: the CPU runs Megatron's local spec",
    "--moe-grouped-gemm": "TE's grouped GEMM: the local spec's experts are SequentialMLP",
    "--attention-backend": "TE's attention kernels",
    "--fp8-format": "FP8 GEMMs", "--fp8-recipe": "FP8 scaling", "--fp8-param-gather": "FP8 weights",
    "--tp-comm-overlap": "TE userbuffers",
    "--context-parallel-size": "Megatron's own attention asserts CP 1",
    "--disable-bias-linear": "added for biased MoE models: the local experts cannot add biases",
    "--qk-layernorm": "dropped for MLA without q_lora_rank: Megatron's local MLA spec refuses that query norm",
    "--sequence-parallel": "dropped where TP shrinks to 1 (Megatron turns it off)",
    "--num-virtual-stages-per-pipeline-rank": "dropped where PP shrinks to 1",
    "--decoder-first-pipeline-num-layers": "dropped where PP shrinks to 1",
    "--decoder-last-pipeline-num-layers": "dropped where PP shrinks to 1",
}


def _catalog_plan(key: str) -> Plan:
    """recommend_parallelism's top plan on the smallest of 8, 64, 512, 4096 H100s that holds it."""
    for gpus in (8, 64, 512, 4096):
        rec = recommend_parallelism(RecommendRequest(model={"name": key}, cluster=ClusterSpec(gpu="h100-sxm", num_gpus=gpus),
                                                     seq_length=4096, top_k=1, what_if=False))
        if rec.plans:
            return rec.plans[0].plan
    raise AssertionError(f"no plan for {key} on up to 4096 H100s")


def _gpt_models() -> list[str]:
    """The catalog's GPT models: hybrid Mamba models render pretrain_hybrid.py (Megatron's HybridModel),
    which the profile job's GPT model provider does not build, so job_spec refuses them."""
    return [key for key in model_catalog() if resolve_model(ModelSpec(name=key)).hybrid_layer_pattern is None]


def _plans() -> dict[str, Plan]:
    plans = {key: _catalog_plan(key) for key in _gpt_models()}
    for key, gpus, seq in RECOMMENDED:
        rec = recommend_parallelism(RecommendRequest(model={"name": key}, cluster=ClusterSpec(gpu="h100-sxm", num_gpus=gpus),
                                                     seq_length=seq, top_k=1, what_if=False))
        plans[f"recommended {key} on {gpus}"] = rec.plans[0].plan
    return plans


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    groups: dict[tuple[str, ...], list[str]] = {}
    jobs = []
    for name, plan in _plans().items():
        spec = job_spec(plan, warmup_steps=0, measure_steps=1, profile_steps=None)
        key = tuple(A.shrink(spec["megatron_argv"], WORLD)[0])
        if key not in groups:
            d = root / f"job{len(jobs):02d}"
            d.mkdir()
            (d / "spec.json").write_text(json.dumps(spec))
            jobs.append({"spec": str(d / "spec.json"), "out_dir": str(d / "out")})
        groups.setdefault(key, []).append(name)
    (root / "batch.json").write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port",
         str(29500 + os.getpid() % 300), "-m", "mcore_advisor.launcher.entry.profile", "--batch", str(root / "batch.json"),
         "--shrink", str(WORLD), "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=900)
    return proc, jobs, list(groups.values())


def test_every_catalog_model_and_the_recommended_plans_train_one_iteration_in_megatron(batch):
    proc, jobs, groups = batch
    failed = [(names, json.loads((Path(j["out_dir"]) / "error.json").read_text())["message"][:300])
              for j, names in zip(jobs, groups, strict=True) if (Path(j["out_dir"]) / "error.json").exists()]
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    assert {n for names in groups for n in names} >= set(_gpt_models())
    for j in jobs:
        r = json.loads((Path(j["out_dir"]) / "result.json").read_text())
        (line,) = [parse_iteration_line(x) for x in r["megatron"]["iteration_lines"]]
        assert line["iteration"] == 1 and line["skipped"] == 0 and line["nan"] == 0
        assert math.isfinite(line["lm_loss"]) and abs(line["lm_loss"] - math.log(256)) < 0.5  # vocab 256
        assert r["world_size"] == WORLD and r["megatron"]["memory_lines"]


def test_only_size_layout_and_listed_te_only_flags_change_on_the_cpu(batch):
    _, jobs, _ = batch
    size_flags = set(A.SMALL) | {"--num-layers", "--global-batch-size", "--moe-layer-freq", "--moe-router-topk",
                                 "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                 "--expert-model-parallel-size", "--expert-tensor-parallel-size"}
    seen = set()
    for j in jobs:
        r = json.loads((Path(j["out_dir"]) / "result.json").read_text())
        for a in r["argv_adjustments"]:
            seen.add(a["flag"])
            machine = a["flag"] in {"--distributed-backend", "--no-rope-fusion", "--no-persist-layer-norm",
                                    "--no-masked-softmax-fusion", "--num-workers"}
            assert a["flag"] in size_flags or a["flag"] in TE_ONLY_ON_CPU or machine, a
    # the catalog exercises the TE fallbacks, uneven pipelines and interleaving
    assert {"--transformer-impl", "--moe-grouped-gemm"} <= seen
    assert any("--decoder-first-pipeline-num-layers" in json.loads((Path(j["out_dir"]) / "result.json").read_text())["megatron_argv"]
               for j in jobs)
