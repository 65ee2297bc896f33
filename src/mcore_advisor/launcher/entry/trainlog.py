"""Megatron-LM's console log lines, byte for byte, so check_mfu and humans read our job's train.log
exactly like a real Megatron run.

Formats follow megatron/training/training.py `training_log` (megatron-core 0.19.2 wheel) and
megatron/training/utils `report_memory`.
"""

from __future__ import annotations

from datetime import datetime


def iteration_line(
    *,
    when: datetime,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    tflops_per_gpu: float | None,
    learning_rate: float | None,
    global_batch_size: int,
    losses: dict[str, float],
    loss_scale: float = 1.0,
    grad_norm: float | None = None,
    skipped_iterations: int = 0,
    nan_iterations: int = 0,
) -> str:
    """One `training_log` line; losses below 0 (and nan) are left out, as Megatron does."""
    s = f" [{when.strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    s += f" iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed_samples:12d} |"
    s += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if tflops_per_gpu is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} |"
    if learning_rate is not None:
        s += f" learning rate: {learning_rate:.6E} |"
    s += f" global batch size: {global_batch_size:5d} |"
    for key, avg in losses.items():
        if avg >= 0.0:  # False for nan too: a nan loss shows only in the nan-iterations count
            s += f" {key}: {avg:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    s += f" number of skipped iterations: {skipped_iterations:3d} |"
    s += f" number of nan iterations: {nan_iterations:3d} |"
    return s


def memory_line(rank: int, iteration: int, allocated_mb: float, max_allocated_mb: float, reserved_mb: float, max_reserved_mb: float) -> str:
    """Megatron's `report_memory(f'(after {iteration} iterations)')` line as rank `rank` prints it."""
    s = f"(after {iteration} iterations) memory (MB)"
    s += f" | allocated: {allocated_mb:.2f}"
    s += f" | max allocated: {max_allocated_mb:.2f}"
    s += f" | reserved: {reserved_mb:.2f}"
    s += f" | max reserved: {max_reserved_mb:.2f}"
    return f"[Rank {rank}] {s}"
