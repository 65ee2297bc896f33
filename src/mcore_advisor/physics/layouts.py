"""The typed batch of layouts every physics array function takes: one row per candidate layout.

`LayoutBatch` holds a model, a sequence length and a global batch, the implementation choices
shared by all rows (`Implementation`) and one numpy array per layout field (TP, PP, DP, ...,
micro-batch, recompute, optimizer sharding). `LayoutBatch.from_plan(plan)` is the one-row batch
that `memory_breakdown` and `step_time` use; the layout search builds one batch of thousands of
rows and passes the per-layout stage tables it has already computed (`StageTable`), so the scalar
and the vectorised figures come from the same functions.

Pure data: no physics here (physics.memory and physics.step_time compute from it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

from mcore_advisor.knowledge.cuda_graphs import captured_parts
from mcore_advisor.schemas import (
    ImplementationSpec,
    ModelShape,
    Plan,
    layers_per_stage,
    pads_to_capacity,
    parallel_dims,
)

# recompute codes of LayoutBatch.recompute
RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL = 0, 1, 2
_RECOMPUTE_CODES = {None: RECOMPUTE_NONE, "selective": RECOMPUTE_SELECTIVE, "full": RECOMPUTE_FULL}
NUM_SLOTS = 4
"""Pipeline ranks evaluated per layout: the first, rank 1 (the most-loaded middle), rank PP-2 (the
least-loaded middle) and the last; padded by repeating the last when PP < 4."""


@dataclass(frozen=True, slots=True)
class Implementation:
    """Plan choices every row of a batch shares: kernels, buffers, the FP8 recipe, selective modules.

    `output_layer_wgrad_fusion` None follows gradient_accumulation_fusion (Megatron-LM with Apex);
    False = only the TE layers fuse (the profile job without Apex). `recompute_modules` None =
    Megatron's default ['core_attn'].
    """

    transformer_impl: Literal["transformer_engine", "local"]
    attention_backend: str
    grad_reduce_in_fp32: bool
    gradient_accumulation_fusion: bool
    cross_entropy_loss_fusion: bool
    cross_entropy_fusion_impl: Literal["native", "te"]
    moe_token_dispatcher_type: str
    moe_grouped_gemm: bool
    use_torch_fsdp2: bool
    expandable_segments: bool
    fp8_recipe: str
    fp8_param_gather: bool
    recompute_modules: tuple[str, ...] | None = None
    output_layer_wgrad_fusion: bool | None = None
    attention_softmax_in_fp32: bool = False
    masked_softmax_fusion: bool = True
    bias_activation_fusion: bool = True
    bias_dropout_fusion: bool = True
    apply_rope_fusion: bool = True
    check_for_nan_in_loss_and_grad: bool = True
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    cuda_graph_impl: str = "none"
    cuda_graph_modules: tuple[str, ...] = ()
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "optim_grads_params"
    use_precision_aware_optimizer: bool = False
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    moe_router_force_load_balancing: bool = False
    moe_permute_fusion: bool = False
    create_attention_mask_in_dataloader: bool = True
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    moe_routing_imbalance: float | None = None
    moe_expert_load_cv: float | None = None
    moe_heuristic_miss_share: float | None = None
    cublaslt_heuristics_cache_capacity: int | None = None

    @classmethod
    def of(cls, im: ImplementationSpec, *, fp8_recipe: str = "delayed", fp8_param_gather: bool = False,
           recompute_modules: tuple[str, ...] | list[str] | None = None, **overrides: Any) -> Implementation:
        """From a plan's ImplementationSpec plus the training/parallelism fields that act like kernel
        choices (FP8 recipe, selective modules, dropout rates in `overrides`); `overrides` replace any
        field (e.g. output_layer_wgrad_fusion)."""
        base = {name: getattr(im, name) for name in _FROM_SPEC}
        mods = tuple(recompute_modules) if recompute_modules is not None else None
        return cls(**{**base, "fp8_recipe": fp8_recipe, "fp8_param_gather": fp8_param_gather,
                      "recompute_modules": mods, "cuda_graph_modules": tuple(im.cuda_graph_modules or ()), **overrides})

    @property
    def pads_to_capacity(self) -> bool:
        """--moe-pad-expert-input-to-capacity takes effect (schemas.pads_to_capacity)."""
        return pads_to_capacity(self.moe_expert_capacity_factor, self.moe_pad_expert_input_to_capacity)

    @property
    def graphed(self) -> frozenset[str]:
        """The layer parts CUDA graphs capture (knowledge.cuda_graphs.captured_parts)."""
        return captured_parts(self.cuda_graph_impl, self.cuda_graph_modules)

    @property
    def unfused_attention(self) -> bool:
        """Whether core attention stores the s x s scores: the local spec always runs Megatron's own
        DotProductAttention (gpt_layer_specs.get_gpt_layer_local_submodules: LocalSpecProvider.core_attention,
        whatever --attention-backend says); with Transformer Engine only 'unfused' (TE's
        UnfusedDotProductAttention) and 'local' do. 'auto'/'flash'/'fused' are TE's flash-type kernels."""
        return self.transformer_impl == "local" or self.attention_backend in ("unfused", "local")

    @property
    def selective_modules(self) -> frozenset[str]:
        return frozenset(self.recompute_modules or ("core_attn",))


