"""Llama 3.1+ JSON tool calling: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several calls separated by `; `. A reply that does not start with a call is content."""

from __future__ import annotations

from runtime.entrypoints.tool_calls.base import (
    Call,
    Pending,
    Segment,
    ToolCallParser,
    call_object_text,
    lark_literal,
    parse_call_object,
    register,
)

TAG = "<|python_tag|>"


@register
class Llama3Parser(ToolCallParser):
    name = "llama3"
    trigger = TAG
    args_key = "parameters"
    template_markers = (TAG, "<|eom_id|>")

    def split(self, text: str, final: bool) -> list[Segment]:
        body = text.lstrip()
        if body.startswith(TAG):
            body = body[len(TAG) :]
        elif not final and TAG.startswith(body):
            return [Pending(text)] if text else []
        if not body.lstrip().startswith("{"):
            return [text] if final or body.strip() else ([Pending(text)] if text else [])
        if not final:  # a later `;` may add calls and a broken one turns it all into content
            return [Pending(text)]
        calls, pos = [], 0
        while True:
            parsed = parse_call_object(body, pos)
            if parsed is None:
                return [text]
            calls.append(parsed[0])
            pos = parsed[1]
            rest = body[pos:].lstrip()
            if not rest:
                return list(calls)
            if not rest.startswith(";"):
                return [text]
            pos = len(body) - len(rest) + 1

    def begins_call(self, text: str) -> bool:
        return TAG in text or text.lstrip().startswith("{")

    def format_calls(self, calls: list[Call]) -> str:
        return "; ".join(call_object_text(c.name, self.args_key, c.arguments) for c in calls)

    def calls_regex(self, call_regexes: list[str], parallel: bool) -> str:
        one = "(?:" + "|".join(call_regexes) + ")"
        return f"{one}(?:; {one})*" if parallel else one

    def gated_regex(self, call_regexes: list[str], parallel: bool) -> str:
        # The format has no trigger in text: either the calls (after the optional tag) or free text that
        # does not start with `{` or the tag.
        calls = "(?:" + r"<\|python_tag\|>" + ")?" + self.calls_regex(call_regexes, parallel)
        return f"(?:{calls}|(?:[^{{<\\s][\\s\\S]*)?)"

    def calls_lark(self, parallel: bool) -> list[str]:
        return [f"start: call ({lark_literal('; ')} call)*" if parallel else "start: call"]

    def gated_lark(self, parallel: bool) -> list[str]:
        # As gated_regex: the calls (after the optional tag), or text not starting with `{`, `<` or space.
        calls = self.calls_lark(parallel)[0].removeprefix("start: ")
        return [f"start: {lark_literal(TAG)}? {calls} | FREE_TEXT", r"FREE_TEXT: /([^{<\s](.|\n)*)?/"]

    def instruction(self, tools_json_lines: str) -> str:
        return (
            "# Tools\n\nYou have access to the following functions:\n"
            f"{tools_json_lines}\n\n"
            "To call a function, reply with only a JSON object of the form "
            '{"name": function name, "parameters": dictionary of argument name and its value}; '
            "separate several calls with '; '."
        )
