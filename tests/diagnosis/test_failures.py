"""Pasted logs a new user brings: an NCCL failure alone, a log behind a coloured logging prefix, NeMo and
Megatron-Bridge logs with their config dumps, and crashes before the first step. Each is diagnosed from a
realistic log written for it (tests/fixtures/logs/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_advisor.diagnosis.logparse import parse_log
from mcore_advisor.diagnosis.mfu import MfuRequest, check_mfu
from mcore_advisor.schemas import Plan

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def _log(name: str) -> str:
    return (LOGS / name).read_text()


# ---- NCCL failure alone -------------------------------------------------------------------------

def test_nccl_timeout_alone_is_diagnosed_without_a_plan():
    rep = check_mfu(MfuRequest(log_text=_log("nccl_timeout_only_failing_rank_stderr.log")))
    f = rep.failure
    assert rep.plan is None and f is not None and f.kind == "nccl_timeout"
    text = " ".join([f.summary, *f.details])
    assert "_ALLGATHER_BASE" in text and "SeqNum 48211" in text and "16,777,216 elements" in text
    assert "32.0 MiB in bf16" in text  # 16,777,216 x 2 B
    assert "TENSOR_MODEL_PARALLEL_GROUP" in text and "rank(s) 5" in text
    assert "first observed failure: rank 5 (Signal 6 (SIGABRT)) on gpu-a07" in text
    assert "queued 2 more" in text  # last enqueued 48213 vs failed 48211: the rank was waiting, not stuck
    causes = " ".join(f.likely_causes)
    assert "stopped reaching this collective" in causes and "straggler" in causes and "network" in causes
    assert any("TORCH_NCCL_DESYNC_DEBUG" in c for c in f.checks)
    assert "FAILED (nccl_timeout)" in rep.summary_text()


def test_a_plan_only_adds_detail_to_the_nccl_diagnosis():
    # Llama 3 8B, TP2 + SP, micro-batch 1, seq 8192: one micro-batch's SP shard is 1 x 8192 x 4096 / 2 = 16,777,216.
    plan = Plan(model={"name": "llama3-8b"}, cluster={"num_gpus": 8}, training={"seq_length": 8192, "global_batch_size": 64},
                parallelism={"tensor_model_parallel_size": 2, "sequence_parallel": True})
    rep = check_mfu(MfuRequest(plan=plan, log_text=_log("nccl_timeout_only_failing_rank_stderr.log")))
    text = " ".join(rep.failure.details)
    assert "sequence-parallel all-gather" in text and "TP 2, PP 1, CP 1, DP 4" in text
    assert rep.failure.likely_causes == check_mfu(MfuRequest(log_text=_log("nccl_timeout_only_failing_rank_stderr.log"))).failure.likely_causes


# ---- logging prefixes ---------------------------------------------------------------------------

def test_a_log_behind_a_coloured_logging_prefix_keeps_its_arguments_dump():
    plain = check_mfu(MfuRequest(log_text=_log("megatron_0_19_gpt1p3b_te_mbs4_h200.log"), gpu="h200", diagnose=False))
    coloured = check_mfu(MfuRequest(log_text=_log("megatron_0_19_gpt1p3b_te_behind_coloured_logging_prefix.log"), gpu="h200",
                                    diagnose=False))
    assert coloured.plan_source == "log_arguments" and coloured.plan == plain.plan
    assert coloured.mfu_causal_pct == pytest.approx(plain.mfu_causal_pct, rel=1e-12)
    parsed = parse_log(_log("megatron_0_19_gpt1p3b_te_behind_coloured_logging_prefix.log"))
    assert parsed.megatron_args == parse_log(_log("megatron_0_19_gpt1p3b_te_mbs4_h200.log")).megatron_args
    assert parsed.num_iteration_records == 10 and parsed.iterations[-1].timestamp is not None


# ---- NeMo and Megatron-Bridge config dumps ------------------------------------------------------

def test_nemo_run_config_supplies_the_plan():
    rep = check_mfu(MfuRequest(log_text=_log("nemo2_llama3_8b_fp8_with_nemo_run_config.log"), diagnose=False))
    p = rep.plan
    assert rep.plan_source == "log_config" and p.model.name == "llama3-8b" and p.cluster.num_gpus == 8
    assert (p.training.seq_length, p.training.global_batch_size, p.training.precision) == (8192, 128, "fp8")
    assert p.parallelism.context_parallel_size == 2 and p.parallelism.tensor_model_parallel_size == 1
    # The same MFU as with the plan written by hand (NeMo 24.07's Llama-3 8B row: 8 x H100, CP2, FP8).
    by_hand = Plan(model={"name": "llama3-8b"}, cluster={"gpu": "h100-sxm", "num_gpus": 8},
                   training={"seq_length": 8192, "global_batch_size": 128, "precision": "fp8"},
                   parallelism={"context_parallel_size": 2})
    ref = check_mfu(MfuRequest(plan=by_hand, log_text=_log("nemo2_llama3_8b_fp8_nemo2407_row.log"), diagnose=False))
    assert rep.mfu_causal_pct == pytest.approx(ref.mfu_causal_pct, rel=1e-12)


def test_a_nemo_log_without_a_config_asks_only_for_model_and_gpu_count():
    with pytest.raises(ValueError) as e:
        check_mfu(MfuRequest(log_text=_log("nemo2_llama3_8b_fp8_nemo2407_row.log")))
    msg = str(e.value)
    assert "model" in msg and "num_gpus" in msg and "parallelism" not in msg
    rep = check_mfu(MfuRequest(log_text=_log("nemo2_llama3_8b_fp8_nemo2407_row.log"), model="llama3-8b", num_gpus=8,
                               diagnose=False))
    assert rep.plan.training.seq_length == 8192 and rep.plan.training.global_batch_size == 128
    assert any("sequence length" in n for n in rep.notes) and rep.mfu_causal_pct > 0


def test_bridge_config_summary_supplies_all_but_the_gpu_count():
    with pytest.raises(ValueError) as e:
        check_mfu(MfuRequest(log_text=_log("bridge_llama3_8b_config_summary.log")))
    assert "num_gpus" in str(e.value) and "model (" not in str(e.value)
    rep = check_mfu(MfuRequest(log_text=_log("bridge_llama3_8b_config_summary.log"), num_gpus=16, diagnose=False))
    p = rep.plan
    assert rep.plan_source == "log_config" and p.model.name == "llama3-8b"  # from tokenizer_model meta-llama/Meta-Llama-3-8B
    assert (p.parallelism.tensor_model_parallel_size, p.parallelism.context_parallel_size, p.parallelism.sequence_parallel) == (2, 2, True)
    assert (p.training.seq_length, p.training.global_batch_size, p.training.micro_batch_size) == (8192, 128, 1)
    assert rep.iteration_time_s == pytest.approx(4.119, abs=0.01)  # the Bridge lines' median


# ---- crashes without an iteration line ----------------------------------------------------------

def test_import_error_is_diagnosed_with_its_fix():
    rep = check_mfu(MfuRequest(log_text=_log("crash_import_error_transformer_engine.log")))
    f = rep.failure
    assert f.kind == "import_error" and "No module named 'transformer_engine'" in f.summary
    assert "transformer_engine.py:14 in <module>" in f.details[0]
    assert "install the missing package" in f.fix


def test_megatron_argument_error_names_the_renamed_flag():
    rep = check_mfu(MfuRequest(log_text=_log("crash_megatron_argparse_error.log")))
    f = rep.failure
    assert f.kind == "argument_error" and "unrecognized arguments" in f.summary
    assert "--num-virtual-stages-per-pipeline-rank" in f.fix


def test_oom_before_the_first_step_is_diagnosed_from_the_arguments_dump():
    rep = check_mfu(MfuRequest(log_text=_log("crash_oom_before_first_step.log"), gpu="h200"))
    assert rep.plan_source == "log_arguments" and rep.plan.training.micro_batch_size == 32
    o = rep.oom_diagnosis
    assert o is not None and o.verdict == "over_commitment" and o.event.tried_to_allocate_gib == 8.0
    assert rep.iteration_time_s is None
