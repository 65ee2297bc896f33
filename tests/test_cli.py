"""The CLI: one subcommand per tool, readable tables by default, JSON with --json, clear errors."""

from __future__ import annotations

import json
import subprocess

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
    assert "feasible: True" in out and "step-time term" in out
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
    assert main(["render", plan_file, "--target", "slurm", "--nodes", "1", "--job-name", "llama8b"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash") and "#SBATCH" in script and "--tensor-model-parallel-size 2" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


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
    assert main(["recommend", "--model", "llama-9000", "--gpus", "8"]) == 2
    assert "llama3" in capsys.readouterr().err
    notjson = tmp_path / "x.json"
    notjson.write_text("{nope")
    assert main(["memory", str(notjson)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_http_server_refuses_a_public_address_without_a_token(capsys, monkeypatch):
    monkeypatch.delenv("MCORE_ADVISOR_TOKEN", raising=False)
    assert main(["serve", "--http", "--host", "0.0.0.0"]) == 2
    assert "bearer token" in capsys.readouterr().err
