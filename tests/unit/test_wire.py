"""The conversation layer's pure parts (issue 26): the reasoning split, the response store's bounds, and the
Responses / Messages input conversions. No model, no server."""

from __future__ import annotations

import re
import sys

import pytest
from pydantic import ValidationError

from constrained.spec import validate_spec
from runtime.entrypoints.wire.anthropic import Breakpoints, CountTokensRequest, _messages, conversation_of
from runtime.entrypoints.wire.conversation import Message, ToolCall
from runtime.entrypoints.wire.reasoning import ReasoningParser, history_text, resolve
from runtime.entrypoints.wire.responses import (
    ResponsesRequest,
    TextConfig,
    chat_tools,
    input_messages,
    output_schema,
)
from runtime.entrypoints.wire.store import ResponseStore, heap_bytes
from runtime.errors import RequestError

QWEN = ReasoningParser("qwen3", False)
R1 = ReasoningParser("deepseek-r1", True)


@pytest.mark.parametrize(
    "parser, text, reasoning, answer",
    [
        (QWEN, "<think>\nstep one\n</think>\n\nThe answer.", "\nstep one\n", "The answer."),
        (QWEN, "No thoughts here.", None, "No thoughts here."),
        (QWEN, "<think>cut off", "cut off", ""),
        (R1, "step one\n</think>\n\nThe answer.", "step one\n", "The answer."),
        (R1, "<think>step</think>ok", "step", "ok"),
        (R1, "never closed", "never closed", ""),
    ],
)
def test_split(parser, text, reasoning, answer):
    s = parser.split(text)
    assert (s.reasoning, s.answer) == (reasoning, answer)
    assert s.prefix + s.answer == text  # the raw text re-renders byte-identically


@pytest.mark.parametrize("parser", [QWEN, R1])
@pytest.mark.parametrize(
    "text", ["<think>\na < b </thin\n</think>\n\nyes </think>", "plain <thi text", "<thin"]
)
def test_streamed_split_only_grows_and_ends_at_the_final_split(parser, text):
    prev_r, prev_a = "", ""
    for k in range(len(text) + 1):
        s = parser.split(text[:k], final=False)
        r = s.reasoning or ""
        assert r.startswith(prev_r) and s.answer.startswith(prev_a), text[:k]
        prev_r, prev_a = r, s.answer
    final = parser.split(text)
    assert (final.reasoning or "").startswith(prev_r) and final.answer.startswith(prev_a)


def test_resolve_auto_reads_the_template():
    assert resolve("auto", "{{ '<|im_start|>' }}") is None
    assert resolve("auto", "{% if '<think>' in content %}").name == "qwen3"
    assert resolve("auto", "<｜Assistant｜><think>\n").name == "deepseek-r1"
    assert resolve("none", "<think>") is None
    assert resolve("qwen3", None).name == "qwen3"


@pytest.mark.parametrize("parser", [QWEN, R1])
def test_thoughts_regex_then_the_answer(parser):
    regex = parser.thoughts_regex() + "(?:[0-9]+)"
    validate_spec("regex", regex)  # the grammar compiler accepts it
    assert re.fullmatch(regex, "<think>a < b, /think\n</think>\n42")
    assert not re.fullmatch(regex, "<think>a</think> b </think>42")
    assert bool(re.fullmatch(regex, "42")) is (parser is QWEN)  # qwen3 may skip thinking


def test_history_text():
    assert history_text(None, "a", None) == "a"
    assert history_text("t", "a", "<think>t</think>\n") == "<think>t</think>\na"
    assert history_text("t", "a", None) == "<think>\nt\n</think>\n\na"


def test_store_bounds_count_bytes_and_lru():
    store = ResponseStore(max_count=2, max_bytes=10_000)
    for k in range(3):
        assert store.put({"id": f"r{k}"}, [Message("user", "x")])
    assert store.get("r0") is None and store.get("r1") is not None
    store.put({"id": "r3"}, [])  # r2 is now the least recently used
    assert store.get("r2") is None and store.get("r1") is not None
    small = ResponseStore(max_count=100, max_bytes=3000)
    assert not small.put({"id": "big"}, [Message("user", "x" * 4000)])
    for k in range(10):
        small.put({"id": f"s{k}"}, [Message("user", "y" * 60)])
    assert small.bytes <= 3000 and small.get("s9") is not None and small.get("s0") is None
    assert small.delete("s9") and not small.delete("s9")


