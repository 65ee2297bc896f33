"""Model catalog, resolution of a ModelSpec into a fully specified ModelShape, and parameter counts.

Catalog entries (data/models.json) carry each model's published architecture with its source and
its published total (and, for MoE, active) parameter count, which tests compare with
`count_params` as a check on both the catalog and the counting.
"""

from __future__ import annotations

import difflib
import json
from functools import cache, lru_cache
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hf_import import model_from_hf_config
from mcore_advisor.schemas import (
    HYBRID_LAYER_SYMBOLS,
    MAMBA_CONV_KERNEL,
    MODEL_SETTINGS,
    ModelShape,
    ModelSpec,
)


class CatalogModel(BaseModel):
    """A catalog entry: the ModelSpec fields plus provenance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    display_name: str
    aliases: list[str] = Field(default_factory=list)
    spec: ModelSpec
    total_params_b: float | None = Field(None, description="Published total parameter count, billions (a check on our count).")
    active_params_b: float | None = Field(None, description="Published active parameters per token for MoE, billions.")
    source: str


@cache
def model_catalog() -> dict[str, CatalogModel]:
    raw = json.loads(resources.files(__package__).joinpath("data/models.json").read_text(encoding="utf-8"))
    return {m["key"]: CatalogModel(**m) for m in raw["models"]}


def normalize_key(name: str) -> str:
    """Catalog key form of a name: case-insensitive, '_' and ' ' read as '-' (models and GPUs)."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


@cache
def _name_index() -> dict[str, str]:
    """Normalized key or alias -> catalog key (built once; lookups run inside search loops)."""
    index: dict[str, str] = {}
    for m in model_catalog().values():
        for n in (m.key, *m.aliases):
            index.setdefault(normalize_key(n), m.key)
    return index


def catalog_model(name: str) -> CatalogModel:
    """Look up by key or alias (case-insensitive, '_' = '-'); KeyError lists close matches and every key."""
    cat = model_catalog()
    n = normalize_key(name)
    key = _name_index().get(n)
    if key is not None:
        return cat[key]
    close = difflib.get_close_matches(n, list(_name_index()), n=5, cutoff=0.6)
    hint = f"closest: {', '.join(close)}; " if close else ""
    raise KeyError(
        f"unknown model {name!r} (model.name); {hint}known: {', '.join(sorted(cat))} "
        "(or give num_layers, hidden_size, num_attention_heads, vocab_size explicitly)"
    )


_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def resolve_model(spec: ModelSpec) -> ModelShape:
    """Catalog entry (if named) + explicit overrides + Megatron's defaults -> ModelShape.

    Raises KeyError for an unknown name and ValueError naming a missing required field.
    Cached on the spec's content: the recommender resolves the same spec many times.
    """
    return _resolve_cached(spec.model_dump_json())


