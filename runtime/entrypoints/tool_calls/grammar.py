"""Forced tool calls as ONE llguidance Lark grammar (grammar kind "lark"), built once per tool set.

The regex path (schema.forced_regex) builds one DFA of every tool's calls: six ordinary tools take 7-11 s to
compile over the default vocabulary and 20 tools pass the regex size limit. Here the format's wrapper text is
literal Lark, the tools are a choice of rules, and each tool's arguments are an embedded `%json{...}` schema
that llguidance's Earley parser + lexer compiles lazily: 40 tools compile in ~25 ms of CPU
(bench/tool_grammar.py). It accepts the same texts as the regex path: calls laid out as `format_calls`
writes them, arguments in json.dumps layout, objects without unlisted properties.

The text is deterministic for the same tools (schemas serialized with fixed separators, properties in their
given order -- that order is the output's), so the grammar cache, keyed by kind + spec + backend, hits;
building is memoized by a hash of the tool set as well.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from constrained.errors import GrammarError
from constrained.formats import FORMAT_REGEXES, UNSUPPORTED_FORMATS, cap_format_length
from constrained.one_of import resolve_one_of
from constrained.schema_keywords import enforce_dependencies
from runtime.entrypoints.tool_calls.base import ToolCallParser
from runtime.entrypoints.tool_calls.schema import Tool, ToolChoice, ToolRequestError, enforced_parameters

# json.dumps's layout (`{"a": 1, "b": [1, 2]}`), as constrained.spec.DEFAULT_WHITESPACE enforces on the regex
# path: nothing optional, so separators are forced (jump-forward) and the model writes what it was trained on.
# Keywords llguidance cannot enforce are errors (not `lenient`); `oneOf` is rewritten exactly first
# (constrained.one_of, as on the regex path and every backend's json_schema kind), so none is read as `anyOf`.
LAYOUT = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
    "coerce_one_of": False,
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Keys whose presence means the object's other members are governed elsewhere: left open.
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains")
_STANDARD_FORMATS = frozenset(FORMAT_REGEXES) | UNSUPPORTED_FORMATS
_MEMO_SIZE = 256


def closed_objects(node: Any, in_all_of: bool = False) -> Any:
    """The schema as the regex path reads it, in llguidance's terms: objects that list `properties` and say
    nothing about other members get `additionalProperties: false` (the regex path emits listed properties
    only, and `expand_required_branches` relies on that to make oneOf branches exclusive; branches of
    `allOf` and objects merged with `allOf`/`$ref` stay open: closing one side of an intersection would
    forbid the other side's properties); their `dependencies` become `required` / left-out properties; a
    custom `format` (no standard name) is dropped, as the specification says unknown formats are ignored;
    an implied `uniqueItems` (false, or at most one item) too. A format with an RFC length limit gets it as
    `maxLength` (`formats.cap_format_length`: llguidance's `email` bounds no length; the regex path's
    formats are bounded)."""
    if isinstance(node, list):
        return [closed_objects(x, in_all_of) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: closed_objects(v) for k, v in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [closed_objects(v, in_all_of=True) for v in value]
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed_objects(v) for v in value]
        elif key in _SUBSCHEMA_ONE and isinstance(value, dict):
            out[key] = closed_objects(value)
        elif key == "format" and isinstance(value, str) and value not in _STANDARD_FORMATS:
            continue
        elif key == "uniqueItems" and (value is False or _at_most_one_item(node)):
            continue  # implied: llguidance has no uniqueItems
        else:
            out[key] = value
    out = cap_format_length(out)
    if isinstance(node.get("properties"), dict) and not in_all_of and not any(k in node for k in _OPEN_KEYS):
        out["additionalProperties"] = False
        if "dependencies" in out or "dependentRequired" in out:
            out = _dependencies_as_required(out)
    return out


def _at_most_one_item(node: dict[str, Any]) -> bool:
    return isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1


def _dependencies_as_required(node: dict[str, Any]) -> dict[str, Any]:
    """llguidance has no `dependencies`: on a closed object, rewrite them into `required` / left-out
    properties exactly as the regex path does (stricter, so valid), then drop them as implied."""
    try:
        node = enforce_dependencies(node)
    except GrammarError as e:
        raise ToolRequestError(str(e)) from None
    return {k: v for k, v in node.items() if k not in ("dependencies", "dependentRequired")}


def arguments_schema(tool: Tool, index: int) -> dict[str, Any]:
    """A tool's arguments as embedded: the enforced parameters, objects closed, json.dumps layout."""
    enforced = enforced_parameters(tool, index)
    try:
        closed = closed_objects(resolve_one_of(enforced))
    except (ToolRequestError, GrammarError) as e:
        raise ToolRequestError(f"'tools[{index}].function.parameters' cannot be enforced: {e}") from None
    return {"x-guidance": LAYOUT, **closed}


def json_rule(schema: dict[str, Any]) -> str:
    """`%json{...}` with canonical JSON: fixed separators, keys in their given (meaningful) order."""
    return "%json " + json.dumps(schema, separators=(",", ":"), ensure_ascii=True)


def call_rules(parser: ToolCallParser, tools: list[tuple[int, Tool]], strict_only: bool) -> list[str]:
    """`call: call_0 | ...` and one rule per tool: the call object's head, the arguments, the closing brace
    (the object as `base.call_object_text` writes it). `strict_only`: non-strict tools take any object."""
    names = [f"call_{k}" for k in range(len(tools))]
    lines = ["call: " + " | ".join(names)]
    for rule, (i, t) in zip(names, tools, strict=True):
        enforced = t.strict or not strict_only
        schema = arguments_schema(t, i) if enforced else {"x-guidance": LAYOUT, **ANY_OBJECT}
        lines.append(f"{rule}: {parser.call_lark(t.name, json_rule(schema))}")
    return lines


def arguments_grammar(tool: Tool, index: int) -> str:
    """A grammar of one tool's arguments alone: used to name the tool whose schema a tool set fails on."""
    return f"start: {json_rule(arguments_schema(tool, index))}\n"


_memo: OrderedDict[str, str | None] = OrderedDict()
_memo_lock = threading.Lock()


def tool_set_key(parser: ToolCallParser, tools: list[Tool], choice: ToolChoice, parallel: bool) -> str:
    """Hash of everything the grammar depends on."""
    data = [
        parser.name,
        parser.grammar_key,
        choice.mode,
        choice.name,
        parallel,
        [[t.name, t.strict, t.parameters] for t in tools],
    ]
    return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()


def forced_lark(parser: ToolCallParser, tools: list[Tool], choice: ToolChoice, parallel: bool) -> str | None:
    """The Lark grammar of the output for this choice, or None when output is free; same semantics as
    `schema.forced_regex`. Raises ToolRequestError when a tool's schema cannot be satisfied."""
    key = tool_set_key(parser, tools, choice, parallel)
    with _memo_lock:
        if key in _memo:
            _memo.move_to_end(key)
            return _memo[key]
    text = _build(parser, tools, choice, parallel)
    with _memo_lock:
        _memo[key] = text
        while len(_memo) > _MEMO_SIZE:
            _memo.popitem(last=False)
    return text


def _build(parser: ToolCallParser, tools: list[Tool], choice: ToolChoice, parallel: bool) -> str | None:
    if choice.mode == "none" or (choice.mode == "auto" and not any(t.strict for t in tools)):
        return None
    if choice.mode == "auto":
        start = parser.gated_lark(parallel)
        calls = call_rules(parser, list(enumerate(tools)), strict_only=True)
    else:
        chosen = [(i, t) for i, t in enumerate(tools) if choice.mode != "named" or t.name == choice.name]
        start = parser.calls_lark(parallel and choice.mode == "required")
        calls = call_rules(parser, chosen, strict_only=False)
    return "\n".join(["%llguidance {}", *start, *calls]) + "\n"
