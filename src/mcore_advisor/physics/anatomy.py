"""One layer anatomy: the matrices of every layer kind Megatron-Core builds, with their shapes and
how tensor and expert parallelism split them. Model FLOPs (physics.flops and the profile job's
counter), parameter counts (total, and per rank for physics.memory and physics.step_time) and the
linear-weight shapes (TE's dummy weight gradients, the step time's weight-gradient accumulation)
and the widths of the activations each layer saves (physics.activations) are all computed from
it, so a layer is described once.

A layer is a tuple of blocks, each behind its own pre-norm: a GPT layer is ('attention', 'mlp') or
('attention', 'moe') (TransformerLayer: self-attention and MLP, two norms), a hybrid layer one of
('mamba',), ('attention',), ('mlp',), ('moe',) (HybridStack, models/hybrid/hybrid_layer_specs.py:
one block and one norm per symbol M, *, -, E). An MTP layer is one layer of the last decoder layer's
type plus the 'mtp' block (MultiTokenPredictionLayer: enorm, hnorm, eh_proj, final layernorm).

Splits, as Megatron builds the modules: 'column' (ColumnParallelLinear / TE 'column': the output
features split over TP, and the bias with them), 'row' (RowParallelLinear: the input features
split; the bias is added after the reduction and is whole on every rank), 'replicated' (whole on
every TP rank: MLA's linear_q_down_proj and linear_kv_down_proj, TELinear parallel_mode
'duplicated' in multi_latent_attention.py; the router's gating weight). Routed experts are split
over expert TP like an MLP and spread over EP.

FLOPs follow `num_floating_point_operations` (megatron/training/training.py): each counted matrix
x2 (multiply-add) x3 (forward, data-gradient, weight-gradient); the router, biases, norms (except
the ones Megatron adds: MLA's latent norms, MTP's three), softmax and activations are not counted.

Pure Python, standard library only: the profile job (launcher/entry) imports it on GPU images,
where `shape` is the job spec's JSON dump of a ModelShape (spec["model"]); everywhere else it is the
ModelShape itself. Only a Mamba mixer reads the schema (its d_inner, conv and in_proj widths, see
`_schema`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

Split = Literal["column", "row", "replicated"]
Convention = Literal["causal", "full"]

# Megatron's constants: 3 GEMMs per weight per step (fwd, dgrad, wgrad), 2 FLOPs per multiply-add.
FWD_BWD = 3
FMA = 2
GEMM = FWD_BWD * FMA

_TP_DIM = {"column": 0, "row": 1, "replicated": None}


@dataclass(frozen=True, slots=True)
class Matrix:
    """One linear layer: weight (out_features, in_features), how its TP group splits it, and whether
    Megatron builds it with a bias (add_bias_linear where the module passes it)."""

    name: str  # Megatron's module name
    out_features: int
    in_features: int
    split: Split
    bias: bool = False

    @property
    def weights(self) -> int:
        return self.out_features * self.in_features

    @property
    def params(self) -> int:
        return self.weights + (self.out_features if self.bias else 0)

    @property
    def tp_dim(self) -> int | None:
        """The weight dimension TP splits: 0 column-parallel, 1 row-parallel, None replicated."""
        return _TP_DIM[self.split]

    def params_on_rank(self, tp: Any) -> Any:
        """Parameters one rank of its TP group (size `tp`) holds."""
        if self.split == "replicated":
            return self.params
        bias = self.out_features if self.bias else 0
        return self.weights / tp + (bias / tp if self.split == "column" else bias)


@dataclass(frozen=True, slots=True)
class CoreAttention:
    """What core attention takes per token: `heads` query heads (split over TP), `kv_heads` key/value
    heads (GQA: the QKV projection's g groups, g = heads for MHA; MLA: heads, its up-projections make
    one key and value per head), `qk_dim` the width of each query and key head (MLA: d_qk + the RoPE
    part d_rope) and `v_dim` of each value head; `latent` for MLA (MLASelfAttention)."""

    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    latent: bool = False

    @property
    def kind(self) -> str:
        """'mla', 'gqa' (fewer key/value heads than query heads) or 'mha'."""
        return "mla" if self.latent else ("gqa" if self.kv_heads < self.heads else "mha")


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a layer (without its pre-norm).

    `matrices`: its linear layers (Megatron counts their FLOPs, TE casts them to FP8); `router`: an
    MoE block's gating linear (fp32/bf16 outside TE, not counted); `experts`: one routed expert's
    matrices (split over expert TP), `num_experts` of them spread over EP, `topk` per token;
    `whole_params`: other parameters whole on every TP rank (MLA's latent norms, --qk-layernorm's
    per-head norms, MTP's norms); `split_params`: other parameters split over TP (the Mamba mixer's
    conv1d, dt_bias, A_log, D and gated norm); `flops`: Megatron's model FLOPs per token, fwd + bwd,
    of the non-expert part (the token-linear part for attention); `core_width`: multiply-adds per
    token per attended key of core attention (QK^T and PV), 0 for other blocks; `core`: the attention
    block's core attention (heads and head widths), None for other blocks.
    """

    kind: str
    matrices: tuple[Matrix, ...] = ()
    router: Matrix | None = None
    experts: tuple[Matrix, ...] = ()
    num_experts: int = 0
    topk: int = 0
    whole_params: int = 0
    split_params: int = 0
    flops: float = 0.0
    core_width: int = 0
    core: CoreAttention | None = None

    @property
    def expert_flops(self) -> float:
        """Routed experts' FLOPs per token: top-k experts, each counted like an MLP."""
        return float(GEMM * self.topk * sum(m.weights for m in self.experts))

    @property
    def params(self) -> int:
        """All of the block's parameters (every routed expert included)."""
        router = self.router.params if self.router else 0
        return (sum(m.params for m in self.matrices) + router + self.whole_params + self.split_params
                + self.num_experts * self.expert_params)

    @property
    def expert_params(self) -> int:
        """One routed expert's parameters."""
        return sum(m.params for m in self.experts)

    def params_on_rank(self, tp: Any, ep: Any, etp: Any) -> tuple[Any, Any, Any]:
        """(non-expert, routed-expert, FP8-eligible) parameters on one rank: the matrices split by TP,
        the experts by EP x ETP; FP8-eligible = the matrices and experts (TE's linear layers)."""
        linear = sum(m.params_on_rank(tp) for m in self.matrices)
        router = self.router.params if self.router else 0
        experts = self.num_experts * sum(m.params_on_rank(etp) for m in self.experts) / ep
        return linear + router + self.whole_params + self.split_params / tp, experts, linear + experts