def test_store_keeps_each_owners_responses_from_the_others():
    store = ResponseStore(max_count=100, max_bytes=1 << 20, owner_max_count=2, owner_max_bytes=3000)
    assert store.put({"id": "a1"}, [Message("user", "x")], owner="a")
    assert store.get("a1") is None and store.get("a1", "b") is None and store.get("a1", "a") is not None
    assert not store.delete("a1", "b") and store.get("a1", "a") is not None  # b cannot delete it
    assert store.quota_problem("a") is None
    store.put({"id": "a2"}, [], owner="a")
    assert "--tenant-max-stored-responses (2)" in store.quota_problem("a")
    assert store.quota_problem("b") is None
    assert store.quota_problem(None) is None  # no tenant: only the store's own bounds
    store.put({"id": "b1"}, [Message("user", "y" * 100)], owner="b")
    for k in range(6):  # past its bytes, b's own oldest go first; a's stay
        store.put({"id": f"b-big{k}"}, [Message("user", "y" * 900)], owner="b")
    assert store.owner_bytes["b"] <= 3000 and store.get("b1", "b") is None
    assert store.get("a1", "a") is not None and store.get("a2", "a") is not None
    assert store.delete("a1", "a") and store.delete("a2", "a") and "a" not in store.owner_count


def test_store_counts_heap_bytes_not_json():
    """A response echoing 10,000 nested empty lists (30 KB of JSON) counts what they hold in the heap."""
    nested = {"id": "r", "text": {"format": {"schema": {"enum": [[] for _ in range(10_000)]}}}}
    assert heap_bytes(nested) >= 10_000 * sys.getsizeof([])
    store = ResponseStore(max_count=10, max_bytes=100_000)
    assert not store.put(nested, [])  # 30 KB of JSON, over 500 KB of lists: refused
    shared = "z" * 1000
    assert heap_bytes([shared, shared]) < 2 * sys.getsizeof(shared)  # one object counted once


def test_message_json_round_trip():
    m = Message("assistant", "hi", [ToolCall("c1", "f", "{}")], None, "thought", "<think>thought</think>\n")
    assert Message.from_json(m.to_json()) == m


def test_responses_input_items():
    msgs = input_messages(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "Q"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "T"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ]
    )
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]
    assert [c.id for c in msgs[1].tool_calls] == ["c1", "c2"] and msgs[1].reasoning == "T"
    assert msgs[2].call_id == "c1" and msgs[2].text == "1"


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: input_messages([{"type": "web_search_call"}]), "input[0].type"),
        (
            lambda: input_messages([{"role": "user", "content": [{"type": "input_file"}]}]),
            "input[0].content[0]",
        ),
        (lambda: input_messages([{"role": "tool", "content": "x"}]), "input[0].role"),
        (lambda: chat_tools([{"type": "function", "name": "f"}, {"type": "file_search"}]), "tools[1].type"),
        (
            lambda: output_schema(TextConfig.model_validate({"format": {"type": "json_schema"}})),
            "text.format.schema",
        ),
    ],
)
def test_responses_errors_name_the_field(call, field):
    with pytest.raises(RequestError) as info:
        call()
    assert info.value.status == 400 and field in info.value.message


@pytest.mark.parametrize(
    "body, where",
    [
        ({"text": {"format": {"type": "yaml"}}}, ("text", "format", "type")),
        ({"text": {"format": {"type": "text"}, "junk": [[], []]}}, ("text", "junk")),
        ({"metadata": {str(i): "v" for i in range(17)}}, ("metadata",)),
        ({"metadata": {"k" * 65: "v"}}, ("metadata", "k" * 65, "[key]")),
        ({"metadata": {"k": "v" * 513}}, ("metadata", "k")),
    ],
)
def test_responses_text_and_metadata_are_validated_as_openai_does(body, where):
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"model": "m", "input": "hi", **body})
    assert info.value.errors()[0]["loc"][: len(where)] == where
    ok = {"text": {"format": {"type": "json_schema", "name": "n", "schema": {}}, "verbosity": "low"}}
    assert ResponsesRequest.model_validate({"model": "m", "input": "hi", **ok}).text.verbosity == "low"


def test_anthropic_blocks_to_messages():
    body = CountTokensRequest(
        model="m",
        system=[{"type": "text", "text": "S"}],
        messages=[
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "T", "signature": ""},
                    {"type": "text", "text": "A"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "R"}]},
                    {"type": "text", "text": "more"},
                ],
            },
        ],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
    )
    msgs = _messages(body, Breakpoints())
    assert [(m.role, m.text) for m in msgs] == [
        ("system", "S"),
        ("user", "Q"),
        ("assistant", "A"),
        ("tool", "R"),
        ("user", "more"),
    ]
    assert msgs[2].tool_calls == [ToolCall("t1", "f", '{"x": 1}')] and msgs[2].reasoning == "T"
    conv = conversation_of(body)
    assert conv.tool_choice == "required" and conv.parallel_tool_calls is False
    assert conv.tools[0]["function"]["parameters"] == {"type": "object"}
