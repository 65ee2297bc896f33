"""Flat tool arguments: what an assistant fills in from one sentence, mapped onto the core's Plan.

Every tool that takes a plan accepts it three ways, combined in this order: `plan_id` (a handle an
earlier answer returned), `plan` (the full object, or the same as a JSON string), then flat
arguments (`model`, `num_gpus`, `tp`, ...) that override single fields. The published schema of a
flat argument is the core field's own type and bounds with a one-line description: no `$ref`, no
`anyOf`/`null` unions, so every client can fill it. Validation happens here, against the core's
models, so a bad value gets our one-line-per-field message and not the SDK's raw pydantic text.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import inspect
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError, WithJsonSchema

from mcore_advisor.knowledge.megatron_flags import FULL_RECOMPUTE_DEFAULT
from mcore_advisor.schemas import Plan, TrainingSpec
from mcore_advisor.server.errors import describe_validation_error, quote
from mcore_advisor.tools.recommend import RecommendRequest

# flat name -> (plan section, plan field, description)
PLAN_FIELDS: dict[str, tuple[str, str, str]] = {
    "model": ("model", "name", "Catalog model key, e.g. llama3-70b, llama3.1-405b, mixtral-8x22b, deepseek-v3."),
    "hf_config": ("model", "hf_config", "Instead of model: the model's Hugging Face config.json as JSON text (an object "
                                        "is accepted too). Llama, Mistral, Qwen2/3, Mixtral, DeepSeek-V2/V3, GPT-OSS, Nemotron-H."),
    "gpu": ("cluster", "gpu", "GPU key, e.g. h100-sxm, h200, a100-80gb."),
    "num_gpus": ("cluster", "num_gpus", "Total GPUs (world size)."),
    "seq_length": ("training", "seq_length", "Tokens per sample."),
    "global_batch_size": ("training", "global_batch_size", "Samples per optimizer step."),
    "micro_batch_size": ("training", "micro_batch_size", "Samples per micro-batch."),
    "precision": ("training", "precision", "bf16, or fp8 (Transformer Engine)."),
    "tp": ("parallelism", "tensor_model_parallel_size", "Tensor parallel size."),
    "pp": ("parallelism", "pipeline_model_parallel_size", "Pipeline parallel size."),
    "vp": ("parallelism", "virtual_pipeline_model_parallel_size", "Virtual pipeline chunks per stage."),
    "cp": ("parallelism", "context_parallel_size", "Context parallel size."),
    "ep": ("parallelism", "expert_model_parallel_size", "Expert parallel size."),
    "sequence_parallel": ("parallelism", "sequence_parallel", "Sequence parallelism (with tp > 1)."),
    "recompute": ("parallelism", "recompute_granularity", "Activation recompute."),
}
RECOMPUTE = ["none", "selective", "full"]

PLAN_ID_SCHEMA = {"type": "string", "description": "A plan_id from an earlier answer; other arguments override its fields."}
PLAN_SCHEMA = {
    "type": "object", "additionalProperties": True,
    "description": "Full plan {model, cluster, training, parallelism, implementation} with Megatron-LM argument "
                   "names (an object or its JSON string), as recommend_parallelism's mcore://plans/{plan_id} returns it.",
}


def _field_schema(model: type[BaseModel], field: str) -> dict[str, Any]:
    """The core field's JSON schema without its null arm, title, default or long description."""
    info = model.model_fields[field]
    # the field alone: the whole model's schema would be regenerated (a second each) for every argument
    annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    prop = dict(TypeAdapter(annotation).json_schema())
    for arm in prop.pop("anyOf", []):
        if arm.get("type") != "null":
            prop.update(arm)
    for key in ("title", "default", "description"):
        prop.pop(key, None)
    return prop


def flat_schema(name: str) -> dict[str, Any]:
    section, field, description = PLAN_FIELDS[name]
    if name == "recompute":
        return {"type": "string", "enum": RECOMPUTE, "description": description}
    if name == "hf_config":  # the core takes text or an object; one published type keeps the schema union-free
        return {"type": "string", "description": description}
    cls = Plan.model_fields[section].annotation
    return {**_field_schema(cls, field), "description": description}


def field_schema(model: type[BaseModel], field: str, description: str) -> dict[str, Any]:
    """A tool's own argument published with the bounds of the core field it fills."""
    return {**_field_schema(model, field), "description": description}


def arg(schema: Mapping[str, Any]) -> Any:
    """An optional tool argument whose published schema is exactly `schema` (validated by the tool)."""
    return Annotated[Any, WithJsonSchema(dict(schema))]


# ---- plan handles ------------------------------------------------------------------------------