@dataclass(frozen=True, slots=True)
class Anatomy:
    """Every block kind a model has, its decoder layers and MTP layer as tuples of block kinds, and
    the embedding / output layer shapes (`vocab_matrix`)."""

    hidden_size: int
    blocks: Mapping[str, Block]
    layers: tuple[tuple[str, ...], ...]  # decoder layer i's blocks
    mtp_layer: tuple[str, ...]  # one MTP layer's blocks; () without MTP
    mtp_num_layers: int
    hybrid: bool
    norm_params: int  # one norm over hidden_size (LayerNorm: weight and bias; RMSNorm: weight)
    untie_embeddings_and_output_weights: bool
    learned_position_embedding: bool

    def vocab_matrix(self, name: str, vocab: int) -> Matrix:
        """The word embedding or the output layer: V x h, vocab rows split over TP (VocabParallelEmbedding,
        ColumnParallelLinear without bias); `vocab` padded as Megatron builds it."""
        return Matrix(name, vocab, self.hidden_size, "column")

    def layer_params_on_rank(self, blocks: tuple[str, ...], tp: Any, ep: Any, etp: Any) -> tuple[Any, Any, Any]:
        """(non-expert, expert, FP8-eligible) parameters of one layer on one rank, its pre-norms (one
        per block; the MTP block's norms are its own) whole."""
        dense = expert = fp8 = 0.0
        for kind in blocks:
            d, e, f = self.blocks[kind].params_on_rank(tp, ep, etp)
            dense, expert, fp8 = dense + d + (self.norm_params if kind != "mtp" else 0), expert + e, fp8 + f
        return dense, expert, fp8


# ---------------------------------------------------------------------------------------------
# Building the anatomy of a shape
# ---------------------------------------------------------------------------------------------


