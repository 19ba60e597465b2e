"""Hermes format (NousResearch Hermes 2/3, and the fallback for plain ChatML templates such as the default
model's): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, calls separated by a
newline."""

from __future__ import annotations

from runtime.entrypoints.tool_calls.base import (
    Call,
    Pending,
    Segment,
    ToolCallParser,
    call_object_text,
    lark_literal,
    parse_call_object,
    regex_literal,
    register,
    trigger_prefix_start,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NL = lark_literal("\n")


@register
class HermesParser(ToolCallParser):
    name = "hermes"
    trigger = OPEN
    template_markers = (OPEN,)

    def split(self, text: str, final: bool) -> list[Segment]:
        out: list[Segment] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:
                rest = text[pos:]
                cut = len(rest) if final else trigger_prefix_start(rest, OPEN)
                out += [rest[:cut]] + ([Pending(rest[cut:])] if cut < len(rest) else [])
                return out
            out.append(text[pos:start])
            body_start = start + len(OPEN)
            close = text.find(CLOSE, body_start)
            if close < 0 and not final:
                out.append(Pending(text[start:]))
                return out
            body_end = close if close >= 0 else len(text)
            parsed = parse_call_object(text, body_start)
            if parsed is not None and text[parsed[1] : body_end].strip() == "":
                out.append(parsed[0])
            else:  # not a call: the block stays content
                out.append(text[start : body_end + (len(CLOSE) if close >= 0 else 0)])
            if close < 0:
                return out
            pos = close + len(CLOSE)

    def format_calls(self, calls: list[Call]) -> str:
        return "\n".join(
            f"{OPEN}\n{call_object_text(c.name, self.args_key, c.arguments)}\n{CLOSE}" for c in calls
        )

    def calls_regex(self, call_regexes: list[str], parallel: bool) -> str:
        one = regex_literal(OPEN + "\n") + "(?:" + "|".join(call_regexes) + ")" + regex_literal("\n" + CLOSE)
        return f"{one}(?:\\n{one})*" if parallel else one

    def lark_after_trigger(self, parallel: bool) -> tuple[str, list[str]]:
        one = f"{_NL} call {lark_literal(chr(10) + CLOSE)}"
        if not parallel:
            return one, []
        return f"{one} ({_NL} tool_call)*", [f"tool_call: {lark_literal(OPEN)} {one}"]
