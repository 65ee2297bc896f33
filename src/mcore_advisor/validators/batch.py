"""Batch: global batch against micro-batch x DP, and the pipeline schedule's micro-batch needs."""

from __future__ import annotations

from ._core import GBS, MBS, NUM_GPUS, PP, VP, Ctx, choices, divisors, multiples_around, nearest, rule

AREA = "batch"


@rule(
    "global_batch_not_divisible",
    "error",
    AREA,
    "GBS = micro-batches x MBS x DP",
    # Undefined while DP is not an integer; the world-size rule reports that first.
    when=lambda c: c.world_ok and c.gbs % (c.mbs * c.dp) != 0,
)
def _gbs(c: Ctx):
    # num_microbatches_calculator (ConstantNumMicroBatchesCalculator) raises exactly this message.
    step = c.mbs * c.dp
    fix = f"set training.global_batch_size to {choices(multiples_around(c.gbs, step))}"
    if c.gbs % c.dp == 0:
        fix += f", or training.micro_batch_size to {choices(nearest(c.mbs, divisors(c.gbs // c.dp)))}"
    return (
        [GBS, MBS, NUM_GPUS],
        f"global batch size ({c.gbs}) is not divisible by micro batch size ({c.mbs}) times data parallel "
        f"size ({c.dp})",
        fix,
    )


@rule(
    "interleaved_microbatches_not_divisible_by_pp",
    "error",
    AREA,
    "the interleaved schedule runs micro-batches in groups of PP",
    when=lambda c: c.interleaved and c.batch_ok and c.num_microbatches % c.pp != 0,
)
def _interleaved(c: Ctx):
    # schedules.forward_backward_pipelining_with_interleaving: microbatch_group_size_per_vp_stage
    # defaults to PP (ModelParallelConfig.__post_init__); it raises when that group exceeds M, and
    # when the remainder M % group is in (0, PP). With the default group this is M % PP == 0
    # (older releases: "number of microbatches (M) is not divisible by pipeline-model-parallel-size
    # (P) when using interleaved schedule").
    M = c.num_microbatches
    step = c.mbs * c.dp * c.pp
    mbs_ok = [m for m in divisors(c.gbs // c.dp) if (c.gbs // c.dp // m) % c.pp == 0]
    fix = f"set training.global_batch_size to {choices(multiples_around(c.gbs, step))}"
    if mbs_ok:
        fix += f", or training.micro_batch_size to {choices(nearest(c.mbs, mbs_ok))}"
    fix += ", or unset parallelism.virtual_pipeline_model_parallel_size"
    return (
        [GBS, MBS, PP, VP],
        f"number of microbatches ({M}) is not divisible by pipeline-model-parallel-size ({c.pp}) when using "
        f"interleaved schedule (global_batch_size {c.gbs} / (micro_batch_size {c.mbs} x data_parallel_size {c.dp}))",
        fix,
    )


@rule(
    "pipeline_bubble",
    "warning",
    AREA,
    "few micro-batches per step leave pipeline stages idle",
    when=lambda c: (
        c.pp > 1
        and c.batch_ok
        and (c.num_microbatches < c.pp or (c.pp - 1) / (c.vp * c.num_microbatches) >= 0.25)
    ),
)
def _bubble(c: Ctx):
    # Narayanan et al. 2021 (arXiv 2104.04473) section 2.2: 1F1B bubble = (p-1)/m of the ideal step,
    # (p-1)/(v*m) with v interleaved chunks; as a share of the whole step (p-1)/(v*m + p - 1).
    M, p, v = c.num_microbatches, c.pp, c.vp
    share = (p - 1) / (v * M + p - 1)
    severity = "warning" if M < p else "info"
    target = 4 * p  # bubble (p-1)/(v*m) under 25% even without interleaving
    return (
        [GBS, MBS, PP],
        f"{M} micro-batch(es) per step for {p} pipeline stages: the pipeline bubble is {(p - 1) / (v * M):.0%} "
        f"of the ideal compute time, {share:.0%} of each step idle (Narayanan et al. 2021, sec. 2.2)",
        f"raise training.global_batch_size (e.g. to {target * c.mbs * c.dp} for {target} micro-batches), "
        "lower micro_batch_size, use fewer pipeline stages, or interleave (virtual_pipeline_model_parallel_size)",
        severity,
    )