class _Fields:
    """Attribute access to a ModelShape's JSON dump (the profile job's spec["model"])."""

    _DEFAULTS = {"hybrid_layer_pattern": None, "qk_layernorm": False, "mtp_num_layers": 0, "num_experts": None,
                 "mamba_num_heads": 0, "mamba_head_dim": 0, "mamba_state_dim": 0, "mamba_num_groups": 0}

    def __init__(self, dump: Mapping[str, Any]) -> None:
        self._dump = dump

    def __getattr__(self, name: str) -> Any:
        value = self._dump.get(name)
        return self._DEFAULTS.get(name) if value is None else value


def _norm(f: Any, width: int) -> int:
    # LayerNorm has weight and bias, RMSNorm only a weight.
    return width * (2 if f.normalization == "LayerNorm" else 1)


def _attention(f: Any) -> Block:
    """Self-attention: fused QKV (column) + output projection (row), or MLA (MLASelfAttention).

    MLA: q down (h -> r_q, replicated) + q norm + q up (r_q -> n*(d_qk+d_rope), column), or one
    h -> n*(d_qk+d_rope) without q-LoRA; kv down (h -> r_kv+d_rope, replicated) + kv norm + kv up
    (r_kv -> n*(d_qk+d_v), column); output (n*d_v -> h, row). Only the output projection takes a
    bias (the MLA projections are built with bias=False). Megatron's count adds r_q + r_kv (the
    latent norms, "+ 1" per rank in transformer_flops). Core attention: n*(d_qk+d_rope) + n*d_v
    (MLA) or 2*n*d (QK^T and PV) multiply-adds per token and key.
    """
    h, n, bias = f.hidden_size, f.num_attention_heads, bool(f.add_bias_linear)
    if f.multi_latent_attention:
        dq, r_q, r_kv = f.qk_head_dim + f.qk_pos_emb_head_dim, f.q_lora_rank, f.kv_lora_rank
        q = ((Matrix("linear_q_down_proj", r_q, h, "replicated"), Matrix("linear_q_up_proj", n * dq, r_q, "column"))
             if r_q else (Matrix("linear_q_proj", n * dq, h, "column"),))
        mats = (*q, Matrix("linear_kv_down_proj", r_kv + f.qk_pos_emb_head_dim, h, "replicated"),
                Matrix("linear_kv_up_proj", n * (f.qk_head_dim + f.v_head_dim), r_kv, "column"),
                Matrix("linear_proj", h, n * f.v_head_dim, "row", bias))
        latent_norms = (r_q or 0) + r_kv
        whole = (_norm(f, r_q) if r_q else 0) + _norm(f, r_kv)
        core = CoreAttention(n, n, dq, f.v_head_dim, latent=True)
    else:
        d, g = f.kv_channels, f.num_query_groups
        mats = (Matrix("linear_qkv", (n + 2 * g) * d, h, "column", bias), Matrix("linear_proj", h, n * d, "row", bias))
        latent_norms = 0
        # --qk-layernorm: SelfAttention's q_layernorm and k_layernorm, each over one head (kv_channels).
        whole = 2 * _norm(f, d) if f.qk_layernorm else 0
        core = CoreAttention(n, g, d, d)
    flops = GEMM * (sum(m.weights for m in mats) + latent_norms)
    return Block("attention", mats, whole_params=whole, flops=float(flops),
                 core_width=core.heads * (core.qk_dim + core.v_dim), core=core)


def _mlp_matrices(f: Any, ffn: int) -> tuple[Matrix, ...]:
    """fc1 (h -> f, x2 with the SwiGLU gate; column) and fc2 (f -> h; row), with biases."""
    h, gates, bias = f.hidden_size, 2 if f.swiglu else 1, bool(f.add_bias_linear)
    return (Matrix("linear_fc1", gates * ffn, h, "column", bias), Matrix("linear_fc2", h, ffn, "row", bias))


def _mlp(f: Any) -> Block:
    mats = _mlp_matrices(f, f.ffn_hidden_size)
    return Block("mlp", mats, flops=float(GEMM * sum(m.weights for m in mats)))


