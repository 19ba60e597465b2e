"""gpt-oss's harmony format: the reasoning split (analysis channel) and the tool-call parser on crafted
outputs, streamed and final; `auto` picking both from the template; the forced-call Lark grammar (tags as
special token ids) checked with llguidance's matcher over a byte vocabulary plus the harmony tags."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer
from llguidance._tokenizer import TokenizerWrapper

from runtime.entrypoints.tool_calls.base import Call, get_parser
from runtime.entrypoints.tool_calls.grammar import forced_lark
from runtime.entrypoints.tool_calls.harmony import HarmonyParser, parse_messages
from runtime.entrypoints.tool_calls.schema import ToolChoice, ToolRequestError
from runtime.entrypoints.wire.harmony import HarmonyReasoningParser
from runtime.entrypoints.wire.reasoning import resolve
from tests.random_gpt_oss import HARMONY_TAGS, HARMONY_TEMPLATE
from tests.tool_fixtures import TOOLS

THOUGHTS = "<|channel|>analysis<|message|>The user asks for 2+2. Easy.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 3}'
)


def test_messages_are_parsed_with_either_header_order():
    text = THOUGHTS + "<|start|>assistant to=functions.calc<|channel|>commentary json<|message|>{}<|call|>"
    msgs, rest = parse_messages(text)
    assert rest == len(text)
    assert [(m.channel, m.recipient, m.content_type, m.closed) for m in msgs] == [
        ("analysis", None, None, True),
        ("commentary", "functions.calc", "json", True),
    ]
    assert text[msgs[0].body : msgs[0].body_end] == "The user asks for 2+2. Easy."


@pytest.mark.parametrize("terminator", ["", "<|return|>"])
def test_reasoning_split_thoughts_then_final(terminator):
    p = HarmonyReasoningParser()
    split = p.split(THOUGHTS + FINAL + terminator)
    assert split.reasoning == "The user asks for 2+2. Easy."
    assert split.answer == "It is 4."
    assert split.prefix == THOUGHTS + "<|start|>assistant<|channel|>final<|message|>"


def test_reasoning_split_streams_without_partial_tags():
    """Every prefix of the output splits into a prefix of the final thoughts and answer, never showing a
    tag or part of one."""
    p = HarmonyReasoningParser()
    text = THOUGHTS + FINAL
    final = p.split(text)
    for i in range(len(text) + 1):
        s = p.split(text[:i], final=False)
        assert final.reasoning.startswith(s.reasoning or ""), i
        assert final.answer.startswith(s.answer), i
        assert "<|" not in (s.reasoning or "") + s.answer, i


def test_reasoning_split_leaves_a_call_to_the_tool_parser():
    p = HarmonyReasoningParser()
    split = p.split(THOUGHTS + CALL)
    assert split.reasoning == "The user asks for 2+2. Easy." and split.answer == CALL
    assert p.split("plain text, no channels").answer == "plain text, no channels"
    assert p.split("plain text, no channels").reasoning is None


@pytest.mark.parametrize("terminator", ["", "<|call|>"])
def test_tool_call_parser_finds_the_call(terminator):
    """`<|call|>` is a stop token the detokenizer trims: the call is whole without it."""
    p = HarmonyParser()
    segs = p.split(CALL + terminator, final=True)
    assert [s for s in segs if isinstance(s, Call)] == [Call("get_weather", '{"city": "Paris", "days": 3}')]
    assert "".join(s for s in segs if isinstance(s, str)).strip() == ""
    # while streaming, a call whose arguments are not a whole object yet is pending
    partial = p.split(CALL[:-5], final=False)
    assert not any(isinstance(s, Call) for s in partial)
    # thoughts (when no reasoning parser took them) are dropped; a final message is content
    segs = p.split(THOUGHTS + FINAL, final=True)
    assert segs == ["It is 4."]


def test_format_calls_round_trip():
    p = HarmonyParser()
    calls = [Call("get_weather", '{"city": "Paris"}'), Call("calc", '{"expr": "2*3"}')]
    text = p.format_calls(calls)
    assert text.startswith("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    assert [s for s in p.split(text, final=True) if isinstance(s, Call)] == calls


def test_auto_picks_harmony_from_the_template():
    assert get_parser("auto", HARMONY_TEMPLATE).name == "harmony"
    assert isinstance(resolve("auto", HARMONY_TEMPLATE), HarmonyReasoningParser)
    assert resolve("auto", "{{ messages }}") is None


# ---- the forced-call grammar -----------------------------------------------------------------------------
class _BytesAndTags:
    """A tokenizer of the 256 bytes, EOS (256), then the harmony tags as special tokens (257..)."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"] + [b"\xff" + t.encode() for t in HARMONY_TAGS]
    special_token_ids = list(range(256, 257 + len(HARMONY_TAGS)))

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


