"""The CLI: one subcommand per tool, readable tables by default, JSON with --json, clear errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mcore_advisor.cli import main

PLAN = {
    "model": {"name": "llama3-8b"},
    "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
    "training": {"seq_length": 8192, "global_batch_size": 64, "micro_batch_size": 1},
    "parallelism": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
}


@pytest.fixture
def plan_file(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(PLAN))
    return str(p)


def test_recommend_prints_a_ranked_table_and_its_json_plans_feed_evaluate(capsys, tmp_path):
    assert main(["recommend", "--model", "llama3-8b", "--gpus", "8", "--seq-length", "8192",
                 "--global-batch-size", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "tok/s/GPU" in out and "MFU" in out and "searched" in out
    assert main(["recommend", "--model", "llama3-8b", "--gpus", "8", "--seq-length", "8192",
                 "--global-batch-size", "64", "--top", "3", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert 1 <= len(rec["plans"]) <= 3
    best = tmp_path / "best.json"
    best.write_text(json.dumps(rec["plans"][0]["plan"]))
    assert main(["evaluate", str(best), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["feasible"] is True
    # the recommend figures are evaluate_plan's figures for the same plan
    assert ev["performance"]["tokens_per_s_per_gpu"] == pytest.approx(rec["plans"][0]["tokens_per_s_per_gpu"], rel=1e-9)


def test_evaluate_and_memory_print_breakdowns(capsys, plan_file):
    assert main(["evaluate", plan_file]) == 0
    out = capsys.readouterr().out
    assert "verdict: feasible" in out and "step-time term" in out
    assert main(["memory", plan_file]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "activations" in out and "fits" in out


def test_mfu_from_a_log_file(capsys, tmp_path, plan_file):
    log = tmp_path / "train.log"
    log.write_text(
        " [2026-11-21 23:59:01] iteration       10/     100 | consumed samples:          640 | elapsed time per "
        "iteration (ms): 4000.0 | throughput per GPU (TFLOP/s/GPU): 400.0 | learning rate: 3.000000E-04 | "
        "global batch size:    64 | lm loss: 7.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |\n"
    )
    assert main(["mfu", "--log", str(log), "--plan", plan_file, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    body = json.dumps(rep)
    assert "989.4" in body  # the dense BF16 peak is the denominator


def test_render_slurm_script_to_stdout(capsys, plan_file):
    assert main(["render", plan_file, "--launcher", "slurm", "--nodes", "1", "--job-name", "llama8b"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash") and "#SBATCH" in script and "--tensor-model-parallel-size 2" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # --target names the program; the old '--target slurm' still means the launcher, and says so
    assert main(["render", plan_file, "--target", "slurm", "--nodes", "1", "--job-name", "llama8b"]) == 0
    out = capsys.readouterr()
    assert out.out == script and "read as --launcher slurm" in out.err
    assert main(["render", plan_file, "--target", "profile"]) == 0
    assert "mcore_advisor.launcher.entry.profile" in capsys.readouterr().out


def test_render_help_says_what_launcher_and_target_do(capsys):
    with pytest.raises(SystemExit):
        main(["render", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--launcher {torchrun,slurm}" in text and "torchrun on every node via srun" in text
    assert "megatron = Megatron-LM pretrain_gpt.py, profile = the profile job" in text


def test_profile_dry_run_creates_no_job(capsys, plan_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MCORE_ADVISOR_STATE_DIR", str(tmp_path / "state"))
    assert main(["profile", plan_file, "--dry-run", "--json"]) == 0
    assert "mcore_advisor.launcher.entry.profile" in capsys.readouterr().out


def test_catalogs_list_gpus_and_models(capsys):
    assert main(["gpus"]) == 0
    assert "989.4" in capsys.readouterr().out
    assert main(["models", "--json"]) == 0
    keys = [m["key"] for m in json.loads(capsys.readouterr().out)]
    assert "llama3-70b" in keys and "deepseek-v3" in keys


def test_bad_input_exits_2_with_the_field_and_no_traceback(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**PLAN, "cluster": {"num_gpus": "lots"}}))
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "num_gpus" in err and "Traceback" not in err
    # one line per field with the allowed range and an example, never pydantic's own wording
    assert "cluster.num_gpus: not an integer (got 'lots'); allowed: integer >= 1 and <= 1048576; e.g. num_gpus=8" in err
    assert "validation error for" not in err and "Input should be" not in err
    assert main(["recommend", "--model", "llama-9000", "--gpus", "8"]) == 2
    assert "llama3" in capsys.readouterr().err
    notjson = tmp_path / "x.json"
    notjson.write_text("{nope")
    assert main(["memory", str(notjson)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_recommend_takes_the_mcp_tools_inputs(capsys, tmp_path):
    assert main(["recommend", "--model", "llama3-8b", "--gpus", "16", "--seq-length", "8192", "--global-batch-size", "64",
                 "--tp", "4", "--recompute", "none", "--top", "2", "--no-what-if", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["plans"] and rec["what_if"] == []
    for p in rec["plans"]:
        assert p["plan"]["parallelism"]["tensor_model_parallel_size"] == 4
        assert p["plan"]["parallelism"]["recompute_granularity"] is None
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"model": {"name": "llama3-8b"}, "cluster": {"num_gpus": 16}, "seq_length": 8192,
                               "fixed": {"pipeline_model_parallel_size": 2}, "what_if": False}))
    assert main(["recommend", "--request", str(req), "--top", "1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]["plan"]
    assert best["parallelism"]["pipeline_model_parallel_size"] == 2
    assert main(["recommend", "--model", "llama3-8b", "--gpus", "8", "--tp", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcore-advisor recommend: tp: too small (got 0); allowed: integer >= 1")


def test_png_options_write_charts(capsys, tmp_path, plan_file):
    from PIL import Image

    out = tmp_path / "mem.png"
    assert main(["memory", plan_file, "--png", str(out)]) == 0
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (900, 500)
    assert main(["evaluate", plan_file, "--png", str(tmp_path / "step.png")]) == 0
    assert (tmp_path / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pp = tmp_path / "pp.json"
    pp.write_text(json.dumps({**PLAN, "parallelism": {"pipeline_model_parallel_size": 4}}))
    assert main(["chart", "pipeline", str(pp), "--png", str(tmp_path / "pipe.png")]) == 0
    assert (tmp_path / "pipe.png").stat().st_size > 5000
    assert main(["chart", "pipeline", plan_file, "--png", str(tmp_path / "none.png")]) == 2
    assert "pp=1" in capsys.readouterr().err


def test_http_server_refuses_a_public_address_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("MCORE_ADVISOR_TOKEN", raising=False)
    assert main(["serve", "--http", "--host", "0.0.0.0"]) == 2
    assert "bearer token" in capsys.readouterr().err


LOGS = Path(__file__).resolve().parent / "fixtures" / "logs"


def test_mfu_takes_model_gpus_and_seq_length_for_a_log_without_arguments(capsys):
    bridge = str(LOGS / "bridge_llama3_8b_config_summary.log")
    assert main(["mfu", "--log", bridge]) == 2
    err = capsys.readouterr().err
    assert "num_gpus" in err and "Traceback" not in err
    assert main(["mfu", "--log", bridge, "--gpus", "16", "--seq-length", "4096", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["plan_source"] == "log_config" and rep["plan"]["cluster"]["num_gpus"] == 16
    assert rep["plan"]["training"]["seq_length"] == 4096 and rep["plan"]["parallelism"]["context_parallel_size"] == 2
    assert rep["tokens_per_s_per_gpu"] == pytest.approx(128 * 4096 / (16 * rep["iteration_time_s"]), rel=1e-9)
    # a crash log: the model and GPU count give the NCCL diagnosis the job's process groups
    nccl = str(LOGS / "nccl_timeout_only_failing_rank_stderr.log")
    assert main(["mfu", "--log", nccl, "--model", "llama3-8b", "--gpus", "8", "--seq-length", "8192"]) == 0
    out = capsys.readouterr().out
    assert "FAILED (nccl_timeout)" in out and "the plan's groups: TP 1, PP 1, CP 1, DP 8, EP 1 on 8 GPUs" in out


def test_hf_config_files_stand_in_for_a_catalog_model(capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "knowledge"))
    from _hf_configs import LLAMA_3_1_8B, NEMOTRON_H_8B

    llama, nemotron = tmp_path / "llama.json", tmp_path / "nemotron_h.json"
    llama.write_text(json.dumps(LLAMA_3_1_8B, indent=2))
    nemotron.write_text(json.dumps(NEMOTRON_H_8B, indent=2))
    common = ["--gpus", "8", "--seq-length", "8192", "--global-batch-size", "64", "--top", "1", "--no-what-if", "--json"]
    assert main(["recommend", "--hf-config", str(llama), *common]) == 0
    by_config = json.loads(capsys.readouterr().out)["plans"][0]
    assert main(["recommend", "--model", "llama3.1-8b", *common]) == 0
    by_name = json.loads(capsys.readouterr().out)["plans"][0]
    assert by_config["layout"] == by_name["layout"]
    assert by_config["tokens_per_s_per_gpu"] == pytest.approx(by_name["tokens_per_s_per_gpu"], rel=1e-12)
    # evaluate / memory: the config replaces the plan file's model (and says so)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**PLAN, "model": {"name": "nemotron-h-8b"}}))
    assert main(["memory", str(plan), "--json"]) == 0
    catalog = json.loads(capsys.readouterr().out)["breakdown"]
    assert main(["memory", str(plan), "--hf-config", str(nemotron), "--json"]) == 0
    out = capsys.readouterr()
    assert "replaces the plan's model" in out.err
    imported = json.loads(out.out)["breakdown"]
    assert imported["weights_gib"] == pytest.approx(8_100_852_736 * 2 / 2 / 2**30, rel=1e-3)  # BF16 over TP 2
    assert imported["total_gib"] == catalog["total_gib"]
    assert main(["evaluate", str(plan), "--hf-config", str(nemotron)]) == 0
    assert "verdict: feasible" in capsys.readouterr().out
    # errors name the option, exit 2, no traceback
    assert main(["recommend", "--model", "llama3-8b", "--hf-config", str(llama), "--gpus", "8"]) == 2
    assert "model, hf_config: both given" in capsys.readouterr().err
    assert main(["memory", str(plan), "--hf-config", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "--hf-config" in err and "missing.json" in err and "Traceback" not in err
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    assert main(["evaluate", str(plan), "--hf-config", str(broken)]) == 2
    assert "hf_config is not valid JSON" in capsys.readouterr().err
    assert main(["recommend", "--gpus", "8"]) == 2
    assert "--model (or --hf-config)" in capsys.readouterr().err