def _moe(f: Any) -> Block:
    """MoE: the router (TopKRouter: E x h, bias with add_bias_linear, whole on every rank), routed
    experts (each an MLP of moe_ffn_hidden_size over expert TP, E of them over EP, top-k per token)
    and the shared expert (an MLP over TP)."""
    E, shared_f = f.num_experts, f.moe_shared_expert_intermediate_size or 0
    shared = _mlp_matrices(f, shared_f) if shared_f else ()
    return Block("moe", shared, router=Matrix("router", E, f.hidden_size, "replicated", bool(f.add_bias_linear)),
                 experts=_mlp_matrices(f, f.moe_ffn_hidden_size), num_experts=E, topk=f.moe_router_topk,
                 flops=float(GEMM * sum(m.weights for m in shared)))


def mamba_flops_per_token(f: Any) -> float:
    """Training FLOPs (fwd + bwd) of one Mamba layer per token, as Megatron-LM counts them.

    megatron/training/training.py `num_floating_point_operations` -> `hybrid_flops` ->
    `mamba_layer_flops`, times 3 for forward + backward: in_proj 2*h*(2*d_in + 2*G*N + heads),
    scan 7*d_in*N, out_proj 2*d_in*h, where Megatron takes d_in = 2*hidden_size even when
    mamba_num_heads x mamba_head_dim differs (Nemotron 3 Nano: 4096 built vs 5376 counted). This is
    the count behind Megatron's TFLOP/s log line; step_time times the GEMMs at their built sizes.
    """
    h, n, g, heads = f.hidden_size, f.mamba_state_dim, f.mamba_num_groups, f.mamba_num_heads
    d_in = 2 * h
    fwd = 2 * h * (2 * d_in + 2 * g * n + heads) + 7 * d_in * n + 2 * d_in * h
    return 3.0 * fwd


def _schema() -> Any:
    # The Mamba mixer's widths (d_inner, conv channels and kernel, in_proj) are the schema's, which
    # ModelShape, hf_import and the validators use too; imported here, not at module level, so that
    # the profile job can import this module without pydantic.
    from mcore_advisor import schemas

    return schemas


def _mamba(f: Any) -> Block:
    """Mamba-2 mixer (MambaMixer): in_proj (column; z, x, B, C, dt each split by TP) and out_proj
    (row), no biases (MambaMixer asserts bias=False); the depthwise conv1d over x, B and C (weight and
    bias, d_inner + 2*G*N channels), dt_bias, A_log and D (one per head) and the gated RMSNorm over
    d_inner, all split over TP (MambaMixer marks each tensor_model_parallel)."""
    s = _schema()
    other = s.mamba_conv_dim(f) * (s.MAMBA_CONV_KERNEL + 1) + 3 * f.mamba_num_heads + s.mamba_d_inner(f)
    return Block("mamba", _mamba_matrices(f), split_params=other, flops=mamba_flops_per_token(f))


def _mamba_matrices(f: Any) -> tuple[Matrix, ...]:
    h = f.hidden_size
    return (Matrix("in_proj", _schema().mamba_in_proj_width(f), h, "column"),
            Matrix("out_proj", h, _schema().mamba_d_inner(f), "row"))


def _mtp(f: Any) -> Block:
    """MTP's own parts: eh_proj (2h -> h, column, no bias) and enorm, hnorm and the final layernorm,
    which Megatron counts as 3h ("MTP eh norm + final norm")."""
    h = f.hidden_size
    eh = Matrix("eh_proj", h, 2 * h, "column")
    return Block("mtp", (eh,), whole_params=3 * _norm(f, h), flops=float(GEMM * (3 * h + eh.weights)))


_HYBRID_BLOCKS = {"M": ("mamba",), "*": ("attention",), "-": ("mlp",), "E": ("moe",)}
_BUILDERS = {"attention": _attention, "mlp": _mlp, "moe": _moe, "mamba": _mamba, "mtp": _mtp}


