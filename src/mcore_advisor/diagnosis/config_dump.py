"""A Plan from the config dump a Megatron-Bridge or NeMo log prints, plus what the caller adds.

Megatron-Bridge logs `ConfigContainer.log_non_default_values` (training/config.py): the model's
fields that differ from Megatron-Core's TransformerConfig, then [train], [dataset], ... blocks. It
leaves out the provider's own fields (vocab size, sequence length of the model) and the world size,
so the model comes from a catalog name (a config/provider class, the tokenizer's Hugging Face name,
or the caller) or from a shape that matches one catalog entry, and the GPU count from the caller or
Megatron's 'using world size' line. NeMo 2 / NeMo-Run print `Config[...](key=value, ...)` reprs and
NeMo 1 a YAML config; logparse collects all of them as 'section.key' -> value.

Pure: no I/O.
"""

from __future__ import annotations

import re

from mcore_advisor.knowledge import megatron_flags
from mcore_advisor.knowledge.models import catalog_model, model_catalog, resolve_model
from mcore_advisor.schemas import ModelSpec, Plan

# Sections tried in order for an unqualified key: Bridge/NeMo-1 blocks, then NeMo-Run reprs, then bare keys.
_SECTIONS = ("model", "train", "dataset", "ddp", "optimizer", "trainer", "strategy", "data", "inline", "")

# Megatron-LM argument names (the destinations knowledge/megatron_flags.py reads) under the names the
# Bridge / NeMo configs give them, where they differ: Megatron-Core's TransformerConfig (num_moe_experts),
# Bridge's dataset config (sequence_length), NeMo 1's YAML (encoder_seq_length, activations_checkpoint_*),
# ModelParallelConfig / NeMo's strategy (virtual_pipeline_model_parallel_size).
_CONFIG_NAMES = {
    "num_experts": ("num_moe_experts",),
    "seq_length": ("sequence_length", "encoder_seq_length"),
    "num_virtual_stages_per_pipeline_rank": ("virtual_pipeline_model_parallel_size",),
    "recompute_granularity": ("activations_checkpoint_granularity",),
    "recompute_method": ("activations_checkpoint_method",),
    "recompute_num_layers": ("activations_checkpoint_num_layers",),
}
# The model dimensions a dump gives (Megatron argument names), to find the catalog model.
_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
          "vocab_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size")
# What the table reads from a dump: the layout and recompute, precision and FP8, dropout and batch sizes.
_READ = ("parallelism.", "training.")


def _names(dest: str) -> tuple[str, ...]:
    return (dest, *_CONFIG_NAMES.get(dest, ()))


def _get(values: dict[str, str], *names: str) -> str | None:
    for name in names:
        for sec in _SECTIONS:
            v = values.get(f"{sec}.{name}" if sec else name)
            if v not in (None, "", "None", "null"):
                return v
    return None


def _int(values: dict[str, str], *names: str) -> int | None:
    v = _get(values, *names)
    try:
        return int(float(v)) if v is not None else None
    except ValueError:
        return None


def _squash(name: str) -> str:
    n = name.lower().rsplit("/", 1)[-1]
    for word in ("modelprovider", "provider", "config"):
        n = n.replace(word, "")
    return re.sub(r"[^a-z0-9]", "", n)


def catalog_key_for(names: list[str]) -> str | None:
    """The catalog model a config/provider class name ('Llama3Config8B', 'Qwen3MoEModelProvider30B_A3B') or a
    Hugging Face name ('meta-llama/Meta-Llama-3-8B') stands for, if any."""
    index = {}
    for key, m in model_catalog().items():
        for n in (key, *m.aliases):
            index.setdefault(_squash(n), key)
    for name in names:
        try:
            return catalog_model(name.rsplit("/", 1)[-1]).key
        except KeyError:
            pass
        key = index.get(_squash(name))
        if key is not None:
            return key
    return None


def _shape_match(shape: dict) -> str | None:
    """The one catalog model whose resolved shape has every dimension the dump gives (None: none or several
    that differ in vocabulary, which the dump does not give)."""
    dims = {k: v for k, v in shape.items() if k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                                    "ffn_hidden_size", "num_experts")}
    if len(dims) < 3:
        return None
    hits = []
    for key in model_catalog():
        s = resolve_model(ModelSpec(name=key))
        if all(getattr(s, k) == v for k, v in dims.items()):
            hits.append((key, s.vocab_size))
    vocabs = {v for _, v in hits}
    return hits[0][0] if hits and len(vocabs) == 1 else None


