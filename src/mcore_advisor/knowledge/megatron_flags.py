"""Plan fields <-> Megatron-LM arguments: the one table.

Every plan field that reaches Megatron-LM's `pretrain_gpt.py` (or `pretrain_hybrid.py` for a hybrid Mamba
model: the same arguments plus the hybrid rows) has one row here: its flag, the
argparse destination the flag stores into (what Megatron's `---- arguments ----` dump and a profile
job's result.json print), how it is given (`value`, `store_true`, `store_false`, `list` for nargs
'+'/'*'), Megatron's parser default (megatron/training/arguments.py, megatron-core 0.19.2) and why it
is passed. Both directions iterate the table:

- `render(view, group)` gives the flags of one group of the script (rendering/megatron_args.py puts the
  groups in order between the flags that come from render options);
- `parse(args)` reads the plan fields back from Megatron's parsed arguments: a log's dump
  (diagnosis/logparse.py), a profile job's recorded settings (launcher/as_ran.py) or a published run
  described as the arguments it ran with (knowledge/runs.py).

Where a flag is not a plain copy of one field (GQA's pair of flags, the interleaved schedule, the
recompute family, RoPE scaling, the local spec's --no-rope-fusion, a derived
--no-gradient-accumulation-fusion, ...) the row is a `Special`: a small named render function and its
inverse. Gates (MoE, MLA, RoPE, FP8, ...) are named predicates over plan fields, evaluated on the plan
when rendering and on the parsed fields when parsing, so a flag that is not rendered for a plan is
not read back for it either. Pure: no I/O.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mcore_advisor.schemas import (
    MODEL_SETTINGS,
    ClusterSpec,
    ImplementationSpec,
    ModelShape,
    ModelSpec,
    ParallelismSpec,
    Plan,
    TrainingSpec,
    layers_per_stage,
    parallel_dims,
)

Kind = Literal["value", "store_true", "store_false", "list"]
Get = Callable[[str], Any]
"""Looks up a plan field path ('parallelism.sequence_parallel'); see RenderView.get and _Parsed.get."""

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()
"""A parsed field the arguments did not mention (gates let it pass: nothing says the flag is off)."""

#: Full recompute without a method: uniform groups of 1 layer, Megatron-LM's documented "recompute
#: every layer" setting (TransformerConfig asserts a method for full recompute).
FULL_RECOMPUTE_DEFAULT: tuple[Literal["uniform"], int] = ("uniform", 1)

_SECTIONS = {"model": ModelSpec, "cluster": ClusterSpec, "training": TrainingSpec, "parallelism": ParallelismSpec,
             "implementation": ImplementationSpec}


@dataclass(frozen=True, slots=True)
class Flag:
    """One Megatron-LM flag with its values (unquoted strings) and why it is set."""

    name: str
    values: tuple[str, ...]
    why: str

    @property
    def argv(self) -> list[str]:
        return [self.name, *self.values]


def flag_text(v: object) -> str:
    # Floats in the shortest form argparse reads back exactly enough (3e-05, not 2.9999999999999997e-05).
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def make_flag(name: str, *values: object, why: str) -> Flag:
    return Flag(name, tuple(flag_text(v) for v in values), why)


@dataclass(frozen=True, slots=True)
class Arg:
    """A Megatron-LM command-line argument as its parser defines it."""

    flag: str
    kind: Kind
    dest: str = ""
    """argparse destination; '' = the flag's name in snake_case."""
    default: Any = None
    """Megatron's parser default (0.19.2)."""

    @property
    def key(self) -> str:
        return self.dest or self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class RenderView:
    """What rendering reads: the plan as rendered, its resolved model, and what the renderer derived."""

    plan: Plan
    shape: ModelShape
    seq_length_max: int | None = None
    no_wgrad_fusion_why: str | None = None
    notes: list[str] = field(default_factory=list)

    def get(self, path: str) -> Any:
        section, name = path.split(".")
        if section == "model":
            return getattr(self.shape, name)
        return getattr(getattr(self.plan, section), name)


Gate = Callable[[Get], bool]


def _gate(path: str, test: Callable[[Any], bool]) -> Gate:
    """Open where the plan field passes `test`, or where the arguments do not mention it (nothing says it is off)."""
    return lambda get: (v := get(path)) is MISSING or test(v)


moe = _gate("model.num_experts", bool)
mla = _gate("model.multi_latent_attention", bool)
rope = _gate("model.position_embedding_type", lambda v: v == "rope")
fp8 = _gate("training.precision", lambda v: v == "fp8")
loss_fusion = _gate("implementation.cross_entropy_loss_fusion", bool)
manual_gc = _gate("implementation.manual_gc", bool)
mamba = _gate("model.hybrid_layer_pattern", lambda v: bool(v) and "M" in v)
cuda_graphs = _gate("implementation.cuda_graph_impl", lambda v: v in ("local", "transformer_engine"))
_te_spec = _gate("implementation.transformer_impl", lambda v: v == "transformer_engine")
megatron_fsdp = _gate("implementation.use_megatron_fsdp", bool)
precision_aware = _gate("implementation.use_precision_aware_optimizer", bool)


def te_rope(get: Get) -> bool:
    """Transformer Engine's layers and RoPE: the only runs where RoPE fusion is a choice (the local spec
    always passes --no-rope-fusion; validate_args clears apply_rope_fusion without RoPE)."""
    return _te_spec(get) and rope(get)


@dataclass(frozen=True)
class Entry:
    """One plan field carried by one flag."""

    field: str
    arg: Arg
    why: str
    always: bool = False
    """Rendered even at Megatron's default (layout and shape a reader wants spelt out)."""
    negate: bool = False
    """The plan field is the flag's destination negated (grad_reduce_in_fp32 <- grad_reduce_in_bf16)."""
    gate: Gate | None = None
    render_if: Callable[[Get], bool] | None = None
    """An extra condition for rendering only (e.g. kv_channels only where it differs from h / n)."""
    gate_note: Callable[[Get], str] | None = None
    """A note when the plan sets the field but its gate is closed (the flag cannot carry it)."""
    unset_note: str | None = None
    """A note when the gate is open and the plan leaves the field unset."""
    parse_hook: Callable[[Any, Get], Any] | None = None
    """Maps a parsed value to the plan's (e.g. a value Megatron derived back to the plan's 'unset')."""

    @property
    def args(self) -> tuple[Arg, ...]:
        return (self.arg,)


@dataclass(frozen=True)
class Special:
    """Plan fields whose flags are not a plain copy of one field: a named render function and its inverse."""

    name: str
    fields: tuple[str, ...]
    args: tuple[Arg, ...]
    render: Callable[[RenderView], list[Flag]]
    parse: Callable[[Mapping[str, Any], _Parsed], None]


Row = Entry | Special


# --------------------------------------------------------------------------- parsing values

