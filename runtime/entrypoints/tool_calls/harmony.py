"""gpt-oss's harmony format: the output's messages, and its tool calls (`--tool-call-parser harmony`).

After the prompt's `<|start|>assistant`, gpt-oss writes one or more messages, each a header, `<|message|>`, a
body and a terminator; every later message opens with `<|start|>assistant` again:

    <|channel|>analysis<|message|>THOUGHTS<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>

The recipient (` to=functions.NAME`) may also stand before `<|channel|>`, and the content type may be written
without `<|constrain|>`. The tags are special tokens, so a harmony output is decoded with
`skip_special_tokens` off (`keeps_special_tokens`). The analysis channel is the thoughts (the reasoning
parser `harmony`, runtime/entrypoints/wire/harmony.py), the final channel the answer, and a commentary
message to `functions.NAME` a tool call.

Forced calls (tool_choice `required` or a named tool) are a Lark grammar whose tags are the tokenizer's
special token ids (`<[id]>`: llguidance's spelling of a special token), so a tokenizer must be bound
(`from_tokenizer`). `<|call|>` ends the turn (an end-of-turn token of gpt-oss), so a turn holds one call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from runtime.entrypoints.tool_calls.base import (
    Call,
    Pending,
    Segment,
    ToolCallParser,
    lark_literal,
    register,
    trigger_prefix_start,
)
from runtime.entrypoints.tool_calls.schema import ToolRequestError

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TAGS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
TERMINATORS = (END, CALL, RETURN)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]*)")
_CONSTRAIN = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of an output: text[start:body] is its header (with its `<|start|>` when it has one),
    text[body:body_end] its body, text[body_end:end] its terminator (empty while open)."""

    start: int
    body: int  # -1 while the header is not complete (no `<|message|>` yet)
    body_end: int
    end: int
    channel: str | None
    recipient: str | None
    content_type: str | None

    @property
    def closed(self) -> bool:
        return self.end > self.body_end