class PlanStore:
    """Plans the server has answered about, by a short id derived from their content (same plan,
    same id). Bounded: the oldest are forgotten first."""

    def __init__(self, capacity: int = 512):
        self._plans: OrderedDict[str, Plan] = OrderedDict()
        self._capacity = capacity

    @staticmethod
    def id_of(plan: Plan) -> str:
        canonical = json.dumps(plan.model_dump(mode="json", exclude_defaults=True), sort_keys=True)
        return "p-" + hashlib.sha256(canonical.encode()).hexdigest()[:10]

    def add(self, plan: Plan) -> str:
        pid = self.id_of(plan)
        self._plans[pid] = plan
        self._plans.move_to_end(pid)
        while len(self._plans) > self._capacity:
            self._plans.popitem(last=False)
        return pid

    def get(self, plan_id: Any) -> Plan:
        if not isinstance(plan_id, str) or plan_id not in self._plans:
            raise ValueError(f"plan_id: unknown plan {quote(plan_id, 40)}; ids come from this server's answers "
                             "(recommend_parallelism, evaluate_plan ...) and are forgotten on restart: "
                             "pass the plan object or the flat arguments instead")
        return self._plans[plan_id]


# ---- building a plan from the arguments -------------------------------------------------------

MAX_STRING_CHARS = 256  # no plan field (model or GPU key, run name) is longer
# The published configs in tests/knowledge/_hf_configs.py are 0.6-1.6 KB as compact JSON (indented files about
# twice that); 64 KB leaves room for any real one and still refuses a pasted log or weights index.
MAX_HF_CONFIG_CHARS = 65_536


def _check_hf_config(value: Any, path: str) -> None:
    size = len(value) if isinstance(value, str) else len(json.dumps(value, default=str))
    if size > MAX_HF_CONFIG_CHARS:
        raise ValueError(f"{path}: too long ({size:,} characters; at most {MAX_HF_CONFIG_CHARS:,}): pass the model's "
                         "config.json alone")


def check_strings(value: Any, path: str) -> None:
    """Refuse an over-long string anywhere in an argument before anything quotes it back."""
    if path == "hf_config" or path.endswith(".hf_config"):
        _check_hf_config(value, path)
        return
    if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
        raise ValueError(f"{path}: too long ({len(value):,} characters; at most {MAX_STRING_CHARS})")
    if isinstance(value, dict):
        for k, v in value.items():
            check_strings(v, f"{path}.{k}" if path else str(k)[:40])
    elif isinstance(value, list):
        for i, v in enumerate(value[:1000]):
            check_strings(v, f"{path}[{i}]")