def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, str) and v.strip() in ("None", "", "null"))


def _field_annotation(path: str) -> Any:
    section, name = path.split(".")
    return _SECTIONS[section].model_fields[name].annotation


def _base_type(annotation: Any) -> Any:
    """int | None -> int; Annotated[...] unwrapped; list[...] kept."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(options[0]) if len(options) == 1 else annotation
    return annotation


def _words(v: Any) -> list[str]:
    """Words of a printed list ("['seq_aux_loss']"), a list, an enum member ('AttnBackend.flash') or a word."""
    items = v if isinstance(v, list | tuple) else re.findall(r"[A-Za-z_][\w.]*", str(v))
    return [str(x).rsplit(".", 1)[-1] for x in items]


def _number(v: Any) -> float | None:
    if isinstance(v, list | tuple):
        v = v[0] if v else None
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int | float):
        return float(v)
    m = re.search(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", str(v))
    return float(m.group(0)) if m else None


def _bool(v: Any) -> bool | None:
    if isinstance(v, bool):
        return v
    return {"true": True, "1": True, "false": False, "0": False}.get(str(v).strip().lower())


_INVALID: Any = object()
#: validate_args maps the optimizer-state dtype arguments to torch dtypes (map_dtype), so a dump prints
#: 'torch.bfloat16' for the 'bf16' given on the command line; fp8 state is stored as torch.uint8.
_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "fp8"}


def coerce(raw: Any, annotation: Any) -> Any:
    """An argument's value (dump text or a typed value) as the plan field's type; _INVALID when it is
    not one (an unknown choice, a non-number), None when Megatron printed None."""
    if _blank(raw):
        return None
    t = _base_type(annotation)
    if t is bool:
        b = _bool(raw)
        return _INVALID if b is None else b
    if t is int or t is float:
        n = _number(raw)
        if n is None or not math.isfinite(n):
            return _INVALID
        return int(n) if t is int else n
    if typing.get_origin(t) is list:
        allowed = set(typing.get_args(typing.get_args(t)[0]))
        found = [w for w in _words(raw) if w in allowed]
        return found or _INVALID
    if typing.get_origin(t) is Literal:
        words = [_TORCH_DTYPES.get(w, w) for w in _words(raw)]
        return words[0] if words and words[0] in typing.get_args(t) else _INVALID
    return str(raw)


# --------------------------------------------------------------------------- parse state

@dataclass
class _Parsed:
    """Plan fields read from Megatron arguments so far (None: printed as None; absent: not mentioned)."""

    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    read: set[str] = field(default_factory=set)
    """The fields read from the arguments (not given as context)."""

    def get(self, path: str) -> Any:
        return self.values.get(path, MISSING)

    def put(self, path: str, value: Any) -> None:
        if value is not _INVALID:
            self.values[path] = value
            self.read.add(path)


def _raw(args: Mapping[str, Any], key: str) -> Any:
    return args.get(key, MISSING)


#: Destinations older Megatron-LM releases printed instead of today's (old name -> (new name, negated)).
LEGACY_DESTS: dict[str, tuple[str, bool]] = {
    "norm_epsilon": ("layernorm_epsilon", False),
    "accumulate_allreduce_grads_in_fp32": ("grad_reduce_in_bf16", True),
    "hybrid_override_pattern": ("hybrid_layer_pattern", False),
}


def _with_legacy(args: Mapping[str, Any]) -> dict[str, Any]:
    """`args` with today's destinations filled from the legacy ones (a dump of an older release).

    Where a release prints both, the legacy one wins only for accumulate_allreduce_grads_in_fp32, the
    one validate_args itself sets from the others (arguments.py: bf16 section)."""
    out = dict(args)
    for old, (new, negated) in LEGACY_DESTS.items():
        if old not in args or _blank(args[old]):
            continue
        if new in args and old != "accumulate_allreduce_grads_in_fp32":
            continue
        b = _bool(args[old]) if negated else None
        out[new] = args[old] if not negated else (None if b is None else not b)
    return out


# --------------------------------------------------------------------------- rendering / parsing one entry

def _render_entry(e: Entry, get: Get, notes: list[str]) -> list[Flag]:
    v = get(e.field)
    if e.gate is not None and not e.gate(get):
        if e.gate_note is not None and v is not None:
            notes.append(e.gate_note(get))
        return []
    if e.render_if is not None and not e.render_if(get):
        return []
    kind = e.arg.kind
    if kind in ("store_true", "store_false"):
        dest = (not v) if e.negate else bool(v)
        return [make_flag(e.arg.flag, why=e.why)] if dest == (kind == "store_true") else []
    if v is None:
        if e.unset_note:
            notes.append(e.unset_note)
        return []
    if not e.always and v == e.arg.default:
        return []
    values = tuple(v) if isinstance(v, list | tuple) else (v,)
    return [make_flag(e.arg.flag, *values, why=e.why)]


def _parse_entry(e: Entry, args: Mapping[str, Any], parsed: _Parsed) -> None:
    raw = _raw(args, e.arg.key)
    if raw is MISSING:
        return
    v = coerce(raw, _field_annotation(e.field) if not e.negate else bool)
    if e.negate and isinstance(v, bool):
        v = not v
    if e.field.split(".")[1] in MODEL_SETTINGS and v == e.arg.default:
        v = None  # the plan's None is Megatron's default for these settings (schemas.MODEL_SETTINGS)
    parsed.put(e.field, v)


# --------------------------------------------------------------------------- specials

def _v(*flag_values: tuple[str, object, str]) -> list[Flag]:
    return [make_flag(name, *(() if val is None else (val,)), why=why) for name, val, why in flag_values]


def _render_vp(view: RenderView) -> list[Flag]:
    d = parallel_dims(view.plan)
    if d.vp <= 1:
        return []
    return _v(("--num-virtual-stages-per-pipeline-rank", d.vp,
               "parallelism.virtual_pipeline_model_parallel_size: interleaved 1F1B model chunks per stage "
               "(Megatron-LM has no --virtual-pipeline-model-parallel-size flag)"))


def _parse_vp(args: Mapping[str, Any], parsed: _Parsed) -> None:
    # validate_args fills virtual_pipeline_model_parallel_size from --num-virtual-stages-per-pipeline-rank
    # or --num-layers-per-virtual-pipeline-stage; dumps of older releases carry only the latter.
    found = (coerce(args.get(key), int | None) for key in ("virtual_pipeline_model_parallel_size",
                                                             "num_virtual_stages_per_pipeline_rank"))
    vp = next((v for v in found if isinstance(v, int)), None)
    pp = parsed.get("parallelism.pipeline_model_parallel_size")
    pp = 1 if pp in (MISSING, None) else pp
    layers = parsed.get("model.num_layers")
    per_stage = coerce(args.get("num_layers_per_virtual_pipeline_stage"), int | None)
    if vp is None and isinstance(per_stage, int) and per_stage and pp > 1 and isinstance(layers, int):
        vp = layers // (pp * per_stage)
    if isinstance(vp, int) and vp > 1 and pp > 1:
        parsed.put("parallelism.virtual_pipeline_model_parallel_size", vp)


def _render_recompute(view: RenderView) -> list[Flag]:
    p = view.plan.parallelism
    if p.recompute_granularity == "selective":
        flags = _v(("--recompute-granularity", "selective", "parallelism.recompute_granularity: recompute chosen modules in backward"))
        if p.recompute_modules:
            flags.append(make_flag("--recompute-modules", *p.recompute_modules, why="parallelism.recompute_modules"))
        return flags
    if p.recompute_granularity == "full":
        return _v(("--recompute-granularity", "full", "parallelism.recompute_granularity: whole layers recomputed in backward"),
                  ("--recompute-method", p.recompute_method, "parallelism.recompute_method"),
                  ("--recompute-num-layers", p.recompute_num_layers, "parallelism.recompute_num_layers"))
    return []


def _parse_recompute(args: Mapping[str, Any], parsed: _Parsed) -> None:
    gran = coerce(args.get("recompute_granularity"), _field_annotation("parallelism.recompute_granularity"))
    if gran not in ("selective", "full"):
        return
    parsed.put("parallelism.recompute_granularity", gran)
    for name in ("recompute_method", "recompute_num_layers"):
        parsed.put(f"parallelism.{name}", coerce(args.get(name), _field_annotation(f"parallelism.{name}")))
    if gran == "selective":
        parsed.put("parallelism.recompute_modules",
                   coerce(args.get("recompute_modules"), _field_annotation("parallelism.recompute_modules")))


def _render_gqa(view: RenderView) -> list[Flag]:
    s = view.shape
    if s.multi_latent_attention or s.num_query_groups == s.num_attention_heads:
        return []
    return _v(("--group-query-attention", None, "model.num_query_groups < heads: grouped-query attention"),
              ("--num-query-groups", s.num_query_groups, "model.num_query_groups: K/V heads"))


def _parse_gqa(args: Mapping[str, Any], parsed: _Parsed) -> None:
    # Megatron ignores num_query_groups unless group_query_attention is set (it prints its default 1).
    if coerce(args.get("group_query_attention"), bool) is True:
        parsed.put("model.num_query_groups", coerce(args.get("num_query_groups"), int | None))


def _render_max_positions(view: RenderView) -> list[Flag]:
    # Required by validate_args; for learned positions it sizes the embedding table, so keep the model's own.
    seq = view.plan.training.seq_length
    return _v(("--max-position-embeddings", max(seq, view.seq_length_max or 0),
               "required by Megatron; max(training.seq_length, model.seq_length_max)"))


def _parse_max_positions(args: Mapping[str, Any], parsed: _Parsed) -> None:
    parsed.put("model.seq_length_max", coerce(args.get("max_position_embeddings"), int | None))


def moe_layer_freq(pattern: tuple[int, ...]) -> str | None:
    """Megatron's --moe-layer-freq for a 0/1 layer pattern; None when every layer is MoE (default 1).

    An integer N means layer i is MoE when i % N == 0 (arguments.py moe_freq_type); anything else is
    written as the explicit Python list Megatron evaluates (only digits, commas and brackets).
    """
    if all(pattern):
        return None
    for n in range(2, len(pattern) + 1):
        if pattern == tuple(1 if i % n == 0 else 0 for i in range(len(pattern))):
            return str(n)
    return "[" + ",".join(str(x) for x in pattern) + "]"


def _render_moe_freq(view: RenderView) -> list[Flag]:
    # A hybrid model's MoE layers are its pattern's 'E' symbols; HybridModel never reads --moe-layer-freq. Keyed on
    # num_experts, which renders --num-experts, not on is_moe: a pattern of no MoE layer must still be written.
    freq = moe_layer_freq(view.shape.moe_layer_pattern) if view.shape.num_experts and not view.shape.is_hybrid else None
    return [] if freq is None else _v(("--moe-layer-freq", freq, "model.moe_layer_freq: which layers are MoE"))


def _parse_moe_freq(args: Mapping[str, Any], parsed: _Parsed) -> None:
    raw = args.get("moe_layer_freq")
    if _blank(raw) or not moe(parsed.get) or parsed.get(_HYBRID) not in (MISSING, None):
        return
    text = str(raw).strip()
    if isinstance(raw, int) or text.isdigit():
        parsed.put("model.moe_layer_freq", int(text))
        return
    bits = [int(b) for b in (raw if isinstance(raw, list) else re.findall(r"\d+", text))]
    if bits and bits == [b for b in bits if b in (0, 1)] and len(bits) == parsed.get("model.num_layers"):
        parsed.put("model.moe_layer_freq", bits)


_HYBRID = "model.hybrid_layer_pattern"
#: The layer specs pretrain_hybrid.py builds a hybrid model from (--spec module, name): Megatron-Core 0.19's
#: canonical hybrid stack (models/hybrid/hybrid_layer_specs.py; the old mamba_layer_specs path re-exports it).
#: Named explicitly: Megatron-LM's hybrid_builder (hybrid_builders.py, main branch) raises "You must provide a
#: valid hybrid layer spec via --spec" without it; 0.19's HybridModelConfig would default to the same spec.
HYBRID_STACK_SPEC = ("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec")


def hybrid_stage_pattern(view: RenderView) -> str:
    """The plan's hybrid pattern with a '|' after each pipeline stage's layers (PP > 1).

    Megatron-LM 0.19 places a hybrid model's layers on pipeline stages by the pattern's '|' segments
    (hybrid_layer_allocation.select_pipeline_segment: segment vp * PP + pp_rank); a pattern without them
    still splits at run time but is deprecated there, and validate_args forbids
    --decoder-first/last-pipeline-num-layers beside '|'. So the stages carry the plan's split, from
    schemas.layers_per_stage (the split the memory and time models use)."""
    s, p = view.shape, view.plan.parallelism
    pattern, pp = s.hybrid_layer_pattern or "", p.pipeline_model_parallel_size
    if pp == 1:
        return pattern
    try:
        counts = layers_per_stage(s.num_layers, pp, p.decoder_first_pipeline_num_layers,
                                  p.decoder_last_pipeline_num_layers)
    except ValueError:
        return pattern  # an impossible split: the validators name it, Megatron rejects the pattern too
    ends = list(itertools.accumulate(counts))
    return "|".join(pattern[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True))


def _render_hybrid(view: RenderView) -> list[Flag]:
    if not view.shape.is_hybrid:
        return []
    why = "model.hybrid_layer_pattern: one symbol per layer (M Mamba-2, * attention, - MLP, E MoE)"
    if view.plan.parallelism.pipeline_model_parallel_size > 1:
        why += "; '|' ends each pipeline stage (parallelism's split, decoder_first/last_pipeline_num_layers included)"
    return [make_flag("--hybrid-layer-pattern", hybrid_stage_pattern(view), why=why),
            make_flag("--spec", *HYBRID_STACK_SPEC, why="Megatron-Core's hybrid layer specs (Mamba, attention, MLP "
                      "and MoE layers of Transformer Engine modules)")]


def stage_split(counts: list[int]) -> tuple[int | None, int | None] | None:
    """decoder_first/last_pipeline_num_layers that give these per-stage layer counts (layers_per_stage's
    inverse, the fewest fields set); None when no pair does."""
    pp, total = len(counts), sum(counts)
    for first, last in ((None, None), (counts[0], None), (None, counts[-1]), (counts[0], counts[-1])):
        with contextlib.suppress(ValueError):
            if layers_per_stage(total, pp, first, last) == counts:
                return first, last
    return None


def _parse_hybrid(args: Mapping[str, Any], parsed: _Parsed) -> None:
    if "hybrid_layer_pattern" not in args:
        return
    raw = args["hybrid_layer_pattern"]
    if _blank(raw):
        parsed.put(_HYBRID, None)  # a GPT run: its printed Mamba defaults say nothing (the mamba gate closes)
        return
    # '/' starts the MTP depths' patterns: mtp_num_layers is read by its own row (validate_args infers it).
    segments = str(raw).strip().split("/")[0].split("|")
    parsed.put(_HYBRID, "".join(segments))
    pp = parsed.get("parallelism.pipeline_model_parallel_size")
    if len(segments) == 1 or pp in (MISSING, None):
        return
    split = stage_split([len(seg) for seg in segments]) if len(segments) == pp else None
    if split is None:
        parsed.notes.append(f"hybrid_layer_pattern has {len(segments)} '|' segments over {pp} pipeline stages: "
                            "a split decoder_first/last_pipeline_num_layers cannot describe; the even split is assumed")
        return
    for name, v in zip(("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"), split, strict=True):
        if v is not None:
            parsed.put(f"parallelism.{name}", v)


def rope_scaling_kind(shape: ModelShape) -> str:
    """How rope_scaling_factor extends the context: the model's type, else YaRN under MLA, Llama 3 otherwise."""
    return shape.rope_scaling_type or ("yarn" if shape.multi_latent_attention else "llama3")