def parse_messages(text: str) -> tuple[list[HarmonyMessage], int]:
    """(the messages `text` opens with, where the text that is no message begins). The first message may
    omit `<|start|>assistant` (the prompt wrote it); text that opens neither `<|start|>` nor `<|channel|>`
    after a message (or at the start) ends the parse."""
    out: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        if not (
            text.startswith(START, pos) or text.startswith(CHANNEL, pos) or (not out and _role_first(text))
        ):
            break
        head_end = text.find(MESSAGE, pos)
        if head_end < 0:
            out.append(HarmonyMessage(pos, -1, len(text), len(text), None, None, None))
            return out, len(text)
        header = text[pos:head_end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        constrain = _CONSTRAIN.search(header)
        ctype = constrain.group(1) if constrain else None
        if ctype is None and channel is not None:  # `<|channel|>commentary json`: the type after a space
            rest = header[channel.end() :].split()
            ctype = next((w for w in rest if not w.startswith("to=")), None)
        body = head_end + len(MESSAGE)
        ends = [(i, t) for t in TERMINATORS if (i := text.find(t, body)) >= 0]
        body_end, term = min(ends) if ends else (len(text), "")
        out.append(
            HarmonyMessage(
                pos,
                body,
                body_end,
                body_end + len(term),
                channel.group(1) if channel else None,
                recipient.group(1) if recipient else None,
                ctype,
            )
        )
        if not term:
            return out, len(text)
        pos = body_end + len(term)
    return out, pos


def _role_first(text: str) -> bool:
    """An output that opens with its role (`assistant<|channel|>...`, as when a template's generation prompt
    stops at `<|start|>`)."""
    return text.startswith("assistant") and (CHANNEL in text[:64] or MESSAGE in text[:64])


def held_back(body: str) -> int:
    """Where a streamed body's shown part ends: before a trailing partial tag."""
    return min(trigger_prefix_start(body, tag) for tag in TAGS)


def special_ids(tokenizer: Any) -> dict[str, int]:
    """Each harmony tag's token id in `tokenizer`; ToolRequestError when one is not a single token."""
    ids = {}
    vocab = tokenizer.get_vocab()
    for tag in TAGS:
        if tag not in vocab:
            raise ToolRequestError(
                f"the harmony tool-call format needs the token {tag}, which the tokenizer lacks"
            )
        ids[tag] = vocab[tag]
    return ids


@register
class HarmonyParser(ToolCallParser):
    name = "harmony"
    trigger = CHANNEL + "commentary to=" + FUNCTIONS
    template_markers = (CHANNEL, "<|constrain|>")
    keeps_special_tokens = True

    def __init__(self, token_ids: dict[str, int] | None = None) -> None:
        self.token_ids = token_ids  # tag -> special token id, for the forced-call grammar

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> HarmonyParser:
        return cls(special_ids(tokenizer) if tokenizer is not None else None)

    @property
    def grammar_key(self) -> str:
        return json.dumps(self.token_ids, sort_keys=True)

    def split(self, text: str, final: bool) -> list[Segment]:
        """Messages to `functions.NAME` are calls (a complete one with a JSON object body); a final-channel
        message is its body; other messages (analysis, commentary to nobody) and their headers are dropped;
        text outside messages is content."""
        msgs, rest = parse_messages(text)
        out: list[Segment] = []
        for m in msgs:
            is_call = m.recipient is not None and m.recipient.startswith(FUNCTIONS)
            if m.body < 0:  # header still arriving
                if not final:
                    out.append(Pending(text[m.start :]))
                continue
            if is_call:
                # `<|call|>` ends the turn and is trimmed off as a stop token: a body that is a whole JSON
                # object is a complete call, terminator or not (nothing can follow the object's close)
                args = text[m.body : m.body_end].strip()
                if _is_object(args):
                    out.append(Call(m.recipient[len(FUNCTIONS) :], args))
                elif final or m.closed:
                    out.append(text[m.body : m.body_end])
                else:
                    out.append(Pending(text[m.start :]))
            elif m.channel in (None, "final"):
                body = text[m.body : m.body_end]
                out.append(body if final or m.closed else body[: held_back(body)])
        tail = text[rest:]
        if tail:
            cut = len(tail) if final else held_back(tail)
            out += [tail[:cut]] + ([Pending(tail[cut:])] if cut < len(tail) else [])
        return out

    def begins_call(self, text: str) -> bool:
        return FUNCTIONS in text or text.startswith((CHANNEL, START))

    def format_calls(self, calls: list[Call]) -> str:
        return (START + "assistant").join(
            f"{CHANNEL}commentary to={FUNCTIONS}{c.name} {CONSTRAIN}json{MESSAGE}{c.arguments}{CALL}"
            for c in calls
        )

    def calls_regex(self, call_regexes: list[str], parallel: bool) -> str:
        raise ToolRequestError(
            "the harmony tool-call format has no regex grammar (its tags are special tokens): use the "
            "llguidance grammar backend (--grammar-backend auto)"
        )

    def gated_regex(self, call_regexes: list[str], parallel: bool) -> str:
        return self.calls_regex(call_regexes, parallel)

    def _tok(self, tag: str) -> str:
        if self.token_ids is None:
            raise ToolRequestError("the harmony tool-call grammar needs the tokenizer's special token ids")
        return f"<[{self.token_ids[tag]}]>"

    def call_lark(self, name: str, args_rule: str) -> str:
        """One call: header (tags as special tokens), the arguments, `<|call|>`."""
        t = self._tok
        head = lark_literal(f"commentary to={FUNCTIONS}{name} ")
        return f"{t(CHANNEL)} {head} {t(CONSTRAIN)} {lark_literal('json')} {t(MESSAGE)} {args_rule} {t(CALL)}"

    def calls_lark(self, parallel: bool) -> list[str]:
        """One call: `<|call|>` ends gpt-oss's turn, so further calls come in later turns."""
        return ["start: call"]

    def gated_lark(self, parallel: bool) -> list[str]:
        raise ToolRequestError(
            "strict tools under tool_choice auto are not supported in the harmony format: use "
            "tool_choice required or a named tool, or non-strict tools"
        )

    def thoughts_lark(self) -> tuple[str, list[str]]:
        """(the optional analysis message before the answer, its rules): the thoughts as one lexeme, which a
        special token ends."""
        t = self._tok
        rule = (
            f'harmony_thoughts_: {t(CHANNEL)} "analysis" {t(MESSAGE)} HARMONY_TEXT_ {t(END)} {t(START)} '
            '"assistant"'
        )
        return "harmony_thoughts_", [rule, "HARMONY_TEXT_: /(.|\\n)+/"]

    def final_lark(self, answer: str) -> str:
        """The final-channel message around `answer` (a Lark expression)."""
        t = self._tok
        return f'{t(CHANNEL)} "final" {t(MESSAGE)} {answer}'


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