def parse_object(name: str, value: Any) -> dict[str, Any]:
    """An object argument given as an object or as its JSON string (some clients send the latter)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: not valid JSON ({exc.msg} at character {exc.pos}); pass an object") from None
        except ValueError:  # e.g. an integer of more than 4,300 digits, which Python refuses to convert
            raise ValueError(f"{name}: holds a number too large to read; pass an object with sizes in range") from None
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True)
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected an object, got {type(value).__name__} {quote(value)}")
    return value


def _plan_dict(value: Any) -> dict[str, Any]:
    data = parse_object("plan", value)
    if "plan" in data and "model" not in data:  # a result or request wrapper
        data = parse_object("plan", data["plan"])
    out = dict(data)
    for section in ("model", "cluster", "training", "parallelism", "implementation"):
        part = out.get(section)
        if section == "model" and isinstance(part, str) and not part.lstrip().startswith("{"):
            out[section] = {"name": part}
        elif isinstance(part, str):
            out[section] = parse_object(f"plan.{section}", part)
    return out


def _set_recompute(par: dict[str, Any], value: Any) -> None:
    if value not in RECOMPUTE:
        raise ValueError(f"recompute: not an allowed value (got {quote(value)}); allowed: one of "
                         f"{', '.join(map(repr, RECOMPUTE))}; e.g. recompute='selective'")
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"):
        par.pop(key, None)
    if value == "selective":
        par["recompute_granularity"] = "selective"
    elif value == "full":  # every layer, one at a time: Megatron's --recompute-method uniform --recompute-num-layers 1
        method, layers = FULL_RECOMPUTE_DEFAULT
        par.update(recompute_granularity="full", recompute_method=method, recompute_num_layers=layers)


def _one_model(args: Mapping[str, Any]) -> None:
    """`model` or `hf_config`, and the latter as the core takes it (JSON text or an object)."""
    cfg = args.get("hf_config")
    if cfg is None:
        return
    if args.get("model") is not None:
        raise ValueError("model, hf_config: both given; keep one (model: a catalog key, hf_config: a config.json)")
    if not isinstance(cfg, str | dict):
        raise ValueError(f"hf_config: expected the config.json as JSON text (or an object), got {type(cfg).__name__} {quote(cfg)}")
    _check_hf_config(cfg, "hf_config")


def build_plan(args: Mapping[str, Any], store: PlanStore) -> Plan:
    """The plan the arguments describe: plan_id, then plan, then the flat fields on top."""
    _one_model(args)
    base: dict[str, Any] = {}
    if args.get("plan_id") is not None:
        base = store.get(args["plan_id"]).model_dump(exclude_defaults=True)
    if args.get("plan") is not None:
        given = _plan_dict(args["plan"])
        base = {**base, **given} if base else given
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    rename: dict[str, str] = {}
    for name, (section, field, _) in PLAN_FIELDS.items():
        value = args.get(name)
        if value is None:
            continue
        if name in ("model", "hf_config"):
            base["model"] = {field: value}  # another model: the old one's shape overrides do not apply
        elif name == "recompute":
            _set_recompute(base.setdefault(section, {}), value)
        else:
            base.setdefault(section, {})[field] = value
        rename[f"{section}.{field}"] = name
    check_strings({k: v for k, v in args.items() if k != "plan"}, "")
    check_strings(base, "plan" if args.get("plan") is not None else "")
    if "model" not in base:
        raise ValueError("model: required: a catalog key such as model='llama3-70b' (see the mcore://models "
                         "resource), or hf_config (a config.json), or pass plan / plan_id")
    try:
        return Plan.model_validate(base)
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc, Plan, rename)) from None


# ---- recommend_parallelism's request from flat arguments ---------------------------------------

RECOMMEND_FIXED = ("tp", "pp", "vp", "cp", "ep", "micro_batch_size", "sequence_parallel", "recompute")


def recommend_request(args: dict[str, Any]) -> RecommendRequest:
    """Flat arguments (plus an optional full `request` object underneath) -> RecommendRequest."""
    data = parse_object("request", args["request"]) if args.get("request") is not None else {}
    rename: dict[str, str] = {}

    def put(path: tuple[str, ...], name: str) -> None:
        value = args.get(name)
        if value is None:
            return
        target = data
        for key in path[:-1]:
            sub = target.get(key)
            target[key] = parse_object(f"request.{key}", sub) if sub is not None else {}
            target = target[key]
        target[path[-1]] = value
        rename[".".join(path)] = name

    _one_model(args)
    for name in ("model", "hf_config"):
        if args.get(name) is not None:
            data["model"] = {PLAN_FIELDS[name][1]: args[name]}
            rename[f"model.{PLAN_FIELDS[name][1]}"] = name
    put(("cluster", "gpu"), "gpu")
    put(("cluster", "num_gpus"), "num_gpus")
    for name in ("seq_length", "global_batch_size", "precision", "top_k", "allow_fp8", "what_if"):
        put((name,), name)
    put(("max_tensor_model_parallel_size",), "max_tp")
    for name in RECOMMEND_FIXED:
        put(("fixed", PLAN_FIELDS[name][1]), name)
    data.setdefault("seq_length", TrainingSpec.model_fields["seq_length"].default)
    try:
        check_strings(data, "")
    except ValueError as exc:  # name the argument the caller passed, not the request field behind it
        field, _, rest = str(exc).partition(":")
        raise ValueError(f"{rename.get(field, field)}:{rest}") from None
    if "model" not in data:
        raise ValueError("model: required: a catalog key, e.g. model='llama3-70b' (see the mcore://models resource), "
                         "or hf_config (a config.json)")
    if "num_gpus" not in (data.get("cluster") or {}):
        raise ValueError("num_gpus: required: the world size to plan for, e.g. num_gpus=64")
    if isinstance(data.get("model"), str):
        data["model"] = {"name": data["model"]}
    try:
        return RecommendRequest.model_validate(data)
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc, RecommendRequest, rename)) from None


PLAN_ARG_NAMES = ("plan_id", "plan", *PLAN_FIELDS)


def suggest(name: str, known: Sequence[str]) -> str | None:
    """The argument someone probably meant: 'tensor_parallel' or 'tensor_model_parallel_size' -> 'tp'
    (same first word as the Megatron name), else the closest spelling."""
    head = name.lower().replace("-", "_").split("_")[0]
    for flat in known:
        megatron = PLAN_FIELDS[flat][1] if flat in PLAN_FIELDS else flat
        if head and megatron.split("_")[0] == head:
            return flat
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return close[0] if close else None


def plan_params(names: Sequence[str] = PLAN_ARG_NAMES) -> list[inspect.Parameter]:
    schemas = {"plan_id": PLAN_ID_SCHEMA, "plan": PLAN_SCHEMA}
    return [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=arg(schemas.get(n) or flat_schema(n))) for n in names]


def with_plan_args(names: Sequence[str] = PLAN_ARG_NAMES) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Publish the plan arguments `names` next to the tool's own; the tool receives them in `plan_args`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != "plan_args"]
        ctx = [p for p in own if p.name == "ctx"]
        own = [p for p in own if p.name != "ctx"]

        @functools.wraps(fn)
        async def wrapper(**kwargs: Any) -> Any:
            plan_args = {n: kwargs.pop(n, None) for n in names}
            return await fn(plan_args=plan_args, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=[*own, *plan_params(names), *ctx])  # type: ignore[attr-defined]
        return wrapper

    return decorate