def plan_from_config_dump(values: dict[str, str], model_names: list[str], *, gpu: str | None, num_gpus: int | None,
                          model: str | None, seq_length: int | None, world_size: int | None,
                          global_batch_size: int | None = None) -> tuple[Plan, list[str]]:
    """A Plan from a Bridge/NeMo config dump (possibly empty); `model`, `num_gpus` and `seq_length` (the
    caller's) override it, `world_size` (Megatron's own line) and `global_batch_size` (the log's iteration
    lines) fill what it lacks. Raises ValueError naming exactly what is still missing."""
    notes: list[str] = []
    shape = {f: v for f in _SHAPE if (v := _int(values, *_names(f))) is not None}
    key = catalog_key_for([model] if model else []) or catalog_key_for(model_names) or _shape_match(shape)
    missing: list[str] = []
    if model and not key:
        raise KeyError(f"model {model!r} is not a catalog model; give a catalog name (see the models resource)")
    if key is None and not {"num_layers", "hidden_size", "num_attention_heads", "vocab_size"} <= set(shape):
        missing.append("model (a catalog name such as 'llama3-8b')")
    world = num_gpus or _int(values, "world_size") or _world_from_devices(values) or world_size
    if world is None:
        missing.append("num_gpus (the job's GPU count)")
    read = _read_with_the_table(values, shape)
    training, par = read["training"], read["parallelism"]
    seq = seq_length or training.get("seq_length")
    if seq is None and key is not None:
        seq = catalog_model(key).spec.seq_length_max
        if seq is not None:
            notes.append(f"the log gives no sequence length: assumed {key}'s context {seq} (give seq_length if it differs)")
    if seq is None:
        missing.append("seq_length")
    if missing:
        raise ValueError("the log has no Megatron arguments dump and its config (if any) does not say "
                         + ", ".join(missing) + "; give " + " and ".join(m.split(" (")[0] for m in missing)
                         + " with the log (or a full plan)")
    spec = {"name": key, **shape} if key else shape
    if key:
        notes.append(f"model read as catalog '{key}'" + (" (from the config dump)" if not model else ""))
    training["seq_length"] = seq
    if "global_batch_size" not in training and global_batch_size:
        training["global_batch_size"] = global_batch_size
    cluster = {"num_gpus": world, "gpu": gpu or "h100-sxm"}
    if gpu is None:
        notes.append("the log does not name the GPU: assumed h100-sxm (pass gpu)")
    plan = Plan.model_validate({"model": spec, "cluster": cluster, "training": training, "parallelism": par})
    return plan, notes


def _read_with_the_table(values: dict[str, str], shape: dict) -> dict[str, dict]:
    """The plan's parallelism and training fields the dump gives, read by megatron_flags.parse (the one
    Plan <-> Megatron table) from the dump's values under Megatron's argument names; the model's
    dimensions (`shape`) are context for the table's gates (EP only with experts)."""
    rows = [r for r in megatron_flags.TABLE if any(f.startswith(_READ) for f in
                                                   ((r.field,) if isinstance(r, megatron_flags.Entry) else r.fields))]
    args = {dest: v for row in rows for arg in row.args if (v := _get(values, *_names(dest := arg.key))) is not None}
    if (args.get("fp8") or "").lower() in ("false", "0"):
        args["fp8"] = None  # NeMo 1's `fp8: False`; Megatron prints None when FP8 is off
    parsed = megatron_flags.parse(args, {f"model.{k}": v for k, v in shape.items()})
    training = parsed.sections["training"]
    for k in ("attention_dropout", "hidden_dropout"):
        if not 0 <= training.get(k, 0) < 1:
            del training[k]  # not a probability (an unresolved interpolation, say): Megatron's plan default
    return {"training": training, "parallelism": parsed.sections["parallelism"]}


def _world_from_devices(values: dict[str, str]) -> int | None:
    devices, nodes = _int(values, "devices"), _int(values, "num_nodes")
    return devices * (nodes or 1) if devices else None