@lru_cache(maxsize=4096)
def _resolve_cached(spec_json: str) -> ModelShape:
    spec = ModelSpec.model_validate_json(spec_json)
    base: dict = {}
    if spec.name and spec.hf_config:
        raise ValueError("model.name and model.hf_config are both given: keep one (explicit fields override either)")
    if spec.name:
        base = catalog_model(spec.name).spec.model_dump(exclude_none=True)
    elif spec.hf_config:
        base = model_from_hf_config(spec.hf_config).model_dump(exclude_none=True)
    base.update(spec.model_dump(exclude_none=True, exclude={"hf_config"}))
    hybrid = base.get("hybrid_layer_pattern")
    if hybrid is not None:
        _check_hybrid(hybrid, base, explicit_layers=spec.num_layers)
        base["num_layers"] = len(hybrid)
    missing = [f for f in _REQUIRED if base.get(f) is None]
    if missing:
        raise ValueError(f"model.{missing[0]} is required when model.name is not a catalog model (missing: {', '.join(missing)})")
    L, h, n = base["num_layers"], base["hidden_size"], base["num_attention_heads"]
    E = base.get("num_experts")
    freq = base.get("moe_layer_freq", 1)
    if not E:
        pattern = (0,) * L
    elif hybrid is not None:
        pattern = tuple(1 if x == "E" else 0 for x in hybrid)
    elif isinstance(freq, list):
        if len(freq) != L:
            raise ValueError(f"model.moe_layer_freq has {len(freq)} entries but num_layers is {L}")
        pattern = tuple(1 if x else 0 for x in freq)
    else:
        # Megatron: layer i is MoE when i % freq == 0
        pattern = tuple(1 if i % freq == 0 else 0 for i in range(L))
    # Megatron-LM validate_args: with --swiglu and no --ffn-hidden-size, ffn = int(8h/3 / 64) * 64
    # (two input projections, so the 4h MLP's parameter count is kept); TransformerConfig: 4h otherwise.
    default_ffn = int((4 * h * 2 / 3) / 64) * 64 if base.get("swiglu") else 4 * h
    ffn = base.get("ffn_hidden_size", default_ffn)
    mla = bool(base.get("multi_latent_attention", False))
    d = base.get("kv_channels", h // n)
    return ModelShape(
        name=base.get("name"),
        num_layers=L,
        hidden_size=h,
        num_attention_heads=n,
        num_query_groups=base.get("num_query_groups", n),
        kv_channels=d,
        ffn_hidden_size=ffn,
        vocab_size=base["vocab_size"],
        make_vocab_size_divisible_by=base.get("make_vocab_size_divisible_by", 128),
        swiglu=base.get("swiglu", False),
        normalization=base.get("normalization", "LayerNorm"),
        add_bias_linear=base.get("add_bias_linear", not base.get("swiglu", False)),
        untie_embeddings_and_output_weights=base.get("untie_embeddings_and_output_weights", False),
        position_embedding_type=base.get("position_embedding_type", "rope"),
        num_experts=E,
        moe_router_topk=base.get("moe_router_topk", 2) if E else 0,
        moe_ffn_hidden_size=base.get("moe_ffn_hidden_size", ffn) if E else 0,
        moe_shared_expert_intermediate_size=base.get("moe_shared_expert_intermediate_size", 0) if E else 0,
        moe_layer_pattern=pattern,
        multi_latent_attention=mla,
        q_lora_rank=base.get("q_lora_rank") if mla else None,
        kv_lora_rank=base.get("kv_lora_rank", 512) if mla else 0,
        qk_head_dim=base.get("qk_head_dim", 128) if mla else d,
        qk_pos_emb_head_dim=base.get("qk_pos_emb_head_dim", 64) if mla else 0,
        v_head_dim=base.get("v_head_dim", 128) if mla else d,
        mtp_num_layers=base.get("mtp_num_layers", 0) or 0,
        hybrid_layer_pattern=hybrid,
        qk_layernorm=bool(base.get("qk_layernorm", False)),
        **{k: base.get(k) for k in MODEL_SETTINGS},
        **_mamba_dims(base) if hybrid and "M" in hybrid else {},
    )


def _mamba_dims(base: dict) -> dict:
    # TransformerConfig defaults (mamba_head_dim 64, mamba_state_dim 128, mamba_num_groups 8);
    # MambaMixer: nheads = expand * d_model / headdim with expand = 2 when mamba_num_heads is None.
    head_dim = base.get("mamba_head_dim", 64)
    heads = base.get("mamba_num_heads") or 2 * base["hidden_size"] // head_dim
    return dict(mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_state_dim=base.get("mamba_state_dim", 128),
                mamba_num_groups=base.get("mamba_num_groups", 8))


def _check_hybrid(pattern: str, base: dict, explicit_layers: int | None) -> None:
    """Reject hybrid patterns this model cannot describe, naming the field and the fix."""
    bad = sorted(set(pattern) - set(HYBRID_LAYER_SYMBOLS))
    if bad:
        known = ", ".join(f"'{k}' {v}" for k, v in HYBRID_LAYER_SYMBOLS.items())
        raise ValueError(
            f"model.hybrid_layer_pattern has unsupported symbol(s) {', '.join(repr(b) for b in bad)}; "
            f"supported: {known}. Pipeline '|' and MTP '/' segments are not modelled: give the main "
            "pattern alone and split stages with parallelism.decoder_first/last_pipeline_num_layers"
        )
    if explicit_layers is not None and explicit_layers != len(pattern):
        raise ValueError(
            f"model.num_layers ({explicit_layers}) differs from the {len(pattern)} layers of "
            "model.hybrid_layer_pattern; Megatron takes the layer count from the pattern: drop "
            "model.num_layers or give a pattern of that many symbols"
        )
    if "E" in pattern and not base.get("num_experts"):
        raise ValueError("model.hybrid_layer_pattern has MoE ('E') layers but model.num_experts is unset: set it")
    if base.get("mtp_num_layers"):
        raise ValueError("model.mtp_num_layers with model.hybrid_layer_pattern is not modelled: set mtp_num_layers to 0")
    if base.get("multi_latent_attention"):
        raise ValueError("model.multi_latent_attention with model.hybrid_layer_pattern is not modelled ('*' layers "
                         "are standard attention): set multi_latent_attention to false")


# ---------------------------------------------------------------------------------------------
# Parameter counts
# ---------------------------------------------------------------------------------------------


class ParamCounts(BaseModel):
    """Parameters of a resolved model by part, as Megatron-Core builds it (unpadded vocab).

    Per-layer parts are summed over all decoder layers; `mtp` holds the MTP modules (their
    transformer layer, eh-projection and norms; the embedding and output layer are shared with
    the main model). Active = what one token touches: every non-expert parameter plus top-k
    routed experts (embedding and output layer included).
    """

    model_config = ConfigDict(frozen=True)

    embedding: int = Field(description="Word embedding V*h (+ learned position embedding s*h).")
    attention: int = Field(description="Q/K/V (or MLA down/up) and output projections incl. biases and MLA's internal norms.")
    dense_mlp: int = Field(description="Dense MLP layers (fc1 incl. the SwiGLU gate, fc2, biases).")
    moe_routed: int = Field(description="All routed experts of all MoE layers.")
    moe_routed_active: int = Field(description="The top-k routed experts one token uses, all MoE layers.")
    moe_shared: int = Field(description="Shared expert(s), all MoE layers.")
    router: int = Field(description="Router weights (h*E, + E biases with add_bias_linear), all MoE layers.")
    norms: int = Field(description="Pre-attention and pre-MLP norms of every layer (one pre-norm per hybrid layer) plus the final norm.")
    output: int = Field(description="Separate output layer V*h when embeddings are untied, else 0.")
    mtp: int = Field(description="Multi-token-prediction modules (0 when not counted or absent).")
    mamba: int = Field(0, description="Mamba-2 mixers of a hybrid model, all Mamba layers.")

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


def norm_params(shape: ModelShape, width: int) -> int:
    # LayerNorm has weight and bias, RMSNorm only a weight.
    return width * (2 if shape.normalization == "LayerNorm" else 1)


def attention_params_per_layer(shape: ModelShape) -> int:
    """One attention block's parameters (without its pre-norm): its linear weights
    (`linear_weights`), MLA's q and kv norms, --qk-layernorm's per-head norms, and biases with
    add_bias_linear (`attention_params_per_rank` on one rank).

    MHA/GQA: Q (h x n*d), K and V (h x g*d each), output (n*d x h).
    MLA (DeepSeek-V2/V3, Megatron `MLASelfAttention`): q down (h x r_q) + q norm (r_q) + q up
    (r_q x n*(d_qk+d_rope)), or one h x n*(d_qk+d_rope) without q-LoRA; kv down
    (h x (r_kv+d_rope)) + kv norm (r_kv) + kv up (r_kv x n*(d_qk+d_v)); output (n*d_v x h).
    """
    return int(attention_params_per_rank(shape, 1))


def attention_params_per_rank(shape: ModelShape, tp: Any) -> Any:
    """One attention block's parameters held by one TP rank (`tp` may be a numpy array).

    Column- and row-parallel weights are split by TP; MLA's down-projections (linear_q_down_proj,
    linear_kv_down_proj: TELinear with parallel_mode 'duplicated' in Megatron's MLA layer spec) and
    its q/kv latent norms, and the per-head q/k norms of --qk-layernorm, are whole on every rank;
    biases are counted split (the row-parallel output bias, h, is whole but negligible).
    """
    lw = linear_weights(shape)["attention"]
    weights = sum(r * c / (tp if split is not None else 1) for r, c, split in lw)
    h, n = shape.hidden_size, shape.num_attention_heads
    if shape.multi_latent_attention:
        norms = (norm_params(shape, shape.q_lora_rank) if shape.q_lora_rank else 0) + norm_params(shape, shape.kv_lora_rank)
        bias = (n * (shape.qk_head_dim + shape.qk_pos_emb_head_dim) + h) if shape.add_bias_linear else 0
    else:
        d, g = shape.kv_channels, shape.num_query_groups
        # --qk-layernorm: SelfAttention's q_layernorm and k_layernorm, each over one head (kv_channels).
        norms = 2 * norm_params(shape, d) if shape.qk_layernorm else 0
        bias = (n * d + 2 * g * d + h) if shape.add_bias_linear else 0
    return weights + norms + bias / tp


def mamba_params_per_layer(shape: ModelShape) -> int:
    """One Mamba-2 mixer's parameters (without its pre-norm), as Megatron's MambaMixer builds them:
    in_proj and out_proj (`linear_weights`), the depthwise conv1d over x, B and C (weight and bias,
    conv_dim = d_inner + 2*G*N wide), dt_bias, A_log and D (one per head), and the gated RMSNorm
    over d_inner. No linear biases (MambaMixer asserts bias=False)."""
    if not shape.num_mamba_layers:
        return 0
    conv_dim = shape.mamba_d_inner + 2 * shape.mamba_num_groups * shape.mamba_state_dim
    weights = sum(r * c for r, c, _ in linear_weights(shape)["mamba"])
    return weights + conv_dim * (MAMBA_CONV_KERNEL + 1) + 3 * shape.mamba_num_heads + shape.mamba_d_inner


def mlp_params(shape: ModelShape, ffn: int) -> int:
    """One MLP of inner size `ffn`: fc1 (h x f, x2 with the SwiGLU gate), fc2 (f x h), biases."""
    h = shape.hidden_size
    gates = 2 if shape.swiglu else 1
    bias = (gates * ffn + h) if shape.add_bias_linear else 0
    return (gates + 1) * h * ffn + bias


# A linear weight (out_features, in_features) and the dimension tensor parallelism splits: 0 for a
# column-parallel layer, 1 for a row-parallel one, None for one replicated on every TP rank.
LinearWeight = tuple[int, int, int | None]


def linear_weights(shape: ModelShape) -> dict[str, tuple[LinearWeight, ...]]:
    """The linear layers of one transformer layer, by block: 'attention', 'mlp' (dense layers),
    'expert' (one routed expert; TP here means expert TP), 'shared_expert' and 'mamba' (a hybrid
    model's Mamba-2 mixer; empty without one). Megatron-Core's
    layout: fused QKV (column) + output projection (row); MLA's down-projections are replicated,
    its up-projections column-parallel; fc1 (with the SwiGLU gate) column, fc2 row."""
    h, n = shape.hidden_size, shape.num_attention_heads
    gates = 2 if shape.swiglu else 1
    if shape.multi_latent_attention:
        dq = shape.qk_head_dim + shape.qk_pos_emb_head_dim
        r_q, r_kv = shape.q_lora_rank, shape.kv_lora_rank
        q = ((r_q, h, None), (n * dq, r_q, 0)) if r_q else ((n * dq, h, 0),)
        attn = (*q, (r_kv + shape.qk_pos_emb_head_dim, h, None), (n * (shape.qk_head_dim + shape.v_head_dim), r_kv, 0),
                (h, n * shape.v_head_dim, 1))
    else:
        d, g = shape.kv_channels, shape.num_query_groups
        attn = (((n + 2 * g) * d, h, 0), (h, n * d, 1))

    def mlp(f: int | None) -> tuple[LinearWeight, ...]:
        return ((gates * f, h, 0), (h, f, 1)) if f else ()

    # Mamba-2: in_proj packs z, x, B, C, dt (2*d_inner + 2*G*N + heads outputs, column-parallel, each
    # part split by TP); out_proj is row-parallel.
    di = shape.mamba_d_inner
    mamba = ((2 * di + 2 * shape.mamba_num_groups * shape.mamba_state_dim + shape.mamba_num_heads, h, 0),
             (h, di, 1)) if di else ()
    return {"attention": attn, "mlp": mlp(shape.ffn_hidden_size), "expert": mlp(shape.moe_ffn_hidden_size),
            "shared_expert": mlp(shape.moe_shared_expert_intermediate_size), "mamba": mamba}


@lru_cache(maxsize=1024)
def param_counts(shape: ModelShape, seq_length: int | None = None, include_mtp: bool = True) -> ParamCounts:
    """Count parameters part by part; see `ParamCounts` for what each part holds.

    `seq_length` sizes the learned absolute position embedding (ignored for RoPE); published
    totals usually exclude MTP modules (DeepSeek-V3: 671B without, 685B with), hence
    `include_mtp`. GPT-OSS's attention sinks (n per layer) are not in ModelShape and not counted
    (< 0.001% of that model).
    Derivation: Megatron-Core GPTModel + TransformerLayer modules (HybridModel's Mamba, attention,
    MLP and MoE layers for a hybrid pattern, each with one pre-norm); cross-checked against
    megatron/training/theoretical_memory_usage.py (see shared/reference/estimators.md §1a).
    """
    h, V, E = shape.hidden_size, shape.vocab_size, shape.num_experts or 0
    embedding = V * h
    if shape.position_embedding_type == "learned_absolute" and seq_length:
        embedding += seq_length * h
    attn = attention_params_per_layer(shape)
    layer_norms = norms_per_layer(shape) * norm_params(shape, h)
    n_moe = shape.num_moe_layers if E else 0
    n_dense = shape.num_dense_layers
    dense = mlp_params(shape, shape.ffn_hidden_size)
    expert = mlp_params(shape, shape.moe_ffn_hidden_size) if E else 0
    shared = mlp_params(shape, shape.moe_shared_expert_intermediate_size) if E and shape.moe_shared_expert_intermediate_size else 0
    router = (h * E + (E if shape.add_bias_linear else 0)) if E else 0
    mtp = 0
    if include_mtp and shape.mtp_num_layers:
        # Megatron MTP: a layer of the last decoder layer's type, enorm + hnorm, eh_proj (2h x h),
        # and a final norm; embedding and output layer are shared with the main model.
        last_is_moe = bool(E) and shape.moe_layer_pattern[-1] == 1
        layer = attn + 2 * norm_params(shape, h) + ((E * expert + shared + router) if last_is_moe else dense)
        mtp = shape.mtp_num_layers * (layer + 2 * h * h + 3 * norm_params(shape, h))
    return ParamCounts(
        embedding=embedding,
        attention=attn * shape.num_attention_layers,
        dense_mlp=dense * n_dense,
        moe_routed=E * expert * n_moe,
        moe_routed_active=shape.moe_router_topk * expert * n_moe,
        moe_shared=shared * n_moe,
        router=router * n_moe,
        norms=layer_norms * shape.num_layers + norm_params(shape, h),
        output=V * h if shape.untie_embeddings_and_output_weights else 0,
        mtp=mtp,
        mamba=mamba_params_per_layer(shape) * shape.num_mamba_layers,
    )


def norms_per_layer(shape: ModelShape) -> int:
    """Pre-norms per decoder layer: a GPT layer has two (attention, MLP), a hybrid layer one."""
    return 1 if shape.is_hybrid else 2


def count_params(shape: ModelShape, seq_length: int | None = None, include_mtp: bool = True) -> int:
    """Total parameters of a resolved model (embeddings, attention incl. GQA/MLA, MLP incl. SwiGLU,
    MoE experts/router/shared experts, norms, untied output, MTP modules unless excluded)."""
    return param_counts(shape, seq_length, include_mtp).total


def count_active_params(shape: ModelShape, seq_length: int | None = None, include_mtp: bool = False) -> int:
    """Parameters one token uses: all non-expert parameters plus its top-k routed experts."""
    return param_counts(shape, seq_length, include_mtp).active