def _build(f: Any) -> Anatomy:
    pattern, L, mtp = f.hybrid_layer_pattern, f.num_layers, f.mtp_num_layers or 0
    moe_pattern = list(f.moe_layer_pattern or [0] * L) if f.num_experts else [0] * L
    if pattern:
        layers = tuple(_HYBRID_BLOCKS[c] for c in pattern)
    else:
        layers = tuple(("attention", "moe" if m else "mlp") for m in moe_pattern)
    # Megatron: MTP layers copy the type of the last decoder layer (a GPT layer, also in hybrids).
    mtp_layer = ("attention", "moe" if moe_pattern and moe_pattern[-1] else "mlp", "mtp") if mtp else ()
    kinds = {k for layer in (*layers, mtp_layer) for k in layer}
    return Anatomy(hidden_size=f.hidden_size, blocks={k: _BUILDERS[k](f) for k in sorted(kinds)}, layers=layers,
                   mtp_layer=mtp_layer, mtp_num_layers=mtp, hybrid=bool(pattern), norm_params=_norm(f, f.hidden_size),
                   untie_embeddings_and_output_weights=bool(f.untie_embeddings_and_output_weights),
                   learned_position_embedding=f.position_embedding_type == "learned_absolute")


@lru_cache(maxsize=1024)
def _cached(shape: Any) -> Anatomy:
    return _build(shape)


def _view(shape: Any) -> Any:
    return _Fields(shape) if isinstance(shape, Mapping) else shape


def anatomy(shape: Any) -> Anatomy:
    """The anatomy of a ModelShape (memoised) or of its JSON dump (the profile job's spec["model"])."""
    if isinstance(shape, Mapping):
        return _build(_Fields(shape))
    return _cached(shape)


def block(shape: Any, kind: str) -> Block:
    """The `kind` block ('attention', 'mlp', 'moe', 'mamba', 'mtp') of a shape: the anatomy's when a
    layer has one, else built from the shape's sizes (the memory model prices a GPT layer's two
    blocks for a hybrid's one-block layers, whichever of them the pattern uses). 'moe' needs
    num_experts and 'mamba' the Mamba sizes."""
    found = anatomy(shape).blocks.get(kind)
    if found is not None:
        return found
    if kind not in _BUILDERS:
        raise ValueError(f"block kind must be one of {sorted(_BUILDERS)}, got {kind!r}")
    return _BUILDERS[kind](_view(shape))


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def _flop_counted_layers(a: Anatomy) -> Counter:
    """How many times each block kind enters Megatron's count: every decoder layer's blocks, and for a
    GPT model each MTP layer (transformer_flops adds them to the dense or MoE layers by the last
    layer's type, plus their eh-projection and norms); hybrid_flops counts no MTP layer body."""
    counts = Counter(k for layer in a.layers for k in layer)
    if not a.hybrid:
        counts.update({k: a.mtp_num_layers for k in a.mtp_layer})
    return counts


def flops_per_token_parts(shape: Any, seq_length: int, convention: Convention, padded_vocab_size: int) -> dict[str, float]:
    """Megatron's model FLOPs per token (fwd + bwd) by part (physics.flops.FlopsPerToken's fields),
    and `num_attention_layers`. The logits GEMM runs once plus once per MTP layer on the padded vocab."""
    if convention not in ("causal", "full"):
        raise ValueError(f"convention must be 'causal' or 'full', got {convention!r}")
    a = anatomy(shape)
    n = _flop_counted_layers(a)
    b = a.blocks
    none = Block("none")
    attn, moe = b.get("attention", none), b.get("moe", none)
    # 'causal' counts half of the s x s score matrix (Megatron since 2025-03), 'full' all of it.
    core = GEMM * attn.core_width * seq_length * (0.5 if convention == "causal" else 1.0)
    return {
        "attention_linear_flops": float(attn.flops * n["attention"]),
        "core_attention_flops": float(core * n["attention"]),
        "dense_mlp_flops": float(b.get("mlp", none).flops * n["mlp"]),
        "moe_routed_flops": float(moe.expert_flops * n["moe"]),
        "moe_shared_flops": float(moe.flops * n["moe"]),
        "mtp_extra_flops": float(b.get("mtp", none).flops * n["mtp"]),
        "logits_flops": float(GEMM * a.vocab_matrix("output_layer", padded_vocab_size).weights * (a.mtp_num_layers + 1)),
        "mamba_flops": float(b.get("mamba", none).flops * n["mamba"]),
        "num_attention_layers": n["attention"],
    }


