"""History is taken as the client sends it (issue 47, item 2), through the official clients.

A tool call cut short comes back with arguments that are not JSON; agent loops replay that message,
with empty content beside the calls, thoughts in the assistant turn and tool results of any JSON type. Each
is rendered as the chat template defines, never refused, and re-rendering is byte-stable: the next turn's
prompt extends the previous prompt, so the radix cache serves all of it (`cached_tokens`).
"""

from __future__ import annotations

import json

import openai
import pytest

TOOL = {
    "type": "function",
    "function": {
        "name": "write_note",
        "description": "Save a note.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
}
ASK = [{"role": "user", "content": "Write a long note about the history of Rome."}]


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# Cuts the forced call inside its string argument. max_tokens no longer cuts a forced call: below the
# shortest whole call the request is a 400, and above it the call is steered closed (test_closing_budget.py);
# a stop string still cuts one, as a call from another engine or an older server may come cut.
CUT = "Rome"


def cut_call(oai: openai.OpenAI):
    """A forced call cut by a stop string: its arguments are a JSON prefix."""
    out = oai.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
        stop=[CUT],
    )
    (call,) = out.choices[0].message.tool_calls
    assert not is_json(call.function.arguments), call.function.arguments
    return out


def cached(out) -> int:
    details = out.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


@pytest.mark.parametrize(
    "result", ["saved", {"ok": True, "id": 7}, [1, 2, 3], 42, [{"type": "text", "text": "saved"}]]
)
def test_chat_replays_a_cut_call_and_any_tool_result(oai, result):
    first = cut_call(oai)
    message = first.choices[0].message.model_dump(exclude_none=True)  # as an agent loop appends it
    call_id = message["tool_calls"][0]["id"]
    history = [*ASK, message, {"role": "tool", "tool_call_id": call_id, "content": result}]
    second = oai.chat.completions.create(
        model="default", messages=history, tools=[TOOL], max_tokens=4, temperature=0
    )
    # the whole first prompt, and the call's text up to where it was cut, are served from the cache
    assert cached(second) >= first.usage.prompt_tokens + first.usage.completion_tokens - 2, second.usage


def test_chat_history_as_clients_write_it(oai):
    """Empty or absent content beside calls, hand-written arguments that are not JSON, or a JSON value,
    thoughts under `reasoning_content` or `reasoning`: all rendered, none refused."""
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "write_note", "arguments": '{"text": "Ro'}},
        {"id": "c2", "type": "function", "function": {"name": "write_note", "arguments": {"text": "x"}}},
        {"id": "c3", "type": "function", "function": {"name": "write_note", "arguments": "not json"}},
    ]
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": calls, "reasoning_content": "Three notes."},
        {"role": "tool", "tool_call_id": "c1", "content": None},
        {"role": "tool", "tool_call_id": "c2", "content": {"saved": True}},
        {"role": "tool", "tool_call_id": "c3", "content": "error: bad arguments"},
        {"role": "assistant", "tool_calls": calls[:1], "reasoning": "Once more."},
        {"role": "tool", "tool_call_id": "c1", "content": 3.5},
    ]
    out = oai.chat.completions.create(
        model="default", messages=history, tools=[TOOL], max_tokens=4, temperature=0
    )
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # the same history renders to the same bytes: the repeat is a full prefix hit
    again = oai.chat.completions.create(
        model="default", messages=history, tools=[TOOL], max_tokens=4, temperature=0
    )
    assert cached(again) >= again.usage.prompt_tokens - 1


def test_bad_history_values_are_400s_naming_them(oai):
    bad = [
        ({"role": "user", "content": 5}, "messages[0].content"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content[0]",
        ),
    ]
    for message, where in bad:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="default", messages=[message], max_tokens=2)
        assert where in str(e.value), str(e.value)
    history = [*ASK, {"role": "assistant", "content": "x", "reasoning_content": ["not", "text"]}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="default", messages=history, max_tokens=2)
    assert "messages[1].reasoning_content" in str(e.value)


def test_responses_replays_a_cut_call(oai):
    """Responses has no stop strings: the cut call comes from chat completions, replayed as Responses items
    (the same conversation, so the same prompt, served from the cache)."""
    tool = {"type": "function", **TOOL["function"]}  # the same tool text as the chat request
    first = cut_call(oai)
    (call,) = first.choices[0].message.tool_calls
    item = {
        "type": "function_call",
        "call_id": call.id,
        "name": "write_note",
        "arguments": call.function.arguments,
    }
    replay = [*ASK, item, {"type": "function_call_output", "call_id": call.id, "output": {"saved": True}}]
    second = oai.responses.create(
        model="default", input=replay, tools=[tool], max_output_tokens=4, temperature=0, store=False
    )
    details = second.usage.input_tokens_details
    prompt1, out1 = first.usage.prompt_tokens, first.usage.completion_tokens
    assert details.cached_tokens >= prompt1 + out1 - 2, second.usage


def test_messages_replays_a_cut_call(claude):
    tool = {
        "name": "write_note",
        "description": "Save a note.",
        "input_schema": TOOL["function"]["parameters"],
    }
    first = claude.messages.create(
        model="default",
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "any"},
        max_tokens=64,
        stop_sequences=[CUT],
        extra_body={"temperature": 0},
    )
    assert first.stop_reason in ("stop_sequence", "tool_use"), first  # a call was parsed from the cut text
    (use,) = [b for b in first.content if b.type == "tool_use"]
    history = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "saved"}]},
    ]
    second = claude.messages.create(
        model="default", messages=history, tools=[tool], max_tokens=4, extra_body={"temperature": 0}
    )
    # the cut input comes back as the object Anthropic's shape allows ({}), so the cache serves the prompt
    assert (
        second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens
    )
