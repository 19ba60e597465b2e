"""OpenAI's Responses API through the official `openai` client against the shared server (issue 26).

The default model is a 135M ChatML model without tool training: under `required` / a named tool the grammar
makes every call valid; under `auto` it mostly answers in text, so that test checks consistency.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

CALC = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluate an arithmetic expression such as 12 * 7.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string", "maxLength": 24}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    "strict": True,
}
LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look up a fact about a topic in the encyclopedia.",
    "parameters": {
        "type": "object",
        "properties": {"topic": {"type": "string", "maxLength": 24}},
        "required": ["topic"],
    },
    "strict": False,
}
TOOLS = [CALC, LOOKUP]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    c = openai.OpenAI(base_url=server_url + "/v1", api_key="unused", timeout=300, max_retries=0)
    yield c
    c.close()


def ask(client, **kw):
    args = {"model": "default", "input": "What is 12 times 7?", "max_output_tokens": 40, "temperature": 0}
    return client.responses.create(**{**args, **kw})


def calls_of(resp):
    return [(o.name, o.arguments) for o in resp.output if o.type == "function_call"]


def assert_valid_calls(resp):
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def test_text_answer(client):
    r = ask(
        client, input="Say hello in one sentence.", instructions="You are friendly.", max_output_tokens=60
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_input_items_and_max_output_tokens(client):
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
    ]
    r = ask(client, input=items, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_required_single_call(client):
    r = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["function_call"]
    assert_valid_calls(r)


def test_named_tool(client):
    r = ask(client, tools=TOOLS, tool_choice={"type": "function", "name": "lookup"})
    assert [name for name, _ in calls_of(r)] == ["lookup"]
    assert_valid_calls(r)


def test_auto_is_text_or_valid_calls(client):
    r = ask(client, tools=[LOOKUP], tool_choice="auto", max_output_tokens=60)
    if calls_of(r):
        for name, args in calls_of(r):
            assert name == "lookup" and isinstance(json.loads(args), dict)
    else:
        assert r.output_text


def reassemble(events):
    """(text, [(name, arguments)]) rebuilt from raw stream events, checking the .done events agree."""
    text, calls, types = "", {}, []
    for e in events:
        types.append(e.type)
        if e.type == "response.output_text.delta":
            text += e.delta
        elif e.type == "response.output_item.added" and e.item.type == "function_call":
            assert e.item.arguments == "" and e.item.call_id.startswith("call_")
            calls[e.output_index] = [e.item.name, ""]
        elif e.type == "response.function_call_arguments.delta":
            calls[e.output_index][1] += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == calls[e.output_index][1]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert calls_of(final) == [tuple(calls[k]) for k in sorted(calls)]
    return text, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize(
    "kw",
    [
        {"tool_choice": "required", "parallel_tool_calls": False, "tools": TOOLS},
        {"tool_choice": {"type": "function", "name": "calculator"}, "tools": TOOLS},
        {"tool_choice": "auto", "tools": [LOOKUP], "max_output_tokens": 60},
        {"input": "Say hello.", "max_output_tokens": 30},
    ],
)
def test_streamed_events_reassemble_to_the_response(client, kw):
    plain = ask(client, **kw)
    events = list(ask(client, stream=True, **kw))
    text, calls = reassemble(events)
    assert calls == calls_of(plain)
    assert text == plain.output_text


def test_stream_helper_final_response(client):
    with client.responses.stream(
        model="default",
        input="What is 12 times 7?",
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        parallel_tool_calls=False,
        max_output_tokens=40,
    ) as stream:
        final = stream.get_final_response()
    assert_valid_calls(final)


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = ask(
        client, input="Invent a person with a name and an age.", text={"format": fmt}, max_output_tokens=80
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_previous_response_id_reuses_the_cached_prefix(client):
    first = ask(
        client, input="Tell me a short story about a cat.", max_output_tokens=60, instructions="Be vivid."
    )
    second = ask(
        client, input="Now give it a title.", previous_response_id=first.id, instructions="Be vivid."
    )
    previous = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > previous
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * previous
    assert second.previous_response_id == first.id


def test_continuation_with_tool_output(client):
    first = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = next(o for o in first.output if o.type == "function_call")
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "84"}
    second = ask(client, tools=TOOLS, input=[out], previous_response_id=first.id, tool_choice="none")
    previous = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * previous
    assert second.output_text


def test_retrieve_and_delete(client, server_url):
    r = ask(client, input="Hi", max_output_tokens=5)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        ask(client, previous_response_id=r.id)
    unstored = ask(client, input="Hi", max_output_tokens=5, store=False)
    assert httpx.get(f"{server_url}/v1/responses/{unstored.id}").status_code == 404


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [CALC, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"tools": [{**CALC, "name": "bad name"}]}, "tools[0].name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_errors_name_the_field(client, kw, field):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, **kw)
    assert field in info.value.message
    assert ask(client, input="Hi", max_output_tokens=2).output  # still serving


def test_lone_surrogate_is_a_400_naming_its_field(server_url):
    body = '{"model": "default", "max_output_tokens": 4, "input": "hi \\udc00 there"}'
    r = httpx.post(
        server_url + "/v1/responses", content=body, headers={"content-type": "application/json"}, timeout=300
    )
    assert r.status_code == 400 and "lone surrogate" in r.text and "input" in r.text, r.text