def _render_rope_scaling(view: RenderView) -> list[Flag]:
    shape, notes = view.shape, view.notes
    factor = shape.rope_scaling_factor
    if factor is None:
        return []
    kind = rope_scaling_kind(shape)
    if shape.position_embedding_type != "rope":
        notes.append(f"model.rope_scaling_factor not passed: position_embedding_type is {shape.position_embedding_type}")
    elif kind == "llama3" and not shape.multi_latent_attention:
        return _v(("--use-rope-scaling", None, "model.rope_scaling_factor: Llama 3.1 RoPE frequency scaling"),
                  ("--rope-scaling-factor", factor, "model.rope_scaling_factor (Megatron's default 8.0)"))
    elif kind == "yarn" and shape.multi_latent_attention:
        notes.append("YaRN under MLA: --rotary-scaling-factor is passed; its mscale, mscale_all_dim and beta settings "
                     "stay at Megatron's defaults (the catalog does not hold them)")
        return _v(("--rotary-scaling-factor", factor, "model.rope_scaling_factor: MLA's YaRN context extension"))
    else:
        notes.append(f"model.rope_scaling_factor {factor:g} ({kind}) not passed: Megatron-LM 0.19's pretrain_gpt.py has no "
                     f"flag for {kind} scaling with {'MLA' if shape.multi_latent_attention else 'standard attention'}; "
                     "the script trains with unscaled RoPE (the same cost)")
    return []