_FROM_SPEC = tuple(f.name for f in fields(Implementation) if f.name in ImplementationSpec.model_fields)


@dataclass(frozen=True)
class StageTable:
    """Per-row facts of the NUM_SLOTS evaluated pipeline ranks, each an array of shape (NUM_SLOTS, n).

    Parameters come from physics.memory.rank_params (one counter for memory and step time).
    `layers` is the rank's decoder layers over all its model chunks.
    """

    rank: np.ndarray
    layers: np.ndarray
    dense_params: np.ndarray  # non-expert parameters on the rank, after TP
    expert_params: np.ndarray  # routed-expert parameters on the rank, after EP x ETP
    fp8_params: np.ndarray  # linear weights TE casts to FP8
    first: np.ndarray  # bool: holds the embedding
    last: np.ndarray  # bool: holds the output layer and loss
    padded_vocab: np.ndarray  # shape (n,): the vocabulary padded for TP (ModelShape.padded_vocab_size)

    def take(self, idx: np.ndarray) -> StageTable:
        return StageTable(**{f.name: getattr(self, f.name)[..., idx] for f in fields(self)})


@dataclass(frozen=True)
class ActivationTable:
    """Per-row activation facts of the evaluated ranks (arrays of shape (NUM_SLOTS, n)) for one
    recompute variant ('none'/full: no modules recomputed; 'selective': the batch's modules).

    Saved bytes are linear in the micro-batch (every term scales with its tokens): `saved` is the
    rank's layers' bytes per micro-batch of one sample. The backward working set is the largest of
    affine pieces c + s*b (physics.memory.layer_backward_working_pieces), kept as (const, slope)
    columns. `mtp` = the bytes per sample of the MTP layers (last stage); `te_dummy_wgrad` = the bf16
    dummy weight gradients TE keeps with gradient-accumulation fusion.
    """

    saved: np.ndarray
    work_const: np.ndarray  # shape (pieces, NUM_SLOTS, n)
    work_slope: np.ndarray
    mtp: np.ndarray
    te_dummy_wgrad: np.ndarray

    def take(self, idx: np.ndarray) -> ActivationTable:
        return ActivationTable(**{f.name: getattr(self, f.name)[..., idx] for f in fields(self)})


_ARRAY_FIELDS = ("tp", "pp", "dp", "cp", "ep", "etp", "vp", "num_gpus", "micro_batch_size", "sequence_parallel", "fp8",
                 "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap",
                 "recompute", "recompute_block", "recompute_num_layers", "first_stage_layers", "last_stage_layers")
_BOOL_FIELDS = frozenset({"sequence_parallel", "fp8", "use_distributed_optimizer", "overlap_grad_reduce",
                          "overlap_param_gather", "tp_comm_overlap", "recompute_block"})


