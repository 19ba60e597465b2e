"""Mistral format: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` objects, once,
after any content. `[TOOL_CALLS]` is a special token: with `skip_special_tokens` it vanishes, so an output
that starts with `[` is read as the array too."""

from __future__ import annotations

from runtime.entrypoints.tool_calls.base import (
    Call,
    Pending,
    Segment,
    ToolCallParser,
    call_object_text,
    json_extent,
    lark_literal,
    parse_call_object,
    regex_literal,
    register,
    trigger_prefix_start,
)

TAG = "[TOOL_CALLS]"


@register
class MistralParser(ToolCallParser):
    name = "mistral"
    trigger = TAG
    template_markers = (TAG, "[AVAILABLE_TOOLS]")

    def split(self, text: str, final: bool) -> list[Segment]:
        start = text.find(TAG)
        if start >= 0:
            head, array_start = text[:start], start + len(TAG)
        elif text.lstrip().startswith("["):
            head, array_start = "", len(text) - len(text.lstrip())
        else:
            cut = len(text) if final else trigger_prefix_start(text, TAG)
            if not final and text.strip() == "":
                cut = 0
            return [text[:cut]] + ([Pending(text[cut:])] if cut < len(text) else [])
        while array_start < len(text) and text[array_start] in " \t\r\n":
            array_start += 1
        end = json_extent(text, array_start)
        if end is None and not final:
            return [head, Pending(text[len(head) :])]
        calls = self._calls(text, array_start, end)
        if calls is None:
            return [text]
        return [head, *calls, text[end:]]

    @staticmethod
    def _calls(text: str, start: int, end: int | None) -> list[Call] | None:
        if end is None or text[start : start + 1] != "[":
            return None
        calls, pos = [], start + 1
        while True:
            parsed = parse_call_object(text, pos)
            if parsed is None:
                return None
            calls.append(parsed[0])
            rest = text[parsed[1] : end - 1].lstrip()
            if not rest:
                return calls
            if not rest.startswith(","):
                return None
            pos = end - 1 - len(rest) + 1

    def begins_call(self, text: str) -> bool:
        return TAG in text or text.lstrip().startswith("[")

    def format_calls(self, calls: list[Call]) -> str:
        return (
            TAG + "[" + ", ".join(call_object_text(c.name, self.args_key, c.arguments) for c in calls) + "]"
        )

    def calls_regex(self, call_regexes: list[str], parallel: bool) -> str:
        one = "(?:" + "|".join(call_regexes) + ")"
        body = f"{one}(?:, {one})*" if parallel else one
        return regex_literal(TAG + "[") + body + r"\]"

    def lark_after_trigger(self, parallel: bool) -> tuple[str, list[str]]:
        body = f"call ({lark_literal(', ')} call)*" if parallel else "call"
        return f'"[" {body} "]"', []

    def instruction(self, tools_json_lines: str) -> str:
        return (
            f"[AVAILABLE_TOOLS]\n{tools_json_lines}\n[/AVAILABLE_TOOLS]\n"
            "To call functions, reply with [TOOL_CALLS] followed by a JSON array of "
            '{"name": function name, "arguments": arguments object}.'
        )