_ROTARY_SCALING = Arg("--rotary-scaling-factor", "value", default=1.0)


def _parse_rope_scaling(args: Mapping[str, Any], parsed: _Parsed) -> None:
    if coerce(args.get("use_rope_scaling"), bool) is True:
        factor = coerce(args.get("rope_scaling_factor"), float | None)
        if isinstance(factor, float) and factor > 0:
            parsed.put("model.rope_scaling_factor", factor)
            parsed.put("model.rope_scaling_type", "llama3")
    elif parsed.get("model.multi_latent_attention") is True:
        factor = coerce(args.get("rotary_scaling_factor"), float | None)
        if isinstance(factor, float) and factor > 0 and factor != _ROTARY_SCALING.default:
            parsed.put("model.rope_scaling_factor", factor)
            parsed.put("model.rope_scaling_type", "yarn")


def _render_qk_layernorm(view: RenderView) -> list[Flag]:
    if view.shape.multi_latent_attention:
        # gpt_layer_specs: MLA's q and kv latent norms exist only with qk_layernorm (fused into the up-projections);
        # the parameter count and DeepSeek's checkpoints have them (q_a_layernorm, kv_a_layernorm).
        return _v(("--qk-layernorm", None, "MLA: Megatron builds the q/kv latent norms (DeepSeek's q_a/kv_a_layernorm) "
                   "only with --qk-layernorm"))
    if view.shape.qk_layernorm:
        return _v(("--qk-layernorm", None, "model.qk_layernorm: norm on each head's query and key"))
    return []


def _parse_qk_layernorm(args: Mapping[str, Any], parsed: _Parsed) -> None:
    # Under MLA the flag switches the latent norms, which the shape always counts: not the plan's qk_layernorm.
    if parsed.get("model.multi_latent_attention") is not True:
        parsed.put("model.qk_layernorm", coerce(args.get("qk_layernorm"), bool))


def _render_precision(view: RenderView) -> list[Flag]:
    return _v(("--bf16", None, "bf16 parameters and activations (also the base precision under FP8)"))


def _parse_precision(args: Mapping[str, Any], parsed: _Parsed) -> None:
    if not _blank(args.get("fp8")):
        parsed.put("training.precision", "fp8")
    elif coerce(args.get("fp16"), bool) is True:
        parsed.put("training.precision", "bf16")
        parsed.notes.append("the run used fp16; modelled as bf16 (same tensor-core peak)")
    elif "fp8" in args:
        parsed.put("training.precision", "bf16")


_NO_ROPE_FUSION = Arg("--no-rope-fusion", "store_false", dest="apply_rope_fusion", default=True)


def _render_local_spec(view: RenderView) -> list[Flag]:
    impl = view.plan.implementation.transformer_impl
    if impl == "transformer_engine":
        return []
    # The fused RoPE kernel is Transformer Engine's; without TE, TransformerConfig raises
    # "apply_rope_fusion is not available" (transformer_config.py), whatever the position embedding.
    # (implementation.apply_rope_fusion's row is gated to the TE spec, so the flag is written once.)
    return _v(("--transformer-impl", impl, "implementation.transformer_impl: Megatron's local modules"),
              (_NO_ROPE_FUSION.flag, None, "local spec: the fused RoPE kernel comes from Transformer Engine"))


