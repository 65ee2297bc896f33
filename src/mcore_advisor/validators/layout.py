"""Parallel layout: world-size divisibility, node shape, and switches Megatron silently drops."""

from __future__ import annotations

import math

from ._core import (
    CP,
    DIST_OPT,
    EP,
    ETP,
    GPUS_PER_NODE,
    NUM_GPUS,
    PP,
    SP,
    TP,
    VP,
    Ctx,
    choices,
    divisors,
    gib,
    multiples_around,
    nearest,
    prefer,
    rule,
)

AREA = "layout"


@rule(
    "world_not_divisible_by_model_parallel",
    "error",
    AREA,
    "num_gpus must be a multiple of TP*PP*CP (DP is derived)",
    when=lambda c: not c.world_ok,
)
def _world(c: Ctx):
    # Megatron-LM arguments.py validate_args: `world_size % total_model_size == 0`,
    # total_model_size = TP * PP * CP; data_parallel_size = world_size // total_model_size.
    mp = c.model_parallel
    alt = nearest(mp, prefer(divisors(c.num_gpus), lambda d: d > 1))
    return (
        [NUM_GPUS, TP, PP, CP],
        f"world size ({c.num_gpus}) is not divisible by tensor_model_parallel_size x "
        f"pipeline_model_parallel_size x context_parallel_size ({c.tp}x{c.pp}x{c.cp} = {mp}); "
        "data_parallel_size = world / (TP*PP*CP) must be an integer",
        f"set cluster.num_gpus to {choices(multiples_around(c.num_gpus, mp))}, "
        f"or pick TP*PP*CP dividing {c.num_gpus} (e.g. {choices(alt)})",
    )


@rule(
    "world_not_divisible_by_expert_parallel",
    "error",
    AREA,
    "num_gpus must be a multiple of ETP*EP*PP (expert data parallel is derived)",
    # With EP = 1 and ETP = TP the product is TP*PP, already covered by the rule above.
    when=lambda c: (c.ep > 1 or c.etp != c.tp) and not c.expert_world_ok,
)
def _expert_world(c: Ctx):
    # parallel_state.initialize_model_parallel: RuntimeError "world_size (W) is not divisible by
    # expert_tensor_model_pipeline_parallel size (ETP*EP*PP)".
    x = c.expert_model_pipeline
    step = math.lcm(x, c.model_parallel)
    fix = f"set cluster.num_gpus to {choices(multiples_around(c.num_gpus, step))}"
    per = c.num_gpus // (c.etp * c.pp) if c.num_gpus % (c.etp * c.pp) == 0 else 0
    if per:
        eps = prefer(divisors(per), lambda e: c.num_experts % e == 0 if c.num_experts else True)
        fix += f", or expert_model_parallel_size to {choices(nearest(c.ep, eps))}"
    return (
        [NUM_GPUS, EP, ETP, PP],
        f"world size ({c.num_gpus}) is not divisible by expert_tensor_parallel_size x "
        f"expert_model_parallel_size x pipeline_model_parallel_size ({c.etp}x{c.ep}x{c.pp} = {x}); "
        "the expert data-parallel size world / (ETP*EP*PP) must be an integer",
        fix,
    )


@rule(
    "num_gpus_not_multiple_of_node",
    "error",
    AREA,
    "more than one node needs whole nodes",
    when=lambda c: c.num_gpus > c.gpus_per_node and c.num_gpus % c.gpus_per_node != 0,
)
def _nodes(c: Ctx):
    # torchrun/srun launch the same number of ranks on every node (--nproc-per-node), so a
    # multi-node world is nodes * gpus_per_node.
    n = c.gpus_per_node
    fewer = [d for d in divisors(c.num_gpus) if d < n]
    fix = f"set cluster.num_gpus to {choices(multiples_around(c.num_gpus, n))}"
    if fewer:
        fix += f", or cluster.gpus_per_node to {fewer[-1]} (partial nodes)"
    return (
        [NUM_GPUS, GPUS_PER_NODE],
        f"num_gpus ({c.num_gpus}) spans more than one node of {n} GPUs but is not a multiple of "
        f"gpus_per_node ({n}): every node must run the same number of ranks",
        fix,
    )


