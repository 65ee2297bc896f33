"""Model catalog and resolution of a ModelSpec into a fully specified ModelShape."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field

from mcore_advisor.schemas import ModelShape, ModelSpec


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
    raw = json.loads(resources.files(__package__).joinpath("data/models.json").read_text())
    return {m["key"]: CatalogModel(**m) for m in raw["models"]}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def catalog_model(name: str) -> CatalogModel:
    """Look up by key or alias (case-insensitive); KeyError names close matches."""
    cat = model_catalog()
    n = _norm(name)
    for m in cat.values():
        if n == m.key or n in (_norm(a) for a in m.aliases):
            return m
    close = [k for k in cat if n.split("-")[0] in k][:8] or sorted(cat)[:12]
    raise KeyError(f"unknown model {name!r}; known include: {', '.join(close)} (or give num_layers, hidden_size, num_attention_heads, vocab_size explicitly)")


_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")


def resolve_model(spec: ModelSpec) -> ModelShape:
    """Catalog entry (if named) + explicit overrides + Megatron's defaults -> ModelShape.

    Raises KeyError for an unknown name and ValueError naming a missing required field.
    """
    base: dict = {}
    if spec.name:
        base = catalog_model(spec.name).spec.model_dump(exclude_none=True)
    base.update(spec.model_dump(exclude_none=True))
    missing = [f for f in _REQUIRED if base.get(f) is None]
    if missing:
        raise ValueError(f"model.{missing[0]} is required when model.name is not a catalog model (missing: {', '.join(missing)})")
    L, h, n = base["num_layers"], base["hidden_size"], base["num_attention_heads"]
    E = base.get("num_experts")
    freq = base.get("moe_layer_freq", 1)
    if not E:
        pattern = (0,) * L
    elif isinstance(freq, list):
        if len(freq) != L:
            raise ValueError(f"model.moe_layer_freq has {len(freq)} entries but num_layers is {L}")
        pattern = tuple(1 if x else 0 for x in freq)
    else:
        # Megatron: layer i is MoE when i % freq == 0
        pattern = tuple(1 if i % freq == 0 else 0 for i in range(L))
    ffn = base.get("ffn_hidden_size", 4 * h)
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
    )