def _parse_local_spec(args: Mapping[str, Any], parsed: _Parsed) -> None:
    if "transformer_impl" in args:
        parsed.put("implementation.transformer_impl",
                   coerce(args["transformer_impl"], _field_annotation("implementation.transformer_impl")))


def _render_wgrad_fusion(view: RenderView) -> list[Flag]:
    why = view.no_wgrad_fusion_why
    return _v(("--no-gradient-accumulation-fusion", None, why)) if why else []


def _parse_wgrad_fusion(args: Mapping[str, Any], parsed: _Parsed) -> None:
    if "gradient_accumulation_fusion" in args:
        parsed.put("implementation.gradient_accumulation_fusion", coerce(args["gradient_accumulation_fusion"], bool))


def _render_bias_activation(view: RenderView) -> list[Flag]:
    # validate_args clears bias_gelu_fusion itself for models without linear biases: no flag needed there.
    if view.plan.implementation.bias_activation_fusion or not (view.shape.swiglu or view.shape.add_bias_linear):
        return []
    flag = "--no-bias-swiglu-fusion" if view.shape.swiglu else "--no-bias-gelu-fusion"
    return _v((flag, None, "implementation.bias_activation_fusion false: bias and activation as separate kernels"))


def _parse_bias_activation(args: Mapping[str, Any], parsed: _Parsed) -> None:
    # TransformerConfig.bias_activation_fusion is bias_swiglu_fusion with --swiglu, else bias_gelu_fusion
    # (argument_utils.py core_transformer_config_from_args).
    key = "bias_swiglu_fusion" if parsed.get("model.swiglu") is True else "bias_gelu_fusion"
    if key in args:
        parsed.put("implementation.bias_activation_fusion", coerce(args[key], bool))


#: validate_args asserts it under --use-megatron-fsdp ("Megatron-FSDP requires the `fsdp_dtensor` checkpointing
#: format"); Megatron's default is torch_dist. No plan field: it follows use_megatron_fsdp.
FSDP_CKPT_FORMAT = "fsdp_dtensor"


def _render_fsdp_ckpt_format(view: RenderView) -> list[Flag]:
    if not view.plan.implementation.use_megatron_fsdp:
        return []
    return _v(("--ckpt-format", FSDP_CKPT_FORMAT, "implementation.use_megatron_fsdp: validate_args requires "
               "Megatron-FSDP's fsdp_dtensor checkpoint format"))


def _parse_nothing(args: Mapping[str, Any], parsed: _Parsed) -> None:
    """A derived flag with no plan field of its own (read back through the field it follows)."""


def _etp_unset_at_tp(v: Any, get: Get) -> Any:
    # validate_args sets expert_tensor_parallel_size to TP when it is unset: the plan's None.
    return None if v == get("parallelism.tensor_model_parallel_size") else v


def _differs_from_h_over_n(get: Get) -> bool:
    h, n = get("model.hidden_size"), get("model.num_attention_heads")
    return bool(h % n) or get("model.kv_channels") != h // n


def _not_hybrid(get: Get) -> bool:
    # A hybrid model's stages are its pattern's '|' segments (validate_args forbids these flags beside them).
    return not get(_HYBRID)


def _truthy(path: str) -> Callable[[Get], bool]:
    return lambda get: bool(get(path))


def _not_rope_note(name: str) -> Callable[[Get], str]:
    return lambda get: (f"model.{name} not passed: position_embedding_type is "
                        f"{get('model.position_embedding_type')}, not rope")


def _e(path: str, flag: str, kind: Kind, why: str, *, dest: str = "", default: Any = None, **kw: Any) -> Entry:
    return Entry(path, Arg(flag, kind, dest, default), why, **kw)


def _s(name: str, fields: tuple[str, ...], args: tuple[Arg, ...], render, parse) -> Special:
    return Special(name, fields, args, render, parse)


# --------------------------------------------------------------------------- the table

_P, _M, _T, _I = "parallelism.", "model.", "training.", "implementation."

