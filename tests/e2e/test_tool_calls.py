"""Tool calling through the official `openai` client against the shared server (default model, issue 16).

The default model is a 135M ChatML model without tool training: under `required` / a named tool the grammar
makes every call valid; under `auto` it mostly answers in text, so those tests check consistency (a call is
complete and parses, or the reply is content), not that it calls.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 12 * 7.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 24}},
            "required": ["expression"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up a fact about a topic in the encyclopedia.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string", "maxLength": 24}},
            "required": ["topic"],
        },
    },
}
TOOLS = [CALC, LOOKUP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is 12 times 7?"}]


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    c = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", timeout=300, max_retries=0)
    yield c
    c.close()


def ask(client, stream=False, **kw):
    args = {"model": "default", "messages": QUESTION, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    return client.chat.completions.create(**{**args, **kw}, stream=stream)


def assert_valid_calls(calls):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def reassemble(chunks):
    """(content, [(name, arguments)], finish_reason) rebuilt from streamed deltas, as agent SDKs do."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        for choice in ch.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call carries id, type and name
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and not tc.function.name
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[k]) for k in sorted(calls)], finish


def test_required_single_call(client):
    r = ask(client, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls)


def test_required_parallel_calls_are_each_valid(client):
    r = ask(client, tool_choice="required", max_tokens=60)
    choice = r.choices[0]
    complete = (
        choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1]
    )
    assert choice.finish_reason in ("tool_calls", "length")
    assert_valid_calls(complete or choice.message.tool_calls[:1])


def test_named_tool(client):
    r = ask(client, tool_choice={"type": "function", "function": {"name": "lookup"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["lookup"]
    assert_valid_calls(choice.message.tool_calls)


def test_auto_is_content_or_valid_calls(client):
    choice = ask(client, tool_choice="auto").choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for c in choice.message.tool_calls:
            assert c.function.name in SCHEMAS and isinstance(json.loads(c.function.arguments), dict)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content


def test_none_never_calls(client):
    choice = ask(client, tool_choice="none").choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


@pytest.mark.parametrize(
    "kw",
    [
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": "required", "max_tokens": 60},
        {"tool_choice": {"type": "function", "function": {"name": "calculator"}}},
        {"tool_choice": "auto"},
    ],
)
def test_streamed_deltas_reassemble_to_the_message(client, kw):
    msg = ask(client, **kw).choices[0]
    want_calls = [(c.function.name, c.function.arguments) for c in msg.message.tool_calls or []]
    got = reassemble(ask(client, stream=True, **kw))
    assert got == (msg.message.content or None, want_calls, msg.finish_reason)


def test_agent_loop_hits_the_radix_cache(client):
    """Five turns of call -> result -> call: each prompt re-renders the previous prompt + output."""
    messages = [
        {"role": "system", "content": "You answer with tools."},
        {"role": "user", "content": "Look up three topics, one per turn: Paris, Rome, Oslo."},
    ]
    prev = None
    for turn in range(5):
        r = client.chat.completions.create(
            model="default",
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=40,
            temperature=0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        if prev is not None:
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert cached >= 0.9 * (prev.prompt_tokens + prev.completion_tokens), (turn, cached, prev)
        prev = r.usage
        call = choice.message.tool_calls[0]
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}: 42"})


@pytest.mark.parametrize(
    "tools,choice,field",
    [
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "required": 5}},
                }
            ],
            "auto",
            "tools[0].function.parameters",
        ),
        ([CALC], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ([{"type": "function", "function": {"name": "f"}}], "auto", "tools[0].function.parameters"),
        ([CALC, CALC], "auto", "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "required",
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(client, tools, choice, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=QUESTION, tools=tools, tool_choice=choice)
    assert err.value.status_code == 400 and field in str(err.value), str(err.value)


def test_history_with_tool_messages_and_continue_final_message(client):
    history = [
        {"role": "user", "content": "What is 2+2?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "The answer is"},
    ]
    closed = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    cont = client.chat.completions.create(
        model="default",
        messages=history,
        tools=TOOLS,
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    # closed: `...The answer is<|im_end|>\n<|im_start|>assistant\n`; continued: `...The answer is`
    assert closed.usage.prompt_tokens - cont.usage.prompt_tokens >= 4
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model="default", messages=QUESTION, extra_body={"continue_final_message": True}
        )