@rule(
    "virtual_pipeline_ignored_without_pp",
    "warning",
    AREA,
    "VP with PP=1 does nothing",
    when=lambda c: c.pp == 1 and c.vp_raw is not None and c.vp_raw > 1,
)
def _vp_pp1(c: Ctx):
    # Megatron-LM validate_args asserts PP > 1 for the interleaved schedule ("When interleaved
    # schedule is used, pipeline-model-parallel size should be greater than 1"); this tool drops
    # the setting instead (ParallelDims.vp = 1). PP = 2 is fine: the "PP > 2" requirement applies
    # only with --no-overlap-p2p-communication (the CLI default overlaps, arguments.py).
    return (
        [VP, PP],
        f"virtual_pipeline_model_parallel_size ({c.vp_raw}) is ignored with pipeline_model_parallel_size 1: "
        "interleaving splits each pipeline stage into model chunks and there is a single stage "
        "(Megatron-LM itself rejects the flag: 'pipeline-model-parallel size should be greater than 1')",
        "unset parallelism.virtual_pipeline_model_parallel_size, or use pipeline_model_parallel_size >= 2",
    )


@rule(
    "sequence_parallel_without_tp",
    "warning",
    AREA,
    "SP needs TP > 1; Megatron disables it",
    when=lambda c: c.sp and c.tp == 1,
)
def _sp_tp1(c: Ctx):
    # Megatron-LM validate_args: with TP == 1 it warns "Disabling sequence parallelism because tensor
    # model parallelism is disabled" and sets sequence_parallel = False (ModelParallelConfig would
    # otherwise raise "Cannot use sequence parallelism without tensor parallelism").
    return (
        [SP, TP],
        "sequence_parallel has no effect with tensor_model_parallel_size 1: Megatron-LM disables it "
        "('Disabling sequence parallelism because tensor model parallelism is disabled')",
        "set parallelism.sequence_parallel false, or tensor_model_parallel_size > 1",
    )


def _sp_saving_bytes(c: Ctx) -> float:
    # Korthikanti et al. 2022 (arXiv 2205.05198) eq. 2 vs 4: per layer, TP alone keeps
    # sbh(10 + 24/t + ...) bytes, TP+SP sbh(34/t + ...): SP saves 10*s*b*h*(1 - 1/t) per layer.
    s = c.seq_length / c.cp
    layers = c.layers_per_stage or math.ceil(c.shape.num_layers / c.pp)
    return 10 * s * c.mbs * c.shape.hidden_size * (1 - 1 / c.tp) * layers


@rule(
    "sequence_parallel_recommended",
    "info",
    AREA,
    "TP > 1 without SP keeps norm/dropout activations unsharded",
    when=lambda c: c.tp > 1 and not c.sp and not c.is_moe,
)
def _sp_rec(c: Ctx):
    return (
        [SP, TP],
        f"with tensor_model_parallel_size {c.tp} and no sequence parallelism, LayerNorm/dropout activations "
        f"are replicated on every TP rank: sequence_parallel would save about {gib(_sp_saving_bytes(c))} "
        "per micro-batch on a pipeline stage (Korthikanti et al. 2022, eq. 2 vs 4) at no extra communication",
        "set parallelism.sequence_parallel true",
    )


@rule(
    "expert_and_tensor_parallel_without_sp",
    "error",
    AREA,
    "MoE with TP needs SP",
    when=lambda c: c.is_moe and c.tp > 1 and not c.sp,
)
def _ep_tp_sp(c: Ctx):
    # Megatron-LM validate_args asserts "When using MoE and tensor parallelism, sequence parallelism
    # must be used." for any MoE model with TP > 1; ModelParallelConfig.__post_init__ raises the EP
    # variant ("When using expert parallelism and tensor parallelism, sequence parallelism must be used").
    return (
        [SP, TP],
        f"When using MoE and tensor parallelism, sequence parallelism must be used (Megatron-LM; "
        f"tensor_model_parallel_size {c.tp}, expert_model_parallel_size {c.ep})",
        "set parallelism.sequence_parallel true",
    )


@rule(
    "distributed_optimizer_without_data_parallel",
    "info",
    AREA,
    "distributed optimizer has nothing to shard",
    when=lambda c: (
        c.use_distributed_optimizer
        and not c.use_torch_fsdp2
        and c.world_ok
        and c.dp * c.cp == 1
        and (not c.is_moe or c.expert_dp <= 1)
    ),
)
def _distopt(c: Ctx):
    # The distributed optimizer shards state over the data-parallel group including CP
    # (Megatron-Core DistributedOptimizer); with DP*CP = 1 every rank keeps the full state.
    return (
        [DIST_OPT],
        "use_distributed_optimizer is harmless but saves nothing here: data_parallel_size x "
        "context_parallel_size is 1, so each rank keeps the full fp32 master weights and Adam state",
        None,
    )


