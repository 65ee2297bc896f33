"""Turn input errors into short messages a client can act on, and map them to MCP ToolErrors.

A validation error becomes one line per field: the field, what was wrong, the allowed values and an
example (never pydantic's own "1 validation error for ..." text). Whatever an error quotes from the
input is capped, so a 100 KB argument is never echoed back whole.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

import annotated_types as at
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

log = logging.getLogger("mcore_advisor.server")

F = TypeVar("F", bound=Callable[..., Any])

QUOTE_CHARS = 60
MESSAGE_CHARS = 1500
MAX_LINES = 8


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """repr(value), cut to `limit` characters with the full length stated."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def cap(message: str, limit: int = MESSAGE_CHARS) -> str:
    if len(message) <= limit:
        return message
    return f"{message[:limit]} ... (message cut at {limit:,} of {len(message):,} characters)"


# ---- the field a validation error points at ---------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def field_at(model: type[BaseModel] | None, loc: tuple) -> FieldInfo | None:
    """The FieldInfo that `loc` (pydantic's error location) names inside `model`, if any."""
    info: FieldInfo | None = None
    current = model
    for part in loc:
        if isinstance(part, int):
            continue
        if current is None or part not in current.model_fields:
            return None
        info = current.model_fields[part]
        nested = _models_in(info.annotation)
        current = nested[0] if nested else None
    return info


def _choices(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if get_origin(annotation) in (typing.Union, types.UnionType, list):
        return [c for arg in get_args(annotation) for c in _choices(arg)]
    return []


def _base_type(annotation: Any) -> str:
    names = {int: "integer", float: "number", bool: "true/false", str: "string"}
    for arg in (annotation, *get_args(annotation)):
        if arg in names:
            return names[arg]
        if get_origin(arg) is list:
            return "list"
    return "value"


def allowed(info: FieldInfo) -> tuple[str, Any]:
    """('integer 1..1048576', example) for a field, from its own type and bounds."""
    choices = _choices(info.annotation)
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices if c is not None), choices[0]
    kind = _base_type(info.annotation)
    lo = hi = None
    for m in info.metadata:
        if isinstance(m, at.Ge | at.Gt):
            lo = (m.ge if isinstance(m, at.Ge) else m.gt, isinstance(m, at.Gt))
        elif isinstance(m, at.Le | at.Lt):
            hi = (m.le if isinstance(m, at.Le) else m.lt, isinstance(m, at.Lt))
    example = info.default if info.default not in (None, PydanticUndefined, ...) else None
    if lo is not None or hi is not None:
        left = "" if lo is None else f"{'>' if lo[1] else '>='} {lo[0]}"
        right = "" if hi is None else f"{'<' if hi[1] else '<='} {hi[0]}"
        rng = " and ".join(x for x in (left, right) if x)
        if example is None:
            example = lo[0] if lo is not None and not lo[1] else (hi[0] if hi is not None else None)
        return f"{kind} {rng}", example
    return kind, example


_PROBLEMS = {
    "missing": "required",
    "extra_forbidden": "unknown field",
    "int_parsing": "not an integer", "int_type": "not an integer", "int_from_float": "not a whole number",
    "float_parsing": "not a number", "float_type": "not a number", "finite_number": "not a finite number",
    "bool_parsing": "not true/false", "bool_type": "not true/false",
    "string_type": "not a string", "literal_error": "not an allowed value",
    "dict_type": "not an object", "model_type": "not an object", "list_type": "not a list",
    "greater_than_equal": "too small", "greater_than": "too small",
    "less_than_equal": "too large", "less_than": "too large",
    "too_long": "too long", "string_too_long": "too long",
}


def _line(err: Mapping[str, Any], model: type[BaseModel] | None, rename: Mapping[str, str]) -> str:
    loc = tuple(err.get("loc", ()))
    dotted = ".".join(str(x) for x in loc) or "input"
    name = rename.get(dotted, dotted)
    kind = err.get("type", "")
    if kind in ("value_error", "assertion_error"):
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        return msg if loc == () else f"{name}: {msg}"
    problem = _PROBLEMS.get(kind, str(err.get("msg", "invalid")).lower())
    got = "" if kind == "missing" else f" (got {quote(err.get('input'))})"
    info = field_at(model, loc)
    if kind == "extra_forbidden":
        parent = field_at(model, loc[:-1]) if len(loc) > 1 else None
        owner = _models_in(parent.annotation)[0] if parent is not None and _models_in(parent.annotation) else model
        known = ", ".join(owner.model_fields) if owner is not None and (len(loc) > 1 or parent is None) else ""
        return f"{name}: unknown field" + (f"; known fields here: {known}" if known else "")
    if info is None:
        return f"{name}: {problem}{got}"
    rng, example = allowed(info)
    tail = f"; allowed: {rng}" + (f"; e.g. {name.rsplit('.', 1)[-1]}={example!r}" if example is not None else "")
    return f"{name}: {problem}{got}{tail}"


def describe_validation_error(exc: ValidationError, model: type[BaseModel] | None = None,
                              rename: Mapping[str, str] | None = None) -> str:
    """One line per bad field with the allowed values and an example. `rename` maps a dotted plan
    field to the argument name the caller used (e.g. 'cluster.num_gpus' -> 'num_gpus')."""
    errors = exc.errors()
    if model is None:
        model = _model_of(exc)
    lines = [_line(e, model, rename or {}) for e in errors[:MAX_LINES]]
    if len(errors) > MAX_LINES:
        lines.append(f"... and {len(errors) - MAX_LINES} more")
    return "\n".join(dict.fromkeys(lines))


def _model_of(exc: ValidationError) -> type[BaseModel] | None:
    """The model a ValidationError was raised for, found by its title among the core's input models."""
    from mcore_advisor import schemas

    for obj in vars(schemas).values():
        if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__name__ == exc.title:
            return obj
    return None


def user_message(exc: BaseException) -> str:
    """The text a user sees for an error the input could fix."""
    if isinstance(exc, ValidationError):
        return cap(describe_validation_error(exc))
    if isinstance(exc, KeyError) and exc.args:
        return cap(str(exc.args[0]))
    return cap(str(exc))


def tool_errors(fn: F) -> F:
    """Map ValueError/KeyError/ValidationError to ToolError; hide tracebacks of the rest (sync or async)."""

    def convert(exc: BaseException) -> ToolError:
        if isinstance(exc, ToolError):
            return ToolError(cap(str(exc)))
        if isinstance(exc, ValueError | KeyError | ValidationError | FileNotFoundError | OverflowError):
            return ToolError(user_message(exc))
        log.exception("internal error in %s", fn.__name__)
        return ToolError(f"internal error in {fn.__name__} ({type(exc).__name__}); the server log has details")

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                raise convert(exc) from None

        return awrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise convert(exc) from None

    return wrapper  # type: ignore[return-value]