def flops_per_iteration(shape: Any, seq_length: int, global_batch_size: int, convention: Convention = "causal", *,
                        padded_vocab_size: int) -> float:
    """Model FLOPs of one global batch: Megatron's num_floating_point_operations(args, gbs) in
    `convention` ('causal' is what Megatron >= 0.12 logs; 'full' is older Megatron's and NeMo 24.x's)."""
    parts = flops_per_token_parts(shape, seq_length, convention, padded_vocab_size)
    per_token = sum(v for k, v in parts.items() if k != "num_attention_layers")
    return per_token * global_batch_size * seq_length


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameters of a model by part, as Megatron-Core builds it (unpadded vocab).

    Per-layer parts are summed over all decoder layers; `mtp` holds the MTP modules (their
    transformer layer, eh-projection and norms; the embedding and output layer are shared with
    the main model). Active = what one token touches: every non-expert parameter plus top-k
    routed experts (embedding and output layer included).
    """

    embedding: int  # word embedding V*h (+ learned position embedding s*h)
    attention: int  # Q/K/V (or MLA down/up) and output projections incl. biases, MLA's and --qk-layernorm's norms
    dense_mlp: int  # dense MLP blocks (fc1 incl. the SwiGLU gate, fc2, biases)
    moe_routed: int  # all routed experts of all MoE blocks
    moe_routed_active: int  # the top-k routed experts one token uses, all MoE blocks
    moe_shared: int  # shared expert(s), all MoE blocks
    router: int  # router weights (E x h, + E biases with add_bias_linear), all MoE blocks
    norms: int  # every block's pre-norm (two per GPT layer, one per hybrid layer) plus the final norm
    output: int  # separate output layer V*h when embeddings are untied, else 0
    mtp: int  # multi-token-prediction modules (0 when not counted or absent)
    mamba: int  # Mamba-2 mixers of a hybrid model, all Mamba layers

    @property
    def total(self) -> int:
        return (
            self.embedding + self.attention + self.dense_mlp + self.moe_routed + self.moe_shared
            + self.router + self.norms + self.output + self.mtp + self.mamba
        )

    @property
    def active(self) -> int:
        return self.total - self.moe_routed + self.moe_routed_active

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding - self.output


def param_counts(shape: Any, seq_length: int | None = None, include_mtp: bool = True) -> ParamCounts:
    """All parameters by part (see `ParamCounts`), from each block's matrices and norms.

    `seq_length` sizes the learned absolute position embedding (ignored for RoPE); published
    totals usually exclude MTP modules (DeepSeek-V3: 671B without, 685B with), hence
    `include_mtp`. GPT-OSS's attention sinks (n per layer) are not in ModelShape and not counted
    (< 0.001% of that model). Cross-checked against megatron/training/theoretical_memory_usage.py
    (see shared/reference/estimators.md §1a) and each catalog model's published total
    (tests/knowledge/test_model_catalog.py). Memoised for a ModelShape (the recommender asks often).
    """
    if isinstance(shape, Mapping):
        return _param_counts(shape, seq_length, include_mtp)
    return _param_counts_cached(shape, seq_length, include_mtp)


@lru_cache(maxsize=1024)
def _param_counts_cached(shape: Any, seq_length: int | None, include_mtp: bool) -> ParamCounts:
    return _param_counts(shape, seq_length, include_mtp)


def _param_counts(shape: Any, seq_length: int | None, include_mtp: bool) -> ParamCounts:
    a = anatomy(shape)
    b, h, V = a.blocks, a.hidden_size, _view(shape).vocab_size
    n = Counter(k for layer in a.layers for k in layer)
    moe = b.get("moe", Block("none"))

    def total(kind: str) -> int:
        return b[kind].params * n[kind] if kind in b else 0

    mtp_layer = sum(b[k].params + (a.norm_params if k != "mtp" else 0) for k in a.mtp_layer)
    shared = sum(m.params for m in moe.matrices)
    return ParamCounts(
        embedding=V * h + (seq_length * h if a.learned_position_embedding and seq_length else 0),
        attention=total("attention"),
        dense_mlp=total("mlp"),
        moe_routed=moe.num_experts * moe.expert_params * n["moe"],
        moe_routed_active=moe.topk * moe.expert_params * n["moe"],
        moe_shared=shared * n["moe"],
        router=(moe.router.params if moe.router else 0) * n["moe"],
        norms=a.norm_params * (sum(len(layer) for layer in a.layers) + 1),  # pre-norms + the final norm
        output=V * h if a.untie_embeddings_and_output_weights else 0,
        mtp=a.mtp_num_layers * mtp_layer if include_mtp else 0,
        mamba=total("mamba"),
    )


def count_params(shape: Any, seq_length: int | None = None, include_mtp: bool = True) -> int:
    """Total parameters (embeddings, attention incl. GQA/MLA, MLP incl. SwiGLU, MoE experts, router
    and shared experts, norms, untied output, Mamba mixers, MTP modules unless excluded)."""
    return param_counts(shape, seq_length, include_mtp).total


def count_active_params(shape: Any, seq_length: int | None = None, include_mtp: bool = False) -> int:
    """Parameters one token uses: all non-expert parameters plus its top-k routed experts."""
    return param_counts(shape, seq_length, include_mtp).active


@dataclass(frozen=True, slots=True)
class RankParams:
    dense: float  # non-expert params held by this rank (after TP)
    expert: float  # routed-expert params held by this rank (after EP x ETP)
    fp8_eligible: float  # linear weights of the decoder layers on this rank (TE casts these to FP8)


def rank_params(shape: Any, layers: list[int], *, first: bool, last: bool, tp: int, ep: int, etp: int,
                seq_length: int) -> RankParams:
    """Parameters on one pipeline rank holding decoder `layers` (global indices) of a ModelShape.

    Each layer's blocks as `Block.params_on_rank` splits them, its pre-norms whole. The first stage
    holds the word embedding (vocab padded to make_vocab_size_divisible_by * TP, split over TP) and a
    learned position embedding (whole). The last stage holds the final norm and an output layer when
    the embeddings are untied or PP > 1 (Megatron `setup_embeddings_and_output_layer` allocates one
    there, which the optimizer also updates), and the MTP layers with another embedding where PP > 1
    (GPTModel builds one wherever MTP runs and copies the first stage's weights into it).
    """
    a = anatomy(shape)
    dense = expert = fp8 = 0.0
    # one count per distinct layer kind (the search asks for thousands of stages)
    for kinds, n in Counter(a.layers[i] for i in layers).items():
        d, e, f = a.layer_params_on_rank(kinds, tp, ep, etp)
        dense, expert, fp8 = dense + n * d, expert + n * e, fp8 + n * f
    vocab = a.vocab_matrix("embedding", shape.padded_vocab_size(tp)).params_on_rank(tp)
    if first:
        dense += vocab + (seq_length * a.hidden_size if a.learned_position_embedding else 0)
    if last:
        dense += a.norm_params
        if a.untie_embeddings_and_output_weights or not first:
            dense += vocab
        if a.mtp_num_layers:
            d, e, _ = a.layer_params_on_rank(a.mtp_layer, tp, ep, etp)
            dense += a.mtp_num_layers * d + (0 if first else vocab)
            expert += a.mtp_num_layers * e
    return RankParams(dense=dense, expert=expert, fp8_eligible=fp8)


# A linear weight (out_features, in_features) and the dimension tensor parallelism splits: 0 for a
# column-parallel layer, 1 for a row-parallel one, None for one replicated on every TP rank.
LinearWeight = tuple[int, int, int | None]


def linear_weights(shape: Any) -> dict[str, tuple[LinearWeight, ...]]:
    """The linear layers of one block of each kind, by block: 'attention', 'mlp' (dense layers),
    'expert' (one routed expert; TP here means expert TP), 'shared_expert' and 'mamba', from the
    shape's sizes (empty where a size is 0), whether or not a layer has the block."""
    f = _view(shape)

    def rows(mats: tuple[Matrix, ...]) -> tuple[LinearWeight, ...]:
        return tuple((m.out_features, m.in_features, m.tp_dim) for m in mats)

    def mlp(ffn: int) -> tuple[LinearWeight, ...]:
        return rows(_mlp_matrices(f, ffn)) if ffn else ()

    return {"attention": rows(_attention(f).matrices), "mlp": mlp(f.ffn_hidden_size), "expert": mlp(f.moe_ffn_hidden_size),
            "shared_expert": mlp(f.moe_shared_expert_intermediate_size),
            "mamba": rows(_mamba_matrices(f)) if _schema().mamba_d_inner(f) else ()}
