"""Request-side tools: validate `tools` / `tool_choice` (400s name the field), and build the constrained-
decoding regex for forced calls (`required`, a named tool, or `auto` with strict tools)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from constrained.errors import GrammarError
from constrained.spec import DEFAULT_WHITESPACE, validate_spec
from runtime.entrypoints.tool_calls.base import ToolCallParser, call_object_regex

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolRequestError(ValueError):
    """A bad `tools` / `tool_choice` / tool message; the message names the field (HTTP 400)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI writes it (and chat templates read it), keys in a fixed order: the rendered
        prompt must be byte-identical across the turns of an agent loop."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None


def parse_tools(raw: Any) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolRequestError("'tools' must be a list of tools")
    tools, seen = [], set()
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise ToolRequestError(f"'{where}' must be an object")
        if item.get("type", "function") != "function":
            raise ToolRequestError(f"'{where}.type' must be 'function', got {item.get('type')!r}")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise ToolRequestError(f"'{where}.function' must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolRequestError(
                f"'{where}.function.name' must match ^[A-Za-z0-9_-]{{1,64}}$, got {name!r}"
            )
        if name in seen:
            raise ToolRequestError(f"'{where}.function.name' repeats the tool name {name!r}")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolRequestError(f"'{where}.function.description' must be a string")
        strict = fn.get("strict", False)
        if not isinstance(strict, bool):
            raise ToolRequestError(f"'{where}.function.strict' must be a boolean")
        tools.append(Tool(name, desc, _check_parameters(fn, f"{where}.function.parameters"), strict))
    return tools


def _check_parameters(fn: dict[str, Any], where: str) -> dict[str, Any]:
    # Issue 16: tools without `parameters` are refused (OpenAI would read them as "no arguments").
    if "parameters" not in fn:
        raise ToolRequestError(f"'{where}' is required (a JSON Schema of the arguments object)")
    params = fn["parameters"]
    if not isinstance(params, dict):
        raise ToolRequestError(f"'{where}' must be a JSON Schema object")
    if params.get("type", "object") != "object":
        raise ToolRequestError(f'\'{where}\' must describe an object ("type": "object")')
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        raise ToolRequestError(f"'{where}' is not a valid JSON Schema: {e.message}") from None
    return params


def parse_tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if not tools and raw != "none":
        raise ToolRequestError("'tool_choice' needs 'tools'")
    if raw in ("none", "auto", "required"):
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = raw["function"].get("name")
        if name not in {t.name for t in tools}:
            raise ToolRequestError(
                f"'tool_choice.function.name' {name!r} is not the name of any of the tools"
            )
        return ToolChoice("named", name)
    raise ToolRequestError(
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
        '{"name": ...}}'
    )


def expand_required_branches(node: Any) -> Any:
    """Rewrite `anyOf`/`oneOf` branches that only add `required` (optionally with `not: {required}`) next to
    `properties` -- a common function-schema idiom ("length and width, or radius") that the JSON-Schema
    grammar ignores -- into full object branches it enforces. oneOf / `not` branches drop the properties
    that only other branches require, so exactly one branch holds (objects carry no unlisted properties).
    Branches that cannot hold are dropped; every instance of the result is valid under the original.
    """
    if isinstance(node, list):
        return [expand_required_branches(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: expand_required_branches(v) for k, v in node.items()}
    props = node.get("properties")
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if not isinstance(props, dict) or not isinstance(branches, list) or not branches:
            continue
        if not all(isinstance(b, dict) and _required_only(b) for b in branches):
            continue
        base = {k: v for k, v in node.items() if k != key}
        base_req = set(node.get("required") or [])
        out = []
        for i, b in enumerate(branches):
            req = base_req | set(b["required"])
            exclusive = key == "oneOf" or "not" in b
            others = [set(o["required"]) for j, o in enumerate(branches) if j != i]
            others += [set(b["not"]["required"])] if "not" in b else []
            banned = set().union(*[o - req for o in others]) if exclusive else set()
            if not req <= set(props) or (exclusive and any(o <= req for o in others)):
                continue  # needs a property the object cannot have, or cannot exclude the others
            kept = {k: v for k, v in props.items() if k not in banned}
            out.append({**base, "properties": kept, "required": [k for k in props if k in req]})
        if not out:
            raise ToolRequestError(f"no object satisfies the {key} branches of {json.dumps(node)[:200]}")
        node = out[0] if len(out) == 1 else {"anyOf": out}
        break
    return node


def _required_only(branch: dict) -> bool:
    ok_not = "not" not in branch or (set(branch["not"]) == {"required"} and isinstance(branch["not"], dict))
    return isinstance(branch.get("required"), list) and set(branch) <= {"required", "not"} and ok_not


def enforced_parameters(tool: Tool, index: int) -> dict[str, Any]:
    """The schema the grammar enforces for the tool's arguments: `parameters` with required-only branches
    expanded. The HTTP-side check and the grammar both start from this, so they judge the same schema."""
    try:
        return expand_required_branches(tool.parameters)
    except ToolRequestError as e:
        raise ToolRequestError(f"'tools[{index}].function.parameters' cannot be satisfied: {e}") from None


def arguments_regex(tool: Tool, index: int) -> str:
    """The regex of the tool's arguments (blocking: call off the event loop)."""
    schema = enforced_parameters(tool, index)
    try:
        return validate_spec("json_schema", json.dumps(schema), DEFAULT_WHITESPACE)
    except GrammarError as e:
        raise ToolRequestError(f"'tools[{index}].function.parameters' cannot be enforced: {e}") from None


def forced_regex(parser: ToolCallParser, tools: list[Tool], choice: ToolChoice, parallel: bool) -> str | None:
    """The output regex for this choice, or None when output is free (`none`, non-strict `auto`).

    `required`: any tool's call (name enum + that tool's parameters), one or more when `parallel`; named:
    that tool's call, once; `auto` with strict tools: free text without the parser's trigger, then
    optionally calls (strict tools' arguments follow their schema).
    """
    if choice.mode == "none" or (choice.mode == "auto" and not any(t.strict for t in tools)):
        return None
    if choice.mode == "auto":  # trigger-gated; a non-strict tool's arguments are any JSON object
        any_object = validate_spec("json_object", "", DEFAULT_WHITESPACE)
        calls = [
            call_object_regex(t.name, parser.args_key, arguments_regex(t, i) if t.strict else any_object)
            for i, t in enumerate(tools)
        ]
        return parser.gated_regex(calls, parallel)
    chosen = [(i, t) for i, t in enumerate(tools) if choice.mode != "named" or t.name == choice.name]
    calls = [call_object_regex(t.name, parser.args_key, arguments_regex(t, i)) for i, t in chosen]
    return parser.calls_regex(calls, parallel and choice.mode == "required")
