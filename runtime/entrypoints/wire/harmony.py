"""gpt-oss's thoughts: the harmony format's analysis channel (`--reasoning-parser harmony`).

The messages are read by `tool_calls.harmony.parse_messages`. The analysis messages the output opens with
are the thoughts (joined by a newline when there are several); a final-channel message after them is the
answer, its header part of the prefix; any other message (a tool call to `functions.NAME`) starts the answer
as it stands, for the tool-call parser. A trailing terminator (`<|return|>`, `<|end|>`) is dropped from the
answer, so `prefix + answer` is the output less that terminator.

A grammar on the answer (forced tool calls, a JSON schema) becomes one Lark grammar that lets the analysis
message come first, its tags named by their special token ids (`HarmonyParser.thoughts_lark`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from runtime.entrypoints.tool_calls.harmony import (
    MESSAGE,
    HarmonyParser,
    held_back,
    parse_messages,
    special_ids,
)
from runtime.entrypoints.tool_calls.schema import ToolRequestError
from runtime.errors import RequestError


@dataclass(frozen=True)
class HarmonySplit:
    reasoning: str | None
    answer: str
    prefix: str


@dataclass(frozen=True)
class HarmonyReasoningParser:
    name: str = "harmony"
    starts_inside: bool = False
    keeps_special_tokens: bool = True
    token_ids: dict[str, int] | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> HarmonyReasoningParser:
        try:
            ids = special_ids(tokenizer) if tokenizer is not None else None
        except ToolRequestError:
            ids = None  # a tokenizer without the tags: splitting works, grammars are refused
        return cls(token_ids=ids)

    def split(self, text: str, final: bool = True) -> HarmonySplit:
        """Thoughts and answer of `text` (the cumulative output). Not `final`: a header still arriving and a
        trailing partial tag are held back."""
        msgs, _ = parse_messages(text)
        thoughts: list[str] = []
        pos = 0
        for m in msgs:
            if m.body < 0:  # a header still arriving
                if final:
                    break
                return HarmonySplit("\n".join(thoughts) if thoughts else None, "", text[:pos])
            if m.channel == "analysis" and m.recipient is None:
                body = text[m.body : m.body_end]
                if not m.closed and not final:
                    thoughts.append(body[: held_back(body)])
                    return HarmonySplit("\n".join(thoughts), "", text[: m.body])
                thoughts.append(body)
                pos = m.end
                continue
            if m.channel == "final" and m.recipient is None:
                body = text[m.body : m.body_end]
                answer = body if final or m.closed else body[: held_back(body)]
                return HarmonySplit("\n".join(thoughts) if thoughts else None, answer, text[: m.body])
            break
        answer = text[pos:]
        if not final:
            answer = answer[: held_back(answer)]
        return HarmonySplit("\n".join(thoughts) if thoughts else None, answer, text[:pos])

    def _tags(self) -> HarmonyParser:
        if self.token_ids is None:
            raise RequestError("the harmony format's grammar needs the tokenizer's harmony tokens", 400)
        return HarmonyParser(self.token_ids)

    def grammar_after_thoughts(self, grammar: dict[str, Any]) -> dict[str, Any]:
        """`grammar` on the answer, the analysis message optional before it: forced tool calls (Lark) keep
        their `start`; a JSON schema is the final-channel message's body. A regex cannot name special
        tokens: refused."""
        if not grammar:
            return grammar
        if "regex" in grammar:
            raise RequestError(
                "a regex grammar cannot be combined with the harmony format (its tags are special tokens): "
                "use the llguidance grammar backend or a JSON schema",
                400,
            )
        tags = self._tags()
        thoughts, rules = tags.thoughts_lark()
        if "lark" in grammar:
            lines = grammar["lark"].splitlines()
            head = [ln for ln in lines if ln.startswith("%llguidance")]
            body = [ln for ln in lines if not ln.startswith("%llguidance")]
            body = [re.sub(r"^start(?=\s*(?:\[[^\]]*\])?\s*:)", "harmony_answer_", ln) for ln in body]
        else:
            from runtime.entrypoints.tool_calls.grammar import LAYOUT, json_rule

            schema = json.loads(grammar["json_schema"])
            head = ["%llguidance {}"]
            body = [f"harmony_answer_: {tags.final_lark(json_rule({'x-guidance': LAYOUT, **schema}))}"]
        start = f"start: {thoughts} harmony_answer_ | harmony_answer_"
        return {"lark": "\n".join([*head, start, *rules, *body]) + "\n"}


def is_harmony_template(chat_template: str | None) -> bool:
    return MESSAGE in (chat_template or "") and "<|channel|>" in (chat_template or "")
