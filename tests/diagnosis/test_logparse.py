"""Log parsing: every supported format round-trips from a fixture; hostile input gives a clear answer.

Fixture provenance (which numbers are measured, which only exercise a format) is in
tests/fixtures/logs/README.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_advisor.diagnosis.logparse import (
    DEFAULT_MAX_ITERATION_RECORDS,
    DEFAULT_MAX_SCAN_CHARS,
    clean_line,
    parse_log,
    parse_megatron_iteration_line,
    parse_oom_message,
    plan_from_megatron_args,
)

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
GIB = 2**30


def _log(name: str) -> str:
    return (LOGS / name).read_text()


def test_megatron_019_log_yields_iterations_args_memory_and_theoretical_estimate():
    r = parse_log(_log("megatron_0_19_gpt1p3b_te_mbs4_h200.log"))
    assert {"megatron_iteration", "megatron_args", "megatron_memory_report", "megatron_theoretical_memory"} <= set(r.formats_detected)
    assert r.num_iteration_records == 10 and (r.first_iteration, r.last_iteration) == (1, 90)
    # The first record (init overhead, 5123.6 ms) is left out; the other nine have median 1169.0 ms.
    assert r.iteration_time.num_records == 9
    assert r.iteration_time.median_ms == pytest.approx(1169.0)
    assert r.median_reported_tflops() == pytest.approx(462.8)
    it = r.iterations[-1]
    assert it.timestamp == "2026-11-21 14:04:20.044600"
    assert it.consumed_samples == 2880 and it.global_batch_size == 32 and it.train_iters == 100
    assert it.losses == {"lm loss": pytest.approx(6.33)} and it.grad_norm == pytest.approx(0.842)
    assert it.num_skipped_iterations == 0 and it.num_nan_iterations == 0
    assert r.megatron_args["tensor_model_parallel_size"] == "1"
    assert r.megatron_args["attention_backend"] == "AttnBackend.auto"
    assert (r.vocab_size, r.padded_vocab_size) == (32768, 32768)
    # Megatron's MB is 2^20 B: 23051.04 MB = 22.511 GiB.
    assert r.theoretical_memory.weight_and_optimizer_gib == pytest.approx(23051.04 / 1024)
    assert r.theoretical_memory.total_gib == pytest.approx(37347.90 / 1024)
    mem = r.most_loaded_memory_report()
    assert mem.rank == 0 and mem.after_iterations == 10
    assert mem.max_allocated_gib == pytest.approx(38604.80 / 1024) and mem.max_reserved_gib == pytest.approx(40008.0 / 1024)
    assert r.parameter_counts_billions["Total number of parameters"] == pytest.approx(1.34)


def test_arguments_dump_becomes_a_plan_with_the_run_layout():
    r = parse_log(_log("megatron_0_19_gpt1p3b_local_unfused_mbs4_h200.log"))
    plan, notes = plan_from_megatron_args(r.megatron_args, vocab_size=r.vocab_size)
    m = plan.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.vocab_size) == (24, 2048, 16, 8192, 32768)
    assert m.num_query_groups is None  # group_query_attention False: Megatron ignores num_query_groups
    assert m.swiglu is False and m.untie_embeddings_and_output_weights is True and m.normalization == "LayerNorm"
    assert plan.cluster.num_gpus == 1 and plan.cluster.gpu == "h100-sxm"
    assert any("GPU" in n for n in notes)
    t = plan.training
    assert (t.seq_length, t.global_batch_size, t.micro_batch_size, t.precision) == (2048, 32, 4, "bf16")
    assert plan.parallelism.use_distributed_optimizer is False and plan.parallelism.recompute_granularity is None
    assert plan.implementation.transformer_impl == "local" and plan.implementation.attention_backend == "local"
    assert plan.implementation.grad_reduce_in_fp32 is True
    # the run passed --no-gradient-accumulation-fusion (no Apex on the machine)
    assert plan.implementation.gradient_accumulation_fusion is False


def test_manual_gc_in_the_arguments_dump_reaches_the_plan():
    r = parse_log(_log("megatron_0_19_gpt1p3b_local_unfused_mbs4_h200.log"))
    assert plan_from_megatron_args(r.megatron_args, vocab_size=r.vocab_size)[0].implementation.manual_gc is False
    args = {**r.megatron_args, "manual_gc": "True", "manual_gc_interval": "250"}
    im = plan_from_megatron_args(args, vocab_size=r.vocab_size)[0].implementation
    assert im.manual_gc is True and im.manual_gc_interval == 250


def test_arguments_dump_without_the_model_shape_names_the_missing_argument():
    with pytest.raises(ValueError, match="num_layers"):
        plan_from_megatron_args({"hidden_size": "4096", "world_size": "8"})


def test_nemo2_progress_printer_lines_give_step_time_and_tflops():
    r = parse_log(_log("nemo2_llama3_8b_fp8_nemo2407_row.log"))
    assert r.formats_detected == ["nemo2_iteration"]
    assert r.num_iteration_records == 10
    # Iteration 0 (41.72 s, compile/warm-up) is excluded; 'train_step_timing in s: 10.68' -> 10680 ms.
    assert r.iteration_time.median_ms == pytest.approx(10680.0)
    last = r.iterations[-1]
    assert last.iteration == 45 and last.train_iters == 49 and last.global_batch_size == 128
    assert last.consumed_samples == 5888 and last.throughput_tflops_per_gpu == pytest.approx(711.2)
    assert last.losses == {"reduced_train_loss": pytest.approx(7.48)} and last.learning_rate == pytest.approx(1.38e-5)


def test_tqdm_progress_bar_redraws_separated_by_carriage_returns_are_two_records():
    r = parse_log(_log("nemo_tqdm_progress_bar.log"))
    assert r.num_iteration_records == 2 and r.last_iteration == 49
    assert r.iterations[-1].elapsed_time_per_iteration_ms == pytest.approx(10680.0)
    assert r.iterations[-1].consumed_samples == 6400


def test_bridge_memory_report_in_decimal_gigabytes_is_converted_to_gib():
    r = parse_log(_log("bridge_format_only.log"))
    assert "bridge_memory_report" in r.formats_detected and "bridge_step_time" in r.formats_detected
    mem = r.memory_reports[0]
    # Bridge report_memory divides bytes by 1.0e9: 60.129 GB = 60.129e9 / 2^30 GiB.
    assert mem.max_reserved_gib == pytest.approx(60.129e9 / GIB)
    assert mem.max_allocated_gib == pytest.approx(57.862e9 / GIB)
    assert mem.alloc_retries == 3
    assert r.iterations[-1].throughput_tflops_per_gpu == pytest.approx(402.1)


def test_2024_megatron_format_without_throughput_and_with_unrounded_memory():
    r = parse_log(_log("megatron_2024_legacy_format.log"))
    assert r.median_reported_tflops() is None
    assert r.skipped_iterations_total == 15
    assert r.theoretical_memory.weight_and_optimizer_gib == pytest.approx(1519.18 / 1024)
    assert r.theoretical_memory.activation_gib is None
    assert {m.rank for m in r.memory_reports} == {0, 2}
    assert r.memory_reports[0].max_allocated_gib == pytest.approx(2589.13525390625 / 1024)
    # The 'lm loss' field is absent while every iteration of the interval was skipped.
    assert r.iterations[0].losses == {}


def test_skipped_and_nan_iterations_behind_rank_prefixes_are_counted():
    r = parse_log(_log("megatron_fp16_skips_then_nan.log"))
    assert r.num_iteration_records == 4 and r.skipped_iterations_total == 4
    assert [i.loss_scale for i in r.iterations] == [65536.0, 65536.0, 8192.0, 8192.0]
    assert len(r.nan_messages) == 1 and "found NaN in local forward loss calculation" in r.nan_messages[0]


def test_nccl_watchdog_timeouts_give_rank_op_and_timeout():
    r = parse_log(_log("nccl_watchdog_timeout.log"))
    assert r.num_nccl_timeouts == 2
    t = r.nccl_timeouts[0]
    assert (t.rank, t.seq_num, t.op_type, t.numel_in, t.timeout_ms, t.ran_for_ms) == (3, 1853, "ALLREDUCE", 1, 600000, 600018)
    assert "child_failed" in r.error_lines


def test_real_fragmented_oom_message_from_torch_2_11_round_trips():
    r = parse_log(_log("torch_2_11_oom_fragmented_h200.log"))
    assert r.num_oom_events == 1
    o = r.oom_events[0]
    assert o.message_format == "torch>=2.1" and o.rank == 0 and o.gpu_index == 0
    assert (o.tried_to_allocate_gib, o.total_capacity_gib, o.free_gib) == (48.0, 139.80, 42.29)
    assert (o.this_process_in_use_gib, o.allocated_by_pytorch_gib, o.reserved_unallocated_gib) == (97.51, 48.0, 49.0)
    # 97.51 in use - (48 allocated + 49 cached) = 0.51 GiB outside the caching allocator (CUDA context).
    assert o.non_pytorch_gib == pytest.approx(0.51)


def test_legacy_oom_wording_gives_reserved_minus_allocated():
    o = parse_log(_log("torch_oom_legacy_wording.log")).oom_events[0]
    assert o.message_format == "legacy"
    assert o.tried_to_allocate_gib == pytest.approx(36 / 1024)
    assert o.total_capacity_gib == pytest.approx(7.93)
    assert o.reserved_unallocated_gib == pytest.approx((188.0 - 130.35) / 1024)


def test_oom_with_other_processes_and_private_pools_is_split_by_owner():
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.19 GiB "
           "of which 1.02 GiB is free. Process 4411 has 3.00 GiB memory in use. Including non-PyTorch memory, this process "
           "has 75.15 GiB memory in use. Of the allocated memory 61.50 GiB is allocated by PyTorch, with 4.00 GiB allocated "
           "in private pools (e.g., CUDA Graphs), and 7.25 GiB is reserved by PyTorch but unallocated.")
    o = parse_oom_message(msg)
    assert o.other_processes_in_use_gib == 3.0 and o.this_process_in_use_gib == 75.15
    assert o.private_pools_gib == 4.0 and o.reserved_unallocated_gib == 7.25 and o.gpu_index == 3


def test_oom_message_wrapped_over_lines_and_repeated_by_torchrun_is_one_event():
    msg = _log("torch_2_11_oom_fragmented_h200.log").strip()
    cut = msg.index("Including")
    wrapped = msg[:cut] + "\n" + msg[cut:]
    r = parse_log(wrapped + "\n" + msg + "\n")
    assert r.num_oom_events == 1 and r.oom_events[0].reserved_unallocated_gib == 49.0


def test_ansi_colours_and_launcher_prefixes_are_stripped():
    line = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log").splitlines()[-1]
    for prefix in ("[default3]:", "[rank3]:", "3: ", "[1,3]<stdout>:"):
        text, rank = clean_line(f"\x1b[32m{prefix}{line}\x1b[0m")
        assert rank == 3
        assert parse_megatron_iteration_line(text).elapsed_time_per_iteration_ms == pytest.approx(1168.8)


@pytest.mark.parametrize(
    "text, expect",
    [
        ("", "empty"),
        ("   \n\n\t\n", "empty"),
        ("\x00\x01\x02 garbage ¿ü\n" * 50, "no Megatron-LM"),
        ("iteration banana | elapsed time per iteration (ms): fast\n", "no Megatron-LM"),
    ],
)
def test_empty_or_garbage_input_returns_a_clear_note_instead_of_raising(text, expect):
    r = parse_log(text)
    assert not r.has_training_data and r.iteration_time is None
    assert any(expect in n for n in r.notes)


def test_truncated_lines_keep_what_they_carry():
    full = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log").splitlines()[-1]
    cut = full[: full.index("throughput")]
    r = parse_log(cut)
    assert r.iterations[0].elapsed_time_per_iteration_ms == pytest.approx(1168.8)
    assert r.iterations[0].throughput_tflops_per_gpu is None


def test_arguments_dump_without_end_marker_does_not_swallow_the_rest_of_the_log():
    text = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log").replace("-------------------- end of arguments ---------------------\n", "")
    r = parse_log(text)
    assert r.num_iteration_records == 10 and len(r.megatron_args) == 58
    assert any("arguments dump is truncated" in n for n in r.notes)


def test_pathological_lines_are_cut_and_skipped():
    hostile = "\n".join([
        "------------------------ arguments ------------------------", "  x " + " " * 20000 + "y",
        "[" + "a b " * 4000 + " train_step_timing in s=" + "c " * 4000 + "]",
        "CUDA out of memory. " + "Tried to allocate " * 900, "\x1b[" * 5000 + "m", "x" * 1_000_000,
    ])
    r = parse_log(hostile)
    assert any("over-long lines were cut" in n for n in r.notes)
    assert "out_of_memory_unparsed" in r.error_lines


def test_100_mb_log_is_read_in_a_bounded_window_and_keeps_the_latest_iterations():
    line = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log").splitlines()[-1]
    noise = "[rank5]: UserWarning: something harmless that real logs repeat ................................"
    block = line + "\n" + noise + "\n" + noise + "\n"
    n_blocks = 100 * 2**20 // len(block) + 1
    final = line.replace("iteration       90/     100", "iteration 999999/ 1000000")
    text = block * n_blocks + final + "\n"
    assert len(text) > 100 * 2**20
    r = parse_log(text)
    assert r.truncated and any("not read" in n for n in r.notes)
    assert r.lines_scanned < 3 * n_blocks // 4  # the middle was skipped, not read
    assert len(r.iterations) == DEFAULT_MAX_ITERATION_RECORDS < r.num_iteration_records
    assert r.last_iteration == 999999  # the tail, where the latest state is, was read
    assert r.iteration_time.median_ms == pytest.approx(1168.8)
    assert DEFAULT_MAX_SCAN_CHARS < len(text)


def test_non_text_input_is_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="log_text"):
        parse_log(12345)  # type: ignore[arg-type]


def test_the_profile_job_and_check_mfu_read_megatrons_lines_alike():
    # The job (launcher/entry/trainlog.py, no pydantic) copies Megatron's own training_log and
    # report_memory lines into result.json; check_mfu's parser must read the same figures from them.
    from mcore_advisor.launcher.entry import trainlog

    lines = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log").splitlines()
    its = [(trainlog.parse_iteration_line(ln), parse_megatron_iteration_line(ln)) for ln in lines]
    its = [(a, b) for a, b in its if a is not None]
    assert its, "the fixture has Megatron iteration lines"
    for job, ours in its:
        assert job["iteration"] == ours.iteration
        assert job["elapsed_ms"] == ours.elapsed_time_per_iteration_ms
        assert job["tflops_per_gpu"] == ours.throughput_tflops_per_gpu
    line = trainlog.memory_line(3, 20, 1024.0, 2048.0, 3072.0, 4096.0)
    job = trainlog.parse_memory_line(line)
    r = parse_log(line + "\n").memory_reports[0]
    assert (r.rank, r.after_iterations) == (job["rank"], job["iteration"]) == (3, 20)
    assert r.max_reserved_gib == job["max_reserved_mb"] / 1024 == 4.0


@pytest.mark.parametrize("prefix", [
    "\x1b[32m[2026-11-26 03:10:01 INFO]\x1b[0m ",          # colorlog / rich / cluster wrappers
    "[2026-11-26 03:10:01,123][megatron.training][INFO] - ",  # hydra-style logging
    "2026-11-26 03:10:01,123 - INFO - ",                     # Python logging's common format
    "[NeMo I 2026-11-26 03:10:01 nemo_logging:393] ",         # NeMo's logger
    "0: [rank0]: [2026-11-26 03:10:01 INFO] ",                # Slurm label + torchrun rank + logging, stacked
])
def test_logging_prefixes_do_not_hide_the_arguments_dump(prefix):
    dump = ["------------------------ arguments ------------------------",
            "  num_layers ...................................... 24",
            "  attention_dropout ............................... 0.1",
            "-------------------- end of arguments ---------------------"]
    r = parse_log("\n".join(prefix + ln for ln in dump) + "\n")
    assert r.megatron_args == {"num_layers": "24", "attention_dropout": "0.1"}


def test_megatrons_own_iteration_timestamp_is_kept_behind_a_logging_prefix():
    line = _log("megatron_0_19_gpt1p3b_te_mbs4_h200.log").splitlines()[-1]
    text, _ = clean_line("[2026-11-26 03:10:01 INFO] " + line)
    assert parse_megatron_iteration_line(text).timestamp == parse_megatron_iteration_line(line).timestamp is not None


def test_a_dump_at_megatrons_defaults_is_described_as_it_ran():
    """Megatron's default dropout is 0.1 and its RoPE base 10000: a dump that says so gives a plan that says so."""
    args = parse_log(_log("megatron_0_19_gpt1p3b_te_mbs4_h200.log")).megatron_args
    args = {**args, "attention_dropout": "0.1", "hidden_dropout": "0.1", "rotary_base": "500000", "layernorm_epsilon": "1e-06",
            "qk_layernorm": "True", "use_rope_scaling": "True", "rope_scaling_factor": "8.0"}
    plan, _ = plan_from_megatron_args(args, gpu="h200", vocab_size=32768)
    assert (plan.training.attention_dropout, plan.training.hidden_dropout) == (0.1, 0.1)
    m = plan.model
    assert (m.rotary_base, m.norm_epsilon, m.qk_layernorm, m.rope_scaling_factor, m.rope_scaling_type) == (500000, 1e-06, True, 8.0, "llama3")
