"""The tool-call parser interface, the pieces every wire format shares, and the registry of formats.

A parser knows one model family's tool-call text: how calls look in the output (`split`), how to render
calls back into an assistant turn (`format_calls`, byte-identical to what the grammar forces, so agent loops
hit the radix cache), and how to wrap the calls into the whole constrained output: per-call regexes
(`calls_regex`, the outlines backend) or a Lark rule `call` (`calls_lark`, llguidance; see grammar.py).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    """One complete tool call found in the output; `arguments` is the model's JSON text, verbatim."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Pending:
    """Output tail that may still become tool calls (streaming only: never returned when `final`)."""

    text: str


Segment = str | Call | Pending

# `{"name": "NAME", "arguments": ` (or "parameters"): the head of a call object as models (and the grammar)
# write it, name first.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = " \t\r\n"


def json_extent(text: str, start: int) -> int | None:
    """End index of the JSON value starting at `text[start]` (found by bracket and string scanning, not
    validated), or None when it is not closed yet. Scalars end at the first `,`, `}`, `]` or whitespace."""
    if start >= len(text):
        return None
    depth, in_str, esc = 0, False, False
    if text[start] not in '{["':
        m = re.compile(r"[^,\]}\s]*").match(text, start)
        end = m.end()
        return end if end < len(text) else None
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def parse_call_object(text: str, start: int = 0) -> tuple[Call, int] | None:
    """A complete, valid call object `{"name": str, "arguments"|"parameters": object}` starting at
    `text[start]` (after whitespace): (the call, end index), or None. Arguments keep the model's layout."""
    while start < len(text) and text[start] in _WS:
        start += 1
    end = json_extent(text, start)
    if end is None or text[start : start + 1] != "{":
        return None
    try:
        obj = json.loads(text[start:end])
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key)
    if isinstance(args, str):  # some models write arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
        return (Call(obj["name"], json.dumps(args)) if isinstance(args, dict) else None), end
    if not isinstance(args, dict) or set(obj) != {"name", key}:
        return None
    head = _HEAD.match(text, start)
    if head is not None:  # name first: keep the arguments text verbatim (cache-stable re-rendering)
        args_end = json_extent(text, head.end())
        if args_end is not None and text[args_end:end].strip(_WS) == "}":
            return Call(obj["name"], text[head.end() : args_end]), end
    return Call(obj["name"], json.dumps(args)), end


def partial_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments text so far) of every call object begun in `text`, in order. Used while streaming
    grammar-constrained output, where every begun call is known to complete as it reads so far."""
    out, pos = [], 0
    while True:
        head = _HEAD.search(text, pos)
        if head is None:
            return out
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return out
        end = json_extent(text, head.end())
        out.append((name, text[head.end() : end if end is not None else len(text)]))
        if end is None:
            return out
        pos = end


def trigger_prefix_start(text: str, trigger: str) -> int:
    """Start of the longest suffix of `text` that is a proper prefix of `trigger` (len(text) if none)."""
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:k]):
            return len(text) - k
    return len(text)


def regex_literal(text: str) -> str:
    """`text` as a literal in outlines-core's (Rust) regex syntax. `<` and `>` stay bare: escaped they are
    word-boundary assertions there."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def call_object_regex(name: str, args_key: str, args_regex: str) -> str:
    """The regex of `{"name": "NAME", "ARGS_KEY": ARGS}` laid out as json.dumps writes it."""
    return regex_literal(f'{{"name": {json.dumps(name)}, "{args_key}": ') + f"({args_regex})" + r"\}"