LAYOUT: tuple[Row, ...] = (
    _e(_P + "tensor_model_parallel_size", "--tensor-model-parallel-size", "value",
       "parallelism.tensor_model_parallel_size: TP splits every GEMM", default=1, always=True),
    _e(_P + "pipeline_model_parallel_size", "--pipeline-model-parallel-size", "value",
       "parallelism.pipeline_model_parallel_size: PP stages", default=1, always=True),
    _e(_P + "context_parallel_size", "--context-parallel-size", "value",
       "parallelism.context_parallel_size: CP splits the sequence", default=1, always=True),
    _s("virtual_stages", (_P + "virtual_pipeline_model_parallel_size",),
       (Arg("--num-virtual-stages-per-pipeline-rank", "value"),), _render_vp, _parse_vp),
    _e(_P + "decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers", "value",
       "parallelism.decoder_first_pipeline_num_layers: uneven PP split", render_if=_not_hybrid),
    _e(_P + "decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers", "value",
       "parallelism.decoder_last_pipeline_num_layers: uneven PP split", render_if=_not_hybrid),
    _e(_P + "account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split", "store_true",
       "parallelism.account_for_embedding_in_pipeline_split: the embedding counts as a layer in the PP split",
       default=False),
    _e(_P + "account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split", "store_true",
       "parallelism.account_for_loss_in_pipeline_split: the output layer + loss count as a layer in the PP split",
       default=False),
    _e(_P + "expert_model_parallel_size", "--expert-model-parallel-size", "value",
       "parallelism.expert_model_parallel_size: EP splits experts", default=1, always=True, gate=moe),
    _e(_P + "expert_tensor_parallel_size", "--expert-tensor-parallel-size", "value",
       "parallelism.expert_tensor_parallel_size: TP inside experts", gate=moe, parse_hook=_etp_unset_at_tp),
    _e(_P + "sequence_parallel", "--sequence-parallel", "store_true",
       "parallelism.sequence_parallel: norm/dropout activations sharded over TP", default=False),
    _e(_I + "use_torch_fsdp2", "--use-torch-fsdp2", "store_true",
       "implementation.use_torch_fsdp2: parameters sharded by torch FSDP2", default=False),
    _e(_I + "use_megatron_fsdp", "--use-megatron-fsdp", "store_true",
       "implementation.use_megatron_fsdp: Megatron-FSDP instead of DDP", default=False),
    _e(_I + "data_parallel_sharding_strategy", "--data-parallel-sharding-strategy", "value",
       "implementation.data_parallel_sharding_strategy: what Megatron-FSDP shards over DP", default="optim_grads_params",
       always=True, gate=megatron_fsdp),
    _s("megatron_fsdp_checkpoint", (), (Arg("--ckpt-format", "value", default="torch_dist"),),
       _render_fsdp_ckpt_format, _parse_nothing),
    _e(_P + "use_distributed_optimizer", "--use-distributed-optimizer", "store_true",
       "parallelism.use_distributed_optimizer: Adam state sharded over DP (ZeRO-1)", default=False),
    _e(_I + "use_precision_aware_optimizer", "--use-precision-aware-optimizer", "store_true",
       "implementation.use_precision_aware_optimizer: TE FusedAdam with low-precision state (16-bit master "
       "remainders)", default=False),
    _e(_I + "exp_avg_dtype", "--exp-avg-dtype", "value", "implementation.exp_avg_dtype: Adam m as stored",
       default="fp32", gate=precision_aware),
    _e(_I + "exp_avg_sq_dtype", "--exp-avg-sq-dtype", "value", "implementation.exp_avg_sq_dtype: Adam v as stored",
       default="fp32", gate=precision_aware),
    _e(_P + "overlap_grad_reduce", "--overlap-grad-reduce", "store_true",
       "parallelism.overlap_grad_reduce: DP reduce-scatter overlapped with backward", default=False),
    _e(_P + "overlap_param_gather", "--overlap-param-gather", "store_true",
       "parallelism.overlap_param_gather: DP all-gather overlapped with forward", default=False),
    _e(_P + "tp_comm_overlap", "--tp-comm-overlap", "store_true",
       "parallelism.tp_comm_overlap: TE userbuffers overlap TP/SP comms with GEMMs", default=False),
    _s("recompute", tuple(_P + f for f in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")),
       (Arg("--recompute-granularity", "value"), Arg("--recompute-method", "value"),
        Arg("--recompute-num-layers", "value"), Arg("--recompute-modules", "list")), _render_recompute, _parse_recompute),
)

MODEL: tuple[Row, ...] = (
    _e(_M + "num_layers", "--num-layers", "value", "model.num_layers: transformer blocks", always=True),
    _s("hybrid_layer_pattern", (_HYBRID,), (Arg("--hybrid-layer-pattern", "value"), Arg("--spec", "list")),
       _render_hybrid, _parse_hybrid),
    _e(_M + "hidden_size", "--hidden-size", "value", "model.hidden_size: width h", always=True),
    _e(_M + "num_attention_heads", "--num-attention-heads", "value", "model.num_attention_heads", always=True),
    _e(_M + "ffn_hidden_size", "--ffn-hidden-size", "value",
       "model.ffn_hidden_size: explicit, since Megatron's SwiGLU default (8h/3 rounded to 64) differs from 4h", always=True),
    _s("grouped_query_attention", (_M + "num_query_groups",),
       (Arg("--group-query-attention", "store_true", default=False), Arg("--num-query-groups", "value", default=1)),
       _render_gqa, _parse_gqa),
    _e(_M + "kv_channels", "--kv-channels", "value", "model.kv_channels: head dim differs from hidden/heads",
       render_if=_differs_from_h_over_n),
    _e(_M + "swiglu", "--swiglu", "store_true", "model.swiglu: gated SiLU MLP (3 matrices)", default=False),
    _e(_M + "normalization", "--normalization", "value", "model.normalization (Megatron's default is LayerNorm)",
       default="LayerNorm"),
    _e(_M + "add_bias_linear", "--disable-bias-linear", "store_false",
       "model.add_bias_linear false: no biases in linear layers", dest="add_bias_linear", default=True),
    _e(_M + "untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", "store_true",
       "model.untie_embeddings_and_output_weights: separate input embedding and output layer", default=False),
    _e(_M + "position_embedding_type", "--position-embedding-type", "value",
       "model.position_embedding_type (Megatron's default is learned_absolute)", default="learned_absolute"),
    _s("max_position_embeddings", (_M + "seq_length_max",), (Arg("--max-position-embeddings", "value"),),
       _render_max_positions, _parse_max_positions),
    _e(_M + "make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", "value",
       "model.make_vocab_size_divisible_by: vocab padded to a multiple of this x TP", default=128),
    _e(_M + "num_experts", "--num-experts", "value", "model.num_experts: routed experts per MoE layer",
       always=True, gate=moe),
    _e(_M + "moe_ffn_hidden_size", "--moe-ffn-hidden-size", "value", "model.moe_ffn_hidden_size: inner size of one expert",
       always=True, gate=moe),
    _e(_M + "moe_router_topk", "--moe-router-topk", "value", "model.moe_router_topk: experts per token",
       default=2, gate=moe),
    _e(_M + "moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", "value",
       "model.moe_shared_expert_intermediate_size: shared expert(s) total inner size", gate=moe,
       render_if=_truthy(_M + "moe_shared_expert_intermediate_size")),
    _s("moe_layer_freq", (_M + "moe_layer_freq",), (Arg("--moe-layer-freq", "value", default=1),),
       _render_moe_freq, _parse_moe_freq),
    _e(_M + "multi_latent_attention", "--multi-latent-attention", "store_true", "model.multi_latent_attention: DeepSeek MLA",
       default=False),
    _e(_M + "q_lora_rank", "--q-lora-rank", "value", "model.q_lora_rank: query low rank", gate=mla),
    _e(_M + "kv_lora_rank", "--kv-lora-rank", "value", "model.kv_lora_rank: key/value low rank",
       default=32, always=True, gate=mla),
    _e(_M + "qk_head_dim", "--qk-head-dim", "value", "model.qk_head_dim", default=128, always=True, gate=mla),
    _e(_M + "qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", "value", "model.qk_pos_emb_head_dim: RoPE part",
       default=64, always=True, gate=mla),
    _e(_M + "v_head_dim", "--v-head-dim", "value", "model.v_head_dim", default=128, always=True, gate=mla),
    _e(_M + "mtp_num_layers", "--mtp-num-layers", "value", "model.mtp_num_layers: multi-token prediction",
       render_if=_truthy(_M + "mtp_num_layers")),
    # Mamba-2 mixer shape (TransformerConfig: mamba_head_dim 64, mamba_state_dim 128, mamba_num_groups 8,
    # mamba_num_heads None = 2h / head dim); spelt out, as the FLOP count in Megatron's log reads them.
    _e(_M + "mamba_num_heads", "--mamba-num-heads", "value", "model.mamba_num_heads: Mamba-2 heads",
       always=True, gate=mamba),
    _e(_M + "mamba_head_dim", "--mamba-head-dim", "value", "model.mamba_head_dim: Mamba-2 head dim P",
       default=64, always=True, gate=mamba),
    _e(_M + "mamba_state_dim", "--mamba-state-dim", "value", "model.mamba_state_dim: SSM state size N",
       default=128, always=True, gate=mamba),
    _e(_M + "mamba_num_groups", "--mamba-num-groups", "value", "model.mamba_num_groups: B/C groups G",
       default=8, always=True, gate=mamba),
)

# Model settings: they change what the model computes but not its cost; each one the catalog or the
# plan gives is passed, so the script trains that model rather than Megatron's defaults.
SETTINGS: tuple[Row, ...] = (
    _e(_M + "rotary_base", "--rotary-base", "value", "model.rotary_base: RoPE base (Megatron's default 10000)",
       default=10000, always=True, gate=rope, gate_note=_not_rope_note("rotary_base")),
    _e(_M + "rotary_percent", "--rotary-percent", "value", "model.rotary_percent: fraction of each head rotated",
       default=1.0, always=True, gate=rope, gate_note=_not_rope_note("rotary_percent")),
    _s("rope_scaling", (_M + "rope_scaling_factor", _M + "rope_scaling_type"),
       (Arg("--use-rope-scaling", "store_true", default=False), Arg("--rope-scaling-factor", "value", default=8.0),
        _ROTARY_SCALING), _render_rope_scaling, _parse_rope_scaling),
    _e(_M + "norm_epsilon", "--norm-epsilon", "value", "model.norm_epsilon (Megatron's default 1e-5)",
       dest="layernorm_epsilon", default=1e-5, always=True),
    _s("qk_layernorm", (_M + "qk_layernorm",), (Arg("--qk-layernorm", "store_true", default=False),),
       _render_qk_layernorm, _parse_qk_layernorm),
    _e(_M + "squared_relu", "--squared-relu", "store_true", "model.squared_relu: squared-ReLU MLP activation", default=False),
    _e(_M + "moe_router_score_function", "--moe-router-score-function", "value", "model.moe_router_score_function",
       default="softmax", always=True, gate=moe),
    _e(_M + "moe_router_pre_softmax", "--moe-router-pre-softmax", "store_true",
       "model.moe_router_pre_softmax: scores over all experts before the top-k", default=False, gate=moe),
    _e(_M + "moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", "value",
       "model.moe_router_topk_scaling_factor", always=True, gate=moe),
    _e(_M + "moe_router_num_groups", "--moe-router-num-groups", "value", "model.moe_router_num_groups", always=True, gate=moe),
    _e(_M + "moe_router_group_topk", "--moe-router-group-topk", "value", "model.moe_router_group_topk", always=True, gate=moe),
    _e(_M + "moe_router_load_balancing_type", "--moe-router-load-balancing-type", "list",
       "model.moe_router_load_balancing_type", default="aux_loss", always=True, gate=moe),
    _e(_M + "moe_aux_loss_coeff", "--moe-aux-loss-coeff", "list", "model.moe_aux_loss_coeff", default=0.0, always=True,
       gate=moe, unset_note="model.moe_aux_loss_coeff unset: Megatron's default 0.0 leaves the router without a "
                            "load-balancing loss; set it to the recipe's value"),
    _e(_M + "moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", "store_true",
       "model.moe_router_enable_expert_bias: aux-loss-free balancing bias", default=False, gate=moe),
    _e(_I + "moe_permute_fusion", "--moe-permute-fusion", "store_true",
       "implementation.moe_permute_fusion: TE's fused token permute/unpermute", default=False, gate=moe),
    _e(_I + "moe_router_force_load_balancing", "--moe-router-force-load-balancing", "store_true",
       "implementation.moe_router_force_load_balancing: random router logits, balanced experts (benchmarks)",
       default=False, gate=moe),
)

# Always explicit: Megatron's default (0.1 each) is not what the plan, and its predictions, assume.
DROPOUT: tuple[Row, ...] = (
    _e(_T + "attention_dropout", "--attention-dropout", "value", "training.attention_dropout (Megatron's default is 0.1)",
       default=0.1, always=True),
    _e(_T + "hidden_dropout", "--hidden-dropout", "value", "training.hidden_dropout (Megatron's default is 0.1)",
       default=0.1, always=True),
)

PRECISION: tuple[Row, ...] = (
    _s("precision", (_T + "precision",), (Arg("--bf16", "store_true", default=False),), _render_precision, _parse_precision),
    _e(_T + "fp8_format", "--fp8-format", "value", "training.precision fp8: TE FP8 GEMMs; training.fp8_format",
       dest="fp8", always=True, gate=fp8),
    _e(_T + "fp8_recipe", "--fp8-recipe", "value", "training.fp8_recipe: FP8 scaling recipe", default="delayed",
       always=True, gate=fp8),
    _e(_T + "fp8_param_gather", "--fp8-param-gather", "store_true", "training.fp8_param_gather: weights all-gathered in FP8",
       default=False, gate=fp8),
    _e(_I + "grad_reduce_in_fp32", "--grad-reduce-in-bf16", "store_true",
       "implementation.grad_reduce_in_fp32 false: bf16 gradient buffers and reduction", default=False, negate=True),
    _s("local_spec", (_I + "transformer_impl",),
       (Arg("--transformer-impl", "value", default="transformer_engine"),), _render_local_spec, _parse_local_spec),
    _e(_I + "attention_backend", "--attention-backend", "value",
       "implementation.attention_backend: core attention kernel (sets NVTE_*_ATTN itself)", default="auto",
       # 'local' needs --spec local, which pretrain_gpt.py cannot take (rendering's as_rendered notes it)
       render_if=lambda get: get(_I + "attention_backend") != "local"),
    _e(_I + "cross_entropy_loss_fusion", "--cross-entropy-loss-fusion", "store_true",
       "implementation.cross_entropy_loss_fusion: fused vocab-parallel cross entropy", default=False),
    _e(_I + "cross_entropy_fusion_impl", "--cross-entropy-fusion-impl", "value",
       "Transformer Engine's cross entropy: no fp32 copy of the logits (2 B/logit instead of the native fused kernel's 10)",
       default="native", gate=loss_fusion),
    _s("gradient_accumulation_fusion", (_I + "gradient_accumulation_fusion",),
       (Arg("--no-gradient-accumulation-fusion", "store_false", dest="gradient_accumulation_fusion", default=True),),
       _render_wgrad_fusion, _parse_wgrad_fusion),
    _e(_I + "attention_softmax_in_fp32", "--attention-softmax-in-fp32", "store_true",
       "implementation.attention_softmax_in_fp32: Megatron's attention masks and softmaxes in fp32", default=False),
    _e(_I + "masked_softmax_fusion", "--no-masked-softmax-fusion", "store_false",
       "implementation.masked_softmax_fusion false: scale, mask and softmax as separate PyTorch kernels",
       dest="masked_softmax_fusion", default=True),
    _s("bias_activation_fusion", (_I + "bias_activation_fusion",),
       (Arg("--no-bias-swiglu-fusion", "store_false", dest="bias_swiglu_fusion", default=True),
        Arg("--no-bias-gelu-fusion", "store_false", dest="bias_gelu_fusion", default=True)),
       _render_bias_activation, _parse_bias_activation),
    _e(_I + "bias_dropout_fusion", "--no-bias-dropout-fusion", "store_false",
       "implementation.bias_dropout_fusion false: bias add, dropout and residual add as separate kernels",
       dest="bias_dropout_fusion", default=True),
    Entry(_I + "apply_rope_fusion", _NO_ROPE_FUSION,
          "implementation.apply_rope_fusion false: RoPE applied by PyTorch kernels instead of TE's fused one", gate=te_rope),
    _e(_I + "check_for_nan_in_loss_and_grad", "--no-check-for-nan-in-loss-and-grad", "store_false",
       "implementation.check_for_nan_in_loss_and_grad false: no NaN/Inf checks of the loss and gradients",
       dest="check_for_nan_in_loss_and_grad", default=True),
    _e(_I + "create_attention_mask_in_dataloader", "--no-create-attention-mask-in-dataloader", "store_false",
       "implementation.create_attention_mask_in_dataloader false: no seq x seq mask per sample (causal attention "
       "never reads it)", dest="create_attention_mask_in_dataloader", default=True),
    _e(_I + "cuda_graph_impl", "--cuda-graph-impl", "value",
       "implementation.cuda_graph_impl: layers (or the iteration) replayed as CUDA graphs, one launch each", default="none"),
    _e(_I + "cuda_graph_modules", "--cuda-graph-modules", "list",
       "implementation.cuda_graph_modules: the parts of each layer captured (none listed = the whole layer)", default=[],
       gate=cuda_graphs),
)

MOE_IMPL: tuple[Row, ...] = (
    _e(_I + "moe_token_dispatcher_type", "--moe-token-dispatcher-type", "value",
       "implementation.moe_token_dispatcher_type (Megatron's default is allgather)", default="allgather", always=True, gate=moe),
    _e(_I + "moe_grouped_gemm", "--moe-grouped-gemm", "store_true",
       "implementation.moe_grouped_gemm: one grouped GEMM for the local experts", default=False, gate=moe),
    _e(_I + "moe_expert_capacity_factor", "--moe-expert-capacity-factor", "value",
       "implementation.moe_expert_capacity_factor: each expert takes at most its capacity, the rest dropped", gate=moe),
    _e(_I + "moe_pad_expert_input_to_capacity", "--moe-pad-expert-input-to-capacity", "store_true",
       "implementation.moe_pad_expert_input_to_capacity: every expert padded to its capacity (no host sync)",
       default=False, gate=moe),
    _e(_I + "overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm", "store_true",
       "implementation.overlap_moe_expert_parallel_comm: combined 1F1B schedule, token all-to-alls under the other "
       "micro-batch's compute", default=False, gate=moe),
    _e(_I + "delay_wgrad_compute", "--delay-wgrad-compute", "store_true",
       "implementation.delay_wgrad_compute: expert weight gradients run under the backward's dispatch", default=False,
       gate=moe),
)

BATCH: tuple[Row, ...] = (
    _e(_T + "seq_length", "--seq-length", "value", "training.seq_length", always=True),
    _e(_T + "micro_batch_size", "--micro-batch-size", "value", "training.micro_batch_size: samples per forward per replica",
       always=True),
    _e(_T + "global_batch_size", "--global-batch-size", "value", "training.global_batch_size: samples per optimizer step",
       always=True),
)

#: Rendered with mock data only (a real tokenizer brings its own vocabulary).
VOCAB: tuple[Row, ...] = (
    # megatron.core NullTokenizer reports exactly --vocab-size (no extra EOD slot in 0.19.2).
    _e(_M + "vocab_size", "--vocab-size", "value", "model.vocab_size, so the embedding matches the plan", always=True),
)

GC: tuple[Row, ...] = (
    _e(_I + "manual_gc", "--manual-gc", "store_true",
       "implementation.manual_gc: garbage collection only at chosen steps, aligned across ranks", default=False),
    _e(_I + "manual_gc_interval", "--manual-gc-interval", "value",
       "implementation.manual_gc_interval: steps between collections", default=0, gate=manual_gc),
)

GROUPS: dict[str, tuple[Row, ...]] = {
    "layout": LAYOUT, "model": MODEL, "settings": SETTINGS, "dropout": DROPOUT, "precision": PRECISION,
    "moe_impl": MOE_IMPL, "batch": BATCH, "vocab": VOCAB, "gc": GC,
}
TABLE: tuple[Row, ...] = tuple(row for rows in GROUPS.values() for row in rows)


def plan_fields() -> set[str]:
    """Every plan field path the table carries."""
    return {f for row in TABLE for f in ((row.field,) if isinstance(row, Entry) else row.fields)}


# --------------------------------------------------------------------------- the two directions

def render(view: RenderView, group: str) -> list[Flag]:
    """The flags of one group for the as-rendered plan in `view` (notes go to view.notes)."""
    out: list[Flag] = []
    for row in GROUPS[group]:
        out += _render_entry(row, view.get, view.notes) if isinstance(row, Entry) else row.render(view)
    return out


@dataclass(frozen=True)
class ParsedArgs:
    """Plan fields read from Megatron's arguments, by section, and notes on what was assumed."""

    sections: dict[str, dict[str, Any]]
    notes: list[str]


def parse(args: Mapping[str, Any], context: Mapping[str, Any] | None = None) -> ParsedArgs:
    """Plan fields from Megatron's parsed arguments (destination -> value: a dump's text or typed values).

    Plain rows first, then the specials (which may read them), then every gated row whose gate the
    parsed fields close is dropped. Arguments not mentioned leave their field out; values that are not
    the field's type (an unknown choice) are skipped; None and Megatron's default for a setting whose
    None means that default (schemas.MODEL_SETTINGS) leave it unset. `context` gives plan fields known
    from elsewhere ({'model.num_experts': 8}) for the gates when `args` lacks them; they are not returned.
    """
    args = _with_legacy(args)
    parsed = _Parsed(values=dict(context or {}))
    for row in TABLE:
        if isinstance(row, Entry):
            _parse_entry(row, args, parsed)
    for row in TABLE:
        if isinstance(row, Special):
            row.parse(args, parsed)
    entries = [row for row in TABLE if isinstance(row, Entry) and row.field in parsed.values]
    closed = [row.field for row in entries if row.gate is not None and not row.gate(parsed.get)]
    hooked = {row.field: row.parse_hook(parsed.values[row.field], parsed.get) for row in entries if row.parse_hook}
    parsed.values.update(hooked)
    for path in closed:
        del parsed.values[path]
    sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for path, v in parsed.values.items():
        if v is not None and path in parsed.read:
            section, name = path.split(".")
            sections[section][name] = v
    return ParsedArgs(sections, parsed.notes)