@dataclass(frozen=True)
class LayoutBatch:
    """Candidate layouts of one model, sequence and global batch, one row per layout.

    Array fields (numbers broadcast to the batch length): TP, PP, DP, CP, EP, ETP (0 = TP), VP (1 =
    not interleaved), the world size (0 = TP*PP*DP*CP), micro-batch, SP, FP8 (else bf16), distributed optimizer, DP/TP overlaps,
    recompute (RECOMPUTE_* code), recompute_block (full recompute method 'block', else 'uniform'),
    recompute_num_layers (0 = unset, which the validators reject with full recompute), and the
    uneven first/last stage layer counts (-1 = not set: the even split). Divisibility is not checked here
    (the validators do that).

    `stages` / `activations` / `activations_selective`: per-row tables a caller already has (the
    search gathers them per layout); None = computed from the rows by physics.memory.
    """

    shape: ModelShape
    seq_length: int
    global_batch_size: int
    impl: Implementation | None = None  # None = the ImplementationSpec defaults
    tp: Any = 1
    pp: Any = 1
    dp: Any = 1
    cp: Any = 1
    ep: Any = 1
    etp: Any = 0
    vp: Any = 1
    num_gpus: Any = 0
    micro_batch_size: Any = 1
    sequence_parallel: Any = False
    fp8: Any = False
    use_distributed_optimizer: Any = True
    overlap_grad_reduce: Any = True
    overlap_param_gather: Any = True
    tp_comm_overlap: Any = False
    recompute: Any = RECOMPUTE_NONE
    recompute_block: Any = False
    recompute_num_layers: Any = 0
    first_stage_layers: Any = -1
    last_stage_layers: Any = -1
    stages: StageTable | None = field(default=None, compare=False)
    activations: ActivationTable | None = field(default=None, compare=False)
    activations_selective: ActivationTable | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.impl is None:
            object.__setattr__(self, "impl", _DEFAULT_IMPL)
        values = [np.asarray(getattr(self, name)) for name in _ARRAY_FIELDS]
        n = max((v.size for v in values if v.ndim), default=1)
        for name, v in zip(_ARRAY_FIELDS, values, strict=True):
            kind = bool if name in _BOOL_FIELDS else np.int64
            if v.ndim == 0:
                a = np.array([v], dtype=kind) if n == 1 else np.full(n, v, dtype=kind)
            elif v.size == n:
                a = v.reshape(-1).astype(kind, copy=False)
            else:
                raise ValueError(f"LayoutBatch.{name}: {v.size} values for a batch of {n} rows")
            object.__setattr__(self, name, a)
        object.__setattr__(self, "etp", np.where(self.etp > 0, self.etp, self.tp))
        object.__setattr__(self, "vp", np.where(self.pp > 1, np.maximum(self.vp, 1), 1))
        object.__setattr__(self, "num_gpus", np.where(self.num_gpus > 0, self.num_gpus, self.tp * self.pp * self.dp * self.cp))

    def __len__(self) -> int:
        return int(self.tp.shape[0])

    @property
    def expert_dp(self) -> np.ndarray:
        """Data-parallel size of expert parameters: num_gpus / (ETP * EP * PP) (floored, at least 1)."""
        return np.maximum(1, self.num_gpus // (self.etp * self.ep * self.pp))

    @property
    def sp(self) -> np.ndarray:
        """SP as Megatron runs it: only with TP > 1."""
        return self.sequence_parallel & (self.tp > 1)

    @property
    def num_microbatches(self) -> np.ndarray:
        return np.maximum(1, self.global_batch_size // (self.micro_batch_size * self.dp))

    def select(self, mask: np.ndarray) -> LayoutBatch:
        """The rows where mask is true (a bool array or indices), tables included."""
        idx = np.arange(len(self))[mask]
        cols = {n: getattr(self, n)[idx] for n in _ARRAY_FIELDS}
        tables = {n: (t.take(idx) if t is not None else None)
                  for n, t in (("stages", self.stages), ("activations", self.activations),
                               ("activations_selective", self.activations_selective))}
        return LayoutBatch(self.shape, self.seq_length, self.global_batch_size, self.impl, **cols, **tables)

    @classmethod
    def from_plan(cls, plan: Plan, shape: ModelShape, **impl_overrides: Any) -> LayoutBatch:
        """The one-row batch of a plan (`impl_overrides`: Implementation fields to replace)."""
        d = parallel_dims(plan)
        tr, p = plan.training, plan.parallelism
        impl = Implementation.of(plan.implementation, fp8_recipe=tr.fp8_recipe, fp8_param_gather=tr.fp8_param_gather,
                                 recompute_modules=p.recompute_modules, attention_dropout=tr.attention_dropout,
                                 hidden_dropout=tr.hidden_dropout, **impl_overrides)
        return cls(
            shape=shape, seq_length=tr.seq_length, global_batch_size=tr.global_batch_size, impl=impl,
            tp=d.tp, pp=d.pp, dp=d.dp, cp=d.cp, ep=d.ep, etp=d.etp, vp=d.vp, num_gpus=d.world,
            micro_batch_size=tr.micro_batch_size,
            sequence_parallel=p.sequence_parallel, fp8=tr.precision == "fp8",
            use_distributed_optimizer=p.use_distributed_optimizer, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather, tp_comm_overlap=p.tp_comm_overlap,
            recompute=_RECOMPUTE_CODES[p.recompute_granularity], recompute_block=p.recompute_method == "block",
            recompute_num_layers=p.recompute_num_layers or 0,
            **dict(zip(("first_stage_layers", "last_stage_layers"), _split_code(p, shape.num_layers, d.pp), strict=True)),
        )


_DEFAULT_IMPL = Implementation.of(ImplementationSpec())


def _or_unset(layers: int | None, pp: int) -> int:
    return -1 if layers is None or pp == 1 else layers


def _split_code(p, num_layers: int, pp: int) -> tuple[int, int]:
    """(first, last) stage layers as a row encodes them. --account-for-embedding/loss-in-pipeline-split
    becomes the first/last stage layer counts Megatron builds (schemas.layers_per_stage); the middle
    stages are then the same. A split Megatron rejects keeps the even encoding (the validators report it)."""
    emb, loss = p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split
    if pp == 1 or not (emb or loss) or p.decoder_first_pipeline_num_layers is not None \
            or p.decoder_last_pipeline_num_layers is not None:
        return _or_unset(p.decoder_first_pipeline_num_layers, pp), _or_unset(p.decoder_last_pipeline_num_layers, pp)
    try:
        stages = layers_per_stage(num_layers, pp, embedding=emb, loss=loss)
    except ValueError:
        return -1, -1
    return stages[0], stages[-1]


def stage_split(first: int, last: int) -> tuple[int | None, int | None]:
    """(decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers) of a row's encoded split."""
    return (None if first < 0 else int(first)), (None if last < 0 else int(last))


__all__ = [
    "NUM_SLOTS", "RECOMPUTE_FULL", "RECOMPUTE_NONE", "RECOMPUTE_SELECTIVE",
    "ActivationTable", "Implementation", "LayoutBatch", "StageTable", "stage_split",
]