@rule(
    "expert_tensor_parallel_ignored_dense",
    "warning",
    AREA,
    "ETP on a dense model",
    when=lambda c: not c.is_moe and c.etp_raw is not None and c.etp_raw != c.tp,
)
def _etp_dense(c: Ctx):
    return (
        [ETP],
        f"expert_tensor_parallel_size ({c.etp_raw}) has no effect on a dense model "
        "(it still enters Megatron's world-size check ETP x EP x PP)",
        "unset parallelism.expert_tensor_parallel_size",
    )


ACCOUNT_EMB = "parallelism.account_for_embedding_in_pipeline_split"
ACCOUNT_LOSS = "parallelism.account_for_loss_in_pipeline_split"
FIRST_STAGE = "parallelism.decoder_first_pipeline_num_layers"
LAST_STAGE = "parallelism.decoder_last_pipeline_num_layers"


def _accounts(c: Ctx) -> bool:
    return c.account_for_embedding_in_pipeline_split or c.account_for_loss_in_pipeline_split


def _set_accounts(c: Ctx) -> list[str]:
    return [f for f, on in ((ACCOUNT_EMB, c.account_for_embedding_in_pipeline_split),
                            (ACCOUNT_LOSS, c.account_for_loss_in_pipeline_split)) if on]


def split_conflict(c: Ctx) -> bool:
    """decoder_first/last_pipeline_num_layers together with an embedding/loss-aware split."""
    return _accounts(c) and (c.decoder_first_pipeline_num_layers is not None
                             or c.decoder_last_pipeline_num_layers is not None)


@rule(
    "uneven_split_with_account_for",
    "error",
    AREA,
    "first/last stage layers and the embedding/loss-aware split are exclusive",
    when=split_conflict,
)
def _split_conflict(c: Ctx):
    # TransformerConfig.__post_init__ raises ValueError "num_layers_in_first_pipeline_stage and
    # num_layers_in_last_pipeline_stage cannot be set at the same time with
    # account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split".
    return (
        [FIRST_STAGE, LAST_STAGE, *_set_accounts(c)],
        "decoder_first/last_pipeline_num_layers cannot be set together with "
        "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split (Megatron's "
        "TransformerConfig rejects the pair)",
        "unset parallelism.decoder_first_pipeline_num_layers and decoder_last_pipeline_num_layers, or set "
        "account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split false",
    )


@rule(
    "account_for_split_with_hybrid_pattern",
    "error",
    AREA,
    "the embedding/loss-aware split is not for hybrid models",
    when=lambda c: _accounts(c) and c.shape.hybrid_layer_pattern is not None,
)
def _split_hybrid(c: Ctx):
    # Megatron-LM validate_args asserts "--account-for-embedding-in-pipeline-split should not be used with
    # --hybrid-layer-pattern" (and the same for the loss).
    return (
        [*_set_accounts(c), "model.hybrid_layer_pattern"],
        "account_for_embedding/loss_in_pipeline_split should not be used with hybrid_layer_pattern "
        "(Megatron-LM validate_args)",
        "set them false and split stages with parallelism.decoder_first/last_pipeline_num_layers",
    )


def account_split_fix(num_layers: int, pp: int) -> str | None:
    """The embedding/loss-aware split that makes num_layers divide over pp stages, as a fix (None if none)."""
    if num_layers % pp == 0:
        return None
    if (num_layers + 2) % pp == 0:
        return ("set parallelism.account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split "
                f"true ({num_layers} layers + embedding + loss = {num_layers + 2} slots, {(num_layers + 2) // pp} "
                "per stage)")
    if (num_layers + 1) % pp == 0:
        return (f"set parallelism.account_for_loss_in_pipeline_split true ({num_layers} layers + loss = "
                f"{num_layers + 1} slots, {(num_layers + 1) // pp} per stage)")
    return None


def account_split_error(c: Ctx):
    """layers_not_divisible_by_pp's finding when the embedding/loss count as layers."""
    # TransformerConfig.__post_init__ / get_num_layers_to_build: num_layers (+1 embedding) (+1 loss) must be
    # divisible by pipeline_model_parallel_size.
    L = c.shape.num_layers
    slots = L + c.account_for_embedding_in_pipeline_split + c.account_for_loss_in_pipeline_split
    ok = [p for p in divisors(slots) if c.num_gpus % (c.tp * p * c.cp) == 0 and p > 1] or [1]
    return (
        [PP, "model.num_layers", *_set_accounts(c)],
        f"num_layers ({L}) after account_for_embedding/loss_in_pipeline_split ({slots} slots) must be divisible "
        f"by pipeline_model_parallel_size ({c.pp})",
        f"set parallelism.pipeline_model_parallel_size to {choices(nearest(c.pp, ok))}"
        + (f", or {fix}" if (fix := account_split_fix(L, c.pp)) else ""),
    )