def call_object_text(name: str, args_key: str, arguments: str) -> str:
    return f'{{"name": {json.dumps(name)}, "{args_key}": {arguments}}}'


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (JSON string escapes, ASCII only)."""
    return json.dumps(text)


def text_without(trigger: str) -> str:
    """Regex of the strings that do not contain `trigger` (whose first character must not recur in it):
    free text before a trigger-gated tool-call grammar."""
    first, rest = trigger[0], trigger[1:]
    if first in rest:
        raise ValueError(f"trigger {trigger!r}: its first character recurs in it")
    lit, cls = regex_literal, _negated_class
    lt = lit(first) + "+"
    prefixes = [rest[:k] for k in range(len(rest))]  # proper prefixes of the rest, "" included
    broken = "|".join(lit(p) + cls(first + rest[len(p)]) for p in prefixes)
    chain = "(?:" + lt + "(?:" + "|".join(lit(p) for p in prefixes[1:]) + "))*" if len(prefixes) > 1 else ""
    partial = "|".join(lit(p) for p in prefixes[1:])
    tail = f"(?:{lt}(?:{partial})?)*" if partial else f"(?:{lt})?"
    return f"(?:{cls(first)}|{chain}{lt}(?:{broken}))*{tail}"


def _negated_class(chars: str) -> str:
    return "[^" + "".join("\\" + c if c in "\\]^-[" else c for c in sorted(set(chars))) + "]"


class ToolCallParser(ABC):
    """One model family's tool-call wire format."""

    name: str
    # Text that opens tool calls in free output (the gate of `auto` + strict tools).
    trigger: str
    args_key: str = "arguments"
    # Names the chat template uses when it renders tools itself (for `auto` detection).
    template_markers: tuple[str, ...] = ()
    # The format's tags are special tokens (harmony): its output is decoded with them kept.
    keeps_special_tokens: bool = False

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ToolCallParser:
        """The parser for this tokenizer (a format whose grammar names special tokens reads their ids)."""
        return cls()

    @property
    def grammar_key(self) -> str:
        """What besides the name and the tools the forced grammar's text depends on (the grammar memo)."""
        return ""

    def call_lark(self, name: str, args_rule: str) -> str:
        """Lark of one call of tool `name` whose arguments are `args_rule`, as `format_calls` writes it."""
        head = f'{{"name": {json.dumps(name)}, "{self.args_key}": '
        return f'{lark_literal(head)} {args_rule} "}}"'

    @abstractmethod
    def split(self, text: str, final: bool) -> list[Segment]:
        """Output text -> content strings and complete calls, in order. Unless `final`, a tail that may still
        become calls is a `Pending`. Text that looks like a call but does not parse stays a content string."""

    @abstractmethod
    def format_calls(self, calls: list[Call]) -> str:
        """Calls as this model writes them in an assistant turn (exactly the constrained output's text)."""

    @abstractmethod
    def calls_regex(self, call_regexes: list[str], parallel: bool) -> str:
        """Regex of the whole output for forced calls: one of `call_regexes` (each a `call_object_regex`), or
        one or more of them when `parallel`."""

    def begins_call(self, text: str) -> bool:
        """Whether `text` (a `Pending` tail) has started a call, as opposed to possibly starting one."""
        return self.trigger in text

    def gated_regex(self, call_regexes: list[str], parallel: bool) -> str:
        """Free text without the trigger, then optionally the calls (`auto` with strict tools)."""
        calls = self.calls_regex(call_regexes, parallel)
        if not calls.startswith(regex_literal(self.trigger)):
            raise ValueError(f"{self.name}: the calls regex does not start with the trigger")
        return f"{text_without(self.trigger)}(?:{calls})?"

    def lark_after_trigger(self, parallel: bool) -> tuple[str, list[str]]:
        """Lark for forced calls after the trigger text: (an expression over the rule `call` -- one call, or
        one or more when `parallel` -- and the extra rules it uses)."""
        raise NotImplementedError(f"{self.name}: no Lark form")

    def calls_lark(self, parallel: bool) -> list[str]:
        """Lark rules (`start` first) of the whole output for forced calls; the caller defines `call`."""
        expr, rules = self.lark_after_trigger(parallel)
        return [f"start: {lark_literal(self.trigger)} {expr}", *rules]

    def gated_lark(self, parallel: bool) -> list[str]:
        """Free text without the trigger, then optionally the calls (`auto` with strict tools). The text
        before a trigger is one lazy lexeme: it ends at the trigger's first occurrence."""
        expr, rules = self.lark_after_trigger(parallel)
        trig = lark_literal(self.trigger)
        return [
            f"start: FREE_TEXT | free_then_trigger {expr}",
            f"free_then_trigger[lazy]: /(.|\\n)*/ {trig}",
            f"FREE_TEXT: /(.|\\n)*/ & ~(/(.|\\n)*/ {trig} /(.|\\n)*/)",
            *rules,
        ]

    def instruction(self, tools_json_lines: str) -> str:
        """System-prompt block for chat templates that do not render tools (docs/structured-output.md)."""
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{tools_json_lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )


_REGISTRY: dict[str, type[ToolCallParser]] = {}
PARSER_NAMES = ("auto", "harmony", "hermes", "llama3", "mistral", "qwen")


def register(cls: type[ToolCallParser]) -> type[ToolCallParser]:
    _REGISTRY[cls.name] = cls
    return cls


def get_parser(name: str, chat_template: str | None = None, tokenizer: Any = None) -> ToolCallParser:
    """The parser called `name`; `auto` picks the one whose markers the chat template contains (hermes when
    none does: its `<tool_call>` block is the documented fallback for plain templates such as ChatML).
    `tokenizer`: for a format whose grammar names its special tokens (harmony)."""
    from runtime.entrypoints.tool_calls import harmony, hermes, llama3, mistral, qwen  # noqa: F401

    if name == "auto":
        template = chat_template or ""
        name = "hermes"
        for candidate in ("harmony", "qwen", "mistral", "llama3", "hermes"):
            if any(m in template for m in _REGISTRY[candidate].template_markers):
                name = candidate
                break
    if name not in _REGISTRY:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(PARSER_NAMES)}")
    return _REGISTRY[name].from_tokenizer(tokenizer)
