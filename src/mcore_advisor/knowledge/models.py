"""Model catalog and resolution of a ModelSpec into a fully specified ModelShape.

Catalog entries (data/models.json) carry each model's published architecture with its source and
its published total (and, for MoE, active) parameter count, which tests/knowledge/test_model_catalog.py
compares with physics.anatomy's count (the one description of a layer, which knowledge may not
import) as a check on both the catalog and the counting.
"""

from __future__ import annotations

import difflib
import json
from functools import cache, lru_cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.knowledge.hf_import import model_from_hf_config
from mcore_advisor.schemas import (
    HYBRID_LAYER_SYMBOLS,
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