TOK = LLTokenizer(TokenizerWrapper(_BytesAndTags()))
TAG_IDS = {t: 257 + i for i, t in enumerate(HARMONY_TAGS)}


def token_ids(text: str) -> list[int]:
    """`text` as byte tokens, each harmony tag as its special token."""
    out, pos = [], 0
    while pos < len(text):
        tag = next((t for t in HARMONY_TAGS if text.startswith(t, pos)), None)
        if tag is not None:
            out.append(TAG_IDS[tag])
            pos += len(tag)
        else:
            out += list(text[pos].encode())
            pos += 1
    return out


def accepts(lark: str, text: str) -> bool:
    assert LLMatcher.validate_grammar(lark, TOK) == ""
    m = LLMatcher(TOK, lark, log_level=0)
    return m.consume_tokens(token_ids(text)) and m.is_accepting()


def test_forced_call_grammar_names_the_tags_as_special_tokens():
    p = HarmonyParser(TAG_IDS)
    lark = forced_lark(p, TOOLS, ToolChoice("required"), parallel=True)
    call = p.format_calls([Call("get_weather", json.dumps({"city": "Paris", "days": 3}))])
    assert accepts(lark, call)
    assert not accepts(lark, call.replace("get_weather", "get_weathr"))
    # the tags spelled out in bytes are not the tags
    m = LLMatcher(TOK, lark, log_level=0)
    assert not m.consume_tokens(list(call.encode()))
    # the thoughts may come first (the reasoning parser's grammar around the tool grammar)
    around = HarmonyReasoningParser(token_ids=TAG_IDS).grammar_after_thoughts({"lark": lark})["lark"]
    assert accepts(around, call)
    assert accepts(around, THOUGHTS + "<|start|>assistant" + call)
    assert not accepts(around, THOUGHTS + call)  # the next message opens with <|start|>assistant


def test_json_schema_answer_is_the_final_channel():
    parser = HarmonyReasoningParser(token_ids=TAG_IDS)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lark = parser.grammar_after_thoughts({"json_schema": json.dumps(schema)})["lark"]
    assert accepts(lark, '<|channel|>final<|message|>{"n": 4}')
    assert accepts(lark, THOUGHTS + '<|start|>assistant<|channel|>final<|message|>{"n": 4}')
    assert not accepts(lark, '<|channel|>final<|message|>{"n": "4"}')


def test_unsupported_forms_are_refused_clearly():
    p = HarmonyParser(TAG_IDS)
    with pytest.raises(ToolRequestError, match="harmony"):
        p.gated_lark(True)
    with pytest.raises(ToolRequestError, match="llguidance"):
        p.calls_regex([], False)


@pytest.mark.parametrize("constrained", [True, False])
def test_streamed_deltas_add_up_to_the_message(constrained):
    """Fed the output a few characters at a time (the answer after the reasoning split), the tool stream
    sends one call whose streamed arguments equal the final message's, and no tag as content."""
    from runtime.entrypoints.tool_calls.output import ToolStream, final_message

    p = HarmonyParser()
    text = HarmonyReasoningParser().split(THOUGHTS + CALL).answer
    stream = ToolStream(p, constrained)
    deltas = []
    for i in range(1, len(text) + 1, 3):
        deltas += stream.feed(text[:i], finished=False)
    deltas += stream.feed(text, finished=True)
    assert not any("content" in d and d["content"].strip() for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"city": "Paris", "days": 3}'
    content, final = final_message(p, text, constrained)
    assert content is None and final[0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'
