"""Hostile-input fuzzing of every MCP tool, driven by the tools' own published input schemas.

Inputs are generated from `tools/list` (so the fuzzer follows the schemas as they change) with
hypothesis: right shapes, wrong shapes, boundary integers, NaN/Infinity, huge strings and lists,
unicode, deep nesting, unknown fields, stringified JSON and shell/path payloads. Opaque objects
(a full plan, a request, options) start from a plan the server itself returned and are mutated.

Each call is judged by `judge`: an exception reaching the client, an "internal error", a traceback,
a NaN/Infinity in the answer, a call over CALL_LIMIT_S, or a rejection that names no field is a
failure. Used by tests/reliability/test_fuzz.py (a reduced count) and benchmarks/reliability.py.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

CALL_LIMIT_S = 5.0  # CPU seconds of one call: what it costs, whatever else shares the machine
WALL_LIMIT_S = 30.0  # wall seconds: a hang, even on a loaded 2-core CI machine
CANCEL_AFTER_S = 60.0  # a call still running then is abandoned (and counted as a failure)
QUOTE = 300

BIG_INTS = [0, -1, 1, 2, 3, 7, 8, 64, 1024, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]
ODD_FLOATS = [0.0, -0.0, 5e-324, 1e-320, 1e-6, 0.5, 1.0, 3.0, 1e6, 1e300, 1.7976931348623157e308, -1.0,
              math.nan, math.inf, -math.inf]
INJECTION = ["; touch /tmp/mcore-canary", "$(touch /tmp/mcore-canary)", "`touch /tmp/mcore-canary`", "a'b\"c",
             "line1\nline2", "--help", "-rf", "../../../etc/passwd", "/etc/passwd", "%j%x", "${HOME}", "a b", "*", "\\"]
ODD_STRINGS = ["", " ", "\x00", "\u202e\u0645\u0631\u062d\u0628\u0627", "\u00fcn\u00efc\u00f8d\u00e9 \u2713 \u6f22\u5b57 \U0001f680",
               "x" * 100_000, "9" * 5000, "NaN", "Infinity", "-1", "1e309", "8", "true", "null", "[1, 2]", "{}",
               "{\"model\": 1}", *INJECTION]


def _deep(levels: int) -> Any:
    value: Any = 1
    for i in range(levels):
        value = {"a": value} if i % 2 else [value]
    return value


ODD_VALUES = [None, True, False, [], {}, [None] * 3, list(range(10_000)), {"unknown_field": 1}, _deep(200), "x" * 100_000]


@dataclass
class Pools:
    """Known-good values the server publishes (catalog keys, by the argument they fit) and plans it
    returned, so that generated inputs also reach the core's deep paths."""

    strings: list[str] = field(default_factory=list)
    by_name: dict[str, list[str]] = field(default_factory=dict)
    plans: list[dict[str, Any]] = field(default_factory=list)
    # Argument groups that make a call meaningful (what a caller gives first); one goes into each tidy input.
    anchors: tuple[tuple[str, ...], ...] = (("model", "num_gpus"), ("plan_id",), ("plan",), ("model",), ("job_id",))


