"""Reasoning models' thoughts (`<think>...</think>`) split from the answer (`--reasoning-parser`).

`qwen3`: the output may open with `<think>`; without it everything is the answer. `deepseek-r1`: the template
opens the thoughts, so the output starts inside them (a leading `<think>` is tolerated) until `</think>`.
The answer starts after `</think>` and the whitespace after it. Tool calls and structured output apply to
the answer only: their grammar is prefixed with the thoughts' own (`grammar_after_thoughts`). Streaming
holds back a trailing partial tag, so the streamed pieces add up to the split of the finished text.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from constrained.closing import THOUGHTS_CLOSE, THOUGHTS_OPEN
from constrained.errors import GrammarError
from constrained.spec import DEFAULT_WHITESPACE, validate_spec
from runtime.entrypoints.tool_calls.base import regex_literal, text_without, trigger_prefix_start
from runtime.errors import RequestError

PARSERS = ("auto", "none", "deepseek-r1", "qwen3", "harmony")
OPEN, CLOSE = THOUGHTS_OPEN, THOUGHTS_CLOSE  # the closing steer (constrained.closing) closes them too


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output has no thoughts
    answer: str
    prefix: str  # the raw text before the answer (tags and whitespace included): prefix + answer == output


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # deepseek-r1: the prompt already opened the thoughts

    def split(self, text: str, final: bool = True) -> Split:
        """Thoughts and answer of `text` (cumulative output). Not `final`: a trailing partial tag and the
        whitespace that may precede the answer are held back (neither side shows them yet)."""
        if not final and OPEN.startswith(text):  # maybe the start of "<think>": wait
            return Split(None, "", "")
        body = text
        if body.startswith(OPEN):
            body = body[len(OPEN) :]
        elif not self.starts_inside:
            return Split(None, text, "")
        end = body.find(CLOSE)
        if end < 0:
            cut = len(body) if final else trigger_prefix_start(body, CLOSE)
            return Split(body[:cut], "", text[: len(text) - len(body) + cut])
        rest = body[end + len(CLOSE) :]
        answer = rest.lstrip()
        prefix = text[: len(text) - len(answer)]
        return Split(body[:end], answer, prefix)

    def thoughts_block_regex(self) -> str:
        """The thoughts block itself (never empty)."""
        thoughts = f"(?:{regex_literal(OPEN)})?" if self.starts_inside else regex_literal(OPEN)
        return thoughts + text_without(CLOSE) + regex_literal(CLOSE) + "[ \\t\\n]*"

    def thoughts_regex(self) -> str:
        """What may precede the answer: the block, optional unless the output starts inside it."""
        block = self.thoughts_block_regex()
        return block if self.starts_inside else f"(?:{block})?"


def resolve(name: str, chat_template: str | None, tokenizer: Any = None) -> Any:
    """`auto`: harmony for gpt-oss's templates (`<|channel|>`; runtime/entrypoints/wire/harmony.py),
    deepseek-r1 for templates that open `<think>` in the generation prompt (DeepSeek's `<｜Assistant｜>`
    turn), qwen3 for other templates that mention `<think>`, else none. `tokenizer`: harmony's grammars
    name its tags' special token ids. Returns a ReasoningParser, a HarmonyReasoningParser or None."""
    from runtime.entrypoints.wire.harmony import HarmonyReasoningParser, is_harmony_template

    template = chat_template or ""
    if name == "auto":
        if is_harmony_template(template):
            name = "harmony"
        elif OPEN not in template:
            return None
        else:
            name = "deepseek-r1" if "<｜Assistant｜>" in template else "qwen3"
    if name == "none":
        return None
    if name == "harmony":
        return HarmonyReasoningParser.from_tokenizer(tokenizer)
    return ReasoningParser(name, name == "deepseek-r1")


async def grammar_after_thoughts(parser: Any, grammar: dict[str, Any]) -> dict[str, Any]:
    """`grammar` ({"regex"} / {"json_schema"} / {"lark"} / {}) applied to the answer after the thoughts."""
    if parser is None or not grammar:
        return grammar
    if not isinstance(parser, ReasoningParser):  # harmony: its own Lark grammar around the answer
        return parser.grammar_after_thoughts(grammar)
    if "lark" in grammar:
        return {"lark": lark_after_thoughts(parser, grammar["lark"])}
    try:
        if "regex" in grammar:
            answer = validate_spec("regex", grammar["regex"], DEFAULT_WHITESPACE)
        else:
            answer = await asyncio.to_thread(validate_spec, "json_schema", grammar["json_schema"])
    except GrammarError as e:
        raise RequestError(f"the output grammar cannot be used: {e}", 400) from None
    return {"regex": parser.thoughts_regex() + f"(?:{answer})"}


def keeps_special_tokens(plan: Any, reasoning: Any) -> bool:
    """Whether a chat's output is decoded with its special tokens kept: its tool-call (`plan`, a ToolPlan)
    or reasoning format's tags are special tokens (harmony), which their parsers read."""
    calls = plan.parses_calls and plan.parser.keeps_special_tokens
    return calls or bool(getattr(reasoning, "keeps_special_tokens", False))


def lark_after_thoughts(parser: ReasoningParser, lark: str) -> str:
    """A Lark grammar (the tool-call grammar) whose `start` follows the thoughts: `start` is renamed and a
    new `start` puts the thoughts' regex before it (a `/` inside a Lark regex literal is escaped)."""
    lines = lark.splitlines()
    head = [ln for ln in lines if ln.startswith("%llguidance")]
    body = "\n".join(ln for ln in lines if not ln.startswith("%llguidance"))
    body = re.sub(r"(?m)^start(?=\s*(?:\[[^\]]*\])?\s*:)", "answer_after_thoughts_", body)
    thoughts = parser.thoughts_block_regex().replace("/", "\\/")
    start = "start: THOUGHTS_ answer_after_thoughts_"
    if not parser.starts_inside:  # a lexeme may not match the empty string: the block is optional here
        start += " | answer_after_thoughts_"
    return "\n".join([*head, start, f"THOUGHTS_: /{thoughts}/", body]) + "\n"


def history_text(reasoning: str | None, answer: str, raw_prefix: str | None) -> str:
    """An assistant turn with its thoughts, as the next prompt renders it when they are kept
    (`--reasoning-in-history`): the raw prefix the model wrote when known (byte-identical), else a
    canonical `<think>\\n...\\n</think>\\n\\n`."""
    if reasoning is None:
        return answer
    return (raw_prefix if raw_prefix is not None else f"{OPEN}\n{reasoning}\n{CLOSE}\n\n") + answer
