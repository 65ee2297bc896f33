"""check_mfu: MFU/HFU arithmetic in both conventions, the log's convention, claim checks, the
published band, and the low-MFU / OOM diagnoses. Fixture provenance: tests/fixtures/logs/README.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_advisor.diagnosis.mfu import MfuRequest, check_mfu
from mcore_advisor.physics.step_time import step_time
from mcore_advisor.schemas import (
    ClusterSpec,
    ImplementationSpec,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
)
from mcore_advisor.validators import errors, validate

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
H100_BF16_DENSE = 989.4  # NVIDIA H100 SXM datasheet: 1979 TFLOP/s BF16 "with sparsity", dense = half


def _log(name: str) -> str:
    return (LOGS / name).read_text()


def _gpt_causal_flops_per_token(L: int, h: int, s: int, V: int) -> float:
    # Megatron HEAD for MHA, ffn 4h, GeLU: 72*s*L*h^2*(1 + s/(12h) + V/(12*L*h)) per sequence
    # (Korthikanti's 72BsLh^2(1 + s/(6h) + ...) with the core-attention term halved).
    return 72 * L * h * h * (1 + s / (12 * h) + V / (12 * L * h))


def _llama70b_flops_per_token(s: int, V: int, convention: str) -> float:
    # Per layer: QKV+O 6*(h*(q + 2*g*d) + q*h), core 6*q*s*(1/2 causal)*2, SwiGLU MLP 6*3*h*f; logits 6*h*V.
    h, q, g, d, f, L = 8192, 8192, 8, 128, 28672, 80
    core = 6 * q * s * (1.0 if convention == "causal" else 2.0)
    return L * (6 * (h * (q + 2 * g * d) + q * h) + core + 6 * 3 * h * f) + 6 * h * V


LLAMA70B_64 = Plan(
    model=ModelSpec(name="llama3-70b"),
    cluster=ClusterSpec(gpu="h100-sxm", num_gpus=64),
    training=TrainingSpec(seq_length=8192, global_batch_size=128),
    parallelism=ParallelismSpec(tensor_model_parallel_size=4, pipeline_model_parallel_size=4, sequence_parallel=True),
)


# ---------------------------------------------------------------------------------------------
# Arithmetic and conventions
# ---------------------------------------------------------------------------------------------


def test_mfu_from_a_megatron_019_log_matches_the_hand_computation_and_the_logs_own_tflops():
    r = check_mfu(MfuRequest(log_text=_log("megatron_0_19_gpt1p3b_te_mbs4_h200.log"), gpu="h200", diagnose=False))
    assert r.plan_source == "log_arguments" and r.plan.cluster.gpu == "h200"
    # Hand: 1169.0 ms median; 32 x 2048 tokens; 8.2544e9 causal FLOPs/token; H200 dense BF16 989.4.
    per_token = _gpt_causal_flops_per_token(24, 2048, 2048, 32768)
    assert r.flops_per_token_causal == pytest.approx(per_token, rel=1e-9)
    hand_mfu = 100 * 32 * 2048 / 1.169 * per_token / 1e12 / H100_BF16_DENSE
    assert r.mfu_causal_pct == pytest.approx(hand_mfu, rel=1e-3)
    # ... and the log's own 'throughput per GPU (TFLOP/s/GPU): 462.8' / 989.4 agrees to 0.1%.
    assert r.mfu_causal_pct == pytest.approx(100 * 462.8 / H100_BF16_DENSE, rel=1e-3)
    assert r.peak.tflops_per_gpu == H100_BF16_DENSE and "dense BF16" in r.peak.name
    # No recompute: HFU = MFU.
    assert r.hfu_causal_pct == pytest.approx(r.mfu_causal_pct)


def test_megatron_019_log_is_recognised_as_causal_convention():
    r = check_mfu(MfuRequest(log_text=_log("megatron_0_19_gpt1p3b_te_mbs4_h200.log"), gpu="h200", diagnose=False))
    c = r.log_convention
    assert c.convention == "causal" and abs(c.relative_error_pct) < 0.1
    # Full s^2 attention would count 8.858e9 FLOPs/token: 7.3% more than what the log printed.
    assert c.full_tflops_per_gpu / c.causal_tflops_per_gpu == pytest.approx(1 + 24 * 6 * 2048 * 2048 / 8254390272, rel=1e-6)


def test_nemo_2407_row_is_recognised_as_full_convention():
    # NeMo 24.07 performance summary: LLAMA3-8B, 8 x H100, FP8, CP2, GBS 128, seq 8192: 12273 tok/s/GPU, 711 TFLOP/s.
    plan = Plan(model=ModelSpec(name="llama3-8b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=8),
                training=TrainingSpec(seq_length=8192, global_batch_size=128, precision="fp8"),
                parallelism=ParallelismSpec(context_parallel_size=2))
    r = check_mfu(MfuRequest(plan=plan, log_text=_log("nemo2_llama3_8b_fp8_nemo2407_row.log"), diagnose=False))
    assert r.log_convention.convention == "full"
    assert abs(r.log_convention.relative_error_pct) < 0.2
    assert r.tokens_per_s_per_gpu == pytest.approx(12273, rel=1e-3)
    # Headline MFU against the BF16 peak; the FP8-peak figure is half of it (1978.9 = 2 x 989.4 on H100).
    assert r.mfu_full_pct == pytest.approx(100 * 711 / H100_BF16_DENSE, rel=2e-3)
    assert r.mfu_vs_fp8_peak_causal_pct == pytest.approx(r.mfu_causal_pct * 989.4 / 1978.9, rel=1e-6)


def test_reported_tflops_with_a_time_infers_the_convention_from_the_ratio():
    t = 10.0
    causal = 128 * 8192 * _llama70b_flops_per_token(8192, 128512, "causal") / (t * 1e12 * 64)
    full = 128 * 8192 * _llama70b_flops_per_token(8192, 128512, "full") / (t * 1e12 * 64)
    for reported, expect in ((causal, "causal"), (full, "full"), (0.7 * causal, "none")):
        r = check_mfu(MfuRequest(plan=LLAMA70B_64, iteration_time_s=t, reported_tflops_per_gpu=reported, diagnose=False))
        assert r.log_convention.convention == expect


def test_full_recompute_hfu_adds_one_forward_of_the_layers():
    plan = LLAMA70B_64.model_copy(update={"parallelism": LLAMA70B_64.parallelism.model_copy(
        update={"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})})
    r = check_mfu(MfuRequest(plan=plan, iteration_time_s=12.0, diagnose=False))
    # Narayanan 2021: full recompute reruns each layer's forward = 1/3 of its fwd+bwd FLOPs; logits are not rerun.
    total = _llama70b_flops_per_token(8192, 128512, "causal")
    layers = total - 6 * 8192 * 128512
    assert r.hfu_causal_pct / r.mfu_causal_pct == pytest.approx((total + layers / 3) / total, rel=1e-9)


def test_peak_override_is_named_as_coming_from_the_request():
    r = check_mfu(MfuRequest(plan=LLAMA70B_64, iteration_time_s=10.0, peak_tflops_per_gpu=1000.0, diagnose=False))
    assert r.peak.source == "request.peak_tflops_per_gpu"
    assert r.mfu_causal_pct == pytest.approx(r.model_tflops_per_gpu_causal / 10)


# ---------------------------------------------------------------------------------------------
# Claims
# ---------------------------------------------------------------------------------------------


def test_390_tflops_is_not_47_percent_mfu_on_h100():
    r = check_mfu(MfuRequest(plan=LLAMA70B_64, reported_tflops_per_gpu=390, claimed_mfu_pct=47, diagnose=False))
    c = r.claim_checks[0]
    assert not c.consistent
    assert "39.4%" in c.message  # 390 / 989.4


def test_mfu_computed_against_the_sparse_peak_is_named():
    r = check_mfu(MfuRequest(plan=LLAMA70B_64, reported_tflops_per_gpu=390, claimed_mfu_pct=19.7, diagnose=False))
    c = r.claim_checks[0]
    assert not c.consistent and "2:4-sparse" in c.message  # 390 / 1978.8 = 19.7%


def test_tokens_per_s_claim_is_checked_with_the_models_real_flops_per_token():
    tok = 868.1
    hand_causal = 100 * tok * _llama70b_flops_per_token(8192, 128512, "causal") / 1e12 / H100_BF16_DENSE
    hand_full = 100 * tok * _llama70b_flops_per_token(8192, 128512, "full") / 1e12 / H100_BF16_DENSE
    six_nd = 100 * tok * 6 * 70.55e9 / 1e12 / H100_BF16_DENSE  # catalog: 70.55B parameters
    ok_c = check_mfu(MfuRequest(plan=LLAMA70B_64, tokens_per_s_per_gpu=tok, claimed_mfu_pct=round(hand_causal, 1), diagnose=False))
    ok_f = check_mfu(MfuRequest(plan=LLAMA70B_64, tokens_per_s_per_gpu=tok, claimed_mfu_pct=round(hand_full, 1), diagnose=False))
    nd = check_mfu(MfuRequest(plan=LLAMA70B_64, tokens_per_s_per_gpu=tok, claimed_mfu_pct=round(six_nd, 1), diagnose=False))
    bad = check_mfu(MfuRequest(plan=LLAMA70B_64, tokens_per_s_per_gpu=tok, claimed_mfu_pct=47, diagnose=False))
    assert ok_c.claim_checks[-1].consistent and ok_f.claim_checks[-1].consistent
    assert not nd.claim_checks[-1].consistent and "6ND" in nd.claim_checks[-1].message
    assert not bad.claim_checks[-1].consistent and "matches none" in bad.claim_checks[-1].message


def test_disagreeing_measurements_and_an_impossible_mfu_are_flagged():
    r = check_mfu(MfuRequest(plan=LLAMA70B_64, iteration_time_s=10.0, tokens_per_s=2 * 128 * 8192 / 10.0, diagnose=False))
    assert any(f.code == "measurements_disagree" for f in r.findings)
    fast = check_mfu(MfuRequest(plan=LLAMA70B_64, iteration_time_s=0.5, diagnose=False))
    assert fast.mfu_causal_pct > 100 and any(f.code == "mfu_above_peak" and f.severity == "error" for f in fast.findings)


# ---------------------------------------------------------------------------------------------
# Band, inputs
# ---------------------------------------------------------------------------------------------


def test_expected_band_comes_from_published_runs_on_the_same_gpu_family_and_precision():
    plan = Plan(model=ModelSpec(name="llama3-8b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=8),
                training=TrainingSpec(seq_length=8192, global_batch_size=128, precision="fp8"),
                parallelism=ParallelismSpec(context_parallel_size=2))
    r = check_mfu(MfuRequest(plan=plan, tokens_per_s_per_gpu=12273, diagnose=False))
    b = r.expected_band
    assert b.runs and all(run.source.startswith("NEMO") for run in b.runs)  # the H100 FP8 rows of the dev table
    lo, hi = b.mfu_full_pct_range
    assert lo <= r.mfu_full_pct <= hi and "within" in b.verdict


def test_plan_that_differs_from_the_log_arguments_is_reported():
    log = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log")
    r = check_mfu(MfuRequest(log_text=log, gpu="h200", diagnose=False))
    other = r.plan.model_copy(update={"training": r.plan.training.model_copy(update={"micro_batch_size": 8})})
    r2 = check_mfu(MfuRequest(plan=other, log_text=log, diagnose=False))
    assert any(f.code == "plan_differs_from_log" and "training.micro_batch_size" in f.fields for f in r2.findings)


@pytest.mark.parametrize("text", ["", "\x00\x07 nothing here \n" * 20])
def test_empty_or_garbage_log_without_a_plan_names_the_fix(text):
    with pytest.raises(ValueError, match="plan"):
        check_mfu(MfuRequest(log_text=text))


def test_garbage_log_with_a_plan_but_no_measurement_says_what_is_missing():
    with pytest.raises(ValueError, match="log_text: no Megatron-LM"):
        check_mfu(MfuRequest(plan=LLAMA70B_64, log_text="garbage\n" * 10))


def test_nothing_to_work_with_names_the_plan_field():
    with pytest.raises(ValueError, match="plan is required"):
        check_mfu(MfuRequest(iteration_time_s=1.0))


def test_nccl_timeout_and_nan_logs_become_findings():
    r = check_mfu(MfuRequest(plan=LLAMA70B_64, iteration_time_s=10.0, log_text=_log("nccl_watchdog_timeout.log"), diagnose=False))
    t = next(f for f in r.findings if f.code == "nccl_timeout")
    assert "ALLREDUCE" in t.message and "600000" in t.message
    r = check_mfu(MfuRequest(plan=LLAMA70B_64, iteration_time_s=10.0, log_text=_log("megatron_fp16_skips_then_nan.log"), diagnose=False))
    codes = {f.code for f in r.findings}
    assert {"skipped_iterations", "nan_loss"} <= codes


# ---------------------------------------------------------------------------------------------
# Low-MFU diagnosis
# ---------------------------------------------------------------------------------------------


def test_unfused_attention_run_is_diagnosed_and_flash_attention_is_the_top_fix():
    # Measured 2365 ms with Megatron's local spec (unfused attention) vs 1169 ms with TE on the same H200.
    # The local spec always runs Megatron's DotProductAttention (gpt_layer_specs LocalSpecProvider), so the
    # flash kernel comes only with Transformer Engine's spec.
    r = check_mfu(MfuRequest(log_text=_log("megatron_0_19_gpt1p3b_local_unfused_mbs4_h200.log"), gpu="h200"))
    d = r.diagnosis
    assert "attention below peak" in [c.name for c in d.components[:2]]
    top = d.fixes[0]
    assert top.plan.implementation.transformer_impl == "transformer_engine" and top.plan.implementation.attention_backend == "flash"
    assert top.predicted_throughput_change_pct > 50 and top.fits
    # The fix's predicted MFU is the measured one scaled by the predicted speed-up.
    ratio = top.predicted_step_time_s_before / top.predicted_step_time_s_after
    assert top.predicted_mfu_causal_pct_after == pytest.approx(r.mfu_causal_pct * ratio, rel=1e-6)


def test_pipeline_bubble_is_decomposed_and_interleaving_is_proposed():
    plan = Plan(model=ModelSpec(name="llama3-70b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=64),
                training=TrainingSpec(seq_length=4096, global_batch_size=16),
                parallelism=ParallelismSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, sequence_parallel=True))
    t = step_time(plan).iteration_time_s
    r = check_mfu(MfuRequest(plan=plan, iteration_time_s=t))
    d = r.diagnosis
    bubble = next(c for c in d.components if c.name == "pipeline bubble")
    # 16 micro-batches on 8 stages: bubble (p-1)/m = 7/16 of the compute, the largest loss.
    assert bubble.share_of_step_pct > 20 and "(pp-1)/(vp*m) = 43.8%" in bubble.explanation
    vp = [f for f in d.fixes if f.fields == ["parallelism.virtual_pipeline_model_parallel_size"]]
    assert vp and vp[0].predicted_throughput_change_pct > 10 and vp[0].plan.parallelism.virtual_pipeline_model_parallel_size in (2, 5)
    ranked = [f for f in d.fixes if f.fields != ["implementation.grad_reduce_in_fp32"]]
    gains = [f.predicted_throughput_change_pct for f in ranked]
    assert gains == sorted(gains, reverse=True)
    # Every proposal is a whole plan the validators accept and that fits; bf16 gradients come last.
    assert all(not errors(validate(f.plan)) and f.fits for f in d.fixes)
    assert d.fixes[-1].fields == ["implementation.grad_reduce_in_fp32"] or all(f in ranked for f in d.fixes)


def test_the_log_s_missing_wgrad_accumulation_fusion_is_offered_back_with_the_apex_caveat():
    # 16 micro-batches of 2 x 2048 tokens on one H100: the per-micro-batch main_grad add is a few %
    plan = Plan(model=ModelSpec(name="gpt3-1.3b"), cluster=ClusterSpec(gpu="h100-sxm", num_gpus=1),
                training=TrainingSpec(seq_length=2048, global_batch_size=32, micro_batch_size=2),
                parallelism=ParallelismSpec(use_distributed_optimizer=False),
                implementation=ImplementationSpec(gradient_accumulation_fusion=False))
    fused = plan.model_copy(update={"implementation": plan.implementation.model_copy(update={"gradient_accumulation_fusion": True})})
    t, t_fused = step_time(plan).iteration_time_s, step_time(fused).iteration_time_s
    r = check_mfu(MfuRequest(plan=plan, iteration_time_s=t))
    fix = next(f for f in r.diagnosis.fixes if f.fields == ["implementation.gradient_accumulation_fusion"])
    assert fix.predicted_throughput_change_pct == pytest.approx(100 * (t / t_fused - 1), rel=1e-6)
    assert 1.0 < fix.predicted_throughput_change_pct < 10.0
    assert "Apex" in (fix.caveat or "")
    # and a log of a run that passed --no-gradient-accumulation-fusion yields such a plan
    logged = check_mfu(MfuRequest(log_text=_log("megatron_0_19_gpt1p3b_te_mbs4_h200.log"), gpu="h200", diagnose=False))
    assert logged.plan.implementation.gradient_accumulation_fusion is False


def test_spiky_iteration_times_point_at_stalls():
    base = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log").splitlines()
    spiky = [ln.replace("elapsed time per iteration (ms): 1169.8", "elapsed time per iteration (ms): 2400.0")
               .replace("elapsed time per iteration (ms): 1168.9", "elapsed time per iteration (ms): 2100.0") for ln in base]
    r = check_mfu(MfuRequest(log_text="\n".join(spiky), gpu="h200"))
    assert any(c.name == "iteration-time spikes" for c in r.diagnosis.components)
    assert any("--num-workers" in n and "manual_gc" in n for n in r.diagnosis.notes)


def _gpt13b_h200(**par) -> Plan:
    # The profile-job runs (benchmarks/gpu results.jsonl) swapped torch SDPA (FlashAttention-2 on Hopper) into
    # the local spec, which Megatron-LM never does; their nearest Megatron-LM plan is TE with 'flash'.
    return Plan(model=ModelSpec(name="gpt3-1.3b"), cluster=ClusterSpec(gpu="h200", num_gpus=1),
                training=TrainingSpec(seq_length=2048, global_batch_size=32, micro_batch_size=8),
                parallelism=ParallelismSpec(use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False, **par),
                implementation=ImplementationSpec(attention_backend="flash"))


def test_real_full_recompute_run_is_diagnosed_with_the_gain_measured_without_recompute():
    # Measured on an H200 with our profile job (tests/fixtures/logs/README.md): full recompute 1.6195 s/step,
    # the same plan without recompute 1.2457 s/step: +30.0% tokens/s, 43.9% MFU (causal).
    full = _gpt13b_h200(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    r = check_mfu(MfuRequest(plan=full, log_text=_log("profile_job_gpt1p3b_sdpa_mbs8_fullrecompute_h200.log")))
    assert r.iteration_time_s == pytest.approx(1.619, abs=1e-3) and r.log_convention.convention == "causal"
    assert r.hfu_causal_pct > r.mfu_causal_pct  # the recomputed forward is executed but not model FLOPs
    assert r.diagnosis.components[0].name == "activation recompute"
    top = r.diagnosis.fixes[0]
    assert top.plan.parallelism.recompute_granularity is None and top.fits
    measured_gain = 100 * (1.6195 / 1.2457 - 1)
    assert top.predicted_throughput_change_pct == pytest.approx(measured_gain, abs=8)
    after = check_mfu(MfuRequest(plan=_gpt13b_h200(), log_text=_log("profile_job_gpt1p3b_sdpa_mbs8_h200.log"), diagnose=False))
    assert top.predicted_mfu_causal_pct_after == pytest.approx(after.mfu_causal_pct, abs=3)


# ---------------------------------------------------------------------------------------------
# OOM diagnosis
# ---------------------------------------------------------------------------------------------

LLAMA8B_8 = Plan(model=ModelSpec(name="llama3-8b"), cluster=ClusterSpec(gpu="h200", num_gpus=8),
                 training=TrainingSpec(seq_length=8192, global_batch_size=64, micro_batch_size=2),
                 parallelism=ParallelismSpec(tensor_model_parallel_size=1),
                 implementation=ImplementationSpec())


def test_oom_with_large_reserved_unallocated_memory_is_diagnosed_as_fragmentation():
    # Real torch 2.11 message from an H200: 48 GiB asked, 42.29 GiB free + 49.00 GiB reserved-unallocated.
    r = check_mfu(MfuRequest(plan=LLAMA8B_8, log_text=_log("torch_2_11_oom_fragmented_h200.log")))
    o = r.oom_diagnosis
    assert o.verdict == "fragmentation" and "expandable_segments" in o.message
    assert o.where_memory_went_gib["reserved_unallocated"] == 49.0 and o.where_memory_went_gib["allocated_by_pytorch"] == 48.0
    assert o.fixes[0].fields == ["implementation.expandable_segments"]
    assert o.estimate["capacity"] > 0 and o.estimate_vs_message and "pipeline rank 0" in o.most_loaded_rank


def test_oom_with_nothing_cached_is_over_commitment_and_fixes_save_memory():
    r = check_mfu(MfuRequest(plan=LLAMA8B_8, log_text=_log("torch_2_11_oom_overcommitted_h200.log")))
    o = r.oom_diagnosis
    assert o.verdict == "over_commitment"
    assert o.fixes and all(f.memory_saved_gib > 0 for f in o.fixes)
    # Fixes that fit come first, the least throughput lost first; bf16 gradient reduction only as a last resort.
    fitting = [f for f in o.fixes if f.fits and f.fields != ["implementation.grad_reduce_in_fp32"]]
    assert [f.predicted_throughput_change_pct for f in fitting] == sorted((f.predicted_throughput_change_pct for f in fitting), reverse=True)
    assert all(f.fields != ["implementation.grad_reduce_in_fp32"] for f in o.fixes[:-1])


def test_oom_log_without_plan_is_read_from_the_message_alone():
    r = check_mfu(MfuRequest(log_text=_log("torch_oom_legacy_wording.log")))
    o = r.oom_diagnosis
    assert r.plan is None and o.verdict == "outside_pytorch"
    # Legacy wording: 7.93 GiB total, 47.06 MiB free, 188 MiB reserved by PyTorch: 7.70 GiB held elsewhere.
    assert o.where_memory_went_gib["outside_pytorch"] == pytest.approx(7.93 - (47.06 + 188.0) / 1024)
    assert o.where_memory_went_gib["reserved_unallocated"] == pytest.approx((188.0 - 130.35) / 1024)