def _mutate(plan: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A seed plan with one leaf replaced, a key dropped or an unknown one added, or its JSON text."""
    paths = [(s, k) for s, part in plan.items() if isinstance(part, dict) for k in part]

    def build(choice: int, idx: int, value: Any) -> Any:
        out = json.loads(json.dumps(plan))
        if not paths:
            return out
        sec, key = paths[idx % len(paths)]
        if choice == 0:
            out[sec][key] = value
        elif choice == 1:
            out[sec].pop(key, None)
        elif choice == 2:
            out[sec][f"{key}_x"] = value
        elif choice == 3:
            return json.dumps(out)
        return out

    hostile = st.sampled_from(BIG_INTS + ODD_FLOATS + ODD_STRINGS + ODD_VALUES)
    return st.builds(build, st.integers(0, 4), st.integers(0, 10_000), hostile)


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref and ref.startswith("#/"):
        node: Any = root
        for part in ref[2:].split("/"):
            node = node[part]
        return {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def valid_value(schema: dict[str, Any], root: dict[str, Any], pools: Pools, depth: int = 0,
                name: str = "") -> st.SearchStrategy[Any]:
    """Values of the schema's own shape (ranges, enums, items), with the server's known names for strings."""
    schema = _resolve(schema, root)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([valid_value(s, root, pools, depth + 1) for s in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([valid_value({**schema, "type": k}, root, pools, depth + 1) for k in kind])
    if kind == "integer":
        lo = schema.get("minimum", -(2**63))
        hi = schema.get("maximum", 2**63)
        lo = max(lo, schema["exclusiveMinimum"] + 1) if "exclusiveMinimum" in schema else lo
        hi = min(hi, schema["exclusiveMaximum"] - 1) if "exclusiveMaximum" in schema else hi
        small = st.integers(max(lo, -2), min(hi, 128)) if max(lo, -2) <= min(hi, 128) else st.nothing()
        powers = [2**k for k in range(0, 13) if lo <= 2**k <= hi]
        return st.one_of(small, st.sampled_from(powers or [lo]), st.sampled_from(powers or [lo]),
                         st.sampled_from([v for v in (lo, hi) if abs(v) < 2**63] or [lo]), st.integers(lo, hi))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        known = pools.by_name.get(name) or pools.strings or ["x"]
        return st.one_of(st.sampled_from(known), st.sampled_from(known), st.sampled_from(known), st.text(max_size=20))
    if kind == "array":
        item = valid_value(schema.get("items", {}), root, pools, depth + 1) if depth < 4 else st.just("x")
        return st.lists(item, max_size=4)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        if not props:
            seeds = [st.sampled_from(pools.plans)] + [_mutate(p) for p in pools.plans] if pools.plans else []
            return st.one_of(*seeds, st.dictionaries(st.sampled_from(pools.strings or ["k"]), st.integers(0, 8), max_size=3))
        return arguments(schema, root, pools, depth + 1)
    return st.sampled_from(BIG_INTS + ODD_STRINGS[:10])


def hostile_value() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(BIG_INTS), st.sampled_from(ODD_FLOATS), st.sampled_from(ODD_STRINGS),
                     st.sampled_from(ODD_VALUES), st.text(max_size=40), st.integers())


_MISSING = object()


def arguments(schema: dict[str, Any], root: dict[str, Any], pools: Pools, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """An argument object. Half are well-formed (each property absent or of its own shape) with at
    most one hostile value; the other half mix valid, hostile and stringified-JSON values freely, and
    some carry unknown fields."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])

    def optional(n: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return value if n in required else st.one_of(st.just(_MISSING), st.just(_MISSING), value)

    def wild(n: str, sub: dict[str, Any]) -> st.SearchStrategy[Any]:
        good = valid_value(sub, root, pools, depth, n)
        return st.one_of(good, good, good, hostile_value(), good.map(lambda v: json.dumps(v, allow_nan=True)))

    valid = {n: valid_value(s, root, pools, depth, n) for n, s in props.items()}

    @st.composite
    def tidy(draw: Any) -> dict[str, Any]:
        """A few arguments (what a caller usually gives), each of its own shape."""
        names = draw(st.lists(st.sampled_from(sorted(props)), unique=True, max_size=5)) if props else []
        anchors = [a for a in pools.anchors if set(a) <= set(props)]
        if anchors:
            names.extend(draw(st.sampled_from(anchors)))
        return {n: draw(valid[n]) for n in sorted(set(names) | required)}

    messy = st.fixed_dictionaries({n: optional(n, wild(n, s)) for n, s in props.items()})
    unknown = st.dictionaries(st.sampled_from(["unknown", "Model", "tp ", "__proto__"]), hostile_value(), min_size=1, max_size=2)

    def one_hostile(chosen: dict[str, Any], which: int, value: Any) -> dict[str, Any]:
        keys = sorted(chosen) or sorted(props)
        return {**chosen, keys[which % len(keys)]: value} if keys else chosen

    clean = lambda d: {k: v for k, v in d.items() if v is not _MISSING}  # noqa: E731
    return st.one_of(
        tidy(), tidy(), tidy(),
        st.builds(lambda d, i, v: one_hostile(d, i, v), tidy(), st.integers(0, 10_000), hostile_value()),
        st.builds(lambda d, i, v: one_hostile(d, i, v), tidy(), st.integers(0, 10_000), hostile_value()),
        st.builds(clean, messy),
        st.builds(lambda d, more: {**clean(d), **more}, messy, unknown),
    )


# ---- judging one answer ---------------------------------------------------------------------------

_PREFIX = re.compile(r"^Error executing tool \w+: ")
_NONFINITE_TEXT = re.compile(r"(?<![\w.])-?(?:nan|inf|infinity)(?![\w])", re.IGNORECASE)
_FIELD = re.compile(r"(?:^|[\s;('\"\[])([A-Za-z_][\w-]*(?:\.[\w\[\]-]+)*)\s*:")


def _keys(value: Any, out: set[str], depth: int = 0) -> set[str]:
    if depth > 40:
        return out
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(str(k))
            _keys(v, out, depth + 1)
    elif isinstance(value, list):
        for v in value[:50]:
            _keys(v, out, depth + 1)
    elif isinstance(value, str) and value[:1] in "{[" and len(value) < 100_000:
        try:
            _keys(json.loads(value), out, depth + 1)
        except ValueError:
            pass
    return out


_QUOTED_FIELD = re.compile(r"'([^'\n]{1,120})'\s*:")
_CODE_NAME = re.compile(r"`(\w+)`")
_WORD = re.compile(r"\b[a-z][a-z0-9_]{3,}\b")
_DOTTED = re.compile(r"\b[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+\b")


def names_field(text: str, names: set[str], given: set[str]) -> bool:
    """Does the rejection say which field: a 'field: problem' naming a known field, or quoting an
    argument that was given (an unknown one)?"""
    for m in _FIELD.finditer(text):
        parts = re.split(r"[.\[\]]", m.group(1))
        if m.group(1) in given or any(p in names or p in given for p in parts if p):
            return True
    if any(m.group(1) in given for m in _QUOTED_FIELD.finditer(text)):
        return True
    if any(m.group(1) in names for m in _CODE_NAME.finditer(text)):
        return True
    # A dotted plan field anywhere ("... (model.name)", "model.num_layers is required ...").
    if any(all(p in names or p in given for p in m.group(0).split(".")) for m in _DOTTED.finditer(text)):
        return True
    # Or a field named in prose ("extra_args must start with a --flag"): a published or given name as a word.
    return any(w in names or w in given for w in _WORD.findall(text))


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def judge(tool: str, args: dict[str, Any], outcome: Any, cost: tuple[float, float], names: set[str]) -> str | None:
    """None when the answer is acceptable, else why not. `cost`: (wall s, CPU s) of the call."""
    wall_s, cpu_s = cost
    if isinstance(outcome, BaseException):
        return f"exception reached the client: {type(outcome).__name__}: {str(outcome)[:QUOTE]}"
    if cpu_s > CALL_LIMIT_S or wall_s > WALL_LIMIT_S:
        return f"took {cpu_s:.1f} CPU s, {wall_s:.1f} s wall (limits {CALL_LIMIT_S:g} CPU s, {WALL_LIMIT_S:g} s wall)"
    text = " ".join(getattr(c, "text", "") or "" for c in outcome.content)
    if "Traceback" in text or 'File "' in text:
        return f"traceback in the answer: {text[:QUOTE]}"
    if outcome.is_error:
        message = _PREFIX.sub("", text)
        if "internal error" in message:
            return f"unhandled exception: {message[:QUOTE]}"
        if len(message) > 4000:
            return f"error message of {len(message):,} characters (echoes the input?)"
        if not names_field(message, names, _keys(args, set())):
            return f"rejection names no field: {message[:QUOTE]}"
        return None
    if not _finite(outcome.structured_content):
        return "NaN or Infinity in structured_content"
    if _NONFINITE_TEXT.search(text):
        return f"NaN or Infinity in the text: ...{text[max(0, _NONFINITE_TEXT.search(text).start() - 60):][:160]}"
    return None


# ---- running ------------------------------------------------------------------------------------------


@dataclass
class ToolReport:
    tool: str
    tried: int = 0
    rejected: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (input, why)
    slowest_s: float = 0.0  # wall
    slowest_cpu_s: float = 0.0
    slowest_input: str = ""


def short(args: Any) -> str:
    text = json.dumps(args, default=repr, allow_nan=True)
    return text if len(text) <= QUOTE else f"{text[:QUOTE]}... ({len(text):,} chars)"


async def call(client: Any, tool: str, args: dict[str, Any]) -> tuple[Any, tuple[float, float]]:
    """(the result or the exception the client saw, (wall s, process CPU s)); the in-memory server
    runs in this process, so the CPU time is the call's own cost."""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        with anyio.fail_after(CANCEL_AFTER_S):
            outcome: Any = await client.call_tool(tool, args)
    except Exception as exc:  # what reached the client
        outcome = exc
    return outcome, (time.perf_counter() - t0, time.process_time() - c0)


def all_names(tools: list[Any], pools: Pools | None = None) -> set[str]:
    """Every property name the server publishes in any input or output schema, and the plan fields
    of the plans it returned."""
    names: set[str] = set()
    for t in tools:
        for schema in (t.input_schema, t.output_schema or {}):
            _schema_names(schema, names)
    for plan in pools.plans if pools else []:
        _keys(plan, names)
    return names


def _schema_names(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        for k in (node.get("properties") or {}):
            out.add(k)
        for v in node.values():
            _schema_names(v, out)
    elif isinstance(node, list):
        for v in node:
            _schema_names(v, out)


def fuzz_tool(portal: Any, client: Any, tool: Any, pools: Pools, names: set[str], count: int,
              on_call: Callable[[str, dict[str, Any], Any, tuple[float, float]], None] | None = None,
              derandomize: bool = False) -> ToolReport:
    """Run `count` generated inputs against one tool through a sync portal; never raises on a bad answer."""
    report = ToolReport(tool.name)
    strategy = arguments(tool.input_schema, tool.input_schema, pools)
    masked = _MaskedNonFinite()
    server_log = logging.getLogger("mcore_advisor.server")
    server_log.addHandler(masked)

    @settings(max_examples=count, database=None, deadline=None, derandomize=derandomize, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(args: dict[str, Any]) -> None:
        masked.seen.clear()
        outcome, cost = portal.call(call, client, tool.name, args)
        report.tried += 1
        if cost[1] > report.slowest_cpu_s:
            report.slowest_cpu_s, report.slowest_s, report.slowest_input = cost[1], cost[0], short(args)
        if not isinstance(outcome, BaseException) and outcome.is_error:
            report.rejected += 1
        why = judge(tool.name, args, outcome, cost, names)
        if why is None and masked.seen:
            why = f"the core computed NaN/Infinity (the adapter replaced it with null): {masked.seen[0][:QUOTE]}"
        if why:
            report.failures.append((short(args), why))
        if on_call:
            on_call(tool.name, args, outcome, cost)

    try:
        run()
    finally:
        server_log.removeHandler(masked)
    return report


class _MaskedNonFinite(logging.Handler):
    """The adapter's warning when it had to replace a NaN/Infinity the core produced (server/app.py answer)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "non-finite" in text:
            self.seen.append(text)
